"""The wire formats a tensor may cross a slow link in, by name: JAX-free, so the config checks,
the planner prices and the executors run the same names. `parallel/codec.py` implements them
(quantize / dequantize), `parallel/bridge.py` and `parallel/diloco.py` use them."""

BOUNDARY_CODECS = ("none", "int8")  # pipeline.boundary_codec: MPMD activations between worlds
DILOCO_CODECS = ("none", "int8", "int4")  # diloco.codec: pseudo-gradients between sites
BITS = {"none": 32, "int8": 8, "int4": 4}  # bits per value on the wire

__all__ = ["BOUNDARY_CODECS", "DILOCO_CODECS", "BITS"]

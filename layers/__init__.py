"""Flax modules of hetjax's decoder-only language model.

Only modules live here: they name the logical axes of their parameters and activations
(embed, heads, kv_heads, head_dim, mlp, vocab, layers, batch, length) and leave every
decision about devices to `parallel/`. `ModelConfig` is plain data; the modules are imported
lazily so the planner can read a `ModelConfig` without starting JAX.
"""

from hetjax.core.model_config import ModelConfig

_LAZY = {"Transformer": "hetjax.layers.model", "block_apply": "hetjax.layers.model",
         "cross_entropy": "hetjax.layers.model", "DecoderBlock": "hetjax.layers.block"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'layers' has no attribute {name!r}")


__all__ = ["ModelConfig", "Transformer", "DecoderBlock", "block_apply", "cross_entropy"]

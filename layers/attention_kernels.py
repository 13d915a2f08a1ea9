"""Which attention kernel runs, and running it: XLA, cuDNN's fused flash attention, or Pallas.

`model.attention` asks for one of IMPLEMENTATIONS. `choose` turns the request into the kernel
that runs on a platform ('cpu', 'tpu', 'cuda', 'rocm') for a dtype, head size and sequence
length, with the reason, as plain data (no JAX import, so the planner can ask it about a
topology's accelerators). 'auto' takes cuDNN's fused flash attention on NVIDIA GPUs where it
supports the shape (bf16/fp16, head size a multiple of 8 up to 128, or 256 from Hopper on, even
sequence length, Ampere or newer), else the Pallas/Triton flash kernel, else XLA; CPU and TPU
take XLA. An implementation asked for by name that cannot run there is a `ConfigError`.

`attend` runs the chosen kernel on [batch, length, heads, head_dim] queries and
[batch, length, kv_heads, head_dim] keys/values (grouped-query attention), causal, and with
`segment_ids` ([batch, length] int32, documents numbered 1, 2, ... within a row, 0 padding) a
token attends only to earlier tokens of its own document. With a sliding `window` W a query
attends to the W latest positions, itself included (HF's sliding_window): XLA and cuDNN take it
as JAX's `local_window_size`; the Pallas kernel has none, so `choose` refuses it by name (and
'auto' passes it over) whenever the window is shorter than the sequence. The softmax runs in
float32 in every kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from hetjax.core.model_config import ATTENTION_IMPLEMENTATIONS

IMPLEMENTATIONS = ATTENTION_IMPLEMENTATIONS  # their owner is hetjax/core/model_config.py
FUSED_DTYPES = ("bfloat16", "float16")  # what cuDNN's flash attention takes
PALLAS_BLOCK = 128  # the Pallas kernel's default query/key block (smaller sequences: one block
PALLAS_BWD_BLOCK = 32  # ... and its backward's blocks); the sequence must split into them

_log = logging.getLogger("hetjax.attention")
_said: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Choice:
    """The kernel that runs (`name`, never 'auto') and why (`reason`, one short clause)."""

    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def _cudnn_problem(dtype: str, head_dim: int, seq_len: int, capability: float | None) -> str:
    """Why cuDNN's fused attention cannot run this shape on CUDA ('' when it can)."""
    if dtype not in FUSED_DTYPES:
        return f"cuDNN fused attention takes bf16/fp16, the model computes in {dtype}"
    if capability is not None and capability < 8.0:
        return f"cuDNN fused attention needs compute capability >= 8.0, the GPU has {capability}"
    h_max = 256 if capability is not None and capability >= 9.0 else 128
    if head_dim % 8 or head_dim > h_max:
        return f"cuDNN fused attention takes head sizes multiple of 8 up to {h_max}, " \
               f"the model has {head_dim}"
    if seq_len % 2:
        return f"cuDNN fused attention with a mask needs an even sequence length, got {seq_len}"
    return ""


def _pallas_problem(seq_len: int, window: int = 0) -> str:
    """Why the Pallas/Triton flash kernel cannot run this shape on a GPU ('' when it can)."""
    if 0 < window < seq_len:
        return f"the Pallas flash kernel has no sliding window (model.sliding_window = " \
               f"{window} < sequence length {seq_len})"
    for block in (PALLAS_BLOCK, PALLAS_BWD_BLOCK):
        if seq_len % min(block, seq_len):
            return f"the Pallas flash kernel splits the sequence into blocks of {block}; " \
                   f"{seq_len} does not split"
    return ""


def choose(requested: str, platform: str, dtype: str, head_dim: int, seq_len: int,
           capability: float | None = None, window: int = 0) -> Choice:
    """The kernel `model.attention = requested` takes on `platform` ('cpu', 'tpu', 'cuda',
    'rocm'; 'gpu' is read as 'cuda') for this compute dtype, head size, sequence length and
    sliding window (0: none); `capability` is the CUDA compute capability when known. Raises
    ConfigError for a named implementation the platform cannot run."""
    platform = "cuda" if platform == "gpu" else platform
    from hetjax.errors import ConfigError  # here: layers/ stays importable without hetjax's config

    if requested not in IMPLEMENTATIONS:
        raise ConfigError("model.attention", f"unknown implementation {requested!r}",
                          f"use one of {', '.join(IMPLEMENTATIONS)}")
    if requested == "xla":
        return Choice("xla", "asked for")
    cudnn = (_cudnn_problem(dtype, head_dim, seq_len, capability) if platform == "cuda"
             else f"cuDNN runs on NVIDIA GPUs, this is {platform}")
    pallas = (_pallas_problem(seq_len, window) if platform == "cuda"
              else f"the Pallas flash kernel is the Triton one, for NVIDIA GPUs; this is "
                   f"{platform}")
    if requested == "cudnn":
        if cudnn:
            raise ConfigError("model.attention", f"'cudnn' cannot run here: {cudnn}",
                              "--config.model.attention=auto (or xla)")
        return Choice("cudnn", "asked for")
    if requested == "pallas":
        if pallas:
            raise ConfigError("model.attention", f"'pallas' cannot run here: {pallas}",
                              "--config.model.attention=auto (or xla)")
        return Choice("pallas", "asked for")
    if platform != "cuda":  # auto on CPU / TPU / ROCm: XLA's own fusions
        return Choice("xla", f"auto on {platform}")
    if not cudnn:
        return Choice("cudnn", f"auto: {dtype}, head size {head_dim} on CUDA")
    if not pallas:
        return Choice("pallas", f"auto: {cudnn}")
    return Choice("xla", f"auto: {cudnn}; {pallas}")


def platform_of_vendor(vendor: str) -> str:
    """The platform a topology accelerator's vendor runs JAX on (the catalogue's vendors)."""
    return {"nvidia": "cuda", "amd": "rocm", "cpu": "cpu", "google": "tpu"}.get(vendor, vendor)


# CUDA compute capability of the catalogue's NVIDIA kinds (cuDNN flash attention: >= 8.0).
# A name matches the first entry it starts with (so "a100" before "a10", "l40s" before "l4").
CAPABILITY = {"v100": 7.0, "a100": 8.0, "a800": 8.0, "l40s": 8.9, "h100": 9.0, "h200": 9.0,
              "h800": 9.0, "t4": 7.5, "rtx_2080_ti": 7.5, "titan_rtx": 7.5, "rtx_3090": 8.6,
              "a10": 8.6, "a40": 8.6, "rtx_4090": 8.9, "l4": 8.9}


def choose_for_accelerator(requested: str, vendor: str, kind: str, dtype: str, head_dim: int,
                           seq_len: int, window: int = 0) -> Choice:
    """`choose` for a topology's accelerator (its catalogue vendor and kind name)."""
    capability = next((c for name, c in CAPABILITY.items() if kind.lower().startswith(name)),
                      None)
    return choose(requested, platform_of_vendor(vendor), dtype, head_dim, seq_len, capability,
                  window)


def local_platform() -> tuple[str, float | None]:
    """The platform of the devices this JAX process sees and (CUDA) their compute capability."""
    import jax

    dev = jax.devices()[0]
    platform = dev.platform
    if platform == "gpu":  # older JAX names both GPU platforms 'gpu'
        version = str(getattr(getattr(dev, "client", None), "platform_version", ""))
        platform = "rocm" if "rocm" in version.lower() else "cuda"
    try:
        capability = float(getattr(dev, "compute_capability", None))
    except (TypeError, ValueError):
        capability = None
    return platform, capability


def choose_local(requested: str, dtype: str, head_dim: int, seq_len: int,
                 window: int = 0) -> Choice:
    """`choose` for the devices this process runs on."""
    platform, capability = local_platform()
    return choose(requested, platform, dtype, head_dim, seq_len, capability, window)


def say_once(choice: Choice) -> None:
    """One log line per distinct choice when 'auto' on a GPU did not get cuDNN (a fallback)."""
    key = (choice.name, choice.reason)
    if choice.reason.startswith("auto: ") and choice.name != "cudnn" and key not in _said:
        _said.add(key)
        _log.warning("hetjax: attention uses %s: %s", choice.name, choice.reason[6:])


# --- the kernels ---------------------------------------------------------------------------------
def document_mask(segment_ids):
    """[batch, 1, q, k] bool: query and key in the same document (equal segment ids).

    Padding (0) attends to padding, as in the Pallas kernel: a padded query always has itself
    to attend to (no all-masked row, no NaN), and no loss reads its output."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def attend(q, k, v, segment_ids=None, *, implementation: str = "xla", window: int = 0,
           interpret: bool = False):
    """Causal attention of q [B, T, N, H] over k, v [B, T, K, H] (N a multiple of K) with the
    kernel `implementation` ('xla', 'cudnn' or 'pallas'; see `choose`); `segment_ids` [B, T]
    confines each token to its own document; `window` > 0 to its `window` latest positions.
    `interpret` runs the Pallas kernel in its interpreter (any platform; for tests)."""
    import jax
    import jax.numpy as jnp

    # A window as long as the sequence masks nothing: leave it out (and let Pallas run).
    window = window if 0 < window < q.shape[1] else 0
    if implementation in ("xla", "cudnn"):
        mask = None if segment_ids is None else document_mask(segment_ids)
        # JAX's (left, right) window: W - 1 earlier positions and none later (causal).
        local = (window - 1, 0) if window else None
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                            local_window_size=local,
                                            implementation=implementation)
    if window:  # `choose` never picks Pallas for a window; a direct call must not lose it
        raise ValueError(f"the Pallas flash kernel has no sliding window ({window})")
    if implementation == "pallas":
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        groups = q.shape[2] // k.shape[2]
        if groups > 1:  # the kernel has no GQA: each kv head serves `groups` query heads
            k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        # The kernel masks key j for query i when their segment ids differ (document_mask).
        return pallas_attention.mha(q, k, v, segment_ids, sm_scale=q.shape[-1] ** -0.5,
                                    causal=True, interpret=interpret)
    raise ValueError(f"attention implementation {implementation!r}: choose one of "
                     f"{', '.join(IMPLEMENTATIONS[1:])}")


def reference(q, k, v, segment_ids=None, window: int = 0):
    """Plain float32 masked-softmax attention (the tests' reference): causal, GQA, documents,
    a sliding window of `window` positions (0: none)."""
    import jax
    import jax.numpy as jnp

    b, t, n, h = q.shape
    groups = n // k.shape[2]
    k, v = (jnp.repeat(a.astype(jnp.float32), groups, axis=2) for a in (k, v))
    s = jnp.einsum("bqnh,bknh->bnqk", q.astype(jnp.float32), k) / jnp.sqrt(jnp.float32(h))
    allowed = jnp.tril(jnp.ones((t, t), bool))[None, None]
    if window:
        allowed = allowed & ~jnp.tril(jnp.ones((t, t), bool), -window)[None, None]
    if segment_ids is not None:
        allowed = allowed & document_mask(segment_ids)
    p = jax.nn.softmax(jnp.where(allowed, s, -jnp.inf), axis=-1)
    return jnp.einsum("bnqk,bknh->bqnh", p, v)


__all__ = ["IMPLEMENTATIONS", "Choice", "choose", "choose_local", "choose_for_accelerator",
           "platform_of_vendor",
           "local_platform", "say_once", "document_mask", "attend", "reference"]

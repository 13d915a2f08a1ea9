"""Per-row symmetric quantization: the one codec for what crosses slow links.

Used by DiLoCo's pseudo-gradients between sites (parallel/diloco.py) and by the bridge's
compressed pipeline boundaries between worlds (parallel/bridge.py, `pipeline.boundary_codec`).
Each row (last axis) of a tensor is scaled by max|row| / (2^(b-1) - 1) and rounded to b-bit
integer codes: the error per element is at most scale / 2 = max|row| / (2 (2^(b-1) - 1)).
int4 codes are packed two to a byte. `encode` / `decode` apply a codec named in
`hetjax.core.wire` to a whole pytree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hetjax.core.wire import BITS


def rows(x):
    """`x` as rows [R, c] of its last axis (a scalar is one row of one value)."""
    return x.reshape(1, 1) if x.ndim == 0 else x.reshape(-1, x.shape[-1])


def quantize_rows(r: jax.Array, bits: int):
    """Rows [R, c] (float32) -> (int8 codes [R, c], float32 scales [R, 1]), unpacked."""
    qmax = 2 ** (bits - 1) - 1
    peak = jnp.max(jnp.abs(r), axis=1, keepdims=True)
    scale = jnp.where(peak > 0, peak / qmax, 1.0)
    return jnp.clip(jnp.round(r / scale), -qmax, qmax).astype(jnp.int8), scale


def quantize(x: jax.Array, bits: int):
    """`x` -> (codes, scales): each row (last axis) scaled by max|row| / (2^(bits-1) - 1) and
    rounded; int4 codes are packed two to a byte (flat). Error bound: |x - dequantize| <=
    scale / 2 = max|row| / (2 (2^(bits-1) - 1)) per element."""
    q, scale = quantize_rows(rows(x.astype(jnp.float32)), bits)
    if bits == 4:
        flat = (q.reshape(-1) + 8).astype(jnp.uint8)  # 1..15
        flat = jnp.pad(flat, (0, flat.size % 2))
        q = flat[0::2] | (flat[1::2] << 4)
    return q, scale


def dequantize(codes, scale, shape, bits: int) -> jax.Array:
    """The float32 tensor of `shape` that `quantize` encoded as (codes, scale)."""
    n = int(np.prod(shape)) if shape else 1
    if bits == 4:
        lo = (codes & 0xF).astype(jnp.int8) - 8
        hi = (codes >> 4).astype(jnp.int8) - 8
        codes = jnp.stack([lo, hi], axis=1).reshape(-1)[:n]
    r = scale.shape[0]
    return (codes.reshape(r, -1).astype(jnp.float32) * scale).reshape(shape)


def pack4(q):
    """int4 codes (int8 in -7..7) [..., c] -> two per byte along the last axis."""
    u = (q + 8).astype(jnp.uint8)
    u = jnp.pad(u, [(0, 0)] * (u.ndim - 1) + [(0, u.shape[-1] % 2)])
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack4(p, c: int):
    """The inverse of `pack4` for `c` codes a row."""
    lo = (p & 0xF).astype(jnp.int8) - 8
    hi = (p >> 4).astype(jnp.int8) - 8
    return jnp.stack([lo, hi], axis=-1).reshape(*p.shape[:-1], -1)[..., :c]


def error_bound(x, bits: int):
    """The per-element error bound of quantizing `x` (numpy), row by row."""
    r = np.abs(np.asarray(x, np.float32)).reshape(-1, x.shape[-1] if np.ndim(x) else 1)
    return (r.max(axis=1, keepdims=True) / (2 * (2 ** (bits - 1) - 1))).reshape(
        (*np.shape(x)[:-1], 1) if np.ndim(x) else ())


# --- a codec by name on pytrees (DiLoCo's pseudo-gradients) ---------------------------------
def encode(tree, codec: str):
    """A pytree of float arrays -> its wire form under `codec` (a name of `hetjax.core.wire`):
    fp32 arrays for 'none', else (codes, scales) per leaf."""
    if codec == "none":
        return jax.tree.map(lambda x: x.astype(jnp.float32), tree)
    return jax.tree.map(lambda x: quantize(x, BITS[codec]), tree)


def decode(wire, like, codec: str):
    """The inverse of `encode`; `like` gives the shapes."""
    if codec == "none":
        return wire
    return jax.tree.map(lambda w, x: dequantize(w[0], w[1], x.shape, BITS[codec]), wire, like,
                        is_leaf=lambda w: isinstance(w, tuple))


def wire_bytes(wire) -> int:
    """Bytes of an encoded pytree (what one site sends per exchange, before a ring's
    2 (n - 1) / n factor)."""
    return int(sum(x.nbytes for x in jax.tree.leaves(wire)))


__all__ = ["rows", "quantize_rows", "quantize", "dequantize", "pack4", "unpack4",
           "error_bound", "encode", "decode", "wire_bytes"]

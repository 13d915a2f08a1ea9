"""The key/value cache of decoding: its arrays, and attention of new tokens against it.

A cache holds, per layer, the rotated keys and the values of every position written so far
(`k`, `v`: [n_layers, batch, length, kv_heads, head_dim]) and where each row's next tokens go
(`pos`: [n_layers, batch], the same in every layer; repeated so `nn.scan` can slice the whole
cache per layer) and each layer's sliding window (`window`: [n_layers], 0 for full attention,
so layers with and without one decode in the one scanned program). Rows may sit at different
positions (prompts of different lengths), so the writes and the causal mask are per row. The
training path never sees a cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hetjax.core.model_config import ModelConfig
from hetjax.layers.embeddings import apply_rotary, rotary_tables


def init_cache(cfg: ModelConfig, batch: int, length: int) -> dict:
    """An empty cache for `batch` rows of up to `length` positions, in the compute dtype."""
    shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
    windows = [cfg.sliding_window if w else 0 for w in cfg.window_flags()]
    return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype),
            "pos": jnp.zeros((cfg.n_layers, batch), jnp.int32),
            "window": jnp.asarray(windows, jnp.int32)}


def cached_attention(q, k, v, cache: dict, head_dim: int, theta: float, inv_freq=None):
    """Causal attention of L new tokens per row (q, k, v: [batch, L, heads, head_dim], not yet
    rotated; `inv_freq`: the model's scaled RoPE frequencies, `rope_frequencies`) at positions
    pos .. pos + L - 1 against the cache of one layer; returns the output
    [batch, L, heads, head_dim] and the cache with the new keys and values written."""
    pos = cache["pos"]
    positions = pos[:, None] + jnp.arange(q.shape[1])  # [batch, L]

    def rotate(t, p):  # one row at its own positions
        cos, sin = rotary_tables(p, head_dim, theta, inv_freq)
        return apply_rotary(t[None], cos, sin)[0]

    q, k = jax.vmap(rotate)(q, positions), jax.vmap(rotate)(k, positions)

    def write(c, new, p):
        return jax.lax.dynamic_update_slice(c, new.astype(c.dtype), (p, 0, 0))

    ck, cv = jax.vmap(write)(cache["k"], k, pos), jax.vmap(write)(cache["v"], v, pos)
    # A key is visible when it is at or before the query's position: positions past a row's
    # end hold zeros or a padded prompt's leftovers and are always in its future.
    keys = jnp.arange(ck.shape[1])[None, None, :]
    mask = keys <= positions[:, :, None]  # [batch, L, S]
    window = cache["window"]  # this layer's: keys at most window - 1 positions back
    mask &= (window == 0) | (keys > positions[:, :, None] - window)
    out = jax.nn.dot_product_attention(q, ck.astype(q.dtype), cv.astype(q.dtype),
                                       mask=mask[:, None])
    return out, {"k": ck, "v": cv, "pos": pos + q.shape[1], "window": window}

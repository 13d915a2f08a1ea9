"""Causal multi-head attention with grouped key/value heads and rotary embeddings."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from layers.config import ModelConfig
from layers.embeddings import apply_rotary, rotary_tables
from layers.kv_cache import cached_attention


def dense_init(scale: float = 1.0, in_axis=-2, out_axis=-1):
    return nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal",
                                            in_axis=in_axis, out_axis=out_axis)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, cache=None):
        """x [batch, length, d_model] -> same shape; with a KV `cache` (decoding,
        layers/kv_cache.py) also returns the updated cache."""
        cfg = self.cfg
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)

        def kernel(name, shape, axes, init):
            # Kernels are declared at their full shape (not flattened as DenseGeneral does),
            # so their logical names apply unchanged under a mesh.
            w = self.param(name, nn.with_logical_partitioning(init, axes), shape, pdtype)
            return w.astype(dtype)

        d, h = cfg.d_model, cfg.head_dim
        in_init = dense_init(in_axis=0, out_axis=(1, 2))
        wq = kernel("query", (d, cfg.n_heads, h), ("embed", "heads", "head_dim"), in_init)
        wk = kernel("key", (d, cfg.n_kv_heads, h), ("embed", "kv_heads", "head_dim"), in_init)
        wv = kernel("value", (d, cfg.n_kv_heads, h), ("embed", "kv_heads", "head_dim"), in_init)
        wo = kernel("out", (cfg.n_heads, h, d), ("heads", "head_dim", "embed"),
                    dense_init(1.0 / (2 * cfg.n_layers), in_axis=(0, 1), out_axis=2))

        x = x.astype(dtype)
        q = nn.with_logical_constraint(jnp.einsum("bld,dnh->blnh", x, wq),
                                       ("batch", "length", "heads", "head_dim"))
        k = nn.with_logical_constraint(jnp.einsum("bld,dnh->blnh", x, wk),
                                       ("batch", "length", "kv_heads", "head_dim"))
        v = nn.with_logical_constraint(jnp.einsum("bld,dnh->blnh", x, wv),
                                       ("batch", "length", "kv_heads", "head_dim"))
        if cache is not None:  # decoding: new tokens against the cache, at each row's position
            out, cache = cached_attention(q, k, v, cache, h, cfg.rope_theta)
            return jnp.einsum("blnh,nhd->bld", out, wo), cache
        cos, sin = rotary_tables(jnp.arange(x.shape[1]), h, cfg.rope_theta)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Groups query heads over the kv heads (GQA); the softmax runs in float32.
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        out = nn.with_logical_constraint(out, ("batch", "length", "heads", "head_dim"))
        y = jnp.einsum("blnh,nhd->bld", out, wo)
        return nn.with_logical_constraint(y, ("batch", "length", "embed"))

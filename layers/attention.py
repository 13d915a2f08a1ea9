"""Causal multi-head attention with grouped key/value heads and rotary embeddings, optionally
QK-norm (RMSNorm of queries and keys before RoPE: per head, or over all heads) and a sliding
window (`ModelConfig.sliding_window`, on every layer or on those `full_attention_layers` leaves
out)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from hetjax.core.model_config import ModelConfig
from hetjax.errors import HetjaxError
from hetjax.layers import attention_kernels
from hetjax.layers.embeddings import apply_rotary, rope_frequencies, rotary_tables
from hetjax.layers.kv_cache import cached_attention
from hetjax.layers.norms import RMSNorm


def dense_init(scale: float = 1.0, in_axis=-2, out_axis=-1):
    return nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal",
                                            in_axis=in_axis, out_axis=out_axis)


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, segment_ids=None, cache=None, windowed=None):
        """x [batch, length, d_model] -> same shape; segment_ids [batch, length] (None: one
        document per row) confine each token's attention to its own document; with a KV
        `cache` (decoding, layers/kv_cache.py) also returns the updated cache. `windowed` (a
        bool scalar, this layer's `ModelConfig.window_flags()` entry) is needed only when the
        layers' windows differ; the cache carries its own."""
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
        q = jnp.einsum("bld,dnh->blnh", x, wq)
        k = jnp.einsum("bld,dnh->blnh", x, wk)
        v = jnp.einsum("bld,dnh->blnh", x, wv)
        if cfg.qkv_bias:  # Qwen2: biases on the q/k/v projections (not on the output)
            zeros = nn.initializers.zeros_init()
            q = q + kernel("query_bias", (cfg.n_heads, h), ("heads", "head_dim"), zeros)
            k = k + kernel("key_bias", (cfg.n_kv_heads, h), ("kv_heads", "head_dim"), zeros)
            v = v + kernel("value_bias", (cfg.n_kv_heads, h), ("kv_heads", "head_dim"), zeros)
        if cfg.qk_norm != "none":  # after the biases, before RoPE (Qwen3, OLMoE)
            per_head = cfg.qk_norm == "head"
            q = RMSNorm(cfg.norm_eps, dtype, pdtype, ("head_dim",) if per_head else
                        ("heads", "head_dim"), name="query_norm")(q)
            k = RMSNorm(cfg.norm_eps, dtype, pdtype, ("head_dim",) if per_head else
                        ("kv_heads", "head_dim"), name="key_norm")(k)
        q = nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
        k = nn.with_logical_constraint(k, ("batch", "length", "kv_heads", "head_dim"))
        v = nn.with_logical_constraint(v, ("batch", "length", "kv_heads", "head_dim"))
        inv_freq = rope_frequencies(h, cfg.rope_theta, cfg.rope_type, cfg.rope_factor,
                                    cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                                    cfg.rope_original_max_len)
        if cache is not None:  # decoding: new tokens against the cache, at each row's position
            out, cache = cached_attention(q, k, v, cache, h, cfg.rope_theta, inv_freq)
            return jnp.einsum("blnh,nhd->bld", out, wo), cache
        cos, sin = rotary_tables(jnp.arange(x.shape[1]), h, cfg.rope_theta, inv_freq)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # The kernel is chosen once per trace from the devices JAX runs on (model.attention);
        # every kernel groups query heads over the kv heads (GQA), softmax in float32.
        choice = attention_kernels.choose_local(cfg.attention, cfg.dtype, h, x.shape[1],
                                                cfg.sliding_window)
        attention_kernels.say_once(choice)

        def attend(window):
            return attention_kernels.attend(q, k, v, segment_ids, implementation=choice.name,
                                            window=window)

        if not cfg.mixed_windows:
            out = attend(cfg.window)
        elif windowed is None:  # one layer on its own (a pipeline stage): its window unknown
            raise HetjaxError(
                f"model.full_attention_layers = {list(cfg.full_attention_layers)} with "
                f"model.sliding_window = {cfg.sliding_window}: layers with and without the "
                "window run only in the whole layer stack; fix: set parallel.pp=1")
        else:  # each layer's flag is data of the scanned stack: both kernels, one runs
            out = jax.lax.cond(windowed, lambda: attend(cfg.sliding_window), lambda: attend(0))
        out = nn.with_logical_constraint(out, ("batch", "length", "heads", "head_dim"))
        y = jnp.einsum("blnh,nhd->bld", out, wo)
        return nn.with_logical_constraint(y, ("batch", "length", "embed"))

"""One pre-norm decoder block: x + attention(norm(x)), then x + mlp(norm(x)) -- the feed-forward
a Mixture-of-Experts layer (layers/moe.py) in an MoE model."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from hetjax.layers.attention import Attention
from hetjax.core.model_config import ModelConfig
from hetjax.layers.mlp import MLP
from hetjax.layers.moe import MoE
from hetjax.layers.norms import RMSNorm


class DecoderBlock(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, segment_ids=None, cache=None, windowed=None):
        """With a KV cache (decoding) returns (x, updated cache). `windowed`: this layer's
        sliding-window flag, when the layers' windows differ (`Attention`)."""
        cfg = self.cfg
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        h = RMSNorm(cfg.norm_eps, dtype, pdtype, name="attn_norm")(x)
        if cache is None:
            x = x + Attention(cfg, name="attn")(h, segment_ids, windowed=windowed)
        else:
            a, cache = Attention(cfg, name="attn")(h, cache=cache)
            x = x + a
        h = RMSNorm(cfg.norm_eps, dtype, pdtype, name="mlp_norm")(x)
        x = x + (MoE(cfg, name="moe") if cfg.is_moe else MLP(cfg, name="mlp"))(h)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        return x if cache is None else (x, cache)

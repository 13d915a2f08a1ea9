"""SwiGLU feed-forward block: out(silu(gate(x)) * up(x))."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from hetjax.layers.attention import dense_init
from hetjax.core.model_config import ModelConfig


class MLP(nn.Module):
    cfg: ModelConfig
    d_ff: int = 0  # hidden width; 0: cfg.d_ff (an MoE's shared expert has its own)

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)

        def dense(name, features, axes, init=dense_init()):
            return nn.Dense(features, use_bias=False, dtype=dtype, param_dtype=pdtype, name=name,
                            kernel_init=nn.with_logical_partitioning(init, axes))

        d_ff = self.d_ff or cfg.d_ff
        gate = dense("gate", d_ff, ("embed", "mlp"))(x)
        up = dense("up", d_ff, ("embed", "mlp"))(x)
        h = nn.with_logical_constraint(nn.silu(gate) * up, ("batch", "length", "mlp"))
        y = dense("down", cfg.d_model, ("mlp", "embed"), dense_init(1.0 / (2 * cfg.n_layers)))(h)
        return nn.with_logical_constraint(y, ("batch", "length", "embed"))

"""RMSNorm (LLaMA): scale x by the reciprocal root-mean-square, computed in float32.

It normalises the last dimension (the residual stream, 'embed'), or the last several when
`axes` names more (OLMoE's QK-norm: all heads of a projection together)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
    eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    axes: tuple[str, ...] = ("embed",)  # logical names of the normalised (last) dimensions

    @nn.compact
    def __call__(self, x):
        n = len(self.axes)
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, self.axes),
                           x.shape[-n:], self.param_dtype)
        x32 = x.astype(jnp.float32)
        dims = -1 if n == 1 else tuple(range(-n, 0))
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=dims, keepdims=True) + self.eps)
        return (y * scale.astype(jnp.float32)).astype(self.dtype)

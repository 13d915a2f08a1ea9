"""Token embedding (also the tied output projection) and rotary position embeddings."""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp


def padded_init(init, rows: int, axis: int):
    """`init` for a table whose dimension `axis` has more entries than its `rows` real ones
    (a vocabulary padded for tensor parallelism): the real entries as `init` draws them for
    `rows` (so a padded model starts as the unpadded one), the padding zero."""
    def draw(key, shape, dtype=jnp.float32):
        real = init(key, (*shape[:axis], rows, *shape[axis + 1:]), dtype)
        pad = [(0, 0)] * len(shape)
        pad[axis] = (0, shape[axis] - rows)
        return jnp.pad(real, pad)
    return draw


def mask_padded_vocab(logits, vocab_size: int):
    """Logits [..., rows] with the ids >= `vocab_size` (padding rows) at a value no softmax,
    arg-max or sampler picks. Finite, so a one-hot loss (0 x it) stays exact; the masked ids
    get no gradient."""
    if logits.shape[-1] == vocab_size:
        return logits
    ids = jnp.arange(logits.shape[-1])
    return jnp.where(ids < vocab_size, logits, jnp.asarray(PADDED_LOGIT, logits.dtype))


# exp(PADDED_LOGIT - any real logit) is exactly 0 in float32.
PADDED_LOGIT = -1e30


class Embed(nn.Module):
    vocab_size: int  # rows of the table (the vocabulary, padded)
    d_model: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    real_rows: int = 0  # rows that are tokens (0: all); the rest are padding, zero at the start

    def setup(self):
        init = nn.initializers.normal(stddev=0.02)
        if self.real_rows and self.real_rows < self.vocab_size:
            init = padded_init(init, self.real_rows, 0)
        self.embedding = self.param(
            "embedding", nn.with_logical_partitioning(init, ("vocab", "embed")),
            (self.vocab_size, self.d_model), self.param_dtype)

    def __call__(self, tokens):
        x = jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))

    def attend(self, x):
        """Logits against the embedding table (the tied output projection)."""
        # The table's small init (std 0.02, as GPT-2) keeps each token's logit for itself
        # small at the start, where the residual stream is still mostly its own embedding.
        w = self.embedding.astype(self.dtype)
        logits = jnp.einsum("bld,vd->blv", x, w)
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


def rope_frequencies(head_dim: int, theta: float, rope_type: str = "default",
                     factor: float = 1.0, low_freq_factor: float = 1.0,
                     high_freq_factor: float = 4.0, original_max_len: int = 8192):
    """Inverse frequencies [head_dim / 2], scaled as transformers' `ROPE_INIT_FUNCTIONS`
    ('default', 'linear', 'llama3'), so HF checkpoints see the rotations they were trained with."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_wavelen = original_max_len / low_freq_factor
        high_wavelen = original_max_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max_len / wavelen - low_freq_factor) / (high_freq_factor -
                                                                    low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(medium, smoothed, scaled)
    return inv_freq


def rotary_tables(positions, head_dim: int, theta: float, inv_freq=None):
    """cos and sin tables [len, head_dim / 2] for the given integer positions (`inv_freq`:
    scaled frequencies from `rope_frequencies`; None = unscaled)."""
    if inv_freq is None:
        inv_freq = rope_frequencies(head_dim, theta)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x, cos, sin):
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) of x [batch, len, heads, head_dim]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)

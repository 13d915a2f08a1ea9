"""The decoder-only Transformer, as three pieces the pipeline can run apart: embed, blocks, head.

`Transformer` holds the embedding, a stack of `n_layers` decoder blocks (parameters stacked on
a leading 'layers' axis and applied with `nn.scan`, so compile time does not grow with depth,
optionally rematerialised) and the head (final norm and output projection, tied to the
embedding by default). Methods `embed`, `blocks` and `head` run each piece; `block_apply`
runs one layer from a slice of the stacked parameters.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from hetjax.layers.block import DecoderBlock
from hetjax.core.model_config import ModelConfig
from hetjax.layers.embeddings import Embed, mask_padded_vocab, padded_init
from hetjax.layers.moe import STATS
from hetjax.layers.norms import RMSNorm

# JAX's policy for each recomputing name of hetjax.core.model_config.REMAT_POLICIES ('none' and 'auto'
# keep every intermediate)
REMAT_JAX_POLICIES = {
    "full": None,  # save nothing, recompute the whole block
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class _ScanStep(nn.Module):
    """DecoderBlock in the (carry, x) -> (carry, y) form nn.scan needs."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, segment_ids, cache, windowed):
        block = DecoderBlock
        if cache is not None:  # decoding (no gradients): the layer's slice of the KV cache
            return block(self.cfg, name="block")(x, cache=cache)
        if self.cfg.remat in REMAT_JAX_POLICIES:
            block = nn.remat(DecoderBlock, prevent_cse=False,
                             policy=REMAT_JAX_POLICIES[self.cfg.remat])
        return block(self.cfg, name="block")(x, segment_ids, None, windowed), None


class Transformer(nn.Module):
    cfg: ModelConfig

    def setup(self):
        cfg = self.cfg
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.embedder = Embed(cfg.vocab_rows, cfg.d_model, dtype, pdtype, cfg.vocab_size)
        # An MoE layer's records (layers/moe.py: STATS, and router logits when asked) are
        # stacked over layers like the parameters.
        axes = {"params": 0, **({STATS: 0, "router_logits": 0} if cfg.is_moe else {})}
        self.layers = nn.scan(
            _ScanStep, variable_axes=axes, split_rngs={"params": True},
            # every layer sees the same segment ids; its own cache and sliding-window flag
            in_axes=(nn.broadcast, 0, 0),
            length=cfg.n_layers, metadata_params={nn.PARTITION_NAME: "layers"})(cfg)
        self.final_norm = RMSNorm(cfg.norm_eps, dtype, pdtype)
        if not cfg.tie_embeddings:
            init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
            if cfg.vocab_rows > cfg.vocab_size:
                init = padded_init(init, cfg.vocab_size, 1)
            self.lm_head = nn.Dense(
                cfg.vocab_rows, use_bias=False, dtype=dtype, param_dtype=pdtype,
                kernel_init=nn.with_logical_partitioning(init, ("embed", "vocab")))

    def embed(self, tokens):
        return self.embedder(tokens)

    def blocks(self, x, segment_ids=None):
        # Per-layer window flags only when the layers differ (else the window is a constant).
        flags = jnp.asarray(self.cfg.window_flags()) if self.cfg.mixed_windows else None
        x, _ = self.layers(x, segment_ids, None, flags)
        return x

    def head(self, x):
        x = self.final_norm(x)
        if self.cfg.tie_embeddings:
            logits = self.embedder.attend(x)
        else:
            logits = nn.with_logical_constraint(self.lm_head(x), ("batch", "length", "vocab"))
        return mask_padded_vocab(logits.astype(jnp.float32), self.cfg.vocab_size)

    def __call__(self, tokens, segment_ids=None):
        """Logits [batch, length, vocab] (float32) of tokens [batch, length]; with segment_ids
        (the packer's, [batch, length]) tokens attend only within their own document."""
        return self.head(self.blocks(self.embed(tokens), segment_ids))

    def decode(self, tokens, cache):
        """Logits of `tokens` [batch, L] placed at each row's cache position, and the cache
        with their keys and values written (layers/kv_cache.py, layers/generate.py)."""
        x, cache = self.layers(self.embed(tokens), None, cache, None)
        return self.head(x), cache


def block_apply(cfg: ModelConfig, layer_params, x, segment_ids=None):
    """Run one decoder block from the parameters of one layer (a slice of the stack)."""
    return DecoderBlock(cfg).apply({"params": layer_params}, x, segment_ids)


def layer_slice(params, i):
    """The parameters of layer i out of the stacked `params['layers']['block']` tree."""
    return jax.tree.map(lambda a: a[i], params["layers"]["block"])


def chunked_head_loss(model: Transformer, params, x, targets, chunk_tokens: int):
    """`cross_entropy(model.head(x), targets)` without the whole float32 logits [tokens,
    vocab]: the head and the loss run over chunks of `chunk_tokens` tokens, each recomputed in
    the backward (jax.checkpoint), so one chunk's logits are alive at a time. x: the blocks'
    output [batch, length, d_model]; params: the model's (natural layout)."""
    d = x.shape[-1]
    x, targets = x.reshape(-1, d), targets.reshape(-1)
    n = x.shape[0]
    chunks = -(-n // chunk_tokens)
    pad = chunks * chunk_tokens - n  # padded tokens carry weight 0
    weight = jnp.pad(jnp.ones((n,), jnp.float32), (0, pad))
    x, targets = jnp.pad(x, ((0, pad), (0, 0))), jnp.pad(targets, (0, pad))

    @jax.checkpoint
    def chunk_nll(xc, tc, wc):
        logits = model.apply({"params": params}, xc[None], method=Transformer.head)[0]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, tc[:, None], axis=-1)[:, 0] * wc)

    sums = jax.lax.map(lambda a: chunk_nll(*a), (x.reshape(chunks, chunk_tokens, d),
                                                targets.reshape(chunks, chunk_tokens),
                                                weight.reshape(chunks, chunk_tokens)))
    return jnp.sum(sums) / n


def cross_entropy(logits, targets, mask=None):
    """Mean next-token cross-entropy in float32 (mask weights tokens; None = all)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    if mask is None:
        return jnp.mean(nll)
    mask = mask.astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)

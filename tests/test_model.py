"""The Flax model against a plain NumPy implementation of the same maths (float64)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetjax.layers import ModelConfig, Transformer
from hetjax.layers.model import block_apply, layer_slice


def reference_forward(cfg: ModelConfig, params, tokens):
    """Embedding, then per layer: RMSNorm, rotary causal GQA attention (QK-norm per head or over
    all heads, a sliding window on the layers cfg.window_flags() names), RMSNorm, SwiGLU; then
    the final norm and the (tied or untied) output projection. Loops over heads, no Flax."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = p["embedder"]["embedding"][tokens]
    B, S, D = x.shape
    H, K, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def rms(v, scale):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + cfg.norm_eps) * scale

    inv = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(S)[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(v):  # [B, S, hd]
        a, b = v[..., : hd // 2], v[..., hd // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    def qk(h, a, name, heads, n):
        """Head n of the query or key projection, QK-normed as cfg says, rotated."""
        t = np.einsum("bsd,dnh->bsnh", h, a[name])
        if cfg.qk_norm == "head":
            t = rms(t, a[f"{name}_norm"]["scale"])
        elif cfg.qk_norm == "all_heads":
            flat = rms(t.reshape(B, S, heads * hd), a[f"{name}_norm"]["scale"].reshape(-1))
            t = flat.reshape(B, S, heads, hd)
        return rope(t[:, :, n])

    for i in range(cfg.n_layers):
        lp = jax.tree.map(lambda a: a[i], p["layers"]["block"])
        h = rms(x, lp["attn_norm"]["scale"])
        att = np.zeros((B, S, D))
        causal = np.tril(np.ones((S, S), bool))
        if cfg.window_flags()[i]:
            causal &= ~np.tril(np.ones((S, S), bool), -cfg.sliding_window)
        for n in range(H):
            kv = n // (H // K)
            q = qk(h, lp["attn"], "query", H, n)
            k = qk(h, lp["attn"], "key", K, kv)
            v = h @ lp["attn"]["value"][:, kv, :]
            s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
            s = np.where(causal, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            att += (w @ v) @ lp["attn"]["out"][n]
        x = x + att
        h = rms(x, lp["mlp_norm"]["scale"])
        g = h @ lp["mlp"]["gate"]["kernel"]
        x = x + ((g / (1 + np.exp(-g))) * (h @ lp["mlp"]["up"]["kernel"])) @ \
            lp["mlp"]["down"]["kernel"]
    x = rms(x, p["final_norm"]["scale"])
    if cfg.tie_embeddings:
        return x @ p["embedder"]["embedding"].T
    return x @ p["lm_head"]["kernel"]


@pytest.mark.parametrize("tie, kv", [(True, 2), (False, 4), (True, 1)])
def test_forward_matches_numpy_reference(tie, kv):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=kv,
                      d_ff=48, tie_embeddings=tie)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
    model = Transformer(cfg)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])
    # Perturb the norm scales so a wrong scale would show.
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: a * 1.3 if path[-1].key == "scale" else a, params)
    got = model.apply({"params": params}, tokens)
    want = reference_forward(cfg, params, np.asarray(tokens))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
    assert sum(a.size for a in jax.tree.leaves(params)) == cfg.num_params


@pytest.mark.parametrize("qk_norm,window,full_layers", [("head", 5, ()),
                                                         ("all_heads", 4, (0, 2))])
def test_qk_norm_and_sliding_windows_match_numpy_reference(qk_norm, window, full_layers):
    """QK-norm per head (Qwen3) and over all heads (OLMoE); a window on every layer, or on
    some (the others attending fully, each layer's flag scanned with the stack)."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48,
                      qk_norm=qk_norm, sliding_window=window, full_attention_layers=full_layers)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
    model = Transformer(cfg)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(  # every scale its own, so a mix-up shows
        lambda path, a: a * (1.0 + 0.3 * rng.standard_normal(a.shape))
        if path[-1].key == "scale" else a, params)
    got = model.apply({"params": params}, tokens)
    want = reference_forward(cfg, params, np.asarray(tokens))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
    assert sum(a.size for a in jax.tree.leaves(params)) == cfg.num_params
    plain = reference_forward(dataclasses.replace(cfg, sliding_window=0), params,
                              np.asarray(tokens))
    assert np.abs(plain - want).max() > 1e-3  # the window matters at 12 positions


def test_one_layer_of_mixed_windows_is_refused_naming_them():
    """block_apply runs a layer without its index (the pipelines): with layers of both kinds
    its window is unknown, so it stops rather than attend fully."""
    from hetjax.errors import HetjaxError

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                      sliding_window=4, full_attention_layers=(0,))
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = nn.unbox(Transformer(cfg).init(jax.random.key(0), tokens)["params"])
    x = jnp.ones((1, 8, 32))
    with pytest.raises(HetjaxError, match=r"full_attention_layers = \[0\] with "
                       "model.sliding_window = 4.*parallel.pp=1"):
        block_apply(cfg, layer_slice(params, 1), x)
    uniform = dataclasses.replace(cfg, full_attention_layers=())
    block_apply(uniform, layer_slice(params, 1), x)  # one window for all: no question


def test_pieces_compose_to_the_whole_model():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
    model = Transformer(cfg)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])
    x = model.apply({"params": params}, tokens, method="embed")
    for i in range(cfg.n_layers):
        x = block_apply(cfg, layer_slice(params, i), x)
    logits = model.apply({"params": params}, x, method="head")
    np.testing.assert_allclose(logits, model.apply({"params": params}, tokens), atol=1e-5)


@pytest.mark.parametrize("remat", [pytest.param("full", marks=pytest.mark.slow), "dots"])
def test_remat_does_not_change_gradients(remat):
    base = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
    params = nn.unbox(Transformer(base).init(jax.random.key(0), tokens)["params"])

    def grads(cfg):
        f = lambda p: jnp.sum(Transformer(cfg).apply({"params": p}, tokens) ** 2)  # noqa: E731
        return jax.grad(f)(params)

    g0, g1 = grads(base), grads(dataclasses.replace(base, remat=remat))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g0, g1)


def test_bf16_compute_keeps_fp32_params_and_logits():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                      dtype="bfloat16")
    tokens = jnp.zeros((1, 8), jnp.int32)
    model = Transformer(cfg)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(params))
    assert model.apply({"params": params}, tokens).dtype == jnp.float32


def test_flops_formula_counts_the_matmuls():
    cfg = ModelConfig(vocab_size=100, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=256)
    per_layer_params = 4 * 64 * 64 + 3 * 64 * 256
    assert cfg.layer_flops(1) == 2 * per_layer_params + 4 * 64
    assert cfg.flops_per_token(8) == 3 * (2 * cfg.layer_flops(8) + 2 * 64 * 100)


def test_segment_ids_make_packed_documents_independent():
    """Two documents packed in one row give the logits each has alone: attention does not
    cross the document boundary (and rotary positions are relative, so the offset of the
    second document does not matter)."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      max_seq_len=32)
    model = Transformer(cfg)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 64, (1, 7)), rng.integers(0, 64, (1, 9))
    row = jnp.asarray(np.concatenate([a, b], 1), jnp.int32)
    seg = jnp.asarray([[1] * 7 + [2] * 9], jnp.int32)
    params = model.init(jax.random.key(0), row)
    packed = model.apply(params, row, seg)
    np.testing.assert_allclose(packed[:, :7], model.apply(params, jnp.asarray(a)), atol=1e-5)
    np.testing.assert_allclose(packed[:, 7:], model.apply(params, jnp.asarray(b)), atol=1e-4)
    # without segment ids the second document sees the first
    assert not np.allclose(model.apply(params, row)[:, 7:], packed[:, 7:], atol=1e-3)


def test_chunked_head_loss_equals_the_plain_loss_and_its_gradients():
    """The cross-entropy over chunks of tokens (one chunk's logits alive at a time, recomputed in
    the backward) gives the plain loss and gradients, also when the chunks do not divide the
    tokens, and XLA's program for it needs less temporary memory."""
    from hetjax.layers.model import chunked_head_loss, cross_entropy

    cfg = ModelConfig(vocab_size=2048, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                      d_ff=64, max_seq_len=64, tie_embeddings=False)
    model = Transformer(cfg)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 2048, (4, 64)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, 2048, (4, 64)), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]
    x = model.apply({"params": params}, model.apply({"params": params}, tokens,
                                                    method=Transformer.embed),
                    method=Transformer.blocks)

    def plain(p, x):
        return cross_entropy(model.apply({"params": p}, x, method=Transformer.head), targets)

    def chunked(chunk):
        return jax.jit(jax.value_and_grad(
            lambda p, x: chunked_head_loss(model, p, x, targets, chunk), argnums=(0, 1)))

    want = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))
    loss, grads = want(params, x)
    for chunk in (64, 100):  # 256 tokens: 4 chunks; 3 chunks with 44 padded tokens
        l2, g2 = chunked(chunk)(params, x)
        np.testing.assert_allclose(l2, loss, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
                     g2, grads)
    temp = [f.lower(params, x).compile().memory_analysis().temp_size_in_bytes
            for f in (want, chunked(64))]
    assert temp[1] < 0.5 * temp[0], temp

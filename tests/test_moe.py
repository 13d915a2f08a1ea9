"""The Mixture-of-Experts layer (layers/moe.py): dispatches against each other and against a
NumPy reference, the auxiliary losses' closed forms, the drop count, parameter counts."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetjax.layers import ModelConfig, Transformer
from hetjax.layers import moe

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                   max_seq_len=16, n_experts=4, experts_per_token=2, moe_d_ff=48)


def layer_params(cfg, seed=0):
    x = jnp.zeros((2, 8, cfg.d_model))
    return nn.unbox(moe.MoE(cfg).init(jax.random.key(seed), x)["params"])


def numpy_moe(cfg, p, x):
    """Plain loops: softmax router, top-k, optional renormalisation, SwiGLU experts, weighted
    sum, plus the gated shared expert (float64)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    x = np.asarray(x, np.float64).reshape(-1, cfg.d_model)
    logits = x @ p["router"]["kernel"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t], kind="stable")[:cfg.experts_per_token]
        w = probs[t, top] / (probs[t, top].sum() if cfg.moe_norm_topk_prob else 1.0)
        for e, we in zip(top, w):
            ex = p["experts"]
            h = silu(x[t] @ ex["gate"][e]) * (x[t] @ ex["up"][e])
            out[t] += we * (h @ ex["down"][e])
    if cfg.shared_expert_d_ff:
        s = p["shared"]
        h = silu(x @ s["gate"]["kernel"]) * (x @ s["up"]["kernel"])
        y = h @ s["down"]["kernel"]
        if cfg.moe_shared_expert_gate:
            y = y / (1 + np.exp(-(x @ p["shared_gate"]["kernel"])))
        out += y
    return out


@pytest.mark.parametrize("norm, shared", [(True, 0), (False, 16)])
def test_layer_matches_numpy_reference(norm, shared):
    cfg = dataclasses.replace(TINY, moe_norm_topk_prob=norm, shared_expert_d_ff=shared,
                              moe_dispatch="dense")
    p = layer_params(cfg)
    x = jax.random.normal(jax.random.key(1), (2, 8, cfg.d_model))
    y = moe.MoE(cfg).apply({"params": p}, x)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, cfg.d_model), numpy_moe(cfg, p, x),
                               rtol=1e-5, atol=1e-5)


def test_dispatches_agree_in_outputs_and_gradients():
    """Dense, dropless and capacity (enough slots: no drops) give the same layer output and
    gradients with respect to the input and every parameter, to 1e-6."""
    p = layer_params(TINY)
    x = jax.random.normal(jax.random.key(1), (2, 8, TINY.d_model))
    ct = jax.random.normal(jax.random.key(2), x.shape)
    got = {}
    for mode in ("dense", "dropless", "capacity"):
        cfg = dataclasses.replace(TINY, moe_dispatch=mode,
                                  moe_capacity_factor=TINY.n_experts / TINY.experts_per_token)

        def f(p, x, cfg=cfg):
            y, st = moe.MoE(cfg).apply({"params": p}, x, mutable=[moe.STATS])
            return jnp.sum(y * ct), st

        (val, st), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(p, x)
        assert float(moe.find_stat(st, "dropped")[0]) == 0.0
        got[mode] = (val, grads)
    for mode in ("dropless", "capacity"):
        np.testing.assert_allclose(got[mode][0], got["dense"][0], rtol=1e-6)
        for a, b in zip(jax.tree.leaves(got[mode][1]), jax.tree.leaves(got["dense"][1])):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_drop_fraction_at_capacity_one_matches_numpy_count():
    """Capacity factor 1: C = T * k / E slots per expert; the dropped assignments are
    sum_e max(0, n_e - C), whatever the order the slots fill in."""
    cfg = dataclasses.replace(TINY, moe_dispatch="capacity", moe_capacity_factor=1.0)
    p = layer_params(cfg)
    # a skewed router, so some experts overflow
    p["router"]["kernel"] = p["router"]["kernel"] + jnp.array([1.5, 0.5, 0.0, -1.0]) / 4
    x = jax.random.normal(jax.random.key(3), (4, 8, cfg.d_model))
    _, st = moe.MoE(cfg).apply({"params": p}, x, mutable=[moe.STATS])
    logits = np.asarray(x, np.float64).reshape(-1, cfg.d_model) @ np.asarray(
        p["router"]["kernel"], np.float64)
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :cfg.experts_per_token]
    counts = np.bincount(top.ravel(), minlength=cfg.n_experts)
    t = logits.shape[0]
    slots = t * cfg.experts_per_token // cfg.n_experts
    dropped = np.maximum(counts - slots, 0).sum()
    assert dropped > 0
    assert float(moe.find_stat(st, "dropped")[0]) == pytest.approx(
        dropped / (t * cfg.experts_per_token), abs=1e-7)
    np.testing.assert_allclose(moe.find_stat(st, "load")[0],
                               counts / (t * cfg.experts_per_token), atol=1e-7)


def test_balance_and_z_loss_closed_forms():
    """Switch / Megatron convention: a uniform router's balance loss is 1 (x coefficient), a
    router sending every token to one expert with k = 1 gives E; zero logits give a z-loss of
    (ln E)^2."""
    e, t = 8, 64
    zeros = jnp.zeros((t, e))
    probs, experts, _ = moe.route(zeros, 2, True)
    # top-k of equal logits picks experts 0, 1; the uniform case needs the choices spread
    spread = jnp.stack([jnp.arange(t) % e, (jnp.arange(t) + 1) % e], axis=1).astype(jnp.int32)
    assert float(moe.balance_loss(probs, spread, e)) == pytest.approx(1.0, rel=1e-6)
    collapsed = jnp.zeros((t, e)).at[:, 3].set(1e4)
    probs, experts, _ = moe.route(collapsed, 1, True)
    assert float(moe.balance_loss(probs, experts, e)) == pytest.approx(e, rel=1e-6)
    assert float(moe.z_loss(zeros)) == pytest.approx(np.log(e) ** 2, rel=1e-6)
    # the model's auxiliary term: coefficient x mean over layers
    cfg = dataclasses.replace(TINY, moe_aux_loss_coef=0.02, moe_z_loss_coef=0.001)
    stats = {"balance": (jnp.array([1.0, 3.0]),), "z": (jnp.array([2.0, 4.0]),)}
    assert float(moe.moe_loss(stats, cfg)) == pytest.approx(0.02 * 2.0 + 0.001 * 3.0)


@pytest.mark.slow
def test_model_records_stats_per_layer_and_counts_parameters():
    cfg = dataclasses.replace(TINY, shared_expert_d_ff=16)
    tokens = jnp.arange(32).reshape(2, 16) % cfg.vocab_size
    v = Transformer(cfg).init(jax.random.key(0), tokens)
    params = nn.unbox(v["params"])
    assert sum(a.size for a in jax.tree.leaves(params)) == cfg.num_params
    block = params["layers"]["block"]["moe"]
    assert block["experts"]["gate"].shape == (2, 4, 32, 48)
    assert block["experts"]["down"].shape == (2, 4, 48, 32)
    assert block["router"]["kernel"].shape == (2, 32, 4)
    _, st = Transformer(cfg).apply({"params": params}, tokens, mutable=[moe.STATS])
    assert moe.find_stat(st, "load")[0].shape == (cfg.n_layers, cfg.n_experts)
    np.testing.assert_allclose(np.sum(moe.find_stat(st, "load")[0], -1), 1.0, rtol=1e-6)
    per_expert = 3 * 32 * 48
    assert cfg.num_params - cfg.active_params == cfg.n_layers * 2 * per_expert


@pytest.mark.slow
def test_auxiliary_gradient_enters_the_backward_inside_the_layer():
    """The layer adds the auxiliary losses' gradient itself (with_aux_gradient): the gradient
    of the cross-entropy of a model with coefficients equals the gradient of cross-entropy +
    moe_loss computed explicitly on the same model without them."""
    from hetjax.layers.model import cross_entropy

    cfg = dataclasses.replace(TINY, moe_aux_loss_coef=0.3, moe_z_loss_coef=0.05)
    off = dataclasses.replace(cfg, moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0)
    tokens = jax.random.randint(jax.random.key(4), (2, 16), 0, cfg.vocab_size)
    params = nn.unbox(Transformer(cfg).init(jax.random.key(0), tokens)["params"])

    def implicit(p):
        return cross_entropy(Transformer(cfg).apply({"params": p}, tokens)[:, :-1], tokens[:, 1:])

    def explicit(p):
        logits, st = Transformer(off).apply({"params": p}, tokens, mutable=[moe.STATS])
        return (cross_entropy(logits[:, :-1], tokens[:, 1:])
                + moe.moe_loss(moe.layer_stats(st), cfg))

    g1, g2 = jax.grad(implicit)(params), jax.grad(explicit)(params)
    router = g1["layers"]["block"]["moe"]["router"]["kernel"]
    off_router = jax.grad(lambda p: cross_entropy(Transformer(off).apply(
        {"params": p}, tokens)[:, :-1], tokens[:, 1:]))(params)["layers"]["block"]["moe"][
        "router"]["kernel"]
    assert float(jnp.max(jnp.abs(router - off_router))) > 1e-4  # the aux term matters here
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

"""KV-cache decoding (layers/kv_cache.py, layers/generate.py): against the no-cache forward,
token by token; sampling cuts; stop tokens."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetjax.layers import ModelConfig
from hetjax.layers.generate import filter_logits, generate
from hetjax.layers.kv_cache import init_cache
from hetjax.layers.model import Transformer

PROMPTS = [[5, 9, 2, 7, 1, 3], [11, 4], [8, 8, 8, 20]]  # different lengths: padded rows


def model_and_params(dtype="float32", n_kv_heads=2):
    cfg = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads,
                      d_ff=64, max_seq_len=64, dtype=dtype)
    model = Transformer(cfg)
    params = nn.unbox(model.init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"])
    # a larger embedding than the init's (std 0.02) so the logits have clear winners
    params["embedder"]["embedding"] = params["embedder"]["embedding"] * 50
    return model, params


def last_logits(model, params):
    """seq -> the no-cache forward's logits after its last token (causal, so a right-padded
    fixed length gives the same numbers with one compile)."""
    fwd = jax.jit(lambda p, s: model.apply({"params": p}, s))

    def run(seq):
        padded = np.zeros((1, 32), np.int32)
        padded[0, :len(seq)] = seq
        return np.asarray(fwd(params, padded)[0, len(seq) - 1])
    return run


@pytest.mark.parametrize("n_kv_heads", [2, pytest.param(1, marks=pytest.mark.slow),
                                        pytest.param(4, marks=pytest.mark.slow)],
                         ids=["gqa", "mqa", "mha"])
def test_greedy_with_cache_equals_the_no_cache_argmax_token_by_token(n_kv_heads):
    model, params = model_and_params(n_kv_heads=n_kv_heads)
    out, ref = generate(model, params, PROMPTS, 8), last_logits(model, params)
    assert [len(o) for o in out] == [8, 8, 8]
    for prompt, new in zip(PROMPTS, out):
        seq = list(prompt)
        for tok in new:
            assert int(np.argmax(ref(seq))) == tok
            seq.append(tok)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5),
                                       pytest.param("bfloat16", 5e-2, marks=pytest.mark.slow)])
def test_cached_logits_match_the_full_forward(dtype, tol):
    """Prefill plus one-token steps (teacher-forced) give the full forward's logits."""
    model, params = model_and_params(dtype)
    seq = jnp.asarray([[5, 9, 2, 7, 1, 3, 30, 12, 40, 17]] * 2)
    full = jax.jit(model.apply)({"params": params}, seq)
    step = jax.jit(lambda p, t, c: model.apply({"params": p}, t, c, method=Transformer.decode))
    logits, cache = step(params, seq[:, :4], init_cache(model.cfg, 2, 16))
    got = [logits]
    for t in range(4, seq.shape[1]):
        logits, cache = step(params, seq[:, t:t + 1], cache)
        got.append(logits)
    got = jnp.concatenate(got, axis=1)
    scale = float(jnp.max(jnp.abs(full)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), atol=tol * scale, rtol=0)
    assert int(cache["pos"][0, 0]) == seq.shape[1]


@pytest.mark.parametrize("full_layers", [(), pytest.param((0,), marks=pytest.mark.slow)],
                         ids=["every-layer", "layer-1-only"])
def test_cached_logits_keep_the_sliding_window(full_layers):
    """A 4-token window over 10 positions, on every layer or on layer 1 only: prefill plus
    one-token steps give the windowed full forward's logits (which differ from full attention),
    the cache carrying each layer's window."""
    import dataclasses

    model, params = model_and_params()
    windowed = Transformer(dataclasses.replace(model.cfg, sliding_window=4,
                                               full_attention_layers=full_layers))
    seq = jnp.asarray([[5, 9, 2, 7, 1, 3, 30, 12, 40, 17]])
    full = jax.jit(windowed.apply)({"params": params}, seq)
    assert np.abs(full - model.apply({"params": params}, seq)).max() > 1e-2
    step = jax.jit(lambda p, t, c: windowed.apply({"params": p}, t, c,
                                                  method=Transformer.decode))
    cache = init_cache(windowed.cfg, 1, 16)
    assert cache["window"].tolist() == ([4, 4] if not full_layers else [0, 4])
    logits, cache = step(params, seq[:, :3], cache)
    got = [logits]
    for t in range(3, seq.shape[1]):
        logits, cache = step(params, seq[:, t:t + 1], cache)
        got.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(got, axis=1)), np.asarray(full),
                               atol=1e-5 * float(jnp.max(jnp.abs(full))), rtol=0)


def test_top_k_1_equals_greedy():
    model, params = model_and_params()
    greedy = generate(model, params, PROMPTS, 6)
    assert generate(model, params, PROMPTS, 6, temperature=1.5, top_k=1, seed=3) == greedy


@pytest.mark.slow  # many draws; the greedy tests are the default tier's
def test_sampling_draws_only_allowed_tokens():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    # top_p = 0.7: 0.5 alone is short of it, 0.5 + 0.3 reaches it -> tokens 0 and 1
    assert np.isfinite(np.asarray(filter_logits(logits, 1.0, 0, 0.7))[0]).tolist() == \
        [True, True, False, False, False]
    assert np.isfinite(np.asarray(filter_logits(logits, 1.0, 3, 1.0))[0]).tolist() == \
        [True, True, True, False, False]
    model, params = model_and_params()
    out = generate(model, params, [[1, 2, 3]] * 8, 6, temperature=20.0, top_k=3, seed=0)
    seen, ref = set(), last_logits(model, params)
    for row in out:  # each drawn token is among the 3 most likely after its prefix
        seq = [1, 2, 3]
        for tok in row:
            assert tok in np.argsort(ref(seq))[-3:].tolist()
            seq.append(tok)
            seen.add(tok)
    assert len(seen) > 1  # it did sample, not always the argmax
    hot = generate(model, params, [[1, 2, 3]] * 8, 4, temperature=5.0, seed=0, vocab_limit=10)
    assert all(t < 10 for row in hot for t in row)


def test_stop_tokens_end_a_row():
    model, params = model_and_params()
    free = generate(model, params, PROMPTS, 8)
    stop = free[0][2]
    first = free[0].index(stop)
    out = generate(model, params, PROMPTS, 8, stop_tokens=(stop,))
    assert out[0] == free[0][:first]
    for row, ref in zip(out[1:], free[1:]):
        assert row == (ref[:ref.index(stop)] if stop in ref else ref)

"""layers/attention_kernels.py: which kernel runs where, and every kernel against a plain masked
float32 softmax (causal, grouped-query heads, document masks from segment ids, bf16).

cuDNN runs only on an NVIDIA GPU; on CPU its choice rules are tested, and the XLA and Pallas
kernels run (Pallas in its interpreter)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetjax.errors import ConfigError
from hetjax.layers import attention_kernels as ak

B, T, N, K, H = 2, 32, 4, 2, 16  # GQA: 4 query heads over 2 kv heads


def _qkv(dtype=jnp.float32, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, T, N, H), dtype),
            jax.random.normal(kk, (B, T, K, H), dtype),
            jax.random.normal(kv, (B, T, K, H), dtype))


def _segments():
    """Row 0: documents of 10, 15 and 7 tokens; row 1: one document."""
    row0 = np.repeat([1, 2, 3], [10, 15, 7])
    return jnp.asarray(np.stack([row0, np.ones(T, int)]), jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def _run(impl, q, k, v, seg):
    return ak.attend(q, k, v, seg, implementation=impl, interpret=impl == "pallas")


@functools.partial(jax.jit, static_argnums=0)
def _grads(impl, q, k, v, seg, w):
    """Gradients of sum(attention * w) by q, k, v: the kernel's own backward (impl), or the
    reference's (None)."""
    def loss(q, k, v):
        out = ak.reference(q, k, v, seg) if impl is None else ak.attend(
            q, k, v, seg, implementation=impl, interpret=impl == "pallas")
        return jnp.sum(out * w)

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("masked", [False, True])
def test_kernels_match_the_masked_softmax_reference(impl, masked):
    q, k, v = _qkv()
    seg = _segments() if masked else None
    ref = ak.reference(q, k, v, seg)
    np.testing.assert_allclose(_run(impl, q, k, v, seg), ref, atol=2e-5, rtol=2e-5)
    # ... and so do their gradients (the backward is the kernel's own for Pallas)
    w = jax.random.normal(jax.random.key(1), ref.shape)
    for g, r in zip(_grads(impl, q, k, v, seg, w), _grads(None, q, k, v, seg, w)):
        np.testing.assert_allclose(g, r, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_the_xla_window_matches_the_masked_softmax_reference(masked):
    """A 5-token window (shorter than the 32 positions and than two of row 0's documents):
    outputs and gradients equal the reference's, and differ from full attention."""
    q, k, v = _qkv()
    seg = _segments() if masked else None
    ref = ak.reference(q, k, v, seg, window=5)
    got = jax.jit(lambda q, k, v: ak.attend(q, k, v, seg, window=5))(q, k, v)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=2e-5)
    assert np.abs(ref - ak.reference(q, k, v, seg)).max() > 0.1
    w = jax.random.normal(jax.random.key(1), ref.shape)
    grads = [jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)
             for f in (lambda q, k, v: ak.attend(q, k, v, seg, window=5),
                       lambda q, k, v: ak.reference(q, k, v, seg, window=5))]
    for g, r in zip(*grads):
        np.testing.assert_allclose(g, r, atol=5e-5, rtol=5e-5)


def test_a_window_reaches_exactly_its_length_back():
    """Query i sees keys i - 4 .. i with a 5-token window: changing key i - 5 leaves it."""
    q, k, v = _qkv()
    out = ak.attend(q, k, v, window=5)
    k2, v2 = k.at[:, 10].add(5.0), v.at[:, 10].add(5.0)
    moved = np.abs(np.asarray(ak.attend(q, k2, v2, window=5) - out)).max(axis=(0, 2, 3)) > 1e-6
    assert moved.nonzero()[0].tolist() == [10, 11, 12, 13, 14]


def test_pallas_has_no_window_and_says_so():
    with pytest.raises(ConfigError, match="model.attention.*no sliding window "
                       r"\(model.sliding_window = 512 < sequence length 2048\)"):
        ak.choose("pallas", "cuda", "bfloat16", 64, 2048, 9.0, window=512)
    # auto passes it over: cuDNN takes the window; where cuDNN cannot run, XLA does
    assert ak.choose("auto", "cuda", "bfloat16", 64, 2048, 9.0, window=512).name == "cudnn"
    c = ak.choose("auto", "cuda", "float32", 64, 2048, 9.0, window=512)
    assert c.name == "xla" and "no sliding window" in c.reason
    # a window as long as the sequence masks nothing: Pallas runs
    assert ak.choose("pallas", "cuda", "bfloat16", 64, 2048, 9.0, window=4096).name == "pallas"
    with pytest.raises(ValueError, match="no sliding window"):
        ak.attend(*_qkv(), implementation="pallas", window=5, interpret=True)


def test_document_mask_blocks_attention_across_documents():
    """A token's output does not move when another document's keys and values change."""
    q, k, v = _qkv()
    seg = _segments()
    later = seg[0] == 3  # row 0's third document
    k2 = k.at[0, :10].add(5.0)  # change only the first document's keys and values
    v2 = v.at[0, :10].add(5.0)
    for impl in ("xla", "pallas"):
        a, b = _run(impl, q, k, v, seg), _run(impl, q, k2, v2, seg)
        np.testing.assert_allclose(a[0, later], b[0, later], atol=1e-6)
        assert not np.allclose(a[0, :10], b[0, :10])  # the first document itself does move
        # without the mask the third document sees the change
        c, d = _run(impl, q, k, v, None), _run(impl, q, k2, v2, None)
        assert not np.allclose(c[0, later], d[0, later])


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_bf16_kernels_stay_within_bf16_tolerance(impl):
    q, k, v = _qkv(jnp.bfloat16)
    seg = _segments()
    out = _run(impl, q, k, v, seg)
    assert out.dtype == jnp.bfloat16
    ref = ak.reference(q, k, v, seg)  # f32 from the same bf16 inputs
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=3e-2, rtol=3e-2)


def test_auto_takes_cudnn_on_cuda_where_supported_and_says_why_not():
    assert ak.choose("auto", "cpu", "bfloat16", 64, 2048).name == "xla"
    assert ak.choose("auto", "tpu", "bfloat16", 128, 2048).name == "xla"
    assert ak.choose("auto", "cuda", "bfloat16", 64, 2048, 9.0).name == "cudnn"
    assert ak.choose("auto", "gpu", "float16", 128, 2048).name == "cudnn"
    # fp32 compute: cuDNN's flash attention does not take it -> Pallas, with cuDNN's reason
    c = ak.choose("auto", "cuda", "float32", 64, 2048, 9.0)
    assert c.name == "pallas" and "bf16/fp16" in c.reason
    # head size 160: beyond cuDNN's 128 before Hopper; from Hopper on it is fine
    assert ak.choose("auto", "cuda", "bfloat16", 160, 2048, 8.0).name == "pallas"
    assert ak.choose("auto", "cuda", "bfloat16", 160, 2048, 9.0).name == "cudnn"
    assert ak.choose("auto", "cuda", "bfloat16", 64, 2048, 7.0).name == "pallas"  # V100
    # neither fits (odd length): XLA, both reasons given
    c = ak.choose("auto", "cuda", "bfloat16", 64, 999, 9.0)
    assert c.name == "xla" and "even" in c.reason and "Pallas" in c.reason


def test_a_named_kernel_the_device_cannot_run_is_a_config_error():
    with pytest.raises(ConfigError, match="model.attention.*cudnn.*NVIDIA"):
        ak.choose("cudnn", "cpu", "bfloat16", 64, 128)
    with pytest.raises(ConfigError, match="bf16/fp16"):
        ak.choose("cudnn", "cuda", "float32", 64, 128)
    with pytest.raises(ConfigError, match="pallas"):
        ak.choose("pallas", "tpu", "bfloat16", 64, 128)
    with pytest.raises(ConfigError, match="unknown"):
        ak.choose("flash", "cuda", "bfloat16", 64, 128)
    assert ak.choose("xla", "cuda", "bfloat16", 64, 128).name == "xla"


def test_fallback_is_said_once(caplog):
    c = ak.choose("auto", "cuda", "float32", 64, 256, 9.0)
    with caplog.at_level("WARNING", logger="hetjax.attention"):
        ak.say_once(c)
        ak.say_once(c)
        ak.say_once(ak.choose("auto", "cuda", "bfloat16", 64, 256, 9.0))  # cuDNN: silent
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "pallas" in lines[0] and "bf16/fp16" in lines[0]


def test_every_named_kernel_is_chosen_or_refused_with_the_fix():
    """The names (hetjax.core.model_config, read by the config's check and --help) are the ones `choose`
    takes: each explicit one gives its kernel where it runs, or a ConfigError naming the fix."""
    from hetjax.errors import ConfigError

    for name in ak.IMPLEMENTATIONS[1:]:
        try:
            assert ak.choose(name, "cuda", "bfloat16", 64, 256, 9.0).name == name
        except ConfigError as e:
            assert e.field == "model.attention", e
    with pytest.raises(ConfigError, match="use one of auto, xla, cudnn, pallas"):
        ak.choose("flash", "cpu", "float32", 64, 256)


@pytest.mark.slow  # three searched plans (one on DT-FM's 40 sites)
def test_hetjax_plan_shows_the_kernel_each_accelerator_takes(capsys):
    from hetjax.cli import main

    assert main(["hetjax", "plan", "--config.topology.preset=holmes_infiniband",
                 "--config.model.dtype=bfloat16"]) == 0
    assert "attention: cudnn (auto: bfloat16, head size 32 on CUDA)" in capsys.readouterr().out
    assert main(["hetjax", "plan", "--config.topology.preset=dtfm_datacenter_spot",
                 "--config.model.dtype=bfloat16", "--config.train.batch_size=128",
                 "--config.parallel.tp=1"]) == 0
    assert "attention: pallas (auto: cuDNN fused attention needs compute capability >= 8.0" \
        in capsys.readouterr().out  # V100s
    assert main(["hetjax", "plan"]) == 0
    assert "attention: xla (auto on cpu)" in capsys.readouterr().out
    assert main(["hetjax", "plan", "--config.model.attention=cudnn"]) != 0
    assert "model.attention: 'cudnn' cannot run here" in capsys.readouterr().err


def test_the_local_devices_here_are_cpu_and_take_xla():
    assert ak.local_platform() == ("cpu", None)
    assert ak.choose_local("auto", "bfloat16", 64, 128) == ak.Choice("xla", "auto on cpu")

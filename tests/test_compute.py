"""Compute priced by operation kind (hetjax/planner/compute.py) against hand arithmetic."""

import dataclasses

import pytest

from hetjax.core.catalogue import ACCELERATORS
from hetjax.errors import PlanError
from hetjax.planner import compute as ck
from hetjax.planner.cost import CostModel, CostOptions
from hetjax.planner.layout import Layout
from hetjax.core.topology import preset
from hetjax.core.model_config import ModelConfig

A100 = ACCELERATORS["a100"]


def model(**kw):
    base = dict(vocab_size=32000, d_model=1024, n_layers=4, n_heads=16, n_kv_heads=16,
                d_ff=4096, dtype="bfloat16", param_dtype="bfloat16")
    return ModelConfig(**{**base, **kw})


def test_matmul_efficiency_grows_with_size_and_saturates():
    r = ck.KernelRates(matmul_peak=0.8, matmul_half_flops=1e9)
    assert r.matmul_efficiency(1e9) == pytest.approx(0.4)
    assert r.matmul_efficiency(1e8) < r.matmul_efficiency(1e10) < r.matmul_efficiency(1e13) < 0.8
    measured = dataclasses.replace(r, matmul_curve=ck.SizeCurve((1e8, 1e10), (0.2, 0.6)))
    assert measured.matmul_efficiency(1e9) == pytest.approx(0.4)  # log-linear between points


def test_layer_work_matches_hand_arithmetic():
    m, tok, s = model(), 4096.0, 2048
    r = ck.KernelRates(matmul_peak=0.5, matmul_half_flops=0.0, memory_efficiency=1.0)
    fwd, bwd = ck.layer_work(m, A100, r, tok, s, tp=1, attention="cudnn", act_bytes=2)
    peak, bw = 312e12, 2039e9
    d, f = 1024, 4096
    assert fwd.matmul == pytest.approx(2 * tok * (4 * d * d + 3 * d * f) / (0.5 * peak))
    assert fwd.attention == pytest.approx(2 * tok * s * d / (0.55 * peak))  # causal half
    assert fwd.memory == pytest.approx(tok * (10 * d + 4 * d + 3 * f) * 2 / bw)
    assert bwd.matmul == pytest.approx(2 * fwd.matmul)
    assert bwd.attention == pytest.approx(2.5 * fwd.attention)


def test_attention_implementations_and_tensor_parallel_norms():
    m, r = model(), ck.FITTED
    times = {a: ck.layer_work(m, A100, r, 8192, 2048, 1, a)[0].attention
             for a in ("xla", "fused_softmax", "cudnn", "pallas")}
    # XLA streams float32 scores; the fused softmax 16-bit ones; flash kernels none
    assert times["xla"] > times["fused_softmax"] > times["pallas"] > times["cudnn"]
    one = ck.layer_work(m, A100, r, 8192, 2048, 1)[0]
    eight = ck.layer_work(m, A100, r, 8192, 2048, 8)[0]
    # norms and residual adds are replicated over tp: memory work shrinks less than 8x
    assert one.memory / 8 < eight.memory < one.memory
    assert ck.attention_impl("auto", "nvidia") == "cudnn"
    assert ck.attention_impl("auto", "cpu") == "xla"
    with pytest.raises(PlanError, match="model.attention"):
        ck.attention_impl("flash3", "nvidia")


def test_cost_model_kinds_prices_stage_from_the_kinds():
    m = model(remat="full")
    t = preset("holmes_infiniband")
    layout = Layout(pp=1, dp=8, tp=4, device_order=tuple(range(32)), microbatches=2,
                    global_batch=32, seq_len=2048)
    cm = CostModel(t, m, CostOptions(compute="kinds", attention="cudnn"))
    stage = cm.stage_costs(layout)[0]
    tok = layout.tokens_per_device()
    fwd, bwd = ck.layer_work(m, A100, ck.FITTED, tok, 2048, 4, "cudnn")
    tp_ar = 2 * cm.collective("all_reduce", tok * 1024 * 2, layout.mesh()[0])
    assert stage.fwd_layer == pytest.approx(fwd.total + tp_ar)
    assert stage.bwd_layer == pytest.approx(bwd.total + fwd.total + tp_ar)  # + recompute
    # the update is priced from memory bandwidth without a calibration
    assert cm.update_seconds_per_param(A100) == pytest.approx(28 / (2039e9 * 0.8))
    assert CostModel(t, m).update_seconds_per_param(A100) == 0.0
    with pytest.raises(PlanError, match="compute"):
        CostOptions(compute="roofline")

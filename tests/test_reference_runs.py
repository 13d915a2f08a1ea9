"""Megatron-LM's published scaling table (hetjax/planner/reference_runs.py): the fixture as
published, the fit on two rows, every other row predicted within 10%."""

import pytest

from hetjax.planner import compute as ck, reference_runs as rr


def test_table_is_consistent_with_its_own_aggregate_and_peak_columns():
    assert len(rr.MEGATRON_TABLE1) == 10
    for r in rr.MEGATRON_TABLE1:
        # aggregate petaFLOP/s = per-GPU teraFLOP/s x GPUs; % of the A100's 312 TFLOP/s
        assert r.tflops_per_gpu * r.gpus / 1e3 == pytest.approx(r.petaflops, rel=0.01), r.name
        assert round(100 * r.tflops_per_gpu / rr.A100_PEAK_TFLOPS) == r.percent_peak, r.name
        assert r.tp * r.pp * r.dp == r.gpus and r.tp <= 8  # tensor parallelism inside a node


def test_fit_on_two_rows_reproduces_the_stored_rates():
    fit = rr.fit_megatron()
    assert fit.matmul_peak == pytest.approx(ck.FITTED.matmul_peak, rel=0.01)
    assert fit.matmul_half_flops == pytest.approx(ck.FITTED.matmul_half_flops, rel=0.02)
    for name in rr.FITTED_ROWS:  # the fitted rows come out exact
        r = rr.row(name)
        assert rr.predicted_tflops(r, rr.megatron_options(fit)) == pytest.approx(
            r.tflops_per_gpu, rel=0.005)


_BIG = ("529.6B", "1008B")  # their simulations (35 and 64 stages, 2,520+ micro-batches) take ~20 s


@pytest.mark.parametrize("name", [
    pytest.param(r.name, marks=pytest.mark.slow) if r.name in _BIG else r.name
    for r in rr.MEGATRON_TABLE1 if r.name not in rr.FITTED_ROWS])
def test_held_back_row_predicted_within_10_percent(name):
    """Fitted on rows 1.7B and 310.1B; each other row's TFLOP/s per GPU within 10%."""
    assert rr.FITTED_ROWS == ("1.7B", "310.1B")
    r = rr.row(name)
    got = rr.predicted_tflops(r)
    assert abs(got / r.tflops_per_gpu - 1) < 0.10, (name, got, r.tflops_per_gpu)


def test_flat_efficiency_misses_the_table_shape():
    """One efficiency for every FLOP gets the table's shape wrong: the ratio of 18.4B (t = 8,
    small matmuls per GPU, norms replicated over t) to 1.7B is closer to the measured one
    priced by operation kind than priced flat."""
    from hetjax.planner.cost import CostOptions

    small, mid = rr.row("1.7B"), rr.row("18.4B")
    flat = CostOptions(executor="megatron")
    ratio = rr.predicted_tflops(mid, flat) / rr.predicted_tflops(small, flat)
    kinds = rr.predicted_tflops(mid) / rr.predicted_tflops(small)
    measured = mid.tflops_per_gpu / small.tflops_per_gpu
    assert abs(kinds - measured) < abs(ratio - measured)


def test_amsp_reported_mfu_is_predicted_within_10_percent():
    """AMSP's 52% MFU for LLaMA 7B and 13B on 1,024 A800s: ZeRO's per-layer gathers and
    reduce-scatters overlap the layers' compute and the gradient buckets the last backward,
    so at the assumed 400 Gb/s a node only the last bucket and a pass's first gather are
    exposed. (Before the overlap was scheduled the model predicted 40%.)"""
    from hetjax.planner.reference_runs import AMSP_MFU, AMSP_REPORTED, amsp_plan

    for name in AMSP_REPORTED:
        mfu = amsp_plan(name).predicted["mfu"]
        assert abs(mfu / AMSP_MFU - 1) <= 0.10, (name, mfu)

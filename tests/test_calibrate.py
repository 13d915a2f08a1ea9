"""`hetjax calibrate`: fitting a calibration file's measurements (pure numpy, synthetic rows
with known answers), the file round trip, the planner reading it, and measuring on the
simulated CPU devices of this process and under `hetjax launch`."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hetjax.errors import PlanError
from hetjax.planner import plan
from hetjax.planner.calibrate import (Calibration, ComputeRow, LinkRow, load_calibration,
                                      save_calibration)
from hetjax.planner.cost import CostModel, CostOptions
from hetjax.core.topology import preset
from hetjax.core.model_config import ModelConfig

MODEL = ModelConfig(vocab_size=384, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128,
                    max_seq_len=128)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _synthetic(topology, alpha=2e-4, gbps=4.0):
    """Link rows timed by the flat ring with latency `alpha` and `gbps` on every class (NIC
    sharing as the cost model counts it), and compute rows at 10% / 40% of peak."""
    cm = CostModel(topology, MODEL)
    bw = gbps * 1e9 / 8
    node_pairs = np.arange(topology.num_devices).reshape(-1, 2)  # inside nodes: NVLink
    ib_pairs = np.array([[0, 2], [1, 3]])  # two nodes of cluster ib: its NIC, shared by 2
    links = []
    for groups in (node_pairs, ib_pairs, np.arange(topology.num_devices)[None, :]):
        flows = cm.nic_flows(groups)
        p = groups.shape[1]
        for nbytes in (1e4, 1e6, 4e6):
            for op, steps in (("all_reduce", 2 * (p - 1)), ("all_gather", p - 1)):
                t = steps * alpha + flows * steps / p * nbytes / bw
                links.append(LinkRow(op, int(nbytes), tuple(map(tuple, groups.tolist())), t))
    peak = topology.clusters[0].accelerator.peak_tflops
    compute = []
    for b, eff in ((1, 0.1), (8, 0.4)):
        flops = MODEL.layer_flops(64) * b * 64
        compute.append(ComputeRow("cpu", b, 64, flops / (eff * peak * 1e12),
                                  2 * flops / (eff / 2 * peak * 1e12), peak))
    return Calibration(topology, MODEL, tuple(compute), tuple(links))


def test_fits_recover_the_synthetic_latency_bandwidth_and_curve():
    cal = _synthetic(preset("cpu_hybrid"))
    fits = cal.link_fits()
    assert set(fits) == {"nvlink", "infiniband", "ethernet"}
    for kind, ops in fits.items():
        for op, f in ops.items():
            assert f.latency_us == pytest.approx(200.0, rel=1e-6), (kind, op)
            assert f.bandwidth_gbps == pytest.approx(4.0, rel=1e-6), (kind, op)
    curve = cal.curves()["cpu"]
    small, big = (cal.kernel_flops(r) for r in cal.compute)
    assert curve.efficiency(small) == pytest.approx((0.1, 0.05))
    assert curve.efficiency(big) == pytest.approx((0.4, 0.2))
    # Halfway in log size, halfway in efficiency.
    assert curve.efficiency(np.sqrt(small * big)) == pytest.approx((0.25, 0.125))


def test_calibration_file_round_trips_and_the_planner_reads_it(tmp_path):
    t = preset("cpu_hybrid")
    cal = _synthetic(t)
    path = save_calibration(cal, str(tmp_path / "cal.json"))
    back = load_calibration(path)
    assert back == cal
    fitted = json.load(open(path))["fitted"]
    assert fitted["link_fits"]["ethernet"]["all_reduce"]["bandwidth_gbps"] == pytest.approx(4.0)
    # plan() with the file prices with its measurements, the same as with its options.
    by_path = plan(t, MODEL, 16, 64, pp=1, tp=1, zero="ddp", calibration=path).plan
    by_options = plan(t, MODEL, 16, 64, pp=1, tp=1, zero="ddp", options=cal.options()).plan
    default = plan(t, MODEL, 16, 64, pp=1, tp=1, zero="ddp").plan
    assert by_path.predicted["step_time_s"] == by_options.predicted["step_time_s"]
    assert by_path.predicted["step_time_s"] != pytest.approx(default.predicted["step_time_s"])


def test_measured_head_and_update_price_the_step_as_a_hand_computation():
    """The head curve replaces the layer curve for the embedding + head + loss, and the
    optimizer update adds rate x parameters after the sync of every stage."""
    import dataclasses

    from hetjax.core.plan import Plan
    from hetjax.planner.cost import CostOptions

    t = preset("cpu_hybrid")
    cal = _synthetic(t)
    peak = t.clusters[0].accelerator.peak_tflops * 1e12
    tok = 16 * 64  # one device's micro-batch: 16 sequences of 64
    head = ComputeRow("cpu", 16, 64, 3e-3, 5e-3, peak / 1e12, "head")
    update = ComputeRow("cpu", 0, 0, 0.02, 0.0, 0.0, "update", 1_000_000)
    cal = dataclasses.replace(cal, compute=cal.compute + (head, update))
    cm = CostModel(t, MODEL, cal.options())
    acc = t.clusters[0].accelerator
    f, b = cm.head_seconds_per_token(acc, tok)
    assert (f * tok, b * tok) == pytest.approx((3e-3, 5e-3))
    assert cm.update_seconds_per_param(acc) == pytest.approx(2e-8)
    p = Plan(pp=1, dp=8, tp=1, stage_layers=(4,), microbatches=1, global_batch=128, seq_len=64)
    with_update = cm.predict(p).step_time
    without = CostModel(t, MODEL, dataclasses.replace(cal.options(), update_s_per_param={})
                        ).predict(p).step_time
    assert with_update - without == pytest.approx(2e-8 * MODEL.num_params, rel=1e-6)
    assert CostModel(t, MODEL, CostOptions()).update_seconds_per_param(acc) == 0.0


def test_staged_block_prices_pipelined_layers_and_only_those():
    """A "staged:full" row (the block as the pipelines run it, recompute in its backward)
    prices each layer of a pipelined layout -- as a hand computation, no recompute FLOPs
    added -- while pp = 1 keeps the plain block's curve plus the recompute."""
    import dataclasses

    from hetjax.core.plan import Plan

    t = preset("cpu_hybrid")
    model = dataclasses.replace(MODEL, remat="full")
    cal = dataclasses.replace(_synthetic(t), model=model)
    peak = t.clusters[0].accelerator.peak_tflops
    staged = ComputeRow("cpu", 2, 64, 4e-3, 11e-3, peak, "staged:full")
    cal = dataclasses.replace(cal, compute=cal.compute + (staged,))
    assert set(cal.staged_curves()) == {"full"}
    cm = CostModel(t, model, cal.options())
    acc = t.clusters[0].accelerator
    tok = 2 * 64
    f, b = cm.layer_seconds_per_token(acc, 64, "full", tok, staged=True)
    assert (f * tok, b * tok) == pytest.approx((4e-3, 11e-3))
    plain = cm.layer_seconds_per_token(acc, 64, "full", tok)
    ef, eb = cal.curves()["cpu"].efficiency(model.layer_flops(64) * tok)
    flops = model.layer_flops(64)
    assert plain == pytest.approx((flops / (ef * peak * 1e12), 2 * flops / (eb * peak * 1e12)
                                   + flops / (ef * peak * 1e12)))
    # A 2-stage pipeline of the hetjax executors reads the staged row; its stage's forward
    # per micro-batch is layers x 4 ms (dp = 4: 2 sequences of 64 per device).
    p = Plan(pp=2, dp=4, tp=1, stage_layers=(2, 2), microbatches=2, global_batch=16,
             seq_len=64)
    for executor in ("spmd", "mpmd"):
        cm = CostModel(t, model, dataclasses.replace(cal.options(), executor=executor))
        assert cm.stage_costs(cm_layout(p))[0].fwd_layer == pytest.approx(4e-3)
    megatron = CostModel(t, model, dataclasses.replace(cal.options(), executor="megatron"))
    assert megatron.stage_costs(cm_layout(p))[0].fwd_layer != pytest.approx(4e-3)


def cm_layout(plan_):
    from hetjax.planner.layout import Layout

    return Layout.of(plan_)


SAVED = os.path.join(ROOT, "docs", "results", "calibration_hetaccel_0808.json")


def _hostile(path: str, value):
    """The saved calibration with `value` at `path` (keys and list indices split by '.')."""
    with open(SAVED) as f:
        d = json.load(f)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = d
    for p in parents:
        node = node[p]
    node[last] = value
    return d


# (JSON path, hostile value, what the one error says). Before these checks, the first two
# ended in a ZeroDivisionError traceback, the rank out of range and the ragged groups in an
# IndexError / numpy error when the planner read the file, the text number in a TypeError.
HOSTILE_CALIBRATIONS = [
    ("model.n_heads", 0, "model.n_heads: must be > 0, got 0"),
    ("compute.0.fwd_s", 0, "compute[0].fwd_s: must be > 0, got 0"),
    ("links.0.groups.0.1", 10**9, "links[0].groups[0][1]: rank 1000000000 is not one of the "
     "topology's 4 devices"),
    ("links.0.groups", [[0, 1], [2]], "links[0].groups: must be a non-empty list of equal-sized "
     "lists of ranks"),
    ("compute.0.bwd_s", "0.1", "compute[0].bwd_s: must be a finite number, got '0.1'"),
    ("compute.0.batch", 1e300, "compute[0].batch: must be a whole number up to 2**53"),
    ("compute.0.part", "blocks", "compute[0].part: 'blocks' is not a part hetjax calibrate "
     "measures"),
    ("compute.0.evil", 1, "compute[0].evil: is not a field of a ComputeRow"),
    ("links.0.op", "broadcast", "links[0].op: 'broadcast' is not one of all_reduce, "
     "reduce_scatter, all_gather, p2p"),
    ("links.0.seconds", float("nan"), "links[0].seconds: must be a finite number, got nan"),
    ("compute.0.fwd_s", 10**400, "compute[0].fwd_s: must be a finite number, got a number of "
     "401 digits"),
    ("topology.clusters.0.nodes", 10**9, "topology.clusters[0].nodes: must be at most 65,536, "
     "got 1,000,000,000"),
    ("processes", -1, "processes: must be > 0, got -1"),
    ("profile_rows", [{"accelerator": "cpu", "piece": "block", "tp": 1, "tokens": 64,
                       "seq_len": 64, "fwd_s": "fast", "bwd_s": 1.0}],
     "profile_rows[0].fwd_s: must be a finite number, got 'fast'"),
]


@pytest.mark.parametrize("path,value,error", HOSTILE_CALIBRATIONS,
                         ids=[c[0] for c in HOSTILE_CALIBRATIONS])
def test_a_hostile_calibration_file_is_one_error_naming_the_value(tmp_path, path, value, error):
    load_calibration(SAVED)  # the file is good before the change
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps(_hostile(path, value)))
    with pytest.raises(PlanError) as e:
        load_calibration(str(bad))
    assert str(e.value).startswith(f"planner.calibration: {str(bad)!r}: not a hetjax "
                                   f"calibration file ({error}")
    assert str(e.value).endswith("; write one with 'hetjax calibrate'")


def test_a_calibration_file_too_large_or_too_deep_is_refused_unparsed(tmp_path, monkeypatch):
    from hetjax.planner import calibrate

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PlanError, match="nested deeper than a calibration ever is"):
        load_calibration(str(deep))
    monkeypatch.setattr(calibrate, "MAX_CALIBRATION_BYTES", 1000)
    with pytest.raises(PlanError, match=r"\(larger than 0 MiB, which no calibration is\)"):
        load_calibration(SAVED)


def test_a_file_that_is_not_a_calibration_is_one_clear_error(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"version": 1, "compute": []}))
    with pytest.raises(PlanError, match="not a hetjax calibration file"):
        load_calibration(str(bad))
    with pytest.raises(PlanError, match="cannot read"):
        load_calibration(str(tmp_path / "missing.json"))


def test_processes_of_one_kind_merge_to_their_mean_not_their_slowest():
    from hetjax.measure import merge_compute

    rows = [ComputeRow("cpu", 2, 64, 0.0, 0.0, 1.0, "block"),
            ComputeRow("cpu", 4, 64, 0.0, 0.0, 1.0, "block")]
    # processes 0, 1, 3 are kind a (process 3 sampled while throttled), process 2 kind b
    per_process = np.array([[[1.0, 3.0, 10.0], [2.0, 6.0, 10.0]],
                            [[1.2, 3.2, 10.0], [2.2, 6.2, 10.0]],
                            [[5.0, 9.0, 20.0], [7.0, 9.5, 20.0]],
                            [[1.9, 4.5, 10.0], [2.9, 8.0, 10.0]]])
    merged = merge_compute(rows, per_process, ["a", "a", "b", "a"])
    got = {(r.kind, r.batch): (r.fwd_s, r.bwd_s, r.peak_tflops) for r in merged}
    assert {r.part for r in merged} == {"block"} and len(merged) == 4
    want = {("a", 2): (4.1 / 3, 10.7 / 3, 10.0), ("a", 4): (7.1 / 3, 20.2 / 3, 10.0),
            ("b", 2): (5.0, 9.0, 20.0), ("b", 4): (7.0, 9.5, 20.0)}
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-12)


@pytest.mark.slow  # measures every link class on 8 simulated devices (~1 min)
def test_measure_on_this_process_devices_covers_every_link_class(tmp_path):
    """On the 8 simulated CPU devices (cpu_hybrid: 2 clusters x 2 nodes x 2): every link
    class, every operation and each accelerator kind is measured, with positive times."""
    from hetjax import measure
    from hetjax.planner.calibrate import plot_calibration

    t = preset("cpu_hybrid")
    # one micro-batch size: each size is another compile of every part (the suite's time)
    lines = []
    progress = measure.Progress(out=lines.append)
    cal = measure.calibrate(t, MODEL, seq_lens=(16,), batches=(2,), message_bytes=(4096,),
                            repeats=1, min_sample_s=0, progress=progress)
    kinds = {"matmul", "memory", "attention:xla"}
    assert {(r.kind, r.part, r.batch, r.seq_len) for r in cal.compute
            if r.part not in kinds} == {
        ("cpu", part, 2, 16) for part in ("block", "head", "staged:none", "staged:full")
    } | {("cpu", "update", 0, 0)}
    # the per-kind rows: matmul sizes, attention at the largest point, a memory stream
    assert {r.part for r in cal.compute} >= kinds
    assert {r.batch for r in cal.rows("matmul")} == set(measure.MATMUL_SIZES["cpu"])
    assert cal.rows("attention:xla")[0].seq_len == 16
    # loaded always, used when the plan prices compute by kind
    assert cal.options().compute == "flat" and "cpu" in cal.options().kernel_rates
    assert cal.options(CostOptions(compute="kinds")).compute == "kinds"
    # it spoke: a count and an estimate first, then each measurement numbered
    assert lines[0].startswith(f"calibrate: {progress.total} measurements, about ")
    assert progress.count == progress.total == sum(line.lstrip().startswith("[")
                                                   for line in lines)
    assert all(r.fwd_s > 0 and r.bwd_s > 0 for part in ("block", "head", "staged:full")
               for r in cal.rows(part))
    assert set(cal.staged_curves()) == {"none", "full"}
    # the staged rows carry the stash the forward keeps and the backward's peak
    assert all(0 < r.kept_bytes < r.peak_bytes for part in ("staged:none", "staged:full")
               for r in cal.rows(part))
    assert cal.profile().lookup("cpu", "layer", 1, 32, 16, "full", True).kept_bytes > 0
    # the layer split over each TP degree a node allows (2 devices a node): a profile row
    assert [(r.tp, r.tokens, r.seq_len) for r in cal.profile_rows] == [(2, 32, 16)]
    assert all(r.fwd_s > 0 and r.bwd_s > 0 and r.peak_bytes > 0 for r in cal.profile_rows)
    assert cal.options().profile.lookup("cpu", "layer", 2, 32, 16).fwd_s == \
        cal.profile_rows[0].fwd_s
    assert cal.rows("update")[0].params == MODEL.num_params
    assert cal.update_rates()["cpu"] > 0 and set(cal.curves("head")) == {"cpu"}
    # one process: the pipeline stays priced in lockstep with NCCL's algorithms
    assert not cal.asynchronous_sends and cal.options().lockstep
    classes = {(row["class"], row["op"]) for row in cal.link_table()}
    for kind in ("nvlink", "infiniband", "roce", "ethernet"):
        for op in ("all_reduce", "reduce_scatter", "all_gather", "p2p"):
            assert (kind, op) in classes
    assert all(r.seconds > 0 for r in cal.links)
    options = cal.options()
    assert set(options.curves) == {"cpu"} and "ethernet" in options.link_fits
    assert "mean |model / measured - 1|" in cal.describe()
    assert "composed from the kinds" in cal.describe()
    png = plot_calibration(cal, str(tmp_path / "cal.png"))
    assert os.path.getsize(png) > 10_000


@pytest.mark.slow
def test_hetjax_calibrate_under_launch_then_plan(tmp_path, capsys):
    """Two processes (gloo): process 0 writes the file, which `hetjax plan` then reads."""
    from hetjax.cli import main

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    args = ["--config.model.d_model=64", "--config.model.d_ff=128", "--config.train.seq_len=16",
            f"--config.workdir={tmp_path}"]
    # small: one micro-batch size, one sequence length (each another compile of every part)
    # and one message size -- the suite's time
    run = subprocess.run([sys.executable, "-m", "hetjax", "launch", "--local", "2",
                          "--command=calibrate", "--batches=2", "--seq_lens=16",
                          "--min_sample=0", "--sizes=4096", "--repeats=1",
                          *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    path = tmp_path / "calibration.json"
    cal = load_calibration(str(path))
    assert cal.links and (tmp_path / "calibration.png").exists()
    # calibrate's own flags reach the workers through the launcher (without --seq_lens they
    # would measure train.seq_len / 2 and train.seq_len: 8 and 16)
    assert {(r.batch, r.seq_len) for r in cal.rows("block")} == {(2, 16)}
    assert {r.nbytes for r in cal.links} == {4096}
    # measured across gloo processes: stages priced asynchronously, collectives as rings
    assert cal.processes == 2 and cal.collectives == "gloo" and cal.asynchronous_sends
    assert not cal.options().lockstep and cal.options().collectives == "ring"
    # `hetjax plan` reads it (in this process: planning needs no devices, and a process
    # start-up is the suite's time)
    capsys.readouterr()
    assert main(["hetjax", "plan", *args, f"--config.planner.calibration={path}"]) == 0
    assert "predicted" in capsys.readouterr().out


def test_progress_warns_with_the_spread_when_samples_disagree():
    from hetjax import measure

    lines = []
    p = measure.Progress(out=lines.append)
    p.start(2, repeats=3, min_sample_s=0.5, compile_s=0.5)
    assert lines[0] == "calibrate: 2 measurements, about 5 s (3 samples of >= 0.5 s each after " \
                       "a compile)"
    p.done("steady", [1.00, 1.02, 0.99])
    assert "[1/2] steady: 1e+03 ms (spread 3%" in lines[1] and len(lines) == 2
    p.done("noisy", [1.0, 1.5, 1.0])
    assert "[2/2] noisy" in lines[2]
    assert lines[3].startswith("  warning: the samples of noisy disagree by 43%, more than the "
                               "10%")
    assert "1 of them spread beyond 10% (worst noisy: 43%)" in p.summary()


def test_per_kind_rows_fit_the_kernel_rates_by_hand():
    """Synthetic per-kind rows: a matmul at 20% / 60% of peak, a 4 GB/s stream, cuDNN
    attention at 50%: the rates read them back, and the planner then prices by kind."""
    from hetjax.planner import compute as ck

    t = preset("cpu_hybrid")
    peak = t.clusters[0].accelerator.peak_tflops
    rows = [ComputeRow("cpu", n, n, 2 * n ** 3 / (eff * peak * 1e12), 0.0, peak, "matmul",
                       2 * n ** 3) for n, eff in ((64, 0.2), (512, 0.6))]
    rows.append(ComputeRow("cpu", 0, 0, 1.0, 0.0, peak, "memory", 4_000_000_000))
    fl = 4 * 2 * 16 * 16 * 4 * 16
    rows.append(ComputeRow("cpu", 2, 16, fl / 2 / (0.5 * peak * 1e12), 1e-3, peak,
                           "attention:cudnn", fl))
    cal = Calibration(t, MODEL, tuple(rows), ())
    r = cal.kernel_rates()["cpu"]
    assert r.matmul_efficiency(2 * 64 ** 3) == pytest.approx(0.2)
    assert r.matmul_efficiency(2 * 512 ** 3) == pytest.approx(0.6)
    assert r.memory_bytes_per_s == pytest.approx(4e9)
    assert r.flash["cudnn"] == pytest.approx(0.5)
    options = cal.options(CostOptions(compute="kinds"))
    assert options.kernel_rates["cpu"] == r
    cm = CostModel(t, MODEL, options)
    acc = t.clusters[0].accelerator
    assert cm.update_seconds_per_param(acc) == pytest.approx(ck.ADAM_BYTES_PER_PARAM / 4e9)
    cal2 = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert cal2.kernel_rates()["cpu"] == r


def test_plausibility_guard_states_the_fit_and_warns_only_far_outside_it(capsys):
    from hetjax.cli import main
    from hetjax.planner import reference_runs as rr
    from hetjax.planner.fit_range import plausibility_lines

    fit = rr.megatron_range()
    inside = rr.row("145.6B")  # held back, inside the fitted sizes, devices and fabric
    lines = plausibility_lines(0.47, rr.megatron_model(inside), rr.selene(inside.gpus // 8), fit)
    assert len(lines) == 1 and lines[0].startswith("predicted MFU 47.0%; the compute and link "
                                                   "rates were fitted on Megatron-LM Table 1")
    assert "33-39% MFU" in lines[0] and "32-1,920 devices" in lines[0]
    # far outside: 32,768 devices (> 10 x 1,920), a hybrid cluster's RoCE and Ethernet
    huge = plausibility_lines(0.47, rr.megatron_model(inside), rr.selene(4096), fit)
    assert "32,768 devices" in huge[1] and "fabric" not in huge[1]
    hybrid = plausibility_lines(0.10, rr.megatron_model(inside), preset("holmes_hybrid"), fit)
    assert "fabric ethernet/roce never fitted" in hybrid[1] and "an MFU of 10.0%" in hybrid[1]
    # `hetjax plan` on the CPU default: a tiny model on CPU devices, far from Holmes' A100s
    assert main(["hetjax", "plan", "--config.parallel.pp=1", "--config.parallel.tp=1"]) == 0
    out = capsys.readouterr().out
    assert "predicted MFU" in out and "fitted on Holmes Table 1" in out
    assert "warning: this prediction extrapolates far outside that fit: a model of" in out
    assert "accelerator cpu never fitted" in out


def test_calibration_plot_legends_sit_below_the_points(tmp_path, monkeypatch):
    """The log-log squares fill with points: each legend goes under its axes, not over them."""
    import matplotlib.pyplot as plt

    from hetjax.planner.calibrate import load_calibration, plot_calibration

    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cal = load_calibration(os.path.join(repo, "docs", "results",
                                        "calibration_hetaccel_0808.json"))
    plot_calibration(cal, str(tmp_path / "cal.png"))
    (fig,) = closed
    fig.canvas.draw()
    for ax in fig.axes:
        legend = ax.get_legend().get_window_extent()
        assert legend.y1 < ax.get_window_extent().y0  # wholly below the axes

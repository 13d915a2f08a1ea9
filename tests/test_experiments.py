"""The pure parts of the testbed experiments (scripts/bench/experiments/: harness, hetnet, hetaccel):
the testbed topologies, predictions from a calibration file as `hetjax plan` makes them, the
accuracy statistics, T_UB and efficiency, and the command lines the benches assemble. No JAX, no
namespaces: the benches themselves need root and minutes (docs/experiments.md)."""

import dataclasses
import json
import math
import sys
import os
import time

import numpy as np
import pytest

from hetjax import testbed as tbm
from hetjax.errors import HetjaxError, PlanError, TopologyError
from hetjax.linkcheck import LinkMeasurement
from hetjax.core.plan import Plan
from hetjax.planner.scoring import kendall_tau, prediction_errors, spearman
from scripts.bench.experiments import harness, hetaccel, hetnet
from hetjax.core.topology import Link, Topology, preset, topology_from_json, topology_to_json


# --- topologies -----------------------------------------------------------------------------------
def test_testbed_presets_are_two_clusters_of_two_single_device_hosts():
    kinds = {}
    for name in ("testbed_all_fast", "testbed_all_ethernet", "testbed_hybrid",
                 "testbed_hetaccel"):
        t = preset(name)
        assert [(c.nodes, c.devices_per_node) for c in t.clusters] == [(2, 1), (2, 1)]
        assert topology_from_json(t.to_json()) == t
        assert topology_from_json(topology_to_json(t)) == t
        kinds[name] = ([c.nic.kind for c in t.clusters], t.inter_cluster.kind)
    assert kinds == {
        "testbed_all_fast": (["infiniband", "infiniband"], "infiniband"),
        "testbed_all_ethernet": (["ethernet", "ethernet"], "ethernet"),
        "testbed_hybrid": (["infiniband", "roce"], "ethernet"),
        "testbed_hetaccel": (["infiniband", "roce"], "ethernet")}


def test_hetaccel_kinds_set_the_cpu_caps():
    het = preset("testbed_hetaccel")
    assert [c.accelerator.name for c in het.clusters] == ["cpu", "cpu_half"]
    assert hetaccel.caps(het, 0.4) == pytest.approx({"a": 0.4, "b": 0.2})
    hom_b = preset("testbed_hetaccel", kind_a="cpu_half")
    # The testbed's own rule (fastest kind gets N) would give cpu_half the full 0.4.
    assert hetaccel.caps(hom_b, 0.4) == pytest.approx({"a": 0.2, "b": 0.2})
    assert tbm.cpu_quotas(het, 0.4) == pytest.approx({0: 0.4, 1: 0.2})
    with pytest.raises(TopologyError, match="'gpu' is unknown.*cpu, cpu_half"):
        preset("testbed_hetaccel", kind_b="gpu")


# --- calibration ----------------------------------------------------------------------------------
def measurement(label, kind, mbit, rtt_us):
    return LinkMeasurement(label, "x", "y", Link(kind, 1.0, 1.0), 0.0, mbit * 1e6, 1 << 20,
                           rtt_us * 1e-6)


def _calibration_file(tmp_path, topology, work) -> str:
    """A calibration of the workload's model on `topology`: block and head at 10% / 5% of
    peak per kind, an update rate, flat-ring link fits; measured across gloo processes."""
    from hetjax.planner.calibrate import Calibration, ComputeRow, LinkRow, save_calibration

    model = work.model()
    rows = []
    for c in topology.clusters:
        peak = c.accelerator.peak_tflops
        for part, per_token in (("block", model.layer_flops(work.seq_len)),
                                ("head", model.head_flops())):
            f = per_token * 2 * work.seq_len
            rows.append(ComputeRow(c.accelerator.name, 2, work.seq_len, f / (0.1e12 * peak),
                                   2 * f / (0.05e12 * peak), peak, part))
        rows.append(ComputeRow(c.accelerator.name, 0, 0, 0.01, 0.0, 0.0, "update", 10**6))
    links = [LinkRow(op, n, ((0, 1), (2, 3)), 1e-3 + n / 4e7)
             for op in ("all_reduce", "p2p") for n in (1 << 16, 1 << 20)]
    links += [LinkRow(op, n, ((0, 2), (1, 3)), 1e-3 + n / 5e6)
              for op in ("all_reduce", "p2p") for n in (1 << 16, 1 << 20)]
    cal = Calibration(topology, model, tuple(rows), tuple(links), processes=4,
                      collectives="gloo")
    return save_calibration(cal, str(tmp_path / "calibration.json"))


def test_a_case_is_predicted_as_hetjax_plan_predicts_it(tmp_path, monkeypatch):
    """The benches' prediction is `hetjax plan --config.planner.calibration=FILE` for the
    case's layout and topology, priced asynchronously (measured across gloo processes)."""
    from hetjax.cli import main

    work = harness.Workload()
    topo = preset("testbed_hybrid")
    path = _calibration_file(tmp_path, topo, work)
    plan = Plan(pp=2, dp=2, tp=1, stage_layers=(2, 2), microbatches=4, global_batch=16,
                seq_len=64, schedule="1f1b")
    pred = harness.predict_case(plan, topo, work, path)
    argv = ["hetjax", "plan", *work.config_args(), *harness.layout_args(plan),
            f"--config.topology.file={harness.write_topology(topo, str(tmp_path))}",
            "--config.pipeline.executor=spmd", f"--config.planner.calibration={path}",
            "--json", str(tmp_path / "plan.json")]
    monkeypatch.setattr(sys, "argv", argv)
    assert main(argv) == 0
    by_cli = json.load(open(tmp_path / "plan.json"))["predicted"]["step_time_s"]
    assert pred.step_time == pytest.approx(by_cli, rel=1e-12)
    lockstep = harness.predict_case(plan, topo, work, path, lockstep=True).step_time
    assert lockstep > pred.step_time  # the tick grid pays every tick's slowest stage
    # A case's extra flags reach its prediction: int8 boundaries on the MPMD executor send
    # a quarter of the bytes over the slow inter-cluster link, so the step is shorter.
    (int8,) = [c for c in hetnet.nic_cases(work, 0.4) if c.extra]
    assert int8.extra == ("--config.pipeline.boundary_codec=int8",)
    mpmd = dataclasses.replace(plan, executor="mpmd")
    plain = harness.predict_case(mpmd, topo, work, path).step_time
    assert harness.predict_case(mpmd, topo, work, path, int8.extra).step_time < plain


def test_hetaccel_speeds_and_planned_split_come_from_the_calibration(tmp_path):
    work = hetaccel.WORKLOAD
    het = preset("testbed_hetaccel")
    path = _calibration_file(tmp_path, het, work)
    seconds = hetaccel.layer_seconds(work, path, het)
    # both kinds run at the same fraction of their peak: cpu_half's layer takes twice as long
    assert seconds["cpu_half"] == pytest.approx(2 * seconds["cpu"])
    chosen = hetaccel.planner_choice(work)(het, path)
    fast_stage = 0 if chosen.device_order[0] in (0, 1) else 1
    assert chosen.stage_layers[fast_stage] > chosen.stage_layers[1 - fast_stage]


def test_rank_statistics():
    assert spearman([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx(0.8)
    assert kendall_tau([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx(4 / 6)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert kendall_tau([1, 2, 3], [1, 2, 3]) == 1.0
    # Ties: tau-b, and Spearman on mean ranks.
    assert kendall_tau([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(5 / math.sqrt(30))
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.9486833)
    assert math.isnan(kendall_tau([1, 1], [1, 2])) and math.isnan(spearman([1], [1]))


def test_prediction_errors():
    e = prediction_errors([1.0, 2.5, 2.0], [1.0, 2.0, 4.0])
    assert e.n == 3
    assert e.mae_s == pytest.approx((0 + 0.5 + 2.0) / 3)
    assert e.mean_relative == pytest.approx((0 + 0.25 + 0.5) / 3)
    assert e.spearman == pytest.approx(0.5) and e.kendall == pytest.approx(1 / 3)
    with pytest.raises(PlanError, match="as many predictions"):
        prediction_errors([1.0], [1.0, 2.0])


# --- HetHub's upper bound -------------------------------------------------------------------------
def test_upper_bound_and_efficiency_lines():
    work = hetaccel.WORKLOAD
    het = preset("testbed_hetaccel")
    plan = hetaccel.rank_order(work, (4, 4))
    cases = [harness.Case(n, t, plan, None) for n, t in (
        ("homogeneous A", preset("testbed_hetaccel", kind_b="cpu")),
        ("homogeneous B", preset("testbed_hetaccel", kind_a="cpu_half")),
        ("heterogeneous", het))]
    # T = S G / (N T_iter): 256 x 32 tokens over 4 devices.
    assert hetaccel.per_device(cases[2], 2.0) == pytest.approx(256 * 32 / 4 / 2.0)
    t = {"homogeneous A": 600.0, "homogeneous B": 300.0, "heterogeneous": 405.0}
    lines, t_ub = hetaccel.upper_bound_lines(cases, t, "measured")
    assert t_ub == pytest.approx(450.0)  # (600 x 2 + 300 x 2) / 4
    assert "min(T_A, T_B) / T_UB = 67%" in lines[0]
    assert lines[1] == "  heterogeneous: 405.0 tokens/s per device, efficiency 90% of T_UB (SPMD)"
    assert hetaccel.upper_bound_lines(cases, {**t, "homogeneous A": None}, "x")[1] is None
    # Each executor's rows against its own T_UB.
    assert hetaccel.upper_bound_lines(cases, t, "measured", "mpmd") == (
        ["measured, MPMD: T_UB needs both homogeneous MPMD runs"], None)


def test_splits_and_their_stage_kinds():
    work = hetaccel.WORKLOAD
    prop = hetaccel.proportional(work, {"cpu": 4e-4, "cpu_half": 8e-4})  # s per layer-token
    assert prop.stage_layers == (5, 3)  # floor(1.05 x 2/3 x 8)
    het = preset("testbed_hetaccel")
    case = harness.Case("x", het, prop, None)
    assert hetaccel.split_text(case) == "5 cpu / 3 cpu_half"
    flipped = harness.Case("x", het, Plan(pp=2, dp=2, tp=1, stage_layers=(2, 6),
                                               microbatches=4, global_batch=32, seq_len=256,
                                               device_order=(2, 3, 0, 1)), None)
    assert hetaccel.split_text(flipped) == "2 cpu_half / 6 cpu"


# --- what the benches run -------------------------------------------------------------------------
def test_workload_flags():
    w = harness.Workload()
    flags = dict(a[len("--config."):].split("=", 1) for a in w.config_args())
    assert flags["model.n_layers"] == "4" and flags["train.microbatches"] == "4"
    assert flags["train.log_every"] == "1" and flags["checkpoint.every"] == "0"
    assert flags["data.source"] == "synthetic"
    assert "--config.model.n_layers=1" in w.config_args(n_layers=1)
    m = w.model()
    assert (m.d_model, m.n_layers, m.vocab_size) == (256, 4, 384)


def test_nic_layouts_put_each_parallelism_on_the_intended_links():
    w = harness.Workload()
    cases = {c.name: c for c in hetnet.nic_cases(w, 0.4)}
    where = {n: harness.placement(c.topology, c.plan) for n, c in cases.items()}
    assert where == {
        "all-fast": ("infiniband", "infiniband"),
        "all-Ethernet": ("ethernet", "ethernet"),
        "hybrid, hetjax plan": ("infiniband/roce", "ethernet"),
        "hybrid, network-unaware": ("ethernet", "infiniband/roce"),
        "hybrid, dp=4 (no pipeline)": ("ethernet", "-"),
        "all-fast, MPMD": ("infiniband", "infiniband"),
        "all-Ethernet, MPMD": ("ethernet", "ethernet"),
        "hybrid, hetjax plan, MPMD": ("infiniband/roce", "ethernet"),
        "hybrid, hetjax plan, MPMD, int8 boundaries": ("infiniband/roce", "ethernet")}
    hetjax_plan = cases["hybrid, hetjax plan"].plan
    unaware = cases["hybrid, network-unaware"].plan
    assert unaware.stage_layers == hetjax_plan.stage_layers == (2, 2)
    assert harness.layout_args(unaware) == [
        "--config.parallel.pp=2", "--config.parallel.dp=2", "--config.parallel.tp=1",
        "--config.pipeline.stage_layers=[2,2]", "--config.pipeline.schedule=1f1b",
        "--config.train.microbatches=4"]
    # The device order is realised by the hostfile: process i on the host of rank order[i].
    tb = tbm.Testbed(preset("testbed_hybrid"))
    assert harness.host_order(tb, hetjax_plan) == ["ib-0", "ib-1", "roce-0", "roce-1"]
    assert harness.host_order(tb, unaware) == ["ib-0", "roce-0", "ib-1", "roce-1"]
    with pytest.raises(HetjaxError, match="one device per host"):
        harness.host_order(tbm.Testbed(preset("cpu_hybrid")), hetjax_plan)


def test_report_helpers():
    assert harness.table(["a", "b"], [["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"
    c = harness.Case("x", preset("testbed_hybrid"), None, None)
    assert c.mean_s is None and c.tokens_per_s() is None and harness.cpus_text(c) == "-"
    c.step_s, c.cpu_use, c.caps_cpus, c.attempts = [1.0, 3.0], (1.5, 0.04), 1.6, 1
    assert c.mean_s == 2.0 and c.sd_s == pytest.approx(np.sqrt(2))
    assert harness.cpus_text(c) == "1.50 / 0.04 / 1.60"
    c.attempts = 2
    assert harness.cpus_text(c) == "1.50 / 0.04 / 1.60 (run 2)"


def test_cpu_watch_splits_ours_from_the_rest():
    watch = harness.CpuWatch()
    t0 = time.monotonic()
    end = time.process_time() + 0.2
    while time.process_time() < end:  # burn 0.2 s of our own CPU
        pass
    ours, others = watch.stop()
    wall = time.monotonic() - t0
    # Our 0.2 CPU-seconds over the wall time, however busy the machine was (no time bound).
    assert ours == pytest.approx(0.2 / wall, rel=0.25) and ours <= 1.05 and others >= 0.0


def test_a_case_builds_its_testbed_with_its_cpu_caps(monkeypatch, tmp_path):
    """The cap a case asks for reaches the Testbed on every attempt (the measured CPU use is a
    separate field, reset per attempt)."""
    seen = []

    class RecordingTestbed:
        def __init__(self, topology, scale, cpus):
            seen.append(cpus)
            raise HetjaxError("no testbed in this test")

    monkeypatch.setattr(harness, "Testbed", RecordingTestbed)
    case = hetnet.nic_cases(harness.Workload(), 0.4)[0]
    harness.run_case(case, harness.Workload(), str(tmp_path), 0.002, {}, 60,
                          log=lambda msg: None, retries=0)
    assert seen == [0.4] and case.cpus == 0.4 and case.cpu_use is None
    assert "no testbed in this test" in case.error


def test_mpmd_rows_run_one_world_per_cluster_with_the_bridge_on_the_hosts():
    """The MPMD rows: the same plans with the MPMD executor (and the SPMD executor's
    recompute), launched by `hetjax launch --hostfile` as one JAX world per cluster whose
    bridge addresses are the emulated hosts' names (resolved inside their namespaces)."""
    import argparse

    from hetjax.config import load_config
    from hetjax.launch import plan_workers
    from hetjax.planner import plan_from_config

    w = harness.Workload()
    cases = hetnet.nic_cases(w, 0.4)
    mpmd = [c for c in cases if c.executor == "mpmd"]
    assert [c.name for c in mpmd] == ["all-fast, MPMD", "all-Ethernet, MPMD",
                                      "hybrid, hetjax plan, MPMD",
                                      "hybrid, hetjax plan, MPMD, int8 boundaries"]
    assert [c.name for c in harness.select(cases, ["mpmd"])] == [c.name for c in mpmd]
    assert [c.name for c in harness.select(cases, ["HYBRID, hetjax plan"])] == [
        "hybrid, hetjax plan", "hybrid, hetjax plan, MPMD",
        "hybrid, hetjax plan, MPMD, int8 boundaries"]
    assert harness.select(cases, None) == cases
    with pytest.raises(HetjaxError, match="--only 'nope' matches none"):
        harness.select(cases, ["nope"])
    hybrid = mpmd[2]
    plan = dataclasses.replace(hybrid.plan, executor="mpmd")  # as run_case does
    args = harness.layout_args(plan)
    assert args[-2:] == ["--config.pipeline.executor=mpmd", "--config.model.remat=full"]
    # A plan whose recompute the planner chose runs with it (the prediction priced it).
    for executor in ("spmd", "mpmd"):
        chosen = load_config(None, [*w.config_args(), *harness.layout_args(
            dataclasses.replace(plan, executor=executor, remat="dots"))])
        assert chosen.model.remat == "dots", executor

    topo_file = tmp_topology(hybrid.topology)
    config_args = [*w.config_args(), f"--config.topology.file={topo_file}", *args]
    cfg = load_config(None, config_args)
    assert cfg.pipeline.executor == "mpmd" and cfg.model.remat == "full"
    assert cfg.train.microbatches == 4 and cfg.pipeline.schedule == "1f1b"
    hosts = harness.host_order(tbm.Testbed(hybrid.topology), plan)
    hostfile = os.path.join(os.path.dirname(topo_file), "hosts")
    with open(hostfile, "w") as f:
        f.write("\n".join(hosts) + "\n")
    ns = argparse.Namespace(local=None, hostfile=hostfile, port=0, coordinator="10.77.0.1:8477",
                            init_timeout=60, heartbeat_timeout=60, nic_policy="cluster",
                            python="python", chdir="/", rsh="rsh {host}", command="train")
    workers = plan_workers(cfg, hybrid.topology, plan_from_config(cfg, hybrid.topology), ns,
                           config_args)
    assert [wk.env["HETJAX_WORLD"] for wk in workers] == ["0", "0", "1", "1"]
    assert {wk.env["HETJAX_BRIDGE_HOSTS"] for wk in workers} == {"ib-0,ib-1,roce-0,roce-1"}
    # Each world's coordinator on its first host, on that host's own network stack.
    assert [wk.env["HETJAX_COORDINATOR"] for wk in workers] == [
        "ib-0:8476", "ib-0:8476", "roce-0:8477", "roce-0:8477"]
    # The tied embedding's gradient crosses the bridge too, once each way, each of the two
    # replicas pulling half of its rows.
    parts = harness.bridge_bytes(plan, w)
    assert parts["activations"] == parts["activation gradients"] == 16 * 64 * 256 * 4
    assert parts["tied embedding gradient"] == 384 * 256 * 4 * 2


def tmp_topology(topology) -> str:
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="hetjax-test-"), "topology.json")
    with open(path, "w") as f:
        f.write(topology.to_json())
    return path


def test_hetaccel_mpmd_rows_plan_for_the_mpmd_executor_and_gpipe_keeps_the_split(tmp_path):
    work = hetaccel.WORKLOAD
    cases = hetaccel.hetaccel_cases(work, 0.4)
    mpmd = {c.name: c for c in cases if c.executor == "mpmd"}
    assert list(mpmd) == ["homogeneous A (cpu), MPMD", "homogeneous B (cpu_half), MPMD",
                          "heterogeneous, planned split, MPMD",
                          "heterogeneous, planned split, MPMD GPipe"]
    het = preset("testbed_hetaccel")
    path = _calibration_file(tmp_path, het, work)
    one = mpmd["heterogeneous, planned split, MPMD"].choose(het, path)
    gpipe = mpmd["heterogeneous, planned split, MPMD GPipe"].choose(het, path)
    # MPMD is priced on its own (always asynchronous) timeline: lockstep changes nothing
    run = dataclasses.replace(one, executor="mpmd")  # as run_case does
    assert harness.predict_case(run, het, work, path).step_time == pytest.approx(
        harness.predict_case(run, het, work, path, lockstep=True).step_time)
    assert one.schedule == "1f1b" and gpipe.schedule == "gpipe"
    assert gpipe.stage_layers == one.stage_layers and one.stage_layers[0] > 4  # fast kind more
    assert gpipe.device_order == one.device_order
    assert hetaccel.schedule_lines(cases)[0].startswith("MPMD 1F1B vs GPipe: needs both")


def test_saved_runs_are_priced_again_and_compared_run_to_run(tmp_path, capsys):
    """scripts/bench/repredict.py: a bench's results file keeps its calibration beside it; every
    row is priced again as the bench priced it, and the same layout's measured step times
    are compared across runs (different layouts are not)."""
    from scripts.bench.experiments import repredict

    work = dataclasses.replace(hetaccel.WORKLOAD, n_layers=4)
    het = preset("testbed_hetaccel")
    cal = _calibration_file(tmp_path, het, work)
    even, uneven = hetaccel.rank_order(work, (2, 2)), hetaccel.rank_order(work, (3, 1))
    names = ("homogeneous A (cpu)", "heterogeneous, uniform split")

    def save(name, plans, seconds):
        path = str(tmp_path / "runs" / f"{name}.json")
        harness.save_json(path, {
            "command": "scripts/bench/hetaccel.py", "workload": dataclasses.asdict(work),
            "cpus": 0.4, "calibration": cal,
            "cases": [{"name": n, "plan": p.to_dict(), "mean_s": s}
                      for n, p, s in zip(names, plans, seconds)]})
        return path

    a = save("a", (even, even), (2.0, 4.0))
    b = save("b", (even, uneven), (2.2, 3.0))
    kept = harness.kept_calibration_path(a)
    assert json.load(open(a))["calibration"] == kept
    assert open(kept).read() == open(cal).read()
    runs = [repredict.Run.load(a), repredict.Run.load(b)]
    assert repredict.run_to_run(runs) == [(names[0], [2.0, 2.2], pytest.approx(1.1)),
                                          (names[1], [4.0, 3.0], None)]
    (res,) = repredict.repredict(runs[:1], [])  # the run's own (kept) file
    cases = repredict.experiment_cases(runs[0].record)
    expected = [harness.predict_case(even, cases[n].topology, work, cal).step_time
                for n in names]
    assert res["calibration"] == kept
    assert res["predicted"] == pytest.approx(expected, rel=1e-12)
    assert res["mae"] == pytest.approx(np.mean([abs(expected[0] / 2 - 1),
                                                abs(expected[1] / 4 - 1)]))
    assert repredict.main([a, b, "--calibration", cal]) == 0
    out = capsys.readouterr().out
    assert "1.100" in out and "different layouts" in out and out.count(cal) == 2
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"command": "scripts/train.py", "workload": {}, "cpus": 1,
                               "cases": []}))
    with pytest.raises(HetjaxError, match="not by scripts/bench/hetnet.py"):
        repredict.experiment_cases(json.load(open(bad)))
    with pytest.raises(HetjaxError, match="is a calibration file.*--calibration"):
        repredict.Run.load(kept)


def test_hetaccel_replot_draws_each_executors_t_ub_over_its_own_bars(tmp_path, monkeypatch):
    """From a saved results file: the SPMD and MPMD T_UB each over their own bars (labels in
    the legend, not over a bar), every '% of T_UB' note against a drawn line."""
    seen = {}
    real = hetaccel.bar_plot

    def capture(out, title, labels, measured, predicted, ylabel, **kw):
        seen.update(kw, labels=labels)
        return real(out, title, labels, measured, predicted, ylabel, **kw)

    monkeypatch.setattr(hetaccel, "bar_plot", capture)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = hetaccel.replot(os.path.join(repo, "docs", "results", "bench_hetaccel_0604.json"),
                           str(tmp_path / "h.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    (spmd, _, s0, s1), (mpmd, _, m0, m1) = seen["levels"]
    assert (s0, s1, m0, m1) == (0, 4, 5, 8)
    assert round(spmd) == 544 and round(mpmd) == 653  # the tables' T_UB (docs/results)
    assert [n for n in seen["notes"] if n] == ["75% of T_UB", "94% of T_UB", "102% of T_UB",
                                               "102% of T_UB", "92% of T_UB"]
    assert "hline" not in seen

"""Heterogeneous accelerators (HetHub) on the emulated cluster: an uneven split against T_UB.

    sudo python scripts/bench/hetaccel.py                 # the tables, docs/img/bench_hetaccel.png
    sudo python scripts/bench/hetaccel.py --steps 5 --out /tmp/x.png    # a quicker look

(scripts/bench/hetaccel.py runs `main` of this module.)

Two clusters of two single-device hosts, cluster a InfiniBand inside, cluster b RoCE inside,
joined by Ethernet (links x --scale). Accelerator speed is a CPU cap per host: kind `cpu` gets
--cpus CPUs, kind `cpu_half` (half its nominal peak) half as many. One pipeline stage per
cluster (pp = 2), data parallelism inside each (dp = 2), 1F1B over 4 micro-batches:

- homogeneous A (all four hosts `cpu`) and homogeneous B (all `cpu_half`) give T_A and T_B,
  HetHub's throughput per device T = S G / (N T_iter); T_UB = (T_A N_A + T_B N_B) / (N_A + N_B);
- heterogeneous (a: `cpu`, b: `cpu_half`) with the uniform split (n/2 layers per stage), with
  Holmes' proportional split of the calibrated speeds (the throughput ratio), and with the
  planner's split: `hetjax.planner.plan` with pp, dp, micro-batches and schedule fixed and
  the calibration file (HetHub's lesson: measurements, not ratios). The planner picks layers
  per stage and the stage order; the order is realised by which host each process runs on.
  Efficiency = T_het / T_UB.

With the MPMD executor (pipeline.executor=mpmd, rows marked "MPMD"; one JAX world per
cluster, the bridge on the Ethernet link between them, the same recompute as the SPMD
executor): homogeneous A and B again (T_UB on MPMD), the planner's split priced for the MPMD
executor (1F1B), and the same split under GPipe. `--only TEXT` runs only the configurations
whose name contains TEXT (repeatable; `--only mpmd`: the MPMD rows).

The cost model is calibrated once, the way a user calibrates a cluster: `hetjax calibrate` on
the heterogeneous testbed, every host under its cap (both kinds' block, head and optimizer
update; every link class). The homogeneous runs use the planner's split too (their best
layout, as HetHub's T_A and T_B are). Each run's step time is predicted by `hetjax plan` with
that file (as in hetnet.py); first step (compile) and one warm-up step are not timed. The model is compute-heavy for its size (d_model 128, 8 layers,
sequences of 256) so that compute, not the once-per-step gradient sync, dominates a step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from . import harness
from .harness import (ACCURACY_NOTE, CPUS_HEADER, CPUS_NOTE, Case,
                                        Workload, accuracy_table, bar_plot, case_record,
                                        cpus_text, failures, fmt, link_table, load_line,
                                        calibrate_testbed, run_case, save_json, select,
                                        start, table)
from hetjax.errors import HetjaxError
from hetjax.core.plan import Plan
from hetjax.planner import CostModel, options_from_config, plan
from hetjax.planner.cost import PLAN_EXECUTORS
from hetjax.planner.formulas import hethub_efficiency, hethub_throughput, hethub_upper_bound
from hetjax.planner.partition import holmes_split
from hetjax.testbed import Testbed
from hetjax.core.topology import ACCELERATORS, Topology, preset

WORKLOAD = Workload(d_model=128, n_layers=8, n_heads=2, d_ff=384, seq_len=256, batch=32,
                    microbatches=4, steps=8)


def caps(topology: Topology, cpus: float) -> dict[str, float]:
    """CPUs per host by cluster: `cpus` for the `cpu` kind, less in proportion to peak."""
    full = ACCELERATORS["cpu"].peak_tflops
    return {c.name: cpus * c.accelerator.peak_tflops / full for c in topology.clusters}


def rank_order(work: Workload, stage_layers: tuple[int, ...]) -> Plan:
    """pp = 2 x dp = 2 in rank order: stage 0 on cluster a, stage 1 on cluster b."""
    return Plan(pp=2, dp=2, tp=1, stage_layers=tuple(stage_layers),
                microbatches=work.microbatches, global_batch=work.batch, seq_len=work.seq_len,
                schedule=work.schedule)


def layer_seconds(work: Workload, calibration: str, topology: Topology) -> dict[str, float]:
    """Seconds of one layer's forward + backward (with the executor's recompute) per token on
    each accelerator kind, at one device's micro-batch, from the calibration file (the block
    as the pipeline runs it)."""
    cfg = work.config([f"--config.planner.calibration={calibration}"])
    cm = CostModel(topology, work.model(), options_from_config(cfg))
    tokens = work.batch // work.microbatches // 2 * work.seq_len  # dp = 2
    return {c.accelerator.name: sum(cm.layer_seconds_per_token(
        c.accelerator, work.seq_len, "full", tokens, staged=True)) for c in topology.clusters}


def proportional(work: Workload, seconds: dict[str, float]) -> Plan:
    """Holmes' formula on the calibrated speeds (layers per second of each kind): the
    throughput-ratio split HetHub warns about, with stage 0 on the faster kind a."""
    speeds = [1 / seconds[k] for k in ("cpu", "cpu_half")]
    return rank_order(work, holmes_split(speeds, work.n_layers))


def planner_choice(work: Workload, executor: str = "spmd", schedule: str | None = None):
    """The planner's layout with the calibration file, the layout fixed but the split and
    stage order, priced for `executor`; run with `schedule` if given (the split stays the one
    planned for the workload's schedule)."""
    def choose(topology: Topology, calibration: str) -> Plan:
        cfg = work.config([f"--config.planner.calibration={calibration}"])
        options = dataclasses.replace(options_from_config(cfg),
                                      executor=PLAN_EXECUTORS[executor])
        chosen = plan(topology, work.model(), work.batch, work.seq_len, pp=2, dp=2, tp=1,
                      microbatches=work.microbatches, schedule=work.schedule, zero="ddp",
                      options=options).plan
        return dataclasses.replace(chosen, schedule=schedule) if schedule else chosen
    return choose


def hetaccel_cases(work: Workload, cpus: float) -> list[Case]:
    """The configurations, SPMD first, then MPMD (see the module docstring). Their plans
    are chosen when they run, from the calibration file."""
    het = preset("testbed_hetaccel")
    hom_a = preset("testbed_hetaccel", kind_b="cpu")
    hom_b = preset("testbed_hetaccel", kind_a="cpu_half")
    choose = planner_choice(work)
    mpmd = planner_choice(work, "mpmd")
    gpipe = planner_choice(work, "mpmd", schedule="gpipe")
    return [Case("homogeneous A (cpu)", hom_a, None, caps(hom_a, cpus), choose),
            Case("homogeneous B (cpu_half)", hom_b, None, caps(hom_b, cpus), choose),
            Case("heterogeneous, uniform split", het,
                 rank_order(work, (work.n_layers // 2, work.n_layers - work.n_layers // 2)),
                 caps(het, cpus)),
            Case("heterogeneous, proportional split", het, None, caps(het, cpus),
                 lambda t, cal: proportional(work, layer_seconds(work, cal, t))),
            Case("heterogeneous, planned split", het, None, caps(het, cpus), choose),
            Case("homogeneous A (cpu), MPMD", hom_a, None, caps(hom_a, cpus), mpmd, "mpmd"),
            Case("homogeneous B (cpu_half), MPMD", hom_b, None, caps(hom_b, cpus), mpmd,
                 "mpmd"),
            Case("heterogeneous, planned split, MPMD", het, None, caps(het, cpus), mpmd,
                 "mpmd"),
            Case("heterogeneous, planned split, MPMD GPipe", het, None, caps(het, cpus), gpipe,
                 "mpmd")]


def split_text(c: Case) -> str:
    """Layers per stage, with the accelerator kind of each stage, in pipeline order."""
    if c.plan is None:
        return "-"
    kinds = [c.topology.accelerator_of(int(c.plan.mesh_ranks()[s, 0, 0])).name
             for s in range(c.plan.pp)]
    return " / ".join(f"{n} {k}" for n, k in zip(c.plan.stage_layers, kinds))


def per_device(c: Case, seconds: float | None) -> float | None:
    if not seconds:
        return None
    return hethub_throughput(c.plan.seq_len, c.plan.global_batch, c.topology.num_devices,
                             seconds)


def plot(out: str, cpus: float, names: list[str], executors: list[str], t: dict, tp: dict,
         t_ub: dict) -> str:
    """Measured (bars) and predicted (markers) tokens/s per device; each executor's T_UB drawn
    over its own bars, and each heterogeneous bar's share of its executor's T_UB on it."""
    levels = []
    for x in ("spmd", "mpmd"):
        bars = [i for i, e in enumerate(executors) if e == x]
        if bars and t_ub.get(x):
            levels.append((t_ub[x], f"T_UB, {x.upper()} runs ({t_ub[x]:,.0f})", bars[0],
                           bars[-1]))
    notes = [f"{t[n] / t_ub[x]:.0%} of T_UB" if t.get(n) and t_ub.get(x) and
             n.startswith("heterogeneous") else "" for n, x in zip(names, executors)]
    return bar_plot(out, f"Heterogeneous accelerators on the testbed\ncpu hosts {cpus:g} CPU, "
                    f"cpu_half hosts {cpus / 2:g} CPU",
                    [n.replace(", ", ",\n").replace(" (", "\n(") for n in names],
                    [t.get(n) for n in names], [tp.get(n) for n in names],
                    "tokens / s per device", notes=notes, levels=levels)


def replot(json_path: str, out: str) -> str:
    """The plot again from a results file the bench wrote (`--replot JSON`): nothing runs."""
    with open(json_path) as f:
        d = json.load(f)
    devices = preset("testbed_hetaccel").num_devices

    def tokens(case, seconds):
        p = case["plan"]
        return hethub_throughput(p["seq_len"], p["global_batch"], devices, seconds) \
            if seconds and p else None

    cases = d["cases"]
    t = {c["name"]: tokens(c, c["mean_s"]) for c in cases}
    tp = {c["name"]: tokens(c, c["predicted_s"]) for c in cases}
    t_ub = {x: d["t_ub_by_executor"].get(f"{x} measured") for x in ("spmd", "mpmd")}
    return plot(out, d["cpus"], [c["name"] for c in cases], [c["executor"] for c in cases],
                t, tp, t_ub)


def main(argv=None) -> int:
    args = harness.bench_args(argv, "bench_hetaccel", __doc__, WORKLOAD.steps,
                              "CPU cap of a `cpu` host", 600, replot=True)
    if args.replot:
        print(f"plot: {replot(args.replot, args.out)}")
        return 0
    work = dataclasses.replace(WORKLOAD, steps=args.steps)
    cases = select(hetaccel_cases(work, args.cpus), args.only)
    log = start("bench_hetaccel")
    log(work.describe())
    het = preset("testbed_hetaccel")
    log(f"hetjax calibrate on the {het.name} testbed")
    try:
        with Testbed(het, scale=args.scale, cpus=caps(het, args.cpus)) as tb:
            calibration = calibrate_testbed(tb, work, os.path.join(args.workdir, "calibrate"),
                                            log)
    except HetjaxError as e:
        print(f"FAILED: {e}")
        return 1
    seconds = layer_seconds(work, calibration, het)
    for i, c in enumerate(cases):
        run_case(c, work, os.path.join(args.workdir, f"case{i}"), args.scale, calibration,
                 args.timeout, log)
    end_load = load_line()

    print(f"\n## Link rates (measured goodput of a TCP transfer vs configured; x {args.scale:g})\n")
    print(link_table(cases))
    print(f"\nCalibration: {calibration} (its measured-vs-modelled tables: calibrate.log beside "
          "it); one layer's forward + backward with recompute, per token at one device's "
          "micro-batch: " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in seconds.items()))
    rows = []
    for c in cases:
        t = per_device(c, c.mean_s)
        rows.append([c.name, split_text(c),
                     f"{fmt(c.mean_s, '.3f')} ± {c.sd_s:.3f}" if c.step_s else "failed",
                     fmt(t, ",.1f"), fmt(c.predicted_s, ".3f"),
                     fmt(per_device(c, c.predicted_s), ",.1f"), fmt(c.bubble, ".0%"),
                     cpus_text(c)])
    print(f"\n## Throughput ({work.steps - 2} timed steps each; {end_load} at the end)\n")
    print(table(["configuration", "layers per stage (pipeline order)", "s/step",
                 "tokens/s per device", "predicted s/step", "predicted tokens/s per device",
                 "predicted bubble", CPUS_HEADER], rows))
    print(CPUS_NOTE)
    t = {c.name: per_device(c, c.mean_s) for c in cases}
    tp = {c.name: per_device(c, c.predicted_s) for c in cases}
    t_ubs = {}
    for executor in sorted({c.executor for c in cases}, reverse=True):  # spmd first
        summary, t_ubs[executor, "measured"] = upper_bound_lines(cases, t, "measured",
                                                                 executor)
        summary_p, t_ubs[executor, "predicted"] = upper_bound_lines(cases, tp, "predicted",
                                                                    executor)
        print("\n" + "\n".join(summary + summary_p))
    print("\n" + "\n".join(schedule_lines(cases)))
    t_ub, t_ub_p = (t_ubs.get(("spmd", w)) or t_ubs.get(("mpmd", w))
                    for w in ("measured", "predicted"))
    print("\n## Predicted vs measured step time\n")
    print(accuracy_table(cases))
    print(ACCURACY_NOTE)
    if failures(cases):
        print("\n" + failures(cases))
    path = plot(args.out, args.cpus, [c.name for c in cases], [c.executor for c in cases], t,
                tp, {x: t_ubs.get((x, "measured")) for x in ("spmd", "mpmd")})
    print(f"\nplot: {path}")
    save_json(args.json, {"command": " ".join(sys.argv), "workload": dataclasses.asdict(work),
                          "cpus": args.cpus, "scale": args.scale, "load_end": end_load,
                          "calibration": calibration, "layer_s_per_token": seconds,
                          "t_ub": t_ub, "t_ub_predicted": t_ub_p,
                          "t_ub_by_executor": {f"{x} {w}": v for (x, w), v in t_ubs.items()},
                          "cases": [case_record(c) for c in cases]})
    log(f"done; results in {args.json}")
    return 1 if any(c.error for c in cases) else 0


def upper_bound_lines(cases: list[Case], t: dict, what: str,
                      executor: str = "spmd") -> tuple[list[str], float | None]:
    """T_A, T_B, T_UB from the homogeneous runs of `executor` and the efficiency of each
    heterogeneous run of that executor, as text lines."""
    mine = [c for c in cases if c.executor == executor]
    x = executor.upper()
    hom = [next((c for c in mine if c.name.startswith(f"homogeneous {k}")), None)
           for k in "AB"]
    t_a, t_b = (t.get(c.name) if c else None for c in hom)
    if not (t_a and t_b):
        return [f"{what}, {x}: T_UB needs both homogeneous {x} runs"], None
    het = preset("testbed_hetaccel")
    n_a, n_b = (sum(c.num_devices for c in het.clusters if c.accelerator.name == k)
                for k in ("cpu", "cpu_half"))
    t_ub = hethub_upper_bound(t_a, n_a, t_b, n_b)
    lines = [f"{what}, {x}: T_A = {t_a:,.1f}, T_B = {t_b:,.1f} tokens/s per device; T_UB = "
             f"({t_a:,.1f} x {n_a} + {t_b:,.1f} x {n_b}) / {n_a + n_b} = {t_ub:,.1f}; "
             f"min(T_A, T_B) / T_UB = {min(t_a, t_b) / t_ub:.0%}"]
    for c in mine:
        if c.name.startswith("heterogeneous") and t.get(c.name):
            lines.append(f"  {c.name}: {t[c.name]:,.1f} tokens/s per device, efficiency "
                         f"{hethub_efficiency(t[c.name], t_ub):.0%} of T_UB ({x})")
    return lines, t_ub


def schedule_lines(cases: list[Case]) -> list[str]:
    """The MPMD planned split's step under 1F1B against GPipe (measured and predicted)."""
    by = {c.name: c for c in cases}
    one, gp = (by.get(f"heterogeneous, planned split, MPMD{s}") for s in ("", " GPipe"))
    if not (one and gp and one.step_s and gp.step_s):
        return ["MPMD 1F1B vs GPipe: needs both planned-split MPMD runs"]
    out = [f"MPMD planned split, 1F1B / GPipe step time: measured {one.mean_s:.3f} / "
           f"{gp.mean_s:.3f} s = {one.mean_s / gp.mean_s:.3f}"]
    if one.predicted_s and gp.predicted_s:
        out[0] += (f"; predicted {one.predicted_s:.3f} / {gp.predicted_s:.3f} s = "
                   f"{one.predicted_s / gp.predicted_s:.3f}")
    return out

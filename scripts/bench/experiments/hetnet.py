"""Heterogeneous NICs (Holmes) on the emulated cluster: where each parallelism's traffic goes.

    sudo python scripts/bench/hetnet.py                   # the tables, docs/img/bench_hetnet.png
    sudo python scripts/bench/hetnet.py --steps 4 --out /tmp/x.png   # a quicker look

(scripts/bench/hetnet.py runs `main` of this module.)

Two clusters of two single-device hosts (4 processes on this 2-core machine), each host capped
at --cpus CPUs, trained for --steps steps in four environments:

- all-fast: both clusters InfiniBand, joined by an InfiniBand-rate link;
- all-Ethernet: every link 25 GbE;
- hybrid, hetjax plan: an InfiniBand and a RoCE cluster joined by Ethernet, a pipeline stage
  per cluster (pp = 2: only activations cross Ethernet) and data parallelism inside each
  (dp = 2, on the cluster's RDMA link) -- Holmes' placement, hetjax's layout rule;
- hybrid, network-unaware: the same pp = 2 x dp = 2 job, but with the processes placed as a
  scheduler blind to the network might (hosts ib-0, roce-0, ib-1, roce-1): each DP group
  straddles the Ethernet link and the pipeline runs inside the clusters. Same program, same
  config, only the placement differs, which isolates the claim;
- hybrid, pp = 1 x dp = 4: data parallelism across both clusters, no pipeline (another
  network-unaware layout; it runs different code: no pipeline executor, no recompute);
- all-fast, all-Ethernet and hybrid (hetjax plan) again with the MPMD executor
  (pipeline.executor=mpmd, rows marked "MPMD"): one JAX world per cluster (each its own
  jax.distributed job, gloo on its cluster's link), the bridge (parallel/bridge.py) on the
  shaped inter-cluster link; activations, their gradients, the tied embedding's gradient, the
  loss and the norm cross it. Same model, same recompute (model.remat=full, as the SPMD
  executor does). `--only mpmd` runs only these (`--only TEXT` picks the
  configurations whose name contains TEXT; repeatable);
- hybrid (hetjax plan) on MPMD with int8 pipeline boundaries (pipeline.boundary_codec=int8,
  issue 19): the activations and their gradients cross Ethernet as int8 with per-row scales.

Every link is the topology's rate times --scale (default 0.002: InfiniBand 400 Mbit/s,
Ethernet 50 Mbit/s). The model is sized so communication dominates all-Ethernet: with d_model
256 and 4 layers a stage's gradients (2 layers and the tied embedding) are 7.2 MiB, all-reduced
over its data-parallel pair once per step: each host sends 7.2 MiB, 1.2 s at 50 Mbit/s, against
a whole step of about 0.6 s on all-fast.

For every configuration the step time is predicted the way a user would: `hetjax calibrate`
runs once on the hybrid testbed (every emulated host under its CPU cap: the model's block,
head and optimizer update, and every collective per link class -- InfiniBand, RoCE and
Ethernet, which covers the all-fast and all-Ethernet clusters' classes too), and each
configuration is priced by `hetjax plan` with that calibration file for its executor (stages
as the separate processes they are here, and in lockstep for comparison). Printed: the link rates measured vs configured, throughput and ratios,
bytes per link class, predicted vs measured with mean absolute error and rank agreement. The
first step (compilation) and one warm-up step are excluded from the timing.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from . import harness
from .harness import (ACCURACY_NOTE, CPUS_HEADER, CPUS_NOTE, Case,
                                        Workload, accuracy_table, bar_plot, bridge_bytes,
                                        case_record, cpus_text, failures, fmt, link_table,
                                        calibrate_testbed, load_line, run_case, save_json, select,
                                        start, table)
from hetjax.core.plan import Plan, even_split
from hetjax.errors import HetjaxError
from hetjax.testbed import Testbed
from hetjax.core.topology import preset


def nic_cases(work: Workload, cpus: float) -> list[Case]:
    split = even_split(work.n_layers, 2)
    plan = Plan(pp=2, dp=2, tp=1, stage_layers=split, microbatches=work.microbatches,
                global_batch=work.batch, seq_len=work.seq_len, schedule=work.schedule)
    # Ranks 0, 1 are ib-0, ib-1 and 2, 3 roce-0, roce-1: stage 0 = (ib-0, roce-0) puts each
    # DP group across clusters and each pipeline inside one.
    unaware = dataclasses.replace(plan, device_order=(0, 2, 1, 3))
    fast, eth, hybrid = (preset(n) for n in ("testbed_all_fast", "testbed_all_ethernet",
                                              "testbed_hybrid"))
    cases = [Case("all-fast", fast, plan, cpus), Case("all-Ethernet", eth, plan, cpus),
             Case("hybrid, hetjax plan", hybrid, plan, cpus),
             Case("hybrid, network-unaware", hybrid, unaware, cpus)]
    # Data parallelism only, across both clusters: what a layout without pipelining does.
    dp4 = Plan(pp=1, dp=4, tp=1, stage_layers=(work.n_layers,), microbatches=work.microbatches,
               global_batch=work.batch, seq_len=work.seq_len, schedule=work.schedule)
    cases.append(Case("hybrid, dp=4 (no pipeline)", hybrid, dp4, cpus))
    # The MPMD executor: a JAX world per cluster, the bridge on the inter-cluster link.
    cases += [Case(f"{c.name}, MPMD", c.topology, plan, cpus, executor="mpmd")
              for c in cases[:3]]
    # Issue 19's compressed boundaries where they cross the slow link: int8 activations and
    # gradients (their loss effect: scripts/bench/boundary_codec.py).
    return cases + [Case("hybrid, hetjax plan, MPMD, int8 boundaries", hybrid, plan, cpus,
                         executor="mpmd", extra=("--config.pipeline.boundary_codec=int8",))]


def main(argv=None) -> int:
    args = harness.bench_args(argv, "bench_hetnet", __doc__, 10, "CPU cap per emulated host",
                              420)
    work = Workload(steps=args.steps)
    cases = select(nic_cases(work, args.cpus), args.only)
    log = start("bench_hetnet")
    log(work.describe())
    hybrid = preset("testbed_hybrid")
    log(f"hetjax calibrate on the {hybrid.name} testbed ({args.cpus:g} CPUs per host)")
    try:
        with Testbed(hybrid, scale=args.scale, cpus=args.cpus) as tb:
            calibration = calibrate_testbed(tb, work, os.path.join(args.workdir, "calibrate"),
                                            log)
    except HetjaxError as e:
        print(f"FAILED: {e}")
        return 1
    for i, c in enumerate(cases):
        run_case(c, work, os.path.join(args.workdir, f"case{i}"), args.scale, calibration,
                 args.timeout, log)
    end_load = load_line()
    report(cases, work, args, calibration, end_load)
    save_json(args.json, {"command": " ".join(sys.argv), "workload": dataclasses.asdict(work),
                          "cpus": args.cpus, "scale": args.scale, "calibration": calibration,
                          "load_end": end_load, "cases": [case_record(c) for c in cases]})
    log(f"done; results in {args.json}")
    return 1 if any(c.error for c in cases) else 0


def all_fast(by: dict, c: Case) -> float | None:
    """Throughput of the all-fast run with the executor of `c` (or None, not run)."""
    ref = by.get("all-fast" + (", MPMD" if c.executor == "mpmd" else ""))
    return ref.tokens_per_s() if ref else None


def report(cases: list[Case], work: Workload, args, calibration: str, end_load: str) -> None:
    by = {c.name: c for c in cases}
    print(f"\n## Link rates (measured goodput of a TCP transfer vs configured; x {args.scale:g})\n")
    print(link_table(cases))
    print(f"\nCalibration: {calibration} (its measured-vs-modelled tables: calibrate.log beside "
          "it)")
    print(f"\n## Throughput ({work.steps - 2} timed steps each, CPU cap {args.cpus:g} per "
          f"host; {end_load} at the end)\n")
    rows = []
    for c in cases:
        tps, base = c.tokens_per_s(), all_fast(by, c)
        rows.append([c.name, f"pp={c.plan.pp} dp={c.plan.dp}", c.dp_links, c.pp_links,
                     f"{fmt(c.mean_s, '.3f')} ± {c.sd_s:.3f}" if c.step_s else "failed",
                     fmt(tps, ",.0f"), fmt(tps / base if tps and base else None, ".2f"),
                     "; ".join(f"{k} {v:.1f}" for k, v in sorted(
                         c.traffic.items(), key=lambda kv: (" <-> " in kv[0], kv[0]))),
                     cpus_text(c)])
    print(table(["configuration", "layout", "DP on", "PP on", "s/step", "tokens/s",
                 "vs all-fast (same executor)", "MiB per step by link class", CPUS_HEADER],
                rows))
    print(CPUS_NOTE)
    ratios = []
    for mine in ("hybrid, hetjax plan", "hybrid, hetjax plan, MPMD",
                 "hybrid, hetjax plan, MPMD, int8 boundaries"):
        hj = by[mine].tokens_per_s() if mine in by else None
        for other in ("all-fast", "all-fast, MPMD", "all-Ethernet", "all-Ethernet, MPMD",
                      "hybrid, network-unaware", "hybrid, dp=4 (no pipeline)",
                      "hybrid, hetjax plan"):
            t = by[other].tokens_per_s() if other in by and other != mine else None
            if hj and t:
                ratios.append(f"{mine} / {other}: {hj / t:.2f}x")
    print("\n" + "\n".join(ratios))
    mpmd = [c for c in cases if c.executor == "mpmd" and c.plan.pp > 1]
    if mpmd:
        parts = bridge_bytes(mpmd[0].plan, work)
        print("\nOver the bridge (MPMD rows, from the executor's messages, per step): " +
              ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in parts.items()) +
              f"; {sum(parts.values()) / 2**20:.2f} MiB in all, plus the loss, the norm parts "
              "and TCP/IP headers: what the inter-cluster class (the 'a <-> b' entry) "
              "carries. The MiB per step inside a cluster include each world's one-time "
              "start-up traffic, spread over the steps.")
    print("\n## Predicted vs measured step time (hetjax plan for each row's executor, with "
          "hetjax calibrate's file from this testbed)\n")
    print(accuracy_table(cases))
    print(ACCURACY_NOTE)
    if failures(cases):
        print("\n" + failures(cases))
    names = [c.name.replace(", ", ",\n") for c in cases]
    path = bar_plot(args.out, f"Heterogeneous NICs on the testbed\n2 clusters x 2 hosts, "
                    f"{args.cpus:g} CPU each, links x {args.scale:g}", names,
                    [c.tokens_per_s() for c in cases],
                    [c.plan.global_batch * c.plan.seq_len / c.predicted_s
                     if c.predicted_s else None for c in cases], "tokens / s",
                    notes=[f"{c.tokens_per_s() / all_fast(by, c):.2f}x"
                           if c.step_s and all_fast(by, c) else "" for c in cases])
    print(f"\nplot: {path}")


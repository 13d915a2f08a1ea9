"""Planner benchmarks; each prints a markdown table.

    python scripts/bench_planner.py calibrate      # Holmes Table 1: fit on one row, predict
    python scripts/bench_planner.py dtfm           # DT-FM's five scenarios: cost, ratio, time
    python scripts/bench_planner.py speed          # outer search on 64 .. 4,096 devices
    python scripts/bench_planner.py assign-speed   # DT-FM assignment on 64 .. 1,024 devices
    python scripts/bench_planner.py executors      # Holmes' hybrid layouts under each executor
    python scripts/bench_planner.py all

Times are wall-clock on this machine, single-threaded; nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hetjax.planner import assign, plan  # noqa: E402
from hetjax.planner.calibrate import (fit_efficiency, fit_nic_bandwidth,  # noqa: E402
                                      holmes_table1, predicted_samples_per_s)
from hetjax.planner.cost import CostOptions  # noqa: E402
from hetjax.topology import DTFM_SCENARIOS, preset  # noqa: E402


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def calibrate(_args) -> None:
    rows_in = holmes_table1()
    rows = []
    for fit in rows_in:
        eff = fit_efficiency(fit)
        options = CostOptions(efficiency=eff)
        cells = [fit.name, f"{eff:.3f}"]
        for m in rows_in:
            got = predicted_samples_per_s(m, options)
            cells.append(f"{got:.2f} ({(got / m.samples_per_s - 1) * 100:+.1f}%)")
        rows.append(cells)
    print("Holmes Table 1 (GPT 3.6B, 32 A100, PP 2, DP 16, ZeRO-1, 1F1B, M = 48): efficiency "
          "fitted on one row, samples/s predicted for all (error vs measured)\n")
    print(table(["fitted on", "efficiency"] +
                [f"{m.name} (measured {m.samples_per_s})" for m in rows_in], rows))
    ib, roce, eth = rows_in
    options = CostOptions(efficiency=fit_efficiency(ib))
    print("\nEffective NIC bandwidth each row implies, with the efficiency fitted on "
          "InfiniBand:\n")
    print(table(["row", "nominal Gb/s", "fitted Gb/s"],
                [[m.name, f"{m.topology.clusters[0].nic.bandwidth_gbps:g}",
                  f"{fit_nic_bandwidth(m, options):.1f}"] for m in (roce, eth)]))


def gpt13b(topology, stages: int) -> assign.Problem:
    """DT-FM's workload: GPT3-1.3B (24 layers, hidden 2048, seq 2048), 1M-token batch split
    over the pipelines; fp32 gradients of a stage's layers, fp16 activations."""
    dp = topology.num_devices // stages
    return assign.dtfm_problem(topology, stages=stages, layers=24, layer_params=1.3e9 / 24,
                               seq_len=2048, d_model=2048, sequences_per_pipeline=512 / dp)


def dtfm(args) -> None:
    rows = []
    for name in DTFM_SCENARIOS:
        p = gpt13b(preset(name), 8)
        unaware = assign.consecutive(p)
        t0 = time.perf_counter()
        found = assign.search(p, seconds=args.seconds)
        t_search = time.perf_counter() - t0
        t0 = time.perf_counter()
        ga = assign.genetic_search(p, population=100, trials=4900, seconds=args.ga_seconds)
        t_ga = time.perf_counter() - t0
        rows.append([name, f"{found.cost:.2f}", f"{unaware.cost:.2f}",
                     f"{unaware.cost / found.cost:.2f}x", f"{t_search:.1f}",
                     f"{ga.cost:.2f}", f"{t_ga:.0f}"])
    print("DT-FM scenarios (64 V100, D_pp = D_dp = 8, GPT3-1.3B): DT-FM's communication cost "
          "per step [s]\n")
    print(table(["scenario", "planner", "consecutive ranks", "ratio", "search s",
                 f"GA + local search (pop 100, <= {args.ga_seconds:.0f} s)", "GA s"], rows))


def speed(args) -> None:
    from layers.config import ModelConfig

    model = ModelConfig(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                        n_kv_heads=8, d_ff=28672, max_seq_len=4096, remat="full",
                        dtype="bfloat16", param_dtype="bfloat16")
    rows = []
    for n in args.devices:
        t = preset("holmes_hybrid", nodes=n // 16, devices_per_node=8)
        t0 = time.perf_counter()
        result = plan(t, model, 2048, 4096, options=CostOptions(executor=args.executor))
        seconds = time.perf_counter() - t0
        p, pr = result.plan, result.plan.predicted
        rows.append([str(n), f"{seconds:.1f}", str(result.candidates), str(result.simulated),
                     f"pp={p.pp} dp={p.dp} tp={p.tp} M={p.microbatches} {p.schedule} "
                     f"{p.zero.name}", f"{pr['step_time_s']:.2f}", f"{pr['mfu']:.1%}"])
    print("Outer search speed: 70B-class model (80 layers, d 8192, GQA 64/8), batch 2048 x "
          "4096 tokens, on holmes_hybrid (InfiniBand + RoCE clusters of 8-A100 nodes, "
          f"Ethernet between), priced for the {args.executor} executor\n")
    print(table(["devices", "seconds", "layouts priced", "simulated", "chosen",
                 "step s", "MFU"], rows))


def assign_speed(args) -> None:
    rows = []
    for n in (64, 256, 1024):
        for name, topo in (("dtfm_worldwide", preset("dtfm_worldwide", nodes=n // 8)),
                           ("dtfm_datacenter_ondemand",
                            preset("dtfm_datacenter_ondemand", instances=n // 8))):
            p = gpt13b(topo, 8)
            t0 = time.perf_counter()
            found = assign.search(p, seconds=args.seconds)
            seconds = time.perf_counter() - t0
            classes = len(set(assign.twin_classes(p.dp_pair_cost(),
                                                  p.pp_pair_cost()).tolist()))
            rows.append([str(n), name, str(classes), f"{seconds:.1f}",
                         f"{assign.consecutive(p).cost / found.cost:.2f}x"])
    print("DT-FM assignment speed (D_pp = 8): scaled scenarios; 'twin classes' = groups of "
          "devices with identical links\n")
    print(table(["devices", "topology", "twin classes", "seconds", "vs consecutive"], rows))


def holmes_gpt(size: str):
    """Holmes' GPT models: 3.6B (hidden 3072, 30 layers) and 7.5B (hidden 4096, 36 layers), 32
    heads, GPT-2 vocabulary, SwiGLU MLP of the same size, full recompute, bf16."""
    from layers.config import ModelConfig

    d, layers, ff = {"3.6B": (3072, 30, 8192), "7.5B": (4096, 36, 11008)}[size]
    return ModelConfig(vocab_size=50257, d_model=d, n_layers=layers, n_heads=32,
                       n_kv_heads=32, d_ff=ff, max_seq_len=2048, remat="full",
                       dtype="bfloat16", param_dtype="bfloat16")


def executors(_args) -> None:
    """The executor tax: Holmes' hybrid layout (a stage per cluster, dp inside, ZeRO-1, 1F1B,
    one sequence per replica per micro-batch) priced as each executor runs it, and the layout
    the planner picks when it prices each executor."""
    from hetjax.plan import Plan
    from hetjax.planner import zero as zr
    from hetjax.planner.cost import CostModel

    rows, chosen = [], []
    for size in ("3.6B", "7.5B"):
        model = holmes_gpt(size)
        for devices, batch in ((32, 768), (48, 1536), (64, 2688)):
            t = preset("holmes_hybrid", nodes=devices // 16, devices_per_node=8)
            dp = devices // 2
            half = model.n_layers // 2
            holmes = Plan(pp=2, dp=dp, tp=1, stage_layers=(half, model.n_layers - half),
                          microbatches=batch // dp, global_batch=batch, seq_len=2048,
                          schedule="1f1b", zero=zr.named("zero1", dp, 8))
            step = {ex: CostModel(t, model, CostOptions(executor=ex)).predict(holmes).step_time
                    for ex in ("hetjax", "mpmd", "megatron")}
            rows.append([size, str(devices), str(batch), f"pp=2 dp={dp} M={batch // dp}",
                         f"{step['hetjax']:.2f} ({step['hetjax'] / step['megatron']:.2f}x)",
                         f"{step['mpmd']:.2f} ({step['mpmd'] / step['megatron']:.2f}x)",
                         f"{step['megatron']:.2f}"])
        # The planner's choice on 32 A100s as the link between the clusters slows down.
        for gbps in (25, 10, 5):
            t = preset("holmes_hybrid", nodes=2, devices_per_node=8)
            t = dataclasses.replace(t, inter_cluster=dataclasses.replace(
                t.inter_cluster, bandwidth_gbps=gbps))
            for ex, name in (("hetjax", "spmd"), ("mpmd", "mpmd")):
                best = plan(t, model, 768, 2048, options=CostOptions(executor=ex),
                            zero="auto").plan
                chosen.append([size, f"{gbps} Gb/s", name,
                               f"pp={best.pp} dp={best.dp} tp={best.tp} M={best.microbatches} "
                               f"{best.schedule} {best.zero.name}",
                               f"{best.predicted['step_time_s']:.2f}"])
    print("Holmes' hybrid layout (IB + RoCE clusters of 8-A100 nodes, 25 GbE between; a stage "
          "per cluster, ZeRO-1, 1F1B, seq 2048): predicted step time [s] per executor, and "
          "its ratio to Megatron-LM's\n")
    print(table(["model", "A100s", "batch", "layout", "spmd (lockstep)", "mpmd",
                 "megatron"], rows))
    print("\nThe planner's choice on 32 A100s (batch 768) when it prices each of hetjax's "
          "executors (free pp, dp, tp, M, schedule, ZeRO), as the Ethernet link between the "
          "clusters slows down\n")
    print(table(["model", "between clusters", "executor", "chosen", "step s"], chosen))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["calibrate", "dtfm", "speed", "assign-speed",
                                         "executors", "all"])
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="time limit of one assignment search")
    parser.add_argument("--ga-seconds", type=float, default=120.0,
                        help="time limit of one genetic-algorithm run")
    parser.add_argument("--devices", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--executor", choices=["hetjax", "mpmd", "megatron"], default="hetjax",
                        help="speed: how the chosen plans are priced (see cost.EXECUTORS)")
    args = parser.parse_args()
    steps = {"calibrate": [calibrate], "dtfm": [dtfm], "speed": [speed],
             "assign-speed": [assign_speed], "executors": [executors],
             "all": [calibrate, dtfm, speed, assign_speed, executors]}[args.what]
    for i, step in enumerate(steps):
        if i:
            print()
        step(args)


if __name__ == "__main__":
    main()

"""Planner benchmarks; each prints a markdown table.

    python scripts/bench/planner.py calibrate      # Holmes Table 1: fit on one row, predict;
                                                   # one efficiency per fabric
    python scripts/bench/planner.py allreduce      # 1,024-rank all-reduce: flat ring vs NCCL
    python scripts/bench/planner.py amsp           # AMSP's ZeRO choice, LLaMA 7/13/30B, 1,024 A800
    python scripts/bench/planner.py dtfm           # DT-FM's five scenarios: cost, ratio, time
    python scripts/bench/planner.py speed          # outer search on 64 .. 4,096 devices
    python scripts/bench/planner.py speed --devices 4096 --executor spmd mpmd
    python scripts/bench/planner.py speed --devices 4096 --executor spmd mpmd --subsets
    python scripts/bench/planner.py assign-speed   # DT-FM assignment on 64 .. 1,024 devices
    python scripts/bench/planner.py executors      # Holmes' hybrid layouts under each executor
    python scripts/bench/planner.py scenario       # docs/planner.md's cluster: the plan against
                                                   # the best priced without the search
    python scripts/bench/planner.py all
    python scripts/bench/planner.py --smoke        # seconds: calibrate and allreduce

Times are wall-clock on this machine, single-threaded (speed and assign-speed: CPU seconds of
the process, steadier on a shared machine); nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import time

import numpy as np

from hetjax.errors import PlanError
from hetjax.planner import assign, partition, plan, simulate, zero_factors
from hetjax.planner.reference_runs import (fit_efficiency, fit_fabrics, fit_nic_bandwidth,
                                           holmes_table1, predicted_samples_per_s)
from hetjax.planner.cost import DEFAULT_EFFICIENCY, CostOptions
from hetjax.core.topology import DTFM_SCENARIOS, preset


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def calibrate(_args) -> None:
    nominal = holmes_table1(nominal=True)
    rows = []
    for fit in nominal:
        eff = fit_efficiency(fit)
        options = CostOptions(efficiency=eff)
        cells = [fit.name, f"{eff:.3f}"]
        for m in nominal:
            got = predicted_samples_per_s(m, options)
            cells.append(f"{got:.2f} ({(got / m.samples_per_s - 1) * 100:+.1f}%)")
        rows.append(cells)
    print("Holmes Table 1 (GPT 3.6B, 32 A100, PP 2, DP 16, ZeRO-1, 1F1B, M = 48), every link "
          "at its nominal rate: compute efficiency fitted on one row, samples/s predicted for "
          "all (error vs measured)\n")
    print(table(["fitted on", "efficiency"] +
                [f"{m.name} (measured {m.samples_per_s})" for m in nominal], rows))
    ib, roce, eth = nominal
    options = CostOptions(efficiency=fit_efficiency(ib))
    print("\nEffective NIC bandwidth each row implies, with the efficiency fitted on "
          "InfiniBand:\n")
    print(table(["row", "nominal Gb/s", "fitted Gb/s"],
                [[m.name, f"{m.topology.clusters[0].nic.bandwidth_gbps:g}",
                  f"{fit_nic_bandwidth(m, options):.1f}"] for m in (roce, eth)]))
    fit = fit_fabrics(nominal)
    print(f"\nOne efficiency per fabric (reference_runs.fit_fabrics): compute efficiency "
          f"{fit.compute_efficiency:.3f} (the smallest at which no fabric beats its nominal "
          f"rate: {fit.anchor} at 1.0); the catalogue (hetjax.core.topology.LINKS) rounds these, "
          f"and the last column predicts each row with the catalogue and the default compute "
          f"efficiency {DEFAULT_EFFICIENCY}:\n")
    rows = []
    for m in holmes_table1():
        lk = m.topology.clusters[0].nic
        got = predicted_samples_per_s(m, CostOptions())
        rows.append([m.name, f"{lk.bandwidth_gbps:g}", f"{fit.fabric_efficiency[m.name]:.3f}",
                     f"{lk.efficiency:.2f}", f"{lk.bandwidth_gbps * lk.efficiency:.1f}",
                     f"{m.samples_per_s}",
                     f"{got:.2f} ({(got / m.samples_per_s - 1) * 100:+.1f}%)"])
    print(table(["fabric", "nominal Gb/s", "fitted efficiency", "catalogue", "achieved Gb/s",
                 "measured samples/s", "predicted"], rows))


def allreduce(_args) -> None:
    """1 GB and 1 MB all-reduces over 1,024 data-parallel A100s (128 nodes x 8, InfiniBand):
    the flat ring against NCCL's algorithm choice (hetjax/planner/collectives.py)."""
    from hetjax.planner.cost import CostModel
    from hetjax.planner.reference_runs import holmes_model

    t = preset("holmes_infiniband", nodes=128)
    group = np.arange(1024)[None, :]
    nccl = CostModel(t, holmes_model())
    ring = CostModel(t, holmes_model(), CostOptions(collectives="ring"))
    rows = []
    for nbytes in (1e6, 1e8, 1e9):
        t_ring = ring.collective("all_reduce", nbytes, group)
        t_nccl, algo = nccl.collective_choice("all_reduce", nbytes, group)
        algbw = nbytes / t_nccl / 1e9
        rows.append([f"{nbytes / 1e6:g} MB", f"{t_ring * 1e3:.2f}", f"{t_nccl * 1e3:.2f}", algo,
                     f"{t_ring / t_nccl:.2f}x", f"{algbw:.2f}",
                     f"{algbw * 2 * 1023 / 1024:.2f}"])
    nic = t.clusters[0].nic
    print(f"All-reduce over 1,024 data-parallel A100s (128 nodes x 8, {nic.kind} "
          f"{nic.bandwidth_gbps:g} Gb/s x {nic.efficiency} = "
          f"{nic.bytes_per_s / 1e9:.2f} GB/s per node, {nic.latency_us:g} us; NVLink "
          f"{t.clusters[0].intra_node.latency_us:g} us): the flat ring 2(p-1)(a + S/(pB)) "
          "against NCCL's cheaper of ring and tree\n")
    print(table(["buffer", "flat ring ms", "NCCL-like ms", "algorithm", "ring / NCCL",
                 "algbw GB/s", "busbw GB/s"], rows))

def amsp(_args) -> None:
    """AMSP's setting: LLaMA 7B / 13B / 30B on 128 nodes x 8 A800, sequence 4096, 4M tokens per
    step (1,024 sequences), ZeRO-only data parallelism priced as Megatron / DeepSpeed run it;
    the planner chooses the ZeRO point (and nothing else). At the reference's assumed 400 Gb/s
    a node, and at 200 Gb/s."""
    from hetjax.planner.reference_runs import (AMSP_MFU, AMSP_NIC_GBPS, LLAMA, amsp_model,
                                               amsp_plan, amsp_topology)
    from hetjax.planner.search import zero_points_by_traffic

    options = CostOptions(executor="megatron")
    rows = []
    for gbps, name in itertools.product((AMSP_NIC_GBPS, 200.0), LLAMA):
        p = amsp_plan(name, gbps)
        pr = p.predicted
        topo, model = amsp_topology(gbps), amsp_model(name)
        # AMSP's own objective: the least traffic among the points that fit memory.
        for least in zero_points_by_traffic(topo, model, 1024, 4096, p, options):
            try:
                least_plan = amsp_plan(name, gbps, zero=least)
                break
            except PlanError:
                continue
        rows.append([f"{gbps:g}", name, f"{model.num_params / 1e9:.1f}B",
                     f"{p.zero.name} ({p.zero.s_p},{p.zero.s_g},{p.zero.s_os})",
                     f"{pr['step_time_s']:.2f}", f"{pr['mfu']:.1%}",
                     f"{max(pr['stage_memory_gib']):.1f} / {max(pr['stage_capacity_gib']):.0f}",
                     f"{least.name}: {least_plan.predicted['mfu']:.1%}", pr["bound"]["zero"]])
    print("AMSP's setting: LLaMA on 128 nodes x 8 A800 (80 GiB), dp = 1,024, sequence 4096, "
          "1,024 sequences (4M tokens) per step, M = 1, full recompute, Megatron's accounting "
          "with ZeRO's traffic overlapped as scheduled; ZeRO point chosen by predicted step "
          f"time within the usable memory. AMSP reports up to {AMSP_MFU:.0%} MFU for 7B and 13B "
          "at 1,024 GPUs.\n")
    print(table(["Gb/s a node", "model", "params", "chosen (s_p,s_g,s_os)", "step s", "MFU",
                 "GiB / usable", "least traffic: MFU", "what bound it"], rows))


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
    from hetjax.core.model_config import ModelConfig

    model = ModelConfig(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64,
                        n_kv_heads=8, d_ff=28672, max_seq_len=4096, remat="full",
                        dtype="bfloat16", param_dtype="bfloat16")
    rows = []
    for n, executor in itertools.product(args.devices, args.executor):
        options = CostOptions(executor=executor, compute=args.compute)
        t = preset("holmes_hybrid", nodes=n // 16, devices_per_node=8)
        runs = {}
        for prune in (True, False):  # the search as it runs, and exhaustively, side by side
            for cached in (simulate.schedule_table, simulate.in_flight,
                           simulate.in_flight_folded, simulate._ticks, simulate.grid_codes):
                cached.cache_clear()  # each search builds its schedule tables afresh
            partition.split_cache_clear()  # ... and finds its layer splits afresh
            zero_factors.step_collectives.cache_clear()  # ... and its ZeRO collectives
            zero_factors.axis_pattern.cache_clear()
            t0 = time.process_time()  # CPU seconds: the machines this runs on are shared
            runs[prune] = (plan(t, model, 2048, 4096, options=options, prune=prune,
                                subsets=args.subsets, distinct=args.subsets,
                                stage_degrees=args.subsets),
                           time.process_time() - t0)
        (result, seconds), (full, full_seconds) = runs[True], runs[False]
        same = [(p.pp, p.dp, p.tp, p.microbatches, p.schedule, p.zero, p.stage_layers,
                 p.device_order) for p in (result.plan, *result.runners_up)] == \
            [(p.pp, p.dp, p.tp, p.microbatches, p.schedule, p.zero, p.stage_layers,
              p.device_order) for p in (full.plan, *full.runners_up)]
        p, pr = result.plan, result.plan.predicted
        rows.append([str(n), executor, f"{seconds:.1f}", f"{full_seconds:.1f}",
                     f"{result.candidates} + {result.pruned} skipped", str(full.candidates),
                     "yes" if same else "NO",
                     f"pp={p.pp} dp={p.dp} tp={p.tp} M={p.microbatches} {p.schedule} "
                     f"{p.zero.name}" + (f", {p.num_devices} devices" if args.subsets else ""),
                     f"{pr['step_time_s']:.2f}", f"{pr['mfu']:.1%}"])
    print("Outer search speed: 70B-class model (80 layers, d 8192, GQA 64/8), batch 2048 x "
          "4096 tokens, on holmes_hybrid (InfiniBand + RoCE clusters of 8-A100 nodes, "
          f"Ethernet between), priced for each executor, compute "
          f"{args.compute}; the search with its lower-bound pruning beside the exhaustive "
          "one (prune=False)" + ("; the devices used searched too (whole clusters left out), "
                                 "runners-up distinct layouts" if args.subsets else "") + "\n")
    print(table(["devices", "executor", "CPU s", "exhaustive CPU s", "layouts priced",
                 "exhaustive priced", "same plans", "chosen", "step s", "MFU"], rows))


def assign_speed(args) -> None:
    rows = []
    for n in (64, 256, 1024):
        for name, topo in (("dtfm_worldwide", preset("dtfm_worldwide", nodes=n // 8)),
                           ("dtfm_datacenter_ondemand",
                            preset("dtfm_datacenter_ondemand", instances=n // 8))):
            p = gpt13b(topo, 8)
            runs = []
            for patience in (2, 8):  # the search as it runs, and with eight fruitless rounds
                t0 = time.process_time()
                found = assign.search(p, seconds=args.seconds,
                                      min_rounds_without_gain=patience)
                runs.append((found, time.process_time() - t0))
            (found, seconds), (full, full_seconds) = runs
            classes = len(set(assign.twin_classes(p.dp_pair_cost(),
                                                  p.pp_pair_cost()).tolist()))
            rows.append([str(n), name, str(classes), f"{seconds:.1f}", f"{full_seconds:.1f}",
                         "yes" if found.groups == full.groups else
                         f"NO ({found.cost:.4g} vs {full.cost:.4g})",
                         f"{assign.consecutive(p).cost / found.cost:.2f}x"])
    print("DT-FM assignment speed (D_pp = 8): scaled scenarios; 'twin classes' = groups of "
          "devices with identical links; CPU seconds of the search as it runs (it stops "
          "perturbing once it has gone as long without a gain as finding its best took) "
          "beside eight fruitless perturbation rounds\n")
    print(table(["devices", "topology", "twin classes", "CPU s", "8 rounds CPU s",
                 "same assignment", "vs consecutive"], rows))


def holmes_gpt(size: str):
    """Holmes' GPT models: 3.6B (hidden 3072, 30 layers) and 7.5B (hidden 4096, 36 layers), 32
    heads, GPT-2 vocabulary, SwiGLU MLP of the same size, full recompute, bf16."""
    from hetjax.core.model_config import ModelConfig

    d, layers, ff = {"3.6B": (3072, 30, 8192), "7.5B": (4096, 36, 11008)}[size]
    return ModelConfig(vocab_size=50257, d_model=d, n_layers=layers, n_heads=32,
                       n_kv_heads=32, d_ff=ff, max_seq_len=2048, remat="full",
                       dtype="bfloat16", param_dtype="bfloat16")


def executors(_args) -> None:
    """The executor tax: Holmes' hybrid layout (a stage per cluster, dp inside, ZeRO-1, 1F1B,
    one sequence per replica per micro-batch) priced as each executor runs it, and the layout
    the planner picks when it prices each executor."""
    from hetjax.core.plan import Plan
    from hetjax.planner import zero_factors as zr
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
                    for ex in ("spmd", "mpmd", "megatron")}
            # the SPMD pipeline keeping every layer's residuals (model.remat = none)
            keep = dataclasses.replace(model, remat="none")
            step["keep"] = CostModel(t, keep).predict(holmes).step_time
            # ... and running DHelix's two strands per tick (lockstep time = GPipe's)
            step["strands"] = CostModel(t, keep).predict(
                dataclasses.replace(holmes, schedule="strands")).step_time
            rows.append([size, str(devices), str(batch), f"pp=2 dp={dp} M={batch // dp}",
                         f"{step['spmd']:.2f} ({step['spmd'] / step['megatron']:.2f}x)",
                         f"{step['keep']:.2f} ({step['keep'] / step['megatron']:.2f}x)",
                         f"{step['strands']:.2f} ({step['strands'] / step['megatron']:.2f}x)",
                         f"{step['mpmd']:.2f} ({step['mpmd'] / step['megatron']:.2f}x)",
                         f"{step['megatron']:.2f}"])
        # The planner's choice on 32 A100s as the link between the clusters slows down.
        for gbps in (25, 10, 5):
            t = preset("holmes_hybrid", nodes=2, devices_per_node=8)
            t = dataclasses.replace(t, inter_cluster=dataclasses.replace(
                t.inter_cluster, bandwidth_gbps=gbps))
            for ex, name in (("spmd", "spmd"), ("mpmd", "mpmd")):
                best = plan(t, model, 768, 2048, options=CostOptions(executor=ex),
                            zero="auto").plan
                chosen.append([size, f"{gbps} Gb/s", name,
                               f"pp={best.pp} dp={best.dp} tp={best.tp} M={best.microbatches} "
                               f"{best.schedule} {best.zero.name}",
                               f"{best.predicted['step_time_s']:.2f}"])
    print("Holmes' hybrid layout (IB + RoCE clusters of 8-A100 nodes, 25 GbE between; a stage "
          "per cluster, ZeRO-1, 1F1B, seq 2048): predicted step time [s] per executor, and "
          "its ratio to Megatron-LM's\n")
    print(table(["model", "A100s", "batch", "layout", "spmd (lockstep)",
                 "spmd remat=none (lockstep)", "spmd strands remat=none (lockstep)", "mpmd",
                 "megatron"], rows))
    print("\nThe planner's choice on 32 A100s (batch 768) when it prices each of hetjax's "
          "executors (free pp, dp, tp, M, schedule, ZeRO), as the Ethernet link between the "
          "clusters slows down\n")
    print(table(["model", "between clusters", "executor", "chosen", "step s"], chosen))


def _compositions(n: int, parts: int):
    """Every way to give `parts` stages at least one of `n` layers each, in order."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        yield tuple(b - a for a, b in zip((0, *cuts), (*cuts, n)))


# Stage arrangements `exhaustive_best` enumerates per layout before it takes the search's own
# orders instead (slot order, slowest first, fastest first: `partition.candidate_orders`).
ARRANGEMENTS = 2000


def arrangements(kinds: list, most: int = ARRANGEMENTS) -> list[tuple[int, ...]]:
    """Stage orders that differ in the sequence of stage kinds (stages of one kind cost the
    same), every one when there are at most `most`, else []."""
    labels = sorted(set(kinds), key=kinds.index)
    pools = {k: [i for i, x in enumerate(kinds) if x == k] for k in labels}
    counts = [len(pools[k]) for k in labels]
    total = math.factorial(len(kinds)) // math.prod(math.factorial(c) for c in counts)
    if total > most:
        return []
    out = []

    def walk(prefix, left):
        if not any(left):
            used = {k: iter(pools[k]) for k in labels}
            out.append(tuple(next(used[labels[j]]) for j in prefix))
            return
        for j, c in enumerate(left):
            if c:
                left[j] -= 1
                walk(prefix + [j], left)
                left[j] += 1

    walk([], counts)
    return out


def exhaustive_best(topology, model, global_batch: int, seq_len: int,
                    executors=("spmd", "mpmd"), all_splits: bool = True):
    """The fastest plan the cost model can price, found without the search: every connected
    set of clusters (`search.device_subsets`), executor, (pp, dp, tp) that uses those devices
    and keeps the placement rules (and, for the MPMD executor, each cluster's stages of their
    own (dp, tp) where clusters differ in their nodes, replicated states), arrangement of the
    stages (distinct by what they cost; beyond ARRANGEMENTS of them, the search's own stage
    orders), micro-batch count, schedule the executor runs,
    placement, recompute policy the cost model weighs, ZeRO point, and layer split: every
    split (`all_splits`), or for each of the rest the split the partition finds exact for its
    pipeline-time estimate. Every candidate whose lower bound (`simulate.lower_bound`, which
    no schedule beats) is below the best so far is simulated; returns (best Plan with its
    prediction, candidates, simulated)."""
    from hetjax.core.plan import Plan, batch_split_problem, placement_problem
    from hetjax.core.schedules import SCHEDULES
    from hetjax.planner import zero_factors as zr
    from hetjax.planner.cost import PLAN_EXECUTORS, CostModel, runs_schedule
    from hetjax.planner.layout import Layout
    from hetjax.planner.placement import placement_problems
    from hetjax.planner.search import (device_subsets, fits_schedule, stage_shape_layouts,
                                       sub_topology)
    from hetjax.planner.simulate import lower_bound

    def splits_of(lay, subcm):
        if all_splits:
            return list(_compositions(N, lay.pp))
        found = partition.best_split(subcm.stage_table(lay), N, lay.microbatches,
                                     [tuple(range(lay.pp))])
        return [found.layers] if found else []

    best, candidates, simulated = None, 0, 0
    N = model.n_layers

    def price(lay, splits, cm, subcm, ranks):
        nonlocal best, candidates, simulated
        for split in splits:
            candidates += 1
            stages = subcm.stage_costs(lay)
            fwd = [c.fwd(k) for c, k in zip(stages, split)]
            bwd = [c.bwd(k) for c, k in zip(stages, split)]
            if not all(c.memory(k, max(split)) <= c.capacity for c, k in zip(stages, split)):
                continue
            send = subcm.boundary_times(lay)[0]
            if best is not None and lower_bound(fwd, bwd, lay.microbatches, send, send) >= \
                    best.predicted["step_time_s"]:
                continue
            p = lay.with_plan(split, device_order=tuple(ranks[i] for i in lay.device_order))
            pred = cm.predict(p)
            simulated += 1
            if pred.fits and (best is None or pred.step_time < best.predicted["step_time_s"]):
                best = dataclasses.replace(p, predicted=pred.as_dict())

    for keep in device_subsets(topology):
        sub, ranks = sub_topology(topology, keep)
        n = sub.num_devices
        per_node = math.gcd(*(c.devices_per_node for c in sub.clusters))
        tps = [t for t in range(1, n + 1) if math.gcd(model.n_heads, model.n_kv_heads,
                                                      model.d_ff, per_node) % t == 0]
        for name in executors:
            cm = CostModel(topology, model, CostOptions(executor=PLAN_EXECUTORS[name]))
            subcm = CostModel(sub, model, CostOptions(executor=PLAN_EXECUTORS[name]))
            for tp, pp in itertools.product(tps, range(1, N + 1)):
                if n % (tp * pp):
                    continue
                dp = n // (tp * pp)
                probe = Plan(pp=pp, dp=dp, tp=tp, stage_layers=(1,) * pp, microbatches=1,
                             global_batch=dp, seq_len=1)
                if placement_problems(probe, sub):
                    continue
                rows = np.arange(n).reshape(pp, dp * tp)
                base = Layout(pp=pp, dp=dp, tp=tp, microbatches=1, global_batch=global_batch,
                              seq_len=seq_len)
                keys = subcm.stage_keys(base)
                orders = arrangements(list(keys)) or partition.candidate_orders(
                    subcm.stage_table(base))
                nodes = subcm.node_of(base.mesh().transpose(0, 2, 1).reshape(-1, dp))
                for perm, M in itertools.product(orders, range(1, global_batch + 1)):
                    if batch_split_problem(global_batch, M, dp):
                        continue
                    order = tuple(int(r) for r in rows[list(perm)].ravel())
                    for sched, remat, zero in itertools.product(
                            SCHEDULES, subcm.remat_choices(pp), zr.space(nodes)):
                        if not fits_schedule(sched, pp, M, PLAN_EXECUTORS[name], "1f1b") or (
                                pp > 1 and not runs_schedule(name, sched)):
                            continue
                        places = ("looped", "folded") if pp > 1 else ("looped",)
                        for place in places:
                            if placement_problem(place, sched):
                                continue
                            lay = Layout(pp=pp, dp=dp, tp=tp, device_order=order,
                                         microbatches=M, global_batch=global_batch,
                                         seq_len=seq_len, schedule=sched, zero=zero,
                                         placement=place, remat=remat, executor=name)
                            price(lay, splits_of(lay, subcm), cm, subcm, ranks)
            if name != "mpmd":  # stages of different (dp, tp): the MPMD executor's
                continue
            for shapes, order in stage_shape_layouts(sub, model):
                pp = len(shapes)
                blocks = [order[sum(d * t for d, t in shapes[:i]):
                                sum(d * t for d, t in shapes[:i + 1])] for i in range(pp)]
                whole = Layout(pp=pp, dp=shapes[0][0], tp=shapes[0][1], stage_shapes=shapes,
                               device_order=order, microbatches=1,
                               global_batch=global_batch, seq_len=seq_len)
                kinds = [(shapes[i], subcm.stage_keys(CostModel.stage_view(whole, i))[i])
                         for i in range(pp)]
                perms = arrangements(kinds) or partition.candidate_orders(
                    subcm.stage_table(whole))
                dp = math.lcm(*(d for d, _ in shapes))
                for perm, M in itertools.product(perms, range(1, global_batch + 1)):
                    if batch_split_problem(global_batch, M, dp):
                        continue
                    for sched, remat in itertools.product(SCHEDULES, subcm.remat_choices(pp)):
                        if not fits_schedule(sched, pp, M, "mpmd", "1f1b"):
                            continue
                        moved = tuple(shapes[i] for i in perm)
                        lay = Layout(pp=pp, dp=moved[0][0], tp=moved[0][1], stage_shapes=moved,
                                     device_order=tuple(r for i in perm for r in blocks[i]),
                                     microbatches=M, global_batch=global_batch,
                                     seq_len=seq_len, schedule=sched, remat=remat,
                                     executor=name)
                        price(lay, splits_of(lay, subcm), cm, subcm, ranks)
    return best, candidates, simulated


SCENARIO = {  # docs/planner.md: the cluster of a new user, as they would write it
    "name": "lab",
    "clusters": [
        {"name": "a100ib", "nodes": 2, "devices_per_node": 8, "accelerator": "a100_80gb",
         "nic": "ib_hdr_200g", "intra_node": "nvlink3"},
        {"name": "l40s", "nodes": 1, "devices_per_node": 4, "accelerator": "l40s",
         "nic": "eth_25g", "intra_node": "pcie4"}],
    "inter_cluster": "eth_10g"}


def scenario(_args) -> None:
    """The plan `hetjax plan` gives the scenario of docs/planner.md (llama3_8b, batch 256 x
    4096, 2 x 8 A100 on InfiniBand + 4 L40S, 10 Gb/s between) against the best the cost model
    can price, found without the search (`exhaustive_best`, each stage order's exact split)."""
    from hetjax.argv import default_job_path
    from hetjax.config import load_config
    from hetjax.core.topology_file import topology_from_dict
    from hetjax.planner import plan_job

    topology = topology_from_dict(SCENARIO)
    c = load_config(default_job_path(), ["--config.parallel.pp=0", "--config.parallel.tp=0",
                                         "--config.model.preset=llama3_8b",
                                         "--config.train.batch_size=256",
                                         "--config.train.seq_len=4096"], default_job=True)
    t0 = time.process_time()
    job = plan_job(c, topology)
    planned = time.process_time() - t0
    t0 = time.process_time()
    best, candidates, simulated = exhaustive_best(topology, job.model, 256, 4096,
                                                  all_splits=False)
    every = time.process_time() - t0
    rows = []
    for what, p, secs in (("hetjax plan", job.plan, planned), ("exhaustive", best, every)):
        rows.append([what, f"pp={p.pp} dp={p.dp} tp={p.tp} {p.executor} M={p.microbatches} "
                     f"{p.schedule} {p.placement} remat={p.remat} {p.zero.name}",
                     f"{len(p.device_order)}", f"{p.predicted['step_time_s']:.4f}",
                     f"{secs:.1f}"])
    gap = job.plan.predicted["step_time_s"] / best.predicted["step_time_s"] - 1
    print(f"The scenario of docs/planner.md: the planner's plan against the fastest of "
          f"{candidates:,} layouts priced without the search ({simulated:,} simulated); "
          f"the plan is {gap:+.2%} from it\n")
    print(table(["", "plan", "devices", "step s", "CPU s"], rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=["calibrate", "allreduce", "amsp", "dtfm",
                                                    "speed", "assign-speed", "executors",
                                                    "scenario", "all"])
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: the two pure tables (calibrate and allreduce)")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="time limit of one assignment search")
    parser.add_argument("--ga-seconds", type=float, default=120.0,
                        help="time limit of one genetic-algorithm run")
    parser.add_argument("--devices", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--compute", choices=["flat", "kinds"], default="flat",
                        help="speed: compute priced flat (one efficiency) or by operation kind")
    parser.add_argument("--subsets", action="store_true",
                        help="speed: the search as `hetjax plan` runs it: the devices used "
                        "and per-stage degrees a choice too, the runners-up distinct layouts")
    parser.add_argument("--executor", choices=["spmd", "mpmd", "megatron"], nargs="+",
                        default=["spmd"], help="speed: how the plans are priced (see "
                        "cost.PRICED_EXECUTORS); several: one row each, in one table")
    args = parser.parse_args(argv)
    if args.smoke == bool(args.what):
        parser.error("give one benchmark (see above) or --smoke")
    steps = {"calibrate": [calibrate], "allreduce": [allreduce], "amsp": [amsp], "dtfm": [dtfm],
             "speed": [speed], "assign-speed": [assign_speed], "executors": [executors],
             "scenario": [scenario],
             "all": [calibrate, allreduce, amsp, dtfm, speed, assign_speed, executors],
             "smoke": [calibrate, allreduce]}["smoke" if args.smoke else args.what]
    for i, step in enumerate(steps):
        if i:
            print()
        step(args)


if __name__ == "__main__":
    main()

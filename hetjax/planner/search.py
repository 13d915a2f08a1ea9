"""The outer search: every feasible (pp, dp, tp), device order, schedule, micro-batch count and
ZeRO point, priced by the cost model, the best confirmed by the event simulator.

For each choice of degrees the candidates are:
- device orders: rank order (Holmes: a stage is dp * tp consecutive ranks, so stages follow
  clusters and TP groups nodes), with the stages reordered as the partition prefers; and, on
  networks with more than two sites (tp = 1), DT-FM's assignment (`assign.search`);
- micro-batch counts M dividing the global batch with a micro-batch divisible by dp;
- ZeRO factors: AMSP's rule (the valid point with the least communication whose split fits
  memory), or the named / given point;
- the layer split: `partition.best_split`, exact for the pipeline-time estimate.
Each candidate gets the closed-form estimate and a lower bound that no schedule beats;
candidates are simulated best estimate first, and a candidate is skipped once its lower bound
cannot enter the top `top`. The result is the best Plan (with its prediction) and the
runners-up. Requests that nothing satisfies raise a PlanError naming the binding constraint
and the nearest feasible change.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from hetjax.errors import PlanError
from hetjax.core.plan import (UNUSED_KEY, Plan, ZeroFactors, batch_split_problem, even_split,
                              name_problems, placement_problem, raise_first, stage_shape_problem)
from hetjax.planner import assign, partition, zero_factors as zr
from hetjax.planner.cost import (PLAN_EXECUTORS, CostModel, CostOptions, SharedPrices, StageCost,
                                 runs_schedule)
from hetjax.planner.layout import Layout
from hetjax.planner.network import MissingLinkError
from hetjax.planner.placement import placement_problems
from hetjax.planner.simulate import (chain, closed_form, folded_ticks, in_flight,
                                     lockstep_ticks, lower_bound)
from hetjax.core.topology import Topology
from hetjax.core.schedules import SCHEDULES, spmd_schedules

if TYPE_CHECKING:
    from hetjax.core.model_config import ModelConfig

GIB = 2.0 ** 30
# ZeRO points priced per layout during the search (least traffic first); the winning layout
# then has all of them priced (every point's best split costs a partition search).
ZERO_POINTS_PRICED = 3
# A choice must be predicted this much faster to beat a simpler one (less traffic, fewer
# micro-batches): the cost model does not resolve smaller differences.
TIE = 0.01


@dataclass(frozen=True)
class PlanResult:
    """The chosen Plan (with `predicted`), the runners-up, and what the search did."""

    plan: Plan
    runners_up: tuple[Plan, ...]
    candidates: int  # layouts priced by the cost model
    simulated: int  # of which the event simulator ran
    seconds: float
    pruned: int = 0  # layouts skipped: their step floor could not enter the top

    def describe(self, topology: Topology | None = None) -> str:
        lines = [self.plan.describe(topology), *bound_lines(self.plan), "runners-up:"]
        for p in self.runners_up:
            lines.append(f"  {_summary(p)}")
        skipped = f", {self.pruned} skipped by their lower bound" if self.pruned else ""
        lines.append(f"searched {self.candidates} layouts ({self.simulated} simulated{skipped}) "
                     f"in {self.seconds:.2f} s")
        return "\n".join(lines)


def bound_lines(p: Plan) -> list[str]:
    """What bound each choice the planner made freely (memory or time), one line each."""
    bound = p.predicted.get("bound", {})
    return ["what bound each choice:"] + [f"  {what}: {why}" for what, why in bound.items()] \
        if bound else []


def _summary(p: Plan) -> str:
    pr = p.predicted
    extra = (f" {p.placement}" if p.placement != "looped" else "") + \
        (f" remat={p.remat}" if p.remat else "")
    return (f"pp={p.pp} dp={p.dp} tp={p.tp} {p.schedule}{extra} M={p.microbatches} "
            f"zero={p.zero.name} layers={list(p.stage_layers)} "
            f"step {pr.get('step_time_s', float('nan')):.4g} s, "
            f"{pr.get('tokens_per_s', float('nan')):,.0f} tok/s")


@dataclass(frozen=True)
class _Candidate:
    estimate: float
    bound: float
    layout: Layout
    layers: tuple[int, ...]
    tag: str


def fits_schedule(name: str, pp: int, microbatches: int, executor: str,
                  first: str = "") -> bool:
    """Whether a pipeline of pp stages with this many micro-batches can use the schedule under
    the executor. A single stage runs every schedule as plain accumulation: it is priced once
    per tick-grid schedule (as always), or once if `first`, the first schedule asked for."""
    if pp == 1:
        return SCHEDULES[name].spmd_compatible or name == first
    try:
        SCHEDULES[name].check(pp, microbatches)
    except ValueError:
        return False
    return runs_schedule(executor, name)


@dataclass
class _Shortfall:
    """The closest a layout came to fitting memory (for the error message)."""

    ratio: float = math.inf
    text: str = ""


def _schedule_runs(schedule: str, pp: int, microbatches: int) -> bool:
    """Whether `schedule` can run `microbatches` on `pp` stages (the interleaved schedule
    needs a multiple of pp): the alternatives `explain` weighs must be runnable."""
    from hetjax.planner.simulate import in_flight

    try:
        in_flight(schedule, pp, microbatches)
    except PlanError:
        return False
    return True


def plan(topology: Topology, model: "ModelConfig", global_batch: int, seq_len: int, *,
         pp: int = 0, dp: int = 0, tp: int = 0, microbatches: int = 0,
         schedule: str | Sequence[str] = SCHEDULES, zero: str | ZeroFactors = "auto",
         stage_layers: Sequence[int] = (), options: CostOptions | None = None, top: int = 5,
         allow_straddle: bool = False, network_aware: bool | None = None,
         assign_seconds: float = 10.0, calibration=None, placement: str = "looped",
         prune: bool = True, distinct: bool = False, subsets: bool = False,
         stage_degrees: bool = False, ceiling: float = math.inf, ep: int = 1,
         shared: SharedPrices | None = None) -> PlanResult:
    """The best feasible Plan for training `model` on `topology` with `global_batch`
    sequences of `seq_len` tokens per step, and the runners-up.

    Degrees, micro-batches, schedule, ZeRO point and stage layers given here are fixed (0 or
    "auto": the planner chooses). `network_aware` adds DT-FM's device assignment as a
    candidate (default: when the topology has more than two sites). `calibration`: a
    `hetjax calibrate` file (path) or `Calibration`, whose measurements replace the
    options' compute efficiency and link speeds.

    `placement` (Plan.placement) fixes where model chunks live, or "auto" prices looped and
    folded (folded only under hetjax's executor in lockstep, for pp > 1). With
    `model.remat` = 'auto' the recompute policy is a choice too: none, dots and full are
    priced and the fastest that fits memory wins (Plan.remat); hetjax's SPMD pipeline is
    offered full alone (`CostModel.remat_choices`).

    `prune` skips layouts whose `CostModel.step_floor` is no better than the top-th step time
    simulated for a few promising layouts first: their candidates could not enter the top, so
    the plan and runners-up are those of the exhaustive search (`prune=False`), found faster.

    `distinct`: the runners-up are the best plans of other layouts (`layout_key`: degrees,
    devices), not the chosen layout with another micro-batch count, schedule or
    ZeRO point.

    `subsets`: the devices used are a choice too (`device_subsets`: whole clusters left out
    when that prices faster; a smaller set is searched for a plan better than the best so far,
    so the runners-up of a smaller set beat that too); the plan's `predicted["unused"]` says
    why each idle device is idle. `stage_degrees`: under an executor that runs them (MPMD),
    stages may differ in (dp, tp) where clusters differ in their nodes (each cluster's stages
    one shape, `stage_shape_layouts`; their model states replicated). `ceiling`: a step time
    found elsewhere that the top must beat: layouts whose floor reaches it are skipped, and
    `BelowNothing` is raised when nothing is left.

    `ep`: an MoE model's expert-parallel degree; 0 prices every divisor of n_experts that
    divides dp and keeps its groups inside a node or an InfiniBand cluster (the placement
    rule), each with its all-to-alls on the links it crosses and its experts' memory.

    `shared`: prices shared with the searches of other subsets of one topology
    (`SharedPrices`; the device subsets' searches share one)."""
    if calibration is not None:  # (before the subsets: their plans are re-priced with it)
        from hetjax.planner.calibrate import load_calibration

        cal = load_calibration(calibration) if isinstance(calibration, str) else calibration
        options = cal.options(options)
    if subsets:
        return _plan_subsets(topology, model, global_batch, seq_len, ceiling, pp=pp, dp=dp, tp=tp,
                             microbatches=microbatches, schedule=schedule, zero=zero,
                             stage_layers=stage_layers, options=options, top=top,
                             allow_straddle=allow_straddle, network_aware=network_aware,
                             assign_seconds=assign_seconds, placement=placement, prune=prune,
                             distinct=distinct, stage_degrees=stage_degrees, ep=ep)
    t0 = time.perf_counter()
    for name, v in (("global_batch", global_batch), ("seq_len", seq_len), ("top", top)):
        if not (isinstance(v, int) and v >= 1):
            raise PlanError(f"{name} must be a positive integer, got {v!r}")
    s = _Search(topology, model, global_batch, seq_len, options or CostOptions(),
                allow_straddle, network_aware, assign_seconds, shared)
    s.distinct = distinct
    s.fixed_layers = bool(stage_layers)
    schedules = (schedule,) if isinstance(schedule, str) else tuple(schedule)
    for name in schedules:
        raise_first(name_problems(schedule=name))
    executor = s.cm.options.executor
    if schedule is SCHEDULES:  # the default: every schedule this executor can run
        schedules = tuple(n for n in schedules if runs_schedule(executor, n))
    elif not any(runs_schedule(executor, n) for n in schedules) and pp != 1:
        raise PlanError(f"the {executor} executor cannot run schedule {schedules[0]!r}; use the "
                        f"mpmd executor or one of {', '.join(spmd_schedules())}")
    def remats(pp):  # model.remat 'auto': a choice among what the cost model can price
        return s.cm.remat_choices(pp) if model.remat == "auto" else ("",)

    todo = []  # (layout, stage orders, tag) in the order the search has always priced them
    for p, d, t in s.degrees(pp, dp, tp, stage_layers):
        places = s.placements(placement, p)
        for order, orders, tag in s.layouts(p, d, t):
            for M in s.microbatch_counts(d, microbatches):
                for name, place, remat, e in itertools.product(
                        schedules, places, remats(p), s.ep_degrees(p, d, t, order, ep)):
                    if not fits_schedule(name, p, M, executor, schedules[0]) or (
                            placement_problem(place, name)):
                        continue
                    todo.append((Layout(pp=p, dp=d, tp=t, device_order=order, microbatches=M,
                                        global_batch=global_batch, seq_len=seq_len, schedule=name,
                                        placement=place, remat=remat, ep=e), orders, tag))
    if stage_degrees and not (pp or dp or tp or stage_layers) and stage_shape_problem(
            {v: k for k, v in PLAN_EXECUTORS.items()}.get(executor, ""), 0, 0) is None:
        for shapes, order in stage_shape_layouts(topology, model):  # each cluster its own
            P, dps = len(shapes), {d for d, _ in shapes}
            for M in s.microbatch_counts(math.lcm(*dps), microbatches):
                for name, remat in itertools.product(schedules, remats(P)):
                    if fits_schedule(name, P, M, executor, schedules[0]):
                        todo.append((Layout(
                            pp=P, dp=shapes[0][0], tp=shapes[0][1], stage_shapes=shapes,
                            device_order=order, microbatches=M, global_batch=global_batch,
                            seq_len=seq_len, schedule=name, remat=remat), None,
                            "per-stage degrees"))
    floors = [s.cm.step_floor(lay) for lay, _, _ in todo]
    if not (floors and min(floors) < ceiling):
        if todo:  # a better plan was found elsewhere
            raise BelowNothing(f"no layout of {topology.name!r} can beat {ceiling:.4g} s")
    skipped = {i for i, floor in enumerate(floors) if floor >= ceiling}
    if prune and todo and min(floors) < ceiling:
        ceiling, skipped = s.explore(todo, floors, zero, tuple(stage_layers), top, ceiling)
    cands, broken = [], set()
    for i, (lay, orders, tag) in enumerate(todo):
        if i in skipped:
            s.pruned += 1  # no candidate of this layout can enter the top
            continue
        key = (lay.pp, lay.dp, lay.tp, lay.device_order, lay.microbatches)
        if key in broken:
            continue
        c, notes = s.probed.pop(i, None) or s.evaluate_noted(lay, orders, tag, zero,
                                                             tuple(stage_layers))
        s.replay(notes)  # in the search's order, so messages and counts are as exhaustive
        if isinstance(c, MissingLinkError):
            s.rejected.append(f"pp={lay.pp} dp={lay.dp} tp={lay.tp} ({tag}): {c}")
            broken.add(key)
        elif c is not None:
            cands.append(c)
    if not cands:
        if s.pruned and ceiling < math.inf:
            raise BelowNothing(f"no layout of {topology.name!r} can beat {ceiling:.4g} s")
        raise s.infeasible()
    ranked = s.confirm(cands, top)
    best = ranked[0]
    if zero == "auto":  # every ZeRO point on the winning layout, by predicted step time
        lay = dataclasses.replace(Layout.of(best), zero=ZeroFactors())
        tag = best.predicted.get("layout", "")
        keep_order = [tuple(range(best.pp))] if tag == "DT-FM assignment" else None
        c = s.evaluate(lay, keep_order, tag, zero, tuple(stage_layers), limit=math.inf)
        if c is not None and c.layout.zero != best.zero:
            alt = s.confirm([c], 1)[0]
            if alt.predicted["step_time_s"] < best.predicted["step_time_s"] * (1 - TIE):
                ranked = [alt] + [p for p in ranked if p != alt and not (
                    distinct and layout_key(p) == layout_key(alt))][:top - 1]
                best = alt
    free = {}
    if zero == "auto" and best.uniform:  # (stages of different dp: replicated states only)
        free["zero"] = [dataclasses.replace(Layout.of(best), zero=f)
                        for f in zr.space(s.dp_nodes(Layout.of(best)))
                        if f != best.zero]
    if not microbatches:
        free["microbatches"] = [dataclasses.replace(Layout.of(best), microbatches=M)
                                for M in s.microbatch_counts(
                                    math.lcm(*(d for d, _ in best.shapes())), 0)
                                if M != best.microbatches
                                and _schedule_runs(best.schedule, best.pp, M)]
    if len(schedules) > 1 and best.pp > 1:
        free["schedule"] = [dataclasses.replace(Layout.of(best), schedule=n)
                            for n in schedules if n != best.schedule
                            and _schedule_runs(n, best.pp, best.microbatches)]
    places = [n for n in s.placements(placement, best.pp)
              if placement_problem(n, best.schedule) is None and (best.uniform or n == "looped")]
    if len(places) > 1:
        free["placement"] = [dataclasses.replace(Layout.of(best), placement=n)
                             for n in places if n != best.placement]
    if model.is_moe and ep != 1:
        others = [e for e in s.ep_degrees(best.pp, best.dp, best.tp, best.device_order, ep)
                  if e != best.ep]
        if others:
            free["ep"] = [dataclasses.replace(Layout.of(best), ep=e) for e in others]
    if len(remats(best.pp)) > 1:
        free["remat"] = [dataclasses.replace(Layout.of(best), remat=r)
                         for r in remats(best.pp) if r != best.remat]
    free_layout = not (pp and dp and tp)
    bound = s.explain(best, free, len(cands) if free_layout else 0)
    if model.remat == "auto" and len(remats(best.pp)) == 1:
        bound["remat"] = ("executor: the SPMD pipeline recomputes every layer (the model does "
                          "not price its stash copies under none or dots); "
                          "--config.pipeline.executor=mpmd weighs all three")
    ranked[0] = dataclasses.replace(best, predicted={**best.predicted, "bound": bound})
    # the Plan names the executor it was priced for (Megatron's plans keep the default)
    named = {v: k for k, v in PLAN_EXECUTORS.items()}.get(executor)
    plans = [dataclasses.replace(p, source="planner", **({"executor": named} if named else {}))
             for p in ranked]
    return PlanResult(plans[0], tuple(plans[1:]), len(cands), s.simulated,
                      time.perf_counter() - t0, s.pruned)


class BelowNothing(PlanError):
    """No layout of this search can beat the ceiling it was given (a better plan exists)."""


# More clusters than this: the subsets tried are prefixes of the clusters ordered by how well
# they are connected and how fast they are, and each cluster left out alone (not all 2^C).
ALL_SUBSETS_UP_TO = 4


def device_subsets(topology: Topology) -> list[tuple[int, ...]]:
    """The sets of clusters (indices) whose devices a plan may use, every cluster first: all
    connected sets for up to ALL_SUBSETS_UP_TO clusters; beyond, the prefixes of the clusters
    ordered best connected and fastest first, and every cluster left out alone. A cluster's
    nodes are alike, so a subset is whole clusters (leaving a node of a cluster out never
    makes the others faster)."""
    C = len(topology.clusters)
    if C == 1:
        return [(0,)]

    def connected(keep) -> bool:
        seen, todo = {keep[0]}, [keep[0]]
        while todo:
            a = todo.pop()
            for b in keep:
                if b not in seen and topology.has_link(a, b):
                    seen.add(b)
                    todo.append(b)
        return len(seen) == len(keep)

    if C <= ALL_SUBSETS_UP_TO:
        out = [keep for k in range(C, 0, -1) for keep in itertools.combinations(range(C), k)]
    else:
        def best_link(a):
            return max((topology.cluster_link(a, b).bandwidth_gbps for b in range(C)
                        if b != a and topology.has_link(a, b)), default=0.0)

        order = sorted(range(C), key=lambda a: (-best_link(a),
                                                -topology.clusters[a].accelerator.peak_tflops))
        out = [tuple(range(C))] + [tuple(sorted(order[:k])) for k in range(C - 1, 0, -1)]
        out += [tuple(b for b in range(C) if b != a) for a in range(C)]
    return [keep for keep in dict.fromkeys(out) if connected(keep)]


def sub_topology(topology: Topology, keep: Sequence[int]) -> tuple[Topology, list[int]]:
    """The topology of the clusters `keep`, and the rank in `topology` of each of its ranks."""
    if len(keep) == len(topology.clusters):
        return topology, list(range(topology.num_devices))
    gone = [n for i in range(len(topology.clusters)) if i not in keep
            for n in _cluster_nodes(topology, i)]
    ranks = [r for i in keep for r in topology.cluster_ranks(i)]
    return topology.without_nodes(gone), ranks


def _cluster_nodes(topology: Topology, cluster: int) -> range:
    first = sum(c.nodes for c in topology.clusters[:cluster])
    return range(first, first + topology.clusters[cluster].nodes)


def _plan_subsets(topology: Topology, model: "ModelConfig", global_batch: int, seq_len: int,
                  ceiling: float, top: int, options: CostOptions | None, **kw) -> PlanResult:
    """`plan` over the device subsets (`device_subsets`), all devices first: each later
    subset's search skips what cannot beat the best plan found so far; the plans are priced on
    the whole topology (idle devices carry no traffic, so the prices are the subset's), the
    fastest kept, and the plan says why each device it leaves idle is idle."""
    t0 = time.perf_counter()
    options = options or CostOptions()
    cm = CostModel(topology, model, options)
    results, first_error, whole, best_step = [], None, None, math.inf
    everything = tuple(range(len(topology.clusters)))
    # the subsets' cost models price the same clusters: what a stage's structure decides
    # is priced once for all of them
    shared = SharedPrices()
    for keep in device_subsets(topology):
        sub, ranks = sub_topology(topology, keep)
        # DT-FM's assignment (seconds per layout) only on all devices: on a smaller set it
        # would multiply the search's time by the number of sets
        aware = kw.get("network_aware") if keep == everything else False
        try:  # (the exhaustive search, prune=False, searches every subset in full)
            r = plan(sub, model, global_batch, seq_len, top=top, options=options,
                     ceiling=ceiling if kw.get("prune", True) else math.inf,
                     shared=shared, **{**kw, "network_aware": aware})
        except BelowNothing:
            continue
        except PlanError as e:  # e.g. nothing fits: say the whole topology's reason
            first_error = first_error or e
            continue
        r = _on_topology(r, ranks, cm, keep == tuple(range(len(topology.clusters))))
        if results:  # a smaller set is searched for a better plan, not for runners-up: its
            # plans count only when they beat the best so far (as the pruned search finds them)
            beat = [p for p in (r.plan, *r.runners_up) if p.predicted["step_time_s"] < best_step]
            if not beat:
                continue
            r = dataclasses.replace(r, plan=beat[0], runners_up=tuple(beat[1:]))
        whole = r if len(keep) == len(topology.clusters) else whole
        results.append(r)
        best_step = min(p.plan.predicted["step_time_s"] for p in results)
        ceiling = min(ceiling, best_step)
    if not results:
        raise first_error or BelowNothing(f"no plan on {topology.name!r} beats {ceiling:.4g} s")
    ranked = sorted((p for r in results for p in (r.plan, *r.runners_up)),
                    key=lambda p: p.predicted["step_time_s"])
    fastest = ranked[0].predicted["step_time_s"]
    # a simpler plan (all devices, then fewer stages, ...) first when within TIE
    best_r = min(results, key=lambda r: (r.plan.predicted["step_time_s"] > fastest * (1 + TIE),
                                         -len(r.plan.device_order),
                                         r.plan.predicted["step_time_s"]))
    best = best_r.plan
    seen, out = {layout_key(best)}, [best]
    for p in ranked:
        if len(out) < top and (layout_key(p) not in seen or not kw.get("distinct")):
            if p is not best:
                seen.add(layout_key(p))
                out.append(p)
    unused = unused_reasons(topology, best, whole)
    if unused:
        best.predicted[UNUSED_KEY] = unused
    return dataclasses.replace(
        best_r, plan=best, runners_up=tuple(out[1:]),
        candidates=sum(r.candidates for r in results),
        simulated=sum(r.simulated for r in results), pruned=sum(r.pruned for r in results),
        seconds=time.perf_counter() - t0)


def _on_topology(r: PlanResult, ranks: list[int], cm: CostModel, whole: bool) -> PlanResult:
    """A subset's result with its plans on the whole topology's ranks, priced there."""
    if whole:
        return r

    def moved(p: Plan) -> Plan:
        q = dataclasses.replace(p, device_order=tuple(ranks[i] for i in p.device_order),
                                predicted={})
        keep = {k: v for k, v in p.predicted.items() if k in ("layout", "bound")}
        q.predicted.update({**cm.predict(q).as_dict(), **keep})
        return q

    return dataclasses.replace(r, plan=moved(r.plan),
                               runners_up=tuple(moved(p) for p in r.runners_up))


def unused_reasons(topology: Topology, best: Plan, whole: PlanResult | None) -> dict[str, str]:
    """Why `best` leaves each idle device out (rank, as a string for JSON -> why), by
    cluster: the link that joins it to the used ones when slower than theirs, else its
    devices slower or smaller than the used ones', and the best step priced with every
    device (or that no plan with every device fits or could beat it)."""
    used = set(best.device_order)
    if len(used) == topology.num_devices:
        return {}
    used_clusters = sorted({topology.devices[r].cluster for r in used})
    nics = [topology.clusters[c].nic.bandwidth_gbps for c in used_clusters
            if topology.clusters[c].nodes > 1]
    peak = min(topology.clusters[c].accelerator.peak_tflops for c in used_clusters)
    mem = min(topology.clusters[c].accelerator.memory_gib for c in used_clusters)
    step = best.predicted["step_time_s"]
    if whole is None:
        alone = "no plan with every device beats it"
    else:
        alone = ("with every device the best plan is predicted "
                 f"{whole.plan.predicted['step_time_s']:.3g} s")
    out = {}
    for c, cluster in enumerate(topology.clusters):
        if c in used_clusters:
            continue
        links = [topology.cluster_link(c, u) for u in used_clusters if topology.has_link(c, u)]
        link = max(links, key=lambda lk: lk.bandwidth_gbps) if links else None
        acc = cluster.accelerator
        if link is None:
            why = "no link to the devices used"
        elif link.bandwidth_gbps < min(nics, default=link.bandwidth_gbps * 2):
            why = f"behind a {link.bandwidth_gbps:g} Gb/s {link.kind} link"
        elif acc.peak_tflops < peak:
            why = f"slower ({acc.name}: {acc.peak_tflops:g} TFLOP/s against {peak:g})"
        elif acc.memory_gib < mem:
            why = f"smaller ({acc.name}: {acc.memory_gib:g} GiB against {mem:g})"
        else:
            why = "the step is faster without them"
        text = f"{why}; without them {step:.3g} s, {alone}"
        out.update({str(r): text for r in topology.cluster_ranks(c)})
    return out


def stage_shape_layouts(topology: Topology, model: "ModelConfig"
                    ) -> list[tuple[tuple[tuple[int, int], ...], tuple[int, ...]]]:
    """Layouts whose stages differ in (dp, tp), where clusters differ in their nodes
    (accelerator, devices per node or the link inside a node): every cluster split into
    stages of its own (dp, tp) (tp dividing heads, kv heads, d_ff and the cluster's node,
    stages of consecutive ranks, so TP groups stay in a node and stages in the cluster);
    (stage shapes, device order) for each combination whose shapes are not all alike."""
    t, m = topology, model
    kinds = {(c.accelerator, c.devices_per_node, c.intra_node) for c in t.clusters}
    if len(kinds) < 2:
        return []
    per_cluster = []
    for c in t.clusters:
        n, ok = c.num_devices, math.gcd(m.n_heads, m.n_kv_heads, m.d_ff, c.devices_per_node)
        per_cluster.append([(p, n // (p * d), d) for d in _divisors(ok)
                            for p in _divisors(n // d) if p <= m.n_layers])
    out = []
    for choice in itertools.product(*per_cluster):
        shapes = tuple((dp, tp) for p, dp, tp in choice for _ in range(p))
        if len(set(shapes)) > 1 and len(shapes) <= m.n_layers:
            out.append((shapes, tuple(range(t.num_devices))))
    return out


def layout_key(p: "Plan | Layout") -> tuple:
    """What makes two plans different layouts rather than variants of one: the executor of a
    pipeline, the degrees and the set of devices used (not the micro-batch count, schedule,
    placement, ZeRO point, recompute policy or layer split)."""
    executor = getattr(p, "executor", "") if p.pp > 1 else ""
    shapes = getattr(p, "stage_shapes", ()) or ()
    return (executor, p.pp, p.dp, p.tp, tuple(shapes), _device_set(p.device_order))


# id(device order) -> (the order, its set): the search asks for the key of every layout, and
# its layouts share a few orders (one tuple each, copied by reference); the order is kept with
# its set, so its id is not reused while cached
_DEVICE_SETS: dict[int, tuple[tuple[int, ...], frozenset]] = {}


def _device_set(order: tuple[int, ...]) -> frozenset:
    got = _DEVICE_SETS.get(id(order))
    if got is None or got[0] is not order:
        if len(_DEVICE_SETS) >= 256:
            _DEVICE_SETS.clear()
        got = _DEVICE_SETS[id(order)] = (order, frozenset(order))
    return got[1]


def zero_points_by_traffic(topology: Topology, model: "ModelConfig", global_batch: int,
                           seq_len: int, plan_: Plan,
                           options: CostOptions | None = None) -> list[ZeroFactors]:
    """The ZeRO points whose model states can fit `plan_`'s layout at all, least communication
    first (AMSP's own objective; `plan` instead keeps the fastest that fits)."""
    s = _Search(topology, model, global_batch, seq_len, options or CostOptions(), False, False, 0)
    return s.zero_points(Layout.of(plan_), "auto")


class _Search:
    """The state of one search: the cost model, caches, and why candidates were dropped."""

    def __init__(self, topology: Topology, model: "ModelConfig", global_batch: int,
                 seq_len: int, options: CostOptions, allow_straddle: bool,
                 network_aware: bool | None, assign_seconds: float,
                 shared: SharedPrices | None = None):
        _check_connected(topology)
        self.topology, self.model = topology, model
        self.global_batch, self.seq_len = global_batch, seq_len
        self.cm = CostModel(topology, model, options, shared)
        self.allow_straddle = allow_straddle
        many_sites = len(topology.clusters) > 2
        self.network_aware = many_sites if network_aware is None else network_aware
        self.assign_seconds = assign_seconds
        self.simulated = 0
        self.max_capacity = max(c.accelerator.memory_bytes for c in topology.clusters) * \
            options.memory_fraction
        self._zero_cache: dict[tuple, tuple] = {}
        self._nodes_cache: dict[tuple, np.ndarray] = {}
        # (id(device order), pp, dp, tp, stage order) -> (the order, the reordered one)
        self._reordered: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._splits: dict[tuple, partition.Split | None] = {}  # see _fitted
        self.shortfall = _Shortfall()
        self.rejected: list[str] = []
        self.fixed_layers = False
        self.refused_layouts = 0  # layouts no ZeRO point fits, and the fastest of them
        self.refused_best: tuple[float, Layout, float, float] | None = None
        self.pruned = 0
        self.probed: dict[int, tuple] = {}  # layout index -> evaluate_noted's result
        self.distinct = False  # one plan per layout in the top (see `plan`)
        self.key_ceiling: dict[tuple, float] = {}  # distinct: each probed layout's step
        self._predictions: dict[tuple[Layout, tuple[int, ...]], Plan] = {}

    # --- the choices ---------------------------------------------------------------------------
    def placements(self, placement: str, pp: int) -> tuple[str, ...]:
        """The placements to price: the one asked, or for "auto" looped and (pp > 1, hetjax's
        or the MPMD executor) folded."""
        if pp == 1:
            return ("looped",)
        if placement != "auto":
            return (placement,)
        return ("looped", "folded") if self.cm.options.executor != "megatron" else ("looped",)

    def degrees(self, pp: int, dp: int, tp: int, stage_layers: Sequence[int]
                ) -> list[tuple[int, int, int]]:
        """(pp, dp, tp) using every device: tp divides the heads, kv heads, d_ff and the devices
        of every node (a TP group stays in a node); 1 <= pp <= layers."""
        n, m = self.topology.num_devices, self.model
        if stage_layers:
            if pp and pp != len(stage_layers):
                raise PlanError(f"stage_layers {list(stage_layers)} has {len(stage_layers)} "
                                f"stages but pp = {pp}; give pp = {len(stage_layers)}")
            pp = len(stage_layers)
        per_node = math.gcd(*(c.devices_per_node for c in self.topology.clusters))
        tp_ok = math.gcd(m.n_heads, m.n_kv_heads, m.d_ff, per_node,
                         *((m.expert_d_ff, m.shared_expert_d_ff) if m.is_moe else ()))
        if pp > n:
            raise PlanError(
                f"pp = {pp} pipeline stages need at least {pp} devices (one per stage), but "
                f"topology {self.topology.name!r} has {n}; nearest feasible: pp = "
                f"{max(d for d in _divisors(n) if d <= n and d <= m.n_layers)} or add "
                f"{pp - n} devices")
        if pp > m.n_layers:
            raise PlanError(f"pp = {pp} stages for {m.n_layers} layers leaves a stage empty; "
                            f"nearest feasible: pp = {m.n_layers} or fewer")
        if tp and tp_ok % tp:
            raise PlanError(
                f"tp = {tp} must divide n_heads = {m.n_heads}, n_kv_heads = {m.n_kv_heads}, "
                f"d_ff = {m.d_ff} and the {per_node} devices of a node (TP stays in a node); "
                f"nearest feasible: tp in {_divisors(tp_ok)}")
        out = []
        for t in ([tp] if tp else _divisors(tp_ok)):
            for p in ([pp] if pp else [p for p in _divisors(n // t) if p <= m.n_layers]):
                if (n // t) % p:
                    continue
                d = n // (t * p)
                if dp and d != dp:
                    continue
                out.append((p, d, t))
        if not out:
            raise PlanError(
                f"no pp x dp x tp equals the {n} devices of {self.topology.name!r} with "
                f"pp = {pp or 'any'}, dp = {dp or 'any'}, tp = {tp or 'any'}; nearest feasible: "
                f"leave one degree at 0, or choose degrees whose product is {n}")
        return out

    def ep_degrees(self, pp: int, dp: int, tp: int, order, fixed: int) -> list[int]:
        """Expert-parallel degrees to price for an MoE model: `fixed`, or (0) every divisor of
        n_experts dividing dp; those whose groups break the placement rule (EP inside a node or
        an InfiniBand cluster) are refused unless straddling is allowed. [1] for a dense
        model."""
        m = self.model
        if not m.is_moe:
            return [1]
        out = []
        for e in [fixed] if fixed else [e for e in _divisors(m.n_experts) if dp % e == 0]:
            if dp % e:
                self.rejected.append(f"pp={pp} dp={dp} tp={tp}: ep = {e} does not divide dp")
                continue
            probe = Plan(pp=pp, dp=dp, tp=tp, stage_layers=(1,) * pp, microbatches=1,
                         global_batch=dp, seq_len=1, device_order=tuple(order), ep=e)
            bad = [x for x in placement_problems(probe, self.topology)
                   if x.startswith("expert-parallel")]
            if bad and not self.allow_straddle:
                self.rejected.append(f"pp={pp} dp={dp} tp={tp} ep={e}: {bad[0]}")
                continue
            out.append(e)
        return out

    def microbatch_counts(self, dp: int, fixed: int) -> list[int]:
        """M dividing the global batch so that each micro-batch splits evenly over dp."""
        B = self.global_batch
        counts = [M for M in _divisors(B) if batch_split_problem(B, M, dp) is None]
        if fixed:
            counts = [M for M in counts if M == fixed]
        if not counts:
            self.rejected.append(
                f"dp = {dp}: global batch {B} does not split into micro-batches divisible by "
                f"dp{f' with microbatches = {fixed}' if fixed else ''} (make it a multiple "
                f"of {dp * (fixed or 1)})")
        return counts

    def layouts(self, pp: int, dp: int, tp: int
                ) -> list[tuple[tuple[int, ...], list[tuple[int, ...]] | None, str]]:
        """(device order, stage orders the partition may try (None: its default set), tag)."""
        n = self.topology.num_devices
        rank_order = tuple(range(n))
        out = []
        probe = Plan(pp=pp, dp=dp, tp=tp, stage_layers=(1,) * pp, microbatches=1,
                     global_batch=dp, seq_len=1, device_order=rank_order)
        if self.allow_straddle or not placement_problems(probe, self.topology):
            out.append((rank_order, None, "rank order"))
        else:
            self.rejected.append(f"pp={pp} dp={dp} tp={tp}: "
                                 + "; ".join(placement_problems(probe, self.topology)))
        if self.network_aware and tp == 1 and pp > 1 and dp > 1:
            a = self._assignment(pp, dp)
            probe = dataclasses.replace(probe, device_order=a.device_order())
            if self.allow_straddle or not placement_problems(probe, self.topology):
                out.append((a.device_order(), [tuple(range(pp))], "DT-FM assignment"))
        return out

    def _assignment(self, pp: int, dp: int) -> assign.Assignment:
        m, cm = self.model, self.cm
        problem = assign.Problem.from_topology(
            self.topology, pp, dp,
            dp_bytes=m.layer_params * m.n_layers / pp * cm.state_bytes.g,
            pp_bytes=self.global_batch / dp * self.seq_len * m.d_model * cm.act_bytes)
        return assign.search(problem, seconds=self.assign_seconds)

    def zero_points(self, layout: Layout, zero: str | ZeroFactors) -> list[ZeroFactors]:
        """The ZeRO points to try: AMSP's enumeration of the points whose model states can
        fit at all, sorted by AMSP's communication time (so equal step times keep the point
        with less traffic); or the one point asked."""
        if not layout.uniform:  # stages of different dp: replicated states (ddp) only
            ddp = ZeroFactors()
            ok = zero in ("auto", "ddp") or (isinstance(zero, ZeroFactors) and (
                zero.s_p, zero.s_g, zero.s_os) == (1, 1, 1))
            return [ddp] if ok else []
        nodes = self.dp_nodes(layout)
        if isinstance(zero, ZeroFactors):
            zr.check(zero, layout.dp)
            if layout.dp % (zero.s_os * layout.ep):
                raise PlanError(f"ZeRO s_os = {zero.s_os} x ep = {layout.ep} does not divide "
                                f"dp = {layout.dp}: expert-parallel groups sit beside the ZeRO "
                                "sub-groups")
            if {zero.s_p, zero.s_g, zero.s_os} - set(zr.valid_factors(nodes)):
                raise PlanError(f"ZeRO factors {zero} break the node rule on this placement; "
                                f"valid factors: {zr.valid_factors(nodes)}")
            return [zero]
        if zero != "auto":  # a preset over the replicas of the experts (dp / ep of them)
            return [zr.named(zero, layout.dp // layout.ep, zr.node_local_factor(nodes)
                             if layout.ep == 1 else 1)]
        return [f for f, _ in self._auto_points(layout)]

    def _auto_points(self, layout: Layout) -> list[tuple[ZeroFactors, list[zr.ZeroTimes]]]:
        """`zero_points` for zero = "auto" on a layout whose stages share one shape: each point
        whose model states can fit at all, least AMSP communication time first, with its
        terms on each kind of stage (`CostModel.stage_keys`, in the order of their first
        stage); when none fits, the closest is noted."""
        mesh = layout.mesh()
        key = (layout.device_order, layout.pp, layout.dp, layout.tp, layout.ep)
        nodes = self.dp_nodes(layout)
        m, sb = self.model, self.cm.state_bytes
        layer_p = self.cm.layer_params_per_device(layout)
        layers = m.n_layers / layout.pp
        # Necessary for any split: the longest stage holds L = ceil(layers / pp) layers
        # (states and activations), every stage at least one layer's activations.
        L = math.ceil(layers)
        got = self._zero_cache.get(key)  # (one lookup: hashing the order reads every rank)
        if got is None:
            # the points, each one's model states on the longest stage (the key fixes the
            # layer's parameters and L), and its terms on every distinct stage (priced on
            # demand, by the point's index; ZeroFactors hash slower than ints)
            stages = list(dict(zip(self.cm.stage_keys(layout), range(layout.pp))).values())
            space = zr.space(nodes)
            got = self._zero_cache[key] = (
                [np.ascontiguousarray(mesh[s].T) for s in stages], space,
                [zr.step_state_bytes(layer_p, f, sb, self.cm.zero_style) * L for f in space],
                [None] * len(space))
        groups, space, states, terms = got

        def zero_terms(i: int) -> list:
            # priced only for points that can fit memory (most collectives are theirs)
            if terms[i] is None:
                terms[i] = [self.cm.zero_times(space[i], layer_p, g) for g in groups]
            return terms[i]
        live = in_flight(layout.schedule, layout.pp, layout.microbatches)
        act = min(self.cm.activation_bytes_per_token(layout.tp, layout.seq_len,
                                                     layout.remat or None, cpu)
                  for cpu in (True, False)) * layout.tokens_per_device()  # any device's
        acts = max(act * L * min(live), act * max(live))
        need = [x + acts for x in states]
        points = [(max(z.per_step(layers, layout.microbatches) for z in zero_terms(i)), i)
                  for i, f in enumerate(space) if need[i] <= self.max_capacity
                  and layout.dp % (f.s_os * layout.ep) == 0]
        if not points:
            i = min(range(len(space)), key=need.__getitem__)
            f = space[i]
            self._note(need[i] / self.max_capacity, (
                f"pp={layout.pp} dp={layout.dp} tp={layout.tp} zero={f.name} "
                f"M={layout.microbatches} {layout.schedule}: the longest stage's {L} layers "
                f"alone need {need[i] / GIB:.2f} GiB per device (model states "
                f"{(need[i] - acts) / GIB:.2f}, activations {acts / GIB:.2f}) but devices have "
                f"{self.max_capacity / GIB:.2f} GiB usable"))
        return [(space[i], terms[i]) for _, i in sorted(points)]

    def sync_floor(self, layout: Layout, zero: str | ZeroFactors) -> float:
        """A step time no candidate of `layout` beats, for every ZeRO point `evaluate` may
        price: tighter than `CostModel.step_floor` where ZeRO's traffic weighs. On a stage of
        n layers, a layer's micro-batch takes at least f forward and b backward
        (`CostModel.layer_floor`) plus the traffic the window of its compute cannot hide
        (`exposed` hides no more than the window); once a step, the stage leaves exposed at
        least its sync less one micro-batch's backward. So it takes at least n a, with
        a = max(M (f + b), M f + (M - 1) b + sync) + refresh a layer (hetjax's executors
        expose the refresh; in lockstep nothing of the sync hides: a = M (f + b) + sync +
        refresh), each a its least over the points; stages of n_s whole layers, sum N, take
        at least the N-th smallest of the k a_s (`_spread`), plus the shared gradients' sync
        every stage waits for (`CostModel.shared_floor`). 0 where the points are not AMSP's
        enumeration (a fixed or named point, per-stage shapes, expert parallelism) or none
        fits (the search notes why)."""
        if zero != "auto" or not layout.uniform or layout.ep > 1:
            return 0.0
        points = self._auto_points(layout)
        if not points:
            return 0.0
        cm, M = self.cm, layout.microbatches
        lockstep = cm.runs_in_lockstep(layout)
        refresh = cm.options.executor != "megatron"  # Megatron prefetches it (exposed_sync)
        stages = cm.layer_floor(layout)
        per_layer = [math.inf] * len(stages)  # per kind of stage, the least a over the points
        for _, terms in points:
            for i, (x, z) in enumerate(zip(stages, terms)):
                f = x.fwd + max(z.gather - x.fwd_compute, 0.0)
                b = x.bwd + max(z.gather + z.scatter + z.accumulate * (M - 1) / M
                                - x.bwd_compute, 0.0)
                if lockstep:
                    a = M * (f + b) + z.sync + z.refresh
                else:
                    a = max(M * (f + b), M * f + (M - 1) * b + z.sync) + refresh * z.refresh
                per_layer[i] = min(per_layer[i], a)
        return _spread([(a, x.stages) for a, x in zip(per_layer, stages)],
                       self.model.n_layers) + cm.shared_floor(layout)

    def dp_nodes(self, layout: Layout) -> np.ndarray:
        """The node of every member of every DP group ([groups, dp], cached)."""
        key = (layout.device_order, layout.pp, layout.dp, layout.tp)
        got = self._nodes_cache.get(key)  # (one lookup, as in _auto_points)
        if got is None:
            got = self._nodes_cache[key] = self.cm.node_of(
                layout.mesh().transpose(0, 2, 1).reshape(-1, layout.dp))
        return got

    # --- pricing ------------------------------------------------------------------------------
    def evaluate(self, layout: Layout, orders, tag: str, zero: str | ZeroFactors,
                 stage_layers: tuple[int, ...], limit: int = ZERO_POINTS_PRICED
                 ) -> _Candidate | None:
        """Of the first `limit` ZeRO points (in AMSP's order, least traffic first) whose best
        split fits memory, the one with the least predicted step time, priced; None when
        none fits. (`plan` then tries every point on the winning layout.)"""
        best, fitted = None, 0
        for f in self.zero_points(layout, zero):
            cand = self._fitted(dataclasses.replace(layout, zero=f), orders, tag, stage_layers)
            if cand is None:
                continue
            fitted += 1
            if best is None or cand.estimate < best.estimate * (1 - TIE):
                best = cand
            if fitted >= limit:
                break
        if best is None and limit == ZERO_POINTS_PRICED:
            self._note_refused(layout, (self.zero_points(layout, zero) or
                                        [zr.named("zero3", layout.dp, 1)])[0])
        return best

    def _note_refused(self, layout: Layout, f: ZeroFactors) -> None:
        """Remember the fastest layout refused for memory (priced with its even split and
        its least-traffic ZeRO point, memory ignored), for `explain`."""
        lay = dataclasses.replace(layout, zero=f)
        table = self.cm.stage_table(lay)
        worst, need = self._even_need(lay, table)
        est = self._price(lay, even_split(self.model.n_layers, lay.pp), "").estimate
        self.refused_layouts += 1
        if self.refused_best is None or est < self.refused_best[0]:
            self.refused_best = (est, lay, need, table[worst][worst].capacity)

    def _fitted(self, lay: Layout, orders, tag: str, stage_layers: tuple[int, ...]
                ) -> _Candidate | None:
        """`lay` with its best split that fits memory, priced; None when no split fits."""
        table = self.cm.stage_table(lay)
        if stage_layers:
            split = partition.Split(tuple(range(lay.pp)), stage_layers, 0.0)
            if not partition.fits(partition.placed(table, split.order), stage_layers):
                split = None
        else:
            # layouts whose tables are alike (ZeRO points, schedules, device orders whose
            # stages price the same) ask for the same split: memoised on the table's entries
            key = (table.key, lay.microbatches,
                   None if orders is None else tuple(map(tuple, orders)))
            if key not in self._splits:
                self._splits[key] = partition.best_split(table, self.model.n_layers,
                                                         lay.microbatches, orders)
            split = self._splits[key]
        if split is None:
            self._note_shortfall(lay, table)
            return None
        if not lay.uniform:  # the stages move with their shapes
            order = tuple(int(r) for i in split.order for r in lay.stage_mesh(i).ravel())
            lay = dataclasses.replace(lay, stage_shapes=tuple(
                lay.stage_shapes[i] for i in split.order), device_order=order,
                dp=lay.stage_shapes[split.order[0]][0], tp=lay.stage_shapes[split.order[0]][1])
            return self._price(lay, split.layers, tag)
        # the stages reordered; one tuple per (order, stage order), shared by the layouts of
        # every ZeRO point and micro-batch count, so the caches keyed on a device order's
        # identity (meshes, boundaries, shared sync) find it
        key = (id(lay.device_order), lay.pp, lay.dp, lay.tp, split.order)
        got = self._reordered.get(key)
        if got is None or got[0] is not lay.device_order:
            order = (lay.device_order if split.order == tuple(range(lay.pp)) else
                     tuple(lay.mesh()[list(split.order)].ravel().tolist()))
            got = self._reordered[key] = (lay.device_order, order)
        return self._price(dataclasses.replace(lay, device_order=got[1]), split.layers, tag)

    def _price(self, layout: Layout, layers: tuple[int, ...], tag: str) -> _Candidate:
        """The candidate's estimate (the step time played without events: lockstep ticks for
        hetjax's executor in one process, the closed form otherwise) and its lower bound."""
        stages = self.cm.stage_costs(layout)
        send, _ = self.cm.boundary_times(layout)
        M = layout.microbatches
        fwd = [c.fwd(n) for c, n in zip(stages, layers)]
        bwd = [c.bwd(n) for c, n in zip(stages, layers)]
        sync = self.cm.exposed_sync(layout, stages, layers, fwd, bwd)
        if self.cm.runs_in_lockstep(layout) and layout.folded:
            estimate = float(folded_ticks(layout.schedule, M, fwd, bwd, send, send,
                                          self.cm.down_share(stages, layers)).sum())
        elif self.cm.runs_in_lockstep(layout):
            estimate = float(lockstep_ticks(layout.schedule, M, fwd, bwd, send, send).sum())
        else:
            estimate = closed_form(fwd, bwd, M, send)
        fill, drain = chain(layout.schedule, layout.folded)
        bound = lower_bound(fwd, bwd, M, send, send, sync, fill=fill, drain=drain)
        return _Candidate(estimate + max(sync), bound, layout, layers, tag)

    def _even_need(self, layout: Layout, table: Sequence[Sequence[StageCost]]
                   ) -> tuple[int, float]:
        """The stage of the even split that is fullest relative to its capacity, and its
        need in bytes per device."""
        layers = even_split(self.model.n_layers, layout.pp)
        stages = [table[s][s] for s in range(layout.pp)]
        lmax = max(layers)
        worst = max(range(layout.pp),
                    key=lambda s: stages[s].memory(layers[s], lmax) / stages[s].capacity)
        return worst, stages[worst].memory(layers[worst], lmax)

    def _note_shortfall(self, layout: Layout, table: Sequence[Sequence[StageCost]]) -> None:
        """Remember how far the even split of this layout is from fitting."""
        worst, need = self._even_need(layout, table)
        layers = even_split(self.model.n_layers, layout.pp)
        c, n, lmax = table[worst][worst], layers[worst], max(layers)
        slots = lmax if c.padded else n  # (as StageCost.memory counts them)
        self._note(need / c.capacity, (
            f"pp={layout.pp} dp={layout.dp} tp={layout.tp} zero={layout.zero.name} "
            f"M={layout.microbatches} {layout.schedule}: stage {worst} ({c.label}) needs "
            f"{need / GIB:.2f} GiB per device (model states "
            f"{(c.mem_slot - c.stash_slot) * slots / GIB:.2f}, activations "
            f"{(c.mem_layer * n + c.stash_slot * slots + c.stash_fixed) / GIB:.2f}, "
            f"embedding/head/buffers {(c.mem_fixed - c.stash_fixed) / GIB:.2f}) but has "
            f"{c.capacity / GIB:.2f} GiB usable"))

    # --- why the choices were made ---------------------------------------------------------------
    def explain(self, plan: Plan, choices: dict[str, list[Layout]],
                layouts: int = 0) -> dict[str, str]:
        """For each free choice ("zero", "microbatches", "schedule" -> the plan's layout with
        each alternative value), what bound it: "time" when no alternative is predicted
        faster, "memory" when a faster one does not fit (named, with its need). With
        `layouts` (the candidates the search priced), also the layout ("layout": degrees,
        device order, M and schedule) against the layouts no ZeRO point fitted."""
        shortfall, self.shortfall = self.shortfall, _Shortfall()  # keep the search's note
        chosen = self._fitted(Layout.of(plan), None, "", plan.stage_layers
                              if self.fixed_layers else ())
        reasons: dict[str, str] = {}
        if chosen is None:  # cannot happen for a plan the search found; say nothing then
            self.shortfall = shortfall
            return reasons
        for what, alternatives in choices.items():
            fit, refused = 1, []  # the chosen value fits
            for lay in alternatives:
                cand = self._fitted(lay, None, "", plan.stage_layers if self.fixed_layers
                                    else ())
                if cand is not None:
                    fit += 1
                    continue
                table = self.cm.stage_table(lay)
                worst, need = self._even_need(lay, table)
                est = self._price(lay, even_split(self.model.n_layers, lay.pp), "").estimate
                refused.append((est, lay, need, table[worst][worst].capacity))
            faster = [r for r in refused if r[0] < chosen.estimate * (1 - TIE)]
            if faster:
                est, lay, need, cap = min(faster, key=lambda r: r[0])
                value = {"zero": lay.zero.name, "microbatches": f"M={lay.microbatches}",
                         "schedule": lay.schedule, "placement": lay.placement,
                         "remat": f"remat={lay.remat}", "ep": f"ep={lay.ep}"}[what]
                reasons[what] = (
                    f"memory: {value} would be {1 - est / chosen.estimate:.1%} faster but "
                    f"needs {need / GIB:.2f} GiB per device of {cap / GIB:.2f} usable "
                    f"({self.cm.options.memory_fraction:.0%} of memory)")
            else:
                reasons[what] = (f"time: the fastest predicted (within {TIE:.0%}) of the "
                                 f"{fit} that fit memory"
                                 + (f" ({len(refused)} more do not)" if refused else ""))
        if layouts:
            reasons = {"layout": self._layout_reason(chosen.estimate, layouts), **reasons}
        self.shortfall = shortfall
        return reasons

    def _layout_reason(self, estimate: float, layouts: int) -> str:
        best = self.refused_best
        if best is not None and best[0] < estimate * (1 - TIE):
            est, lay, need, cap = best
            extra = (f" {lay.placement}" if lay.placement != "looped" else "") + \
                (f" remat={lay.remat}" if lay.remat else "")
            return (f"memory: pp={lay.pp} dp={lay.dp} tp={lay.tp} M={lay.microbatches} "
                    f"{lay.schedule}{extra} would be {1 - est / estimate:.1%} faster but needs "
                    f"{need / GIB:.2f} GiB per device of {cap / GIB:.2f} usable")
        return (f"time: the fastest predicted (within {TIE:.0%}) of the {layouts} layouts that "
                f"fit memory" + (f" ({self.refused_layouts} more do not)"
                                 if self.refused_layouts else ""))

    def _note(self, ratio: float, text: str) -> None:
        if ratio < self.shortfall.ratio:
            self.shortfall = _Shortfall(ratio, text)

    def explore(self, todo, floors: list[float], zero, stage_layers: tuple[int, ...],
                top: int, ceiling: float) -> tuple[float, set[int]]:
        """Branch and bound over the layouts, lowest floor first: each is evaluated unless its
        floor (or `sync_floor`) reaches the ceiling, the top-th best step simulated so far
        (of distinct layouts with `distinct`: a layout key's best step is also its own
        ceiling, since a candidate no faster cannot improve its layout) or the ceiling given.
        A candidate that could lower the ceiling (while fewer than `top` are simulated, or
        estimated below it) is simulated. The ceiling only falls, so every layout skipped
        could not have entered the top: the plan and runners-up are the exhaustive search's.
        Evaluations are kept in `probed` for the search, which replays their notes in its own
        order. Returns the ceiling and the indices skipped."""
        steps: dict = {}  # layout key (distinct) or candidate -> best simulated step

        def limit() -> float:
            best = heapq.nsmallest(top, steps.values())
            return min(ceiling, best[-1]) if len(best) == top else ceiling

        order = sorted(range(len(todo)), key=floors.__getitem__)
        skipped, broken = set(), set()
        for n, i in enumerate(order):
            lay, orders, tag = todo[i]
            if floors[i] >= limit():  # and so does every later floor
                skipped.update(order[n:])
                break
            key = layout_key(lay)
            bar = min(limit(), self.key_ceiling.get(key, math.inf))
            if floors[i] >= bar or self.sync_floor(lay, zero) >= bar:
                skipped.add(i)
                continue
            link_key = (lay.pp, lay.dp, lay.tp, lay.device_order, lay.microbatches)
            if link_key in broken:  # (the search evaluates these in its own order)
                continue
            self.probed[i] = self.evaluate_noted(lay, orders, tag, zero, stage_layers)
            c = self.probed[i][0]
            if isinstance(c, MissingLinkError):
                broken.add(link_key)
            elif c is not None and (len(steps) < top or c.estimate < bar):
                step = self.simulate(c).predicted["step_time_s"]
                if self.distinct:
                    steps[key] = self.key_ceiling[key] = min(step, steps.get(key, math.inf))
                else:
                    steps[c] = step
        return limit(), skipped

    def evaluate_noted(self, layout: Layout, orders, tag: str, zero,
                       stage_layers: tuple[int, ...]):
        """`evaluate` with what it notes (memory shortfalls, refusals, rejections) kept apart
        for `replay`: (the candidate, None, or the MissingLinkError it raised; the notes)."""
        saved = (self.shortfall, self.rejected, self.refused_layouts, self.refused_best)
        self.shortfall, self.rejected, self.refused_layouts, self.refused_best = (
            _Shortfall(), [], 0, None)
        try:
            try:
                out = self.evaluate(layout, orders, tag, zero, stage_layers)
            except MissingLinkError as e:
                out = e
            return out, (self.shortfall, self.rejected, self.refused_layouts, self.refused_best)
        finally:
            self.shortfall, self.rejected, self.refused_layouts, self.refused_best = saved

    def replay(self, notes) -> None:
        """Add one evaluation's notes to the search's, as if it had just run."""
        shortfall, rejected, refused, best = notes
        if shortfall.ratio < math.inf:
            self._note(shortfall.ratio, shortfall.text)
        self.rejected.extend(rejected)
        self.refused_layouts += refused
        if best is not None and (self.refused_best is None or best[0] < self.refused_best[0]):
            self.refused_best = best

    def simulate(self, c: _Candidate) -> Plan:
        """The candidate's Plan with the event simulator's prediction (each simulated once)."""
        key = (c.layout, c.layers)
        if key not in self._predictions:
            plan = c.layout.with_plan(c.layers)
            plan.predicted.update({**self.cm.predict(plan).as_dict(), "layout": c.tag})
            self.simulated += 1
            self._predictions[key] = plan
        return self._predictions[key]

    def confirm(self, cands: list[_Candidate], top: int) -> list[Plan]:
        """Simulate candidates best estimate first until no lower bound can enter the top.
        Equal step times rank the simpler plan first (fewer stages, micro-batches, shards).
        With `distinct`, the top holds one plan per layout (`layout_key`)."""
        if self.distinct:
            return self._confirm_distinct(cands, top)
        best: list[tuple[float, int, Plan]] = []  # max-heap on step time via negation
        for i, c in enumerate(sorted(cands, key=lambda c: c.estimate)):
            if len(best) >= top and c.bound >= -best[0][0]:
                continue
            plan = self.simulate(c)
            heapq.heappush(best, (-plan.predicted["step_time_s"], -i, plan))
            if len(best) > top:
                heapq.heappop(best)
        fastest = min(-t for t, _, _ in best)

        def rank(entry):
            t, _, p = entry
            return (round(-t / fastest, 9), p.pp, p.microbatches, p.tp, p.zero.s_os, p.zero.s_p)

        return [p for _, _, p in sorted(best, key=rank)]

    def _confirm_distinct(self, cands: list[_Candidate], top: int) -> list[Plan]:
        """`confirm` keeping the best plan of each layout: a candidate whose lower bound is no
        better than the top-th layout's step cannot improve its own layout (already in the
        top, at or below that step) nor bring a new one in."""
        def simpler(p: Plan) -> tuple:
            return (p.pp, p.microbatches, p.tp, p.zero.s_os, p.zero.s_p)

        best: dict[tuple, Plan] = {}
        for c in sorted(cands, key=lambda c: c.estimate):
            if len(best) >= top and c.bound >= max(p.predicted["step_time_s"]
                                                   for p in best.values()):
                continue
            key = layout_key(c.layout)
            old = best.get(key)
            # Its own layout's plan is faster than any step it can have, so the check below
            # would drop it: skip simulating it (the 1e-9 allowing for rounding).
            if old is not None and c.bound * (1 - 1e-9) > \
                    old.predicted["step_time_s"] * (1 + 1e-9):
                continue
            plan = self.simulate(c)
            t = plan.predicted["step_time_s"]
            if old is not None:
                t_old = old.predicted["step_time_s"]
                if t > t_old * (1 + 1e-9) or (t >= t_old * (1 - 1e-9)
                                               and simpler(plan) >= simpler(old)):
                    continue
            best[key] = plan
            if len(best) > top:
                del best[max(best, key=lambda k: best[k].predicted["step_time_s"])]
        fastest = min(p.predicted["step_time_s"] for p in best.values())
        return sorted(best.values(), key=lambda p: (
            round(p.predicted["step_time_s"] / fastest, 9), *simpler(p)))

    def infeasible(self) -> PlanError:
        n = self.topology.num_devices
        if self.shortfall.ratio < math.inf:
            r = self.shortfall.ratio
            fixes = [f"about {math.ceil(r * n)} devices of this kind (x{r:.2f} the memory)"]
            if self.model.remat not in ("full", "auto"):  # 'auto' tried 'full' already
                fixes.append("model.remat='full' (keeps one activation per layer)")
            fixes.append("a smaller train.batch_size or train.seq_len, or more micro-batches")
            return PlanError(
                f"the model does not fit in memory in any layout of {self.topology.name!r}; "
                f"binding constraint: device memory. Closest layout: {self.shortfall.text}. "
                f"Nearest feasible change: {'; or '.join(fixes)}")
        reasons = "; ".join(dict.fromkeys(self.rejected)) or "no candidate layout"
        return PlanError(f"no layout satisfies the request on {self.topology.name!r}: {reasons}")


def _check_connected(topology: Topology) -> None:
    comps = topology.cluster_components()
    if len(comps) > 1:
        main = max(comps, key=len)
        cut = [c for comp in comps if comp is not main for c in comp]
        raise PlanError(
            f"topology {topology.name!r} is not connected: cluster(s) {cut} have no link to "
            f"{main}, so no pipeline or gradient sync can reach them; binding constraint: "
            f"connectivity. Nearest feasible change: add a ClusterLink from {cut[0]!r} to "
            f"{main[0]!r} (or set inter_cluster), or remove {cut}")


def _spread(per_layer: Sequence[tuple[float, int]], layers: int) -> float:
    """The least time the slowest stage can take when `layers` whole layers, at least one a
    stage, are spread over stages that take a_s a layer ((a_s, stages alike) pairs): the
    `layers`-th smallest of the k a_s, k >= 1 (each layer goes where it ends soonest), and
    at least the slowest a_s (no stage is empty)."""
    def placed(t: float) -> int:  # layers that fit by time t (rounding up: a floor)
        return sum(n * math.floor(t / a * (1 + 1e-9)) for a, n in per_layer)

    # the answer is some k a, at least the spread of fractional layers, layers / sum(n / a):
    # per kind, the least k from there with room for every layer
    even = layers / sum(n / a for a, n in per_layer)
    best = math.inf
    for a, _ in per_layer:
        k = max(1, math.ceil(even / a * (1 - 1e-9)))
        while placed(k * a) < layers:
            k += 1
        best = min(best, k * a)
    return max(best, max(a for a, _ in per_layer))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


__all__ = ["PlanResult", "plan", "bound_lines", "layout_key", "zero_points_by_traffic", "TIE",
           "BelowNothing", "device_subsets", "sub_topology", "unused_reasons",
           "stage_shape_layouts"]

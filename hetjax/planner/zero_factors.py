"""ZeRO sharding factors (AMSP, spec/amsp.md): the one owner of their rules -- the named points
(presets), the ordering and node rules, the factors a config asks for on a plan -- and the
space of (s_p, s_g, s_os), the model-state memory formula, the communication terms and the
list of collectives parallel/zero_sharding.py issues (`expected_collectives`, what the HLO audit checks).

Parameters, gradients and optimizer states of a stage are each sharded over s_p, s_g and s_os
of its dp data-parallel devices. hetjax's mesh factors the dp axis into (dp / s_os, s_os / s_p,
s_p) with P innermost, so a valid point has s_p | s_os | dp and s_g in {s_p, s_os}; AMSP's
"fill a node before spanning nodes" rule, checked on the real placement: every block of a
factor's consecutive DP members lies inside one node or consists of whole nodes. Config
validation (hetjax.config), `plan_from_config` and the search all call these rules; parallel/
only executes the point a Plan carries. Collective times come from the cost model
(`hetjax.planner.cost`), passed in as a function, so this module holds only the algebra, for
two ways of running the step:
- "megatron": AMSP's accounting (PyTorch systems): parameters gathered per layer in every
  forward and backward, gradients reduce-scattered per layer, a prefetched layer in memory;
- "hetjax": parallel/zero_sharding.py (JAX even sharding): parameters gathered once per step and kept
  for the step, each micro-batch's gradient reduce-scattered over the G group, after the loop
  a reduce-scatter to the OS shards and an all-reduce across replicas, then the refresh.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from hetjax.errors import ConfigError, PlanError
from hetjax.core.plan import (DP_AXES, Plan, ZeroAxes, ZeroFactors, raise_first,
                         zero_order_problem)  # the ordering rule: the Plan's
from hetjax.core.topology import Topology
from hetjax.core.hlo import Collective as HloCollective
from hetjax.planner.network import unique_rows

NAMED = ("ddp", "zero1", "zero2", "zero3", "mics")
# What config.zero.preset accepts: a named point, 'auto' (AMSP's enumeration by the planner)
# or 'custom' (zero.s_p / s_g / s_os).
CONFIG_PRESETS = NAMED + ("auto", "custom")


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state: parameters, gradients, optimizer states."""

    p: float
    g: float
    os: float


# AMSP's accounting: bf16 parameters and gradients, fp32 master copy + Adam m and v.
MIXED_PRECISION = StateBytes(2, 2, 12)
# hetjax's fp32 default (param_dtype float32): fp32 parameters and gradients, Adam m and v in
# fp32 and no separate master copy. Same 16 bytes in all, split differently over P, G, OS.
FP32 = StateBytes(4, 4, 8)


def state_bytes_for(param_dtype: str) -> StateBytes:
    return FP32 if param_dtype == "float32" else MIXED_PRECISION


def model_state_bytes(params: float, f: ZeroFactors, sb: StateBytes = MIXED_PRECISION) -> float:
    """AMSP's D_ms = P / s_p + G / s_g + OS / s_os for `params` parameters (2/2/12 bytes each
    with mixed precision)."""
    return params * (sb.p / f.s_p + sb.g / f.s_g + sb.os / f.s_os)


def step_state_bytes(params: float, f: ZeroFactors, sb: StateBytes, executor: str) -> float:
    """Model-state bytes held during a step: D_ms, plus the gathered full parameters that
    hetjax keeps for the whole step when they are sharded (s_p > 1)."""
    gathered = params * sb.p if executor == "hetjax" and f.s_p > 1 else 0.0
    return model_state_bytes(params, f, sb) + gathered


def valid_factors(nodes: np.ndarray) -> list[int]:
    """The sharding factors a placement allows, from the node of every member of every DP
    group ([groups, dp], in mesh order): divisors s of dp such that each block of s
    consecutive members lies inside one node or consists of whole nodes (AMSP: fill a node
    before spanning nodes; the rule parallel/zero_sharding.py checks)."""
    dp = nodes.shape[1]
    # each row's nodes relabelled 0, 1, ... in sorted order (np.unique's inverse), all rows at
    # once: large dp worlds have thousands of groups but few patterns
    order = np.argsort(nodes, axis=1, kind="stable")
    ranked = np.take_along_axis(nodes, order, axis=1)
    first = np.zeros_like(ranked)
    first[:, 1:] = ranked[:, 1:] != ranked[:, :-1]
    labels = np.empty_like(ranked)
    np.put_along_axis(labels, order, np.cumsum(first, axis=1), axis=1)
    patterns = {tuple(row) for row in unique_rows(labels).tolist()}
    return [s for s in range(1, dp + 1) if dp % s == 0 and
            all(_fills_nodes(p, s) for p in patterns)]


def _fills_nodes(group: tuple[int, ...], s: int) -> bool:
    """Whether every block of s consecutive members is one node, or holds all of each of its
    nodes' members (a node's first and last member both in the block)."""
    g = np.asarray(group)
    pos = np.arange(len(g))
    first = np.full(g.max() + 1, len(g))
    last = np.zeros(g.max() + 1, dtype=int)
    np.minimum.at(first, g, pos)
    np.maximum.at(last, g, pos)
    blocks = g.reshape(-1, s)
    one_node = (blocks == blocks[:, :1]).all(axis=1)
    whole = (first[g] // s == pos // s) & (last[g] // s == pos // s)
    return bool((one_node[pos // s] | whole).all())


def node_local_factor(nodes: np.ndarray, valid: list[int] | None = None) -> int:
    """MiCS' group: the largest valid factor (of `valid`, default `valid_factors(nodes)`)
    whose blocks all lie inside single nodes."""
    dp = nodes.shape[1]
    return max(s for s in (valid_factors(nodes) if valid is None else valid)
               if (nodes.reshape(len(nodes), dp // s, s) == nodes.reshape(
                   len(nodes), dp // s, s)[..., :1]).all())


def named(name: str, dp: int, node_local: int) -> ZeroFactors:
    """A named point for `dp` data-parallel devices; mics shards everything over the
    `node_local` devices of a group that share a node and replicates across nodes (with the
    whole group on one node it is zero3)."""
    k = node_local
    points = {"ddp": (1, 1, 1), "zero1": (1, 1, dp), "zero2": (1, dp, dp),
              "zero3": (dp, dp, dp), "mics": (k, k, k)}
    if name not in points:
        raise PlanError(f"unknown ZeRO preset {name!r}; choose one of {', '.join(NAMED)} or "
                        "'auto' (AMSP's enumeration)")
    return ZeroFactors(*points[name], name=name)


def check_order(s_p: int, s_g: int, s_os: int) -> None:
    """Raise ConfigError (naming the zero.* field) unless the factors keep the ordering rule.
    Divisibility by dp and the node rules need the plan (`check_factors`)."""
    raise_first([p for p in [zero_order_problem(s_p, s_g, s_os)] if p], ConfigError)


def check(f: ZeroFactors, dp: int) -> None:
    """Raise PlanError unless `f` fits hetjax's mesh for `dp` data-parallel devices."""
    if dp % f.s_os or zero_order_problem(f.s_p, f.s_g, f.s_os):
        raise PlanError(
            f"ZeRO factors (s_p={f.s_p}, s_g={f.s_g}, s_os={f.s_os}) do not fit dp={dp}: "
            f"hetjax needs s_p | s_os | dp and s_g in {{s_p, s_os}}; nearest valid: "
            f"{named('zero1', dp, 1)} or {named('zero3', dp, 1)}")


def space(nodes: np.ndarray) -> list[ZeroFactors]:
    """Every valid (s_p, s_g, s_os) for DP groups placed on `nodes` ([groups, dp])."""
    dp = nodes.shape[1]
    chain = valid_factors(nodes)
    local = node_local_factor(nodes, chain)
    points: dict[tuple[int, int, int], str] = {}
    for n in NAMED:  # the first name wins: mics on one device per node is ddp
        f = named(n, dp, local)
        points.setdefault((f.s_p, f.s_g, f.s_os), n)
    out = []
    for s_os in chain:
        for s_p in chain:
            if s_os % s_p:
                continue
            for s_g in sorted({s_p, s_os}):
                name = points.get((s_p, s_g, s_os), f"amsp({s_p},{s_g},{s_os})")
                out.append(ZeroFactors(s_p, s_g, s_os, name))
    return out


def axis_groups(dp_groups: np.ndarray, f: ZeroFactors, axes: tuple[str, ...]) -> np.ndarray:
    """Rank groups of a collective over the data-parallel mesh `axes` (a subset of DP_AXES),
    from the stage's DP groups [k, dp]: the dp axis is laid out as the mesh factors it,
    ('dp', 'dp_os', 'dp_p') = (dp / s_os, s_os / s_p, s_p) with p innermost. [instances, size]."""
    k, dp = dp_groups.shape
    grid = dp_groups.reshape(k, dp // f.s_os, f.s_os // f.s_p, f.s_p)
    inside = [1 + DP_AXES.index(a) for a in DP_AXES if a in axes]
    outside = [i for i in range(grid.ndim) if i not in inside]
    return grid.transpose(outside + inside).reshape(-1, math.prod(grid.shape[i] for i in inside))


@functools.cache
def axis_pattern(dp: int, s_os: int, s_p: int, axes: tuple[str, ...]
                 ) -> tuple[tuple[int, int], ...]:
    """The (size, stride) in the dp axis of each mesh axis in `axes` that has more than one
    member (`axis_groups`' layout), adjacent ones merged where they are contiguous. Points
    with equal patterns have the same groups: a member's place on an axis of size n and
    stride t is floor(x / t) mod n whatever the other axes are, so the group of position x
    (the positions that differ from x only there) follows from the pattern alone."""
    sizes = dict(zip(DP_AXES, (dp // s_os, s_os // s_p, s_p)))
    strides = dict(zip(DP_AXES, (s_os, s_p, 1)))
    out: list[tuple[int, int]] = []
    for a in DP_AXES:
        if a not in axes or sizes[a] == 1:
            continue
        if out and out[-1][1] == sizes[a] * strides[a]:  # contiguous with the one before
            out[-1] = (out[-1][0] * sizes[a], strides[a])
        else:
            out.append((sizes[a], strides[a]))
    return tuple(out)


def subgroups(dp_groups: np.ndarray, f: ZeroFactors) -> dict[str, np.ndarray]:
    """Rank groups of each ZeRO collective, from the stage's DP groups [k, dp]:
    "p": the s_p devices sharing one parameter shard's gather / scatter;
    "replicas": the dp / s_p devices holding the same P shard (gradient sync);
    "os": the s_os / s_p devices of one OS subgroup inside a P shard (G beyond P, refresh);
    "shard": the s_os devices that together hold one copy of the optimizer states;
    "os_replicas": the dp / s_os devices holding the same OS shard.
    Each value is [instances, size]."""
    return {name: axis_groups(dp_groups, f, ax) for name, ax in SUBGROUP_AXES.items()}


SUBGROUP_AXES = {"p": ("dp_p",), "replicas": ("dp", "dp_os"), "os": ("dp_os",),
                 "shard": ("dp_os", "dp_p"), "os_replicas": ("dp",)}  # see `subgroups`


# --- the collectives of hetjax's ZeRO step: one description, read by the cost model
# (`zero_times`, executor "hetjax") and by the audit of the compiled step (`expected_collectives`)
@dataclass(frozen=True)
class StepCollective:
    """One collective parallel/zero_sharding.py issues for the split parameters of a step: its kind,
    the data-parallel mesh axes of its group (mesh order), the bytes it moves (those of the
    state `of`, "p" or "g", per device, divided by `divisor`) and when it runs: "microbatch"
    (every micro-batch), "sync" (once per step, around the micro-batch loop) or "refresh"
    (after the update)."""

    kind: str
    axes: tuple[str, ...]
    of: str
    divisor: int
    when: str


@functools.cache  # a pure function of the factors, asked once per point and stage priced
def step_collectives(z: ZeroFactors) -> tuple[StepCollective, ...]:
    """AMSP's terms for the JAX even-sharding case (docs/zero.md): T_p's all-gather once per
    step (parameters are gathered before the micro-batch loop) and its reduce-scatter each
    micro-batch, merged with T_g into one reduce-scatter over the G group; T_os0 as a
    reduce-scatter to the OS shard plus an all-reduce across the dp / s_os replicas after the
    loop; T_os1 as an all-gather inside the OS sub-group. A group may have one member (no
    collective runs)."""
    axes = ZeroAxes.of(z)

    def ordered(ax) -> tuple[str, ...]:
        return tuple(a for a in DP_AXES if a in ax)

    return (
        StepCollective("all-gather", ordered(axes.p), "p", 1, "sync"),  # T_p: gather P
        StepCollective("reduce-scatter", ordered(axes.g), "g", 1, "microbatch"),  # T_p + T_g
        StepCollective("reduce-scatter", ordered(set(axes.os) - set(axes.g)), "g", z.s_g,
                       "sync"),  # T_os0: to the OS shards,
        StepCollective("all-reduce", ordered(axes.replica), "g", z.s_os, "sync"),  # then across
        # the replicas, once per step
        StepCollective("all-gather", ordered(set(axes.os) - set(axes.p)), "p", z.s_p,
                       "refresh"),  # T_os1: refresh P inside the OS subgroup
    )


Collective = Callable[[str, float, np.ndarray], float]


@dataclass(frozen=True)
class ZeroTimes:
    """The communication terms for one layer's worth of a stage's parameters, in seconds."""

    gather: float  # all-gather of the P shard, once in each forward and each backward
    scatter: float  # reduce-scatter of each micro-batch's gradient (into P, or into G)
    accumulate: float  # micro-batches 1..M-1: reduce G beyond P (s_g > s_p)
    sync: float  # once per step: the gradient reduction across replicas (and, in hetjax,
    # the parameter gather before the loop)
    refresh: float  # after the update: all-gather of updated parameters in the OS subgroup

    def per_step(self, layers: float, microbatches: int) -> float:
        """AMSP's T_comm = T_p + T_g + T_os0 + T_os1 for `layers` layers and M micro-batches."""
        m = microbatches
        return layers * (m * (2 * self.gather + self.scatter) + (m - 1) * self.accumulate
                         + self.sync + self.refresh)


def zero_times(f: ZeroFactors, p_bytes: float, g_bytes: float, dp_groups: np.ndarray,
               collective: Collective, executor: str = "megatron",
               over: Callable[[str, float, ZeroFactors, tuple[str, ...]], float] | None = None
               ) -> ZeroTimes:
    """The terms for parameters of p_bytes (and gradients of g_bytes) per device.

    `over(op, nbytes, f, axes)` prices one collective over the DP mesh `axes` (default:
    `collective` on `axis_groups(dp_groups, f, axes)`); the cost model passes a memoised one,
    since the points of `space` share most of their groups and byte counts.

    megatron: AMSP's T_p, T_g, T_os0, T_os1, with even sharding (as in JAX) G beyond P a
    reduce-scatter and the refresh an all-gather inside the OS subgroup (spec/amsp.md).
    hetjax: `step_collectives`, what parallel/zero_sharding.py issues: P gathered once per step, G
    reduce-scattered over its group every micro-batch, after the loop a reduce-scatter to the
    OS shards and an all-reduce across the OS replicas, then the refresh."""
    if over is None:
        def over(op, nbytes, f, axes):
            return collective(op, nbytes, axis_groups(dp_groups, f, axes))

    if executor == "hetjax":
        nbytes = {"p": p_bytes, "g": g_bytes}
        times: dict[str, list[float]] = {"microbatch": [], "sync": [], "refresh": []}
        for c in step_collectives(f):
            times[c.when].append(over(c.kind.replace("-", "_"), nbytes[c.of] / c.divisor, f,
                                      c.axes))
        return ZeroTimes(gather=0.0, scatter=sum(times["microbatch"]), accumulate=0.0,
                         sync=sum(times["sync"]), refresh=sum(times["refresh"]))
    axes = SUBGROUP_AXES
    refresh = over("all_gather", p_bytes / f.s_p, f, axes["os"])
    return ZeroTimes(
        gather=over("all_gather", p_bytes, f, axes["p"]),
        scatter=over("reduce_scatter", g_bytes, f, axes["p"]),
        accumulate=(over("reduce_scatter", g_bytes / f.s_p, f, axes["os"])
                    if f.s_g > f.s_p else 0.0),
        sync=over("all_reduce", g_bytes / f.s_p, f, axes["replicas"]),
        refresh=refresh,
    )


# --- the factors of a config on a plan ----------------------------------------------------
def replica_nodes(plan: Plan, topology: Topology) -> np.ndarray:
    """[groups, dp]: the node of each member of each of the plan's data-parallel groups (a
    plan whose stages share one shape; `stage_replica_nodes` is every plan's)."""
    return np.array([[topology.devices[r].global_node for r in g] for g in plan.dp_groups()])


def stage_replica_nodes(plan: Plan, topology: Topology) -> list[np.ndarray]:
    """Per stage, [tp_s, dp_s]: the node of each member of each of its data-parallel groups."""
    return [np.vectorize(lambda r: topology.devices[int(r)].global_node, otypes=[np.int64])(
        plan.stage_mesh(s).T) for s in range(plan.pp)]


def plan_valid_factors(plan: Plan, topology: Topology) -> list[int]:
    """The sharding factors every stage's placement allows (`valid_factors` of each stage)."""
    if plan.uniform:
        return valid_factors(replica_nodes(plan, topology))
    sets = [set(valid_factors(n)) for n in stage_replica_nodes(plan, topology)]
    return sorted(set.intersection(*sets))


def _dp_text(plan: Plan) -> str:
    dps = sorted({d for d, _ in plan.shapes()})
    return f"dp = {dps[0]}" if len(dps) == 1 else f"the stages' dp {dps}"


def check_factors(z: ZeroFactors, plan: Plan, topology: Topology) -> None:
    """Raise ConfigError unless (s_p, s_g, s_os) keeps AMSP's ordering, divisibility and
    node-filling rules for the plan's dp and placement (every stage's, with per-stage
    shapes); the message lists the valid choices."""
    valid = plan_valid_factors(plan, topology)
    dp = _dp_text(plan)
    rule = (f"valid factors for {dp} on {topology.name!r}: {valid} (divisors of dp "
            "whose groups stay inside a node or take whole nodes)")
    for name, s in (("s_p", z.s_p), ("s_g", z.s_g), ("s_os", z.s_os)):
        if s not in valid:
            raise ConfigError(f"zero.{name}", f"{name} = {s} is not usable with {dp}",
                              f"choose from the {rule}")
    check_order(z.s_p, z.s_g, z.s_os)


def factors_from_config(zc, plan: Plan, topology: Topology) -> ZeroFactors:
    """The ZeroFactors the `zero` config section asks for on this plan, checked."""
    if zc.preset == "auto":  # plan_from_config asks the planner's search for these
        raise ConfigError("zero.preset", "'auto' is chosen by the planner's search, not here",
                          "build the plan with hetjax.planner.plan_from_config")
    if zc.preset == "custom":
        z = ZeroFactors(zc.s_p, zc.s_g, zc.s_os, name="custom")
    elif plan.uniform and plan.ep > 1:  # a preset over the replicas of the experts
        z = named(zc.preset, plan.dp // plan.ep, 1)
    elif plan.uniform:
        z = named(zc.preset, plan.dp, node_local_factor(replica_nodes(plan, topology)))
    else:  # per-stage shapes: one point, valid on every stage
        dps = {d for d, _ in plan.shapes()}
        if zc.preset != "ddp" and len(dps) > 1:
            raise ConfigError("zero.preset", f"{zc.preset!r} shards over all of a stage's dp "
                              f"devices, but the stages' dp differ ({sorted(dps)})",
                              "use zero.preset=ddp, or zero.preset=custom with factors that "
                              f"divide every stage's dp: {plan_valid_factors(plan, topology)}")
        valid = plan_valid_factors(plan, topology)
        local = max(s for s in valid if all(
            (n.reshape(len(n), -1, s) == n.reshape(len(n), -1, s)[..., :1]).all()
            for n in stage_replica_nodes(plan, topology)))
        z = named(zc.preset, plan.dp, local)
    check_factors(z, plan, topology)
    return z


# --- the collectives hetjax's ZeRO step issues (what the HLO audit compares with) ------------
def expected_collectives(z: ZeroFactors, dp: int, microbatches: int, split: int,
                         replicated: int) -> list[HloCollective]:
    """The data-parallel collectives one step of parallel/zero_sharding.py `accumulate_gradients` + the
    sharded update issues for point z (`step_collectives`), as the audit of the compiled
    program reads them (hetjax/core/hlo.py), with V in bytes per device (`split` / `replicated`
    from parallel/zero_sharding.py `split_bytes`). Parameters left unsplit are all-reduced over every
    data-parallel device, as plain data parallelism; scalar reductions (loss, gradient norm)
    are left out."""
    sizes = {"dp": dp // z.s_os, "dp_os": z.s_os // z.s_p, "dp_p": z.s_p}
    out = []

    def add(kind, ax, nbytes, count=1, depth=0):
        ax = tuple(a for a in ax if sizes[a] > 1)
        if ax and nbytes:
            out.append(HloCollective(kind, ax, math.prod(sizes[a] for a in ax), nbytes, count,
                                     depth))

    for c in step_collectives(z):
        each = c.when == "microbatch"
        add(c.kind, c.axes, split // c.divisor, microbatches if each else 1, int(each))
    add("all-reduce", DP_AXES, replicated)
    return out

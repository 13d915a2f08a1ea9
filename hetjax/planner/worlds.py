"""Which JAX world runs which pipeline stages: one world per group of stages that share one
cluster fabric and one accelerator kind.

Under the MPMD executor, each such group is its own `jax.distributed` job (a *world*): its own
coordinator and processes, its own stock NCCL environment from its cluster's `nic_settings`
(so data parallelism inside an InfiniBand cluster stays on InfiniBand and inside a RoCE cluster
on RoCE, with no socket fallback), and its own compiled programs for its own accelerator kind.
Stages in different worlds exchange activations, their gradients, the tied embedding's
gradient, the loss and the clipping norm over the bridge (`parallel/bridge.py`).

The rule: a stage's key is the set of clusters its devices lie in (a stage that straddles
clusters is its own fabric) plus their accelerator kinds; stages with equal keys form one
world; worlds are numbered by their first stage. A world owns whole processes: a process
(`hetjax.distributed.process_slots`) whose devices belong to two worlds is an error. A plan
that is not MPMD, or has pp = 1, is one world. A process whose devices the plan leaves out,
all of them, is in no world and is not started (`idle_processes`); the job then runs as
bridged worlds even when there is one (`bridged`). jax-free: the launcher and `hetjax plan` use it
before jax starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetjax.distributed import ProcessSlot, process_slots
from hetjax.errors import PlanError
from hetjax.core.plan import Plan
from hetjax.core.topology import Topology


@dataclass(frozen=True)
class World:
    """World `index`: the pipeline stages it runs, on its clusters' devices, by its processes
    (global process indices, in order; its own process ids are 0..len - 1)."""

    index: int
    stages: tuple[int, ...]
    clusters: tuple[int, ...]
    accelerator: str
    ranks: tuple[int, ...]  # topology ranks of its stages' devices, ascending
    processes: tuple[int, ...]  # global process indices (process_slots order)

    def process_id(self, global_process: int) -> int:
        return self.processes.index(global_process)


def stage_key(plan: Plan, topology: Topology, s: int) -> tuple:
    ranks = plan.stage_ranks(s)
    clusters = tuple(sorted({topology.devices[r].cluster for r in ranks}))
    kinds = tuple(sorted({topology.clusters[c].accelerator.name for c in clusters}))
    return clusters, kinds


def plan_worlds(plan: Plan, topology: Topology,
                slots: tuple[ProcessSlot, ...] | None = None) -> list[World]:
    """The plan's worlds (see the module docstring); `slots` default to one process per
    node."""
    slots = slots or process_slots(topology, topology.num_nodes)
    if plan.executor != "mpmd" or plan.pp == 1:
        groups = {((), ()): list(range(plan.pp))}
    else:
        groups: dict[tuple, list[int]] = {}
        for s in range(plan.pp):
            groups.setdefault(stage_key(plan, topology, s), []).append(s)
    owner = {r: slot.index for slot in slots for r in slot.ranks}
    worlds = []
    for i, stages in enumerate(sorted(groups.values(), key=min)):
        ranks = sorted(r for s in stages for r in plan.stage_ranks(s))
        clusters = tuple(sorted({topology.devices[r].cluster for r in ranks}))
        procs = tuple(sorted({owner[r] for r in ranks}))
        worlds.append(World(i, tuple(stages), clusters, "+".join(sorted(
            {topology.clusters[c].accelerator.name for c in clusters})), tuple(ranks), procs))
    seen: dict[int, int] = {}
    for w in worlds:
        for p in w.processes:
            if p in seen:
                slot = slots[p]
                raise PlanError(
                    f"process {p} (topology nodes {list(slot.nodes)}) runs devices of world "
                    f"{seen[p]} and world {w.index}; a process belongs to one world. Use one "
                    "process per node (the default), or place stages on whole processes")
            seen[p] = w.index
    return worlds


def idle_processes(plan: Plan, slots: tuple[ProcessSlot, ...]) -> list[ProcessSlot]:
    """The processes whose devices the plan leaves out, every one of them: `hetjax launch`
    does not start them (the plan's worlds have none of their ranks)."""
    used = set(plan.device_order)
    return [slot for slot in slots if not used.intersection(slot.ranks)]


def bridged(plan: Plan, worlds: list[World], slots: tuple[ProcessSlot, ...]) -> bool:
    """Whether the job runs as worlds joined by the bridge, each its own jax.distributed job:
    several worlds, or processes left out (a world's job then holds only some of the
    topology's ranks, and only the worlds executor places stages by rank on such a job)."""
    return len(worlds) > 1 or bool(idle_processes(plan, slots))


def idle_problem(plan: Plan, idle: list[ProcessSlot]) -> str | None:
    """Why a plan that leaves whole processes idle cannot run so, or None: only the MPMD
    executor's worlds run on a job without some of the topology's processes."""
    if not idle or (plan.executor == "mpmd" and plan.pp > 1):
        return None
    nodes = sorted(n for slot in idle for n in slot.nodes)
    return (f"the plan uses none of the devices of process(es) {[s.index for s in idle]} "
            f"(topology nodes {nodes}), which would not be started, and only a pipeline under "
            "the MPMD executor runs without them. Fix: set --config.pipeline.executor=mpmd "
            "with parallel.pp >= 2, or let the plan use those nodes (parallel.exclude)")


def bridged_shape_problem(plan: Plan, topology: Topology,
                          slots: tuple[ProcessSlot, ...]) -> str | None:
    """Why a bridged job (`bridged`) cannot run the plan's per-stage (dp, tp) shapes, or None:
    the bridge carries what crosses between stages on different processes position by
    position, so it needs one shape on both sides (the worlds executor's own check, made
    before anything starts)."""
    worlds = plan_worlds(plan, topology, slots)
    if plan.uniform or not bridged(plan, worlds, slots):
        return None
    owner = {r: slot.index for slot in slots for r in slot.ranks}
    holders = {tuple(sorted({owner[r] for r in plan.stage_ranks(s)})) for s in range(plan.pp)}
    if len(holders) == 1:
        return None
    return (f"stages with different (dp, tp) shapes {list(plan.stage_shapes)} sit on "
            f"different processes of a job whose worlds the bridge joins, which needs one "
            "shape on both sides. Fix: give every stage the same parallel.stage_dp and "
            "parallel.stage_tp, or put the stages on the same processes (fewer processes, or "
            "hetjax train in one process)")


def world_of_stage(worlds: list[World], s: int) -> World:
    return next(w for w in worlds if s in w.stages)


def world_lines(plan: Plan, topology: Topology, environment, slots=None) -> list[str]:
    """For `hetjax plan`: each world's stages, clusters, accelerator kind, processes and
    NCCL network, and which stage boundaries cross the bridge (and on which link).
    `environment(world, slot)` is a process's environment (`hetjax.parallel.nic.world_environment`;
    passed in because the planner does not read parallel/'s jax modules)."""
    slots = slots or process_slots(topology, topology.num_nodes)
    worlds = plan_worlds(plan, topology, slots)
    if len(worlds) == 1:
        return [f"worlds: one (all {plan.pp} stages in one jax.distributed job)"]
    lines = [f"worlds: {len(worlds)} (one jax.distributed job each; the bridge between them)"]
    for w in worlds:
        env = environment(w, slots[w.processes[0]])
        names = ",".join(topology.clusters[c].name for c in w.clusters)
        net = env.get("NCCL_NET", "?")
        extra = "".join(f" {k}={env[k]}" for k in ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX")
                        if k in env)
        lines.append(f"  world {w.index}: stages {_span(w.stages)} on {names} "
                     f"({w.accelerator}), {len(w.processes)} process(es), NCCL_NET={net}{extra}")
    for s in range(plan.pp - 1):
        a, b = world_of_stage(worlds, s), world_of_stage(worlds, s + 1)
        if a is not b:
            link = topology.group_link(plan.stage_ranks(s)[:1] + plan.stage_ranks(s + 1)[:1])
            lines.append(f"  bridge: stage {s} (world {a.index}) <-> stage {s + 1} "
                         f"(world {b.index}) over {link.kind}")
    return lines


def _span(xs) -> str:
    xs = list(xs)
    if xs == list(range(xs[0], xs[-1] + 1)) and len(xs) > 1:
        return f"{xs[0]}-{xs[-1]}"
    return ",".join(map(str, xs))


__all__ = ["World", "plan_worlds", "world_of_stage", "world_lines", "stage_key",
           "idle_processes", "bridged", "idle_problem", "bridged_shape_problem"]

"""What a predicted step is made of, and which links and device kinds to ask "what if" about.

`step_breakdown(cost_model, plan)` splits the simulated step into parts that sum to it, by
playing the plan's schedule again with one cost taken away at a time (the same simulator and
stage costs as `CostModel.predict`):
- exposed DP / ZeRO synchronisation: the gradient sync and parameter refresh the step does
  not hide, and the ZeRO gathers and scatters left on each layer's critical path;
- optimizer update (priced only when measured, or with compute "kinds");
- boundary transfers: activations and their gradients between stages;
- tensor-parallel all-reduces;
- expert all-to-alls (MoE under expert parallelism: the token exchanges and the EP group's
  all-reduce of the shared parameters' gradients);
- recompute: the forwards the backward repeats under the plan's recompute policy;
- what is left is the pipeline of pure compute: `compute` (the mean stage's busy time),
  `stage imbalance` (the busiest stage beyond the mean) and `bubble` (the rest: fill, drain,
  and lockstep waiting).
Each part is the step's drop when that cost goes (in the order above), so they sum to the
step exactly; an overlap between two costs is counted in the first.

`what_ifs(topology)` names the slow links (inter-cluster links and the NICs of clusters with
more than one node, slower than the topology's fastest inter-node link or FAST_GBPS) and the
device kinds
slower or smaller than another kind of the topology, each with the topology changed: the link
at the next common rate (`faster_rate`), the kind at the fastest kind's peak or with the
largest kind's memory. The config's planner searches each (hetjax/planner/config_plan.py).
"""

from __future__ import annotations

import dataclasses

from hetjax.core.plan import Plan
from hetjax.core.topology import ClusterLink, Topology
from hetjax.planner.cost import CostModel
from hetjax.planner.layout import Layout
from hetjax.planner.simulate import simulate
from hetjax.units import percent, seconds

# The parts, in the order they are taken away (see the module doc); the last three are the
# pure compute pipeline's.
PARTS = ("exposed DP/ZeRO sync", "optimizer update", "boundary transfers",
         "tensor-parallel all-reduces", "expert all-to-alls", "recompute", "bubble",
         "stage imbalance", "compute")
# Always shown; the others only when the plan has them.
SHOWN = ("compute", "bubble", "stage imbalance", "exposed DP/ZeRO sync", "boundary transfers",
         "recompute")
# A link between nodes slower than this (or than the topology's fastest) is a slow one.
FAST_GBPS = 100.0
# Common link rates in Gb/s (Ethernet and InfiniBand generations): a slow link's what-if.
RATES = (1, 10, 25, 100, 200, 400, 800)


def step_breakdown(cm: CostModel, plan: Plan) -> dict[str, float]:
    """Seconds of `plan`'s predicted step per part (PARTS, summing to the step) on `cm`."""
    layout = Layout.of(plan)
    stages = cm.stage_costs(layout)
    bare = cm.stage_costs(dataclasses.replace(layout, remat="none"))  # no recompute
    send, _ = cm.boundary_times(layout)
    layers, M = plan.stage_layers, plan.microbatches
    lmax = max(layers)
    fwd = [c.fwd(n) for c, n in zip(stages, layers)]
    bwd = [c.bwd(n) for c, n in zip(stages, layers)]
    sync = cm.exposed_sync(layout, stages, layers, fwd, bwd)  # as `CostModel.predict` plays it
    update = [c.update(n, lmax) for c, n in zip(stages, layers)]
    tpf = [c.comm_layer[0] * n for c, n in zip(stages, layers)]
    tpb = [c.comm_layer[1] * n for c, n in zip(stages, layers)]
    zf = [c.comm_layer[2] * n for c, n in zip(stages, layers)]
    zb = [c.comm_layer[3] * n for c, n in zip(stages, layers)]
    af = [c.comm_layer[4] * n for c, n in zip(stages, layers)]
    ab = [c.comm_layer[5] * n for c, n in zip(stages, layers)]
    down = cm.down_share(stages, layers) if layout.folded else ()
    zeros, quiet = [0.0] * plan.pp, [0.0] * len(send)

    def play(f, b, s, y, u) -> float:
        return float(simulate(plan.schedule, M, f, b, s, s, y, 0.0,
                              lockstep=cm.runs_in_lockstep(layout), placement=plan.placement,
                              down_share=down, update=u, events=False).step_time)

    def minus(xs, *parts):
        return [x - sum(p[i] for p in parts) for i, x in enumerate(xs)]

    steps = [play(fwd, bwd, send, sync, update)]
    f1, b1 = minus(fwd, zf), minus(bwd, zb)
    steps.append(play(fwd, bwd, send, zeros, update))  # sync gone
    steps.append(play(f1, b1, send, zeros, update))  # and the per-layer ZeRO traffic
    steps.append(play(f1, b1, send, zeros, zeros))  # and the update
    steps.append(play(f1, b1, quiet, zeros, zeros))  # and the boundaries
    f2, b2 = minus(f1, tpf), minus(b1, tpb)
    steps.append(play(f2, b2, quiet, zeros, zeros))  # and tensor parallelism
    f2, b2 = minus(f2, af), minus(b2, ab)
    steps.append(play(f2, b2, quiet, zeros, zeros))  # and the expert all-to-alls
    # the backward without recompute: the stage costs under remat 'none', communication out
    f3 = [c.fwd(n) - sum(c.comm_layer[0::2]) * n for c, n in zip(bare, layers)]
    b3 = [c.bwd(n) - sum(c.comm_layer[1::2]) * n for c, n in zip(bare, layers)]
    recompute = sum(b - b0 for b, b0 in zip(b2, b3)) > 0
    f3, b3 = (f3, b3) if recompute else (f2, b2)
    steps.append(play(f3, b3, quiet, zeros, zeros))
    busy = [M * (f + b) for f, b in zip(f3, b3)]
    mean, most = sum(busy) / len(busy), max(busy)
    s = steps
    return {"exposed DP/ZeRO sync": s[0] - s[2], "optimizer update": s[2] - s[3],
            "boundary transfers": s[3] - s[4], "tensor-parallel all-reduces": s[4] - s[5],
            "expert all-to-alls": s[5] - s[6], "recompute": s[6] - s[7], "bubble": s[7] - most,
            "stage imbalance": most - mean, "compute": mean}


def breakdown_lines(parts: dict[str, float]) -> list[str]:
    """The breakdown as text: one line per part (SHOWN, and the others when not zero), the
    largest named, and the largest overhead beside compute."""
    step = sum(parts.values())
    shown = [k for k in sorted(parts, key=parts.get, reverse=True)
             if k in SHOWN or abs(parts[k]) > 1e-4 * step]
    largest = max(parts, key=parts.get)
    overheads = {k: v for k, v in parts.items() if k != "compute"}
    worst = max(overheads, key=overheads.get)
    width = max(len(k) for k in shown)
    lines = [f"the predicted step ({seconds(step)}) is made of:"]
    lines += [f"  {k:<{width}}  {seconds(max(parts[k], 0.0)):>9}  {percent(parts[k] / step):>6}"
              + ("  <- largest" if k == largest else "") for k in shown]
    if worst != largest and overheads[worst] > 0:
        lines.append(f"  largest overhead: {worst} ({percent(overheads[worst] / step)} of the "
                     "step)")
    return lines


@dataclasses.dataclass(frozen=True)
class WhatIf:
    """A change to the topology worth pricing: what it says, and the changed topology."""

    label: str
    topology: Topology


def faster_rate(gbps: float) -> float:
    """The next common link rate at least 4x `gbps` (10 -> 100, 25 -> 100, 1 -> 10), or 2x
    beyond the last."""
    return next((r for r in RATES if r >= 4 * gbps), 2 * gbps)


def _rate(gbps: float) -> str:
    return f"{gbps:g} Gb/s"


def what_ifs(topology: Topology) -> list[WhatIf]:
    """The slow links and device kinds of `topology`, each with the topology changed (see the
    module doc), slowest link first."""
    clusters = topology.clusters
    internode = [c.nic for c in clusters if c.nodes > 1]
    pairs = [(a, b) for i, a in enumerate(clusters) for b in clusters[i + 1:]
             if topology.has_link(clusters.index(a), clusters.index(b))]
    internode += [topology.cluster_link(clusters.index(a), clusters.index(b)) for a, b in pairs]
    if not internode:
        return []
    fastest = max(FAST_GBPS, *(lk.bandwidth_gbps for lk in internode))
    out = []

    def faster(link):
        return dataclasses.replace(link, bandwidth_gbps=faster_rate(link.bandwidth_gbps))

    # Links alike (kind and rate) form one what-if, all of them faster at once: a topology of
    # forty sites has 780 site pairs, and each what-if is a search of its own.
    slow = {}
    for a, b in pairs:
        lk = topology.cluster_link(clusters.index(a), clusters.index(b))
        if lk.bandwidth_gbps < fastest:
            slow.setdefault((lk.kind, lk.bandwidth_gbps), []).append((a.name, b.name, lk))
    links = []
    for (kind, gbps), group in slow.items():
        names = {frozenset((a, b)) for a, b, _ in group}
        override = [x for x in topology.cluster_links if frozenset((x.a, x.b)) not in names]
        changed = dataclasses.replace(topology, cluster_links=(
            *override, *(ClusterLink(a, b, faster(lk)) for a, b, lk in group)))
        (a, b, _), n = group[0], len(group)
        which = (f"link between {a} and {b}" if n == 1 else
                 f"links between clusters ({n} pairs, e.g. {a} and {b})")
        links.append((gbps, WhatIf(f"the {_rate(gbps)} {kind} {which} at "
                                   f"{_rate(faster_rate(gbps))}", changed)))
    nics = {}
    for i, c in enumerate(clusters):
        if c.nodes > 1 and c.nic.bandwidth_gbps < fastest:
            nics.setdefault((c.nic.kind, c.nic.bandwidth_gbps), []).append(i)
    for (kind, gbps), group in nics.items():
        changed = dataclasses.replace(topology, clusters=tuple(
            dataclasses.replace(x, nic=faster(x.nic)) if j in group else x
            for j, x in enumerate(clusters)))
        names = (f"NIC of {clusters[group[0]].name}" if len(group) == 1 else
                 f"NICs of {len(group)} clusters (e.g. {clusters[group[0]].name})")
        links.append((gbps, WhatIf(f"the {_rate(gbps)} {kind} {names} at "
                                   f"{_rate(faster_rate(gbps))}", changed)))
    out += [w for _, w in sorted(links, key=lambda x: x[0])]
    kinds = {c.accelerator.name: c.accelerator for c in clusters}
    if len(kinds) > 1:
        peak = max(a.peak_tflops for a in kinds.values())
        memory = max(a.memory_gib for a in kinds.values())
        for name, acc in kinds.items():
            count = sum(c.num_devices for c in clusters if c.accelerator.name == name)
            for field, value, text in (
                    ("peak_tflops", peak, f"at {peak:g} TFLOP/s"),
                    ("memory_gib", memory, f"with {memory:g} GiB")):
                if getattr(acc, field) < value:
                    better = dataclasses.replace(acc, **{field: value})
                    changed = dataclasses.replace(topology, clusters=tuple(
                        dataclasses.replace(c, accelerator=better)
                        if c.accelerator.name == name else c for c in clusters))
                    out.append(WhatIf(f"the {count} {name} devices {text}", changed))
    return out


__all__ = ["PARTS", "step_breakdown", "breakdown_lines", "WhatIf", "what_ifs", "faster_rate"]

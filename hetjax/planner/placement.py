"""Placement rules: where the groups of a Plan may sit on a Topology (Holmes' group rule).

Ranks are ordered cluster -> node -> device, and the mesh is the plan's device order reshaped
to (pp, dp, tp): a TP group is `tp` consecutive ranks (one node), a stage is `dp * tp`
consecutive ranks (one cluster when the sizes allow), and pipeline groups stride across
stages. Three rules follow, owned here and applied by the planner's search, by
`plan_from_config` (so `hetjax plan` and `hetjax train` refuse the same layouts) and by the
Trainer: a TP group must not straddle a node, a stage must not straddle a cluster, and an
expert-parallel group (four all-to-alls per MoE layer per micro-batch) must stay inside an
island of fast links -- a node, or a cluster whose nodes are joined by InfiniBand -- rather than
cross RoCE, Ethernet or a link between clusters -- unless the user sets
parallel.allow_straddle, in which case `check_placement` warns with the link that traffic will
use.
"""

from __future__ import annotations

import warnings

import numpy as np

from hetjax.errors import PlanError
from hetjax.core.plan import Plan
from hetjax.core.topology import Topology

# Links an expert-parallel group may cross: inside a node, or InfiniBand between the nodes of a
# cluster. Anything slower (RoCE, Ethernet, the links between clusters) is left to pipeline,
# data parallelism and DiLoCo, whose traffic is far less per layer.
EP_ISLAND_LINKS = ("loopback", "nvlink", "pcie", "infiniband")


def placement_problems(plan: Plan, topology: Topology) -> list[str]:
    """Human-readable reasons this plan breaks the placement rules ([] if it keeps them)."""
    problems = []
    node, cluster = _rank_places(topology)
    order, meshes, start = np.asarray(plan.device_order), [], 0
    for dp, tp in plan.shapes():  # each stage's (dp_s, tp_s) ranks, as Plan.stage_mesh
        meshes.append(order[start:start + dp * tp].reshape(dp, tp))
        start += dp * tp
    for mesh in meshes:  # the first TP group (a mesh row) on more than one node
        nodes = node[mesh]
        spans = np.flatnonzero((nodes != nodes[:, :1]).any(axis=1))
        if len(spans):
            g = mesh[spans[0]].tolist()
            problems.append(f"TP group {g} spans {len(set(nodes[spans[0]].tolist()))} nodes, "
                            f"so every layer's all-reduce crosses {topology.group_link(g).kind}")
            break
    # With fewer stages than clusters some stage must span clusters (check_placement notes
    # it); otherwise every stage has to fit in one, whatever the cluster sizes.
    if plan.pp >= len(topology.clusters):
        for s, mesh in enumerate(meshes):
            clusters = np.unique(cluster[mesh])
            if len(clusters) > 1:
                problems.append(f"stage {s} spans clusters "
                                f"{sorted(topology.clusters[c].name for c in clusters.tolist())}"
                                f", so its DP reduction crosses "
                                f"{topology.group_link(plan.stage_ranks(s)).kind}")
                break
    if plan.ep > 1:
        for g in plan.ep_groups():
            kind = topology.group_link(g).kind
            if kind not in EP_ISLAND_LINKS:
                problems.append(f"expert-parallel group {g} crosses {kind}, so every MoE "
                                f"layer's four all-to-alls per micro-batch cross it (keep ep "
                                f"<= the devices joined by {'/'.join(EP_ISLAND_LINKS[1:])})")
                break
    return problems


# id(topology) -> (the topology, the node and the cluster of each rank): the search checks the
# groups of every layout it builds on one topology (kept with the arrays, so its id is not
# reused while cached)
_PLACES: dict[int, tuple[Topology, np.ndarray, np.ndarray]] = {}


def _rank_places(topology: Topology) -> tuple[np.ndarray, np.ndarray]:
    got = _PLACES.get(id(topology))
    if got is None or got[0] is not topology:
        if len(_PLACES) >= 16:
            _PLACES.clear()
        devices = topology.devices
        got = _PLACES[id(topology)] = (topology, np.array([d.global_node for d in devices]),
                                       np.array([d.cluster for d in devices]))
    return got[1], got[2]


def refuse_straddle(problems: list[str]) -> None:
    """Raise the PlanError for placement problems (the one message train and plan give)."""
    if problems:
        ep = any(p.startswith("expert-parallel") for p in problems)
        raise PlanError("the layout breaks hetjax's placement rules: " + "; ".join(problems) +
                        ". Fix: choose tp <= devices per node and pp so each stage fits in a "
                        "cluster, " + ("ep so each expert-parallel group fits in a node or an "
                                       "InfiniBand cluster, " if ep else "")
                        + "or set --config.parallel.allow_straddle=True to accept it.")


def check_placement(plan: Plan, topology: Topology, allow_straddle: bool = False,
                    sites: bool = False) -> list[str]:
    """Raise PlanError for a TP group across nodes or a stage across clusters.

    With `allow_straddle`, warn instead. Also returns notes on unavoidable crossings (pp = 1
    on a multi-cluster topology puts DP across clusters), except under DiLoCo (`sites`), where
    sites exchange across clusters by design and each trains pp = 1 inside its own.
    """
    problems = placement_problems(plan, topology)
    if not allow_straddle:
        refuse_straddle(problems)
    for p in problems:
        warnings.warn(f"hetjax: allowed by parallel.allow_straddle: {p}", stacklevel=2)
    notes = list(problems)
    if plan.pp < len(topology.clusters) and len(topology.clusters) > 1 and not sites:
        crossing = [g for g in plan.dp_groups()
                    if len({topology.devices[r].cluster for r in g}) > 1]
        if crossing:
            notes.append(f"{len(crossing)} DP groups span clusters and reduce gradients over "
                         f"{topology.group_link(crossing[0]).kind}; pp >= "
                         f"{len(topology.clusters)} would keep them inside one cluster")
    return notes

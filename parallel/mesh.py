"""Plan + Topology -> `jax.sharding.Mesh` with axes ('pp', 'dp', 'dp_os', 'dp_p', 'tp').

Axes run slowest first. The data-parallel devices of a stage are factored into three sub-axes
for ZeRO sharding (AMSP): 'dp' (replicas), 'dp_os' and 'dp_p', with sizes
dp / s_os, s_os / s_p and s_p. Parameters shard over 'dp_p', optimizer states over
('dp_p', 'dp_os') -- 'dp_p' major -- so every optimizer-state shard lies inside its device's
parameter shard (parallel/zero.py).
Anything that means "all data-parallel devices" uses `DP_AXES`. With plain data parallelism
the two sub-axes have size 1.

Ranks are ordered cluster -> node -> device, and the mesh is the plan's device order reshaped
to (pp, dp, tp), which is Holmes' group rule: a TP group is `tp` consecutive ranks (one node),
a stage is `dp * tp` consecutive ranks (one cluster when the sizes allow), and pipeline groups
stride across stages. `check_placement` refuses a layout that would put a TP group across
nodes or a stage across clusters, unless the user asked for it, in which case it warns with
the link that traffic will use.

The dp and tp axes are `AxisType.Auto`: Flax modules do not pass `out_sharding` to their
contractions, which Explicit axes demand, so the compiler places activations from the logical
constraints instead. The pipeline makes 'pp' manual with shard_map.
"""

from __future__ import annotations

import warnings

import numpy as np

from hetjax.errors import PlanError
from hetjax.plan import Plan
from hetjax.topology import Topology

AXES = ("pp", "dp", "dp_os", "dp_p", "tp")
DP_AXES = ("dp", "dp_os", "dp_p")


def mesh_shape(plan: Plan) -> tuple[int, ...]:
    """Sizes of AXES for a plan: (pp, dp / s_os, s_os / s_p, s_p, tp)."""
    z = plan.zero
    if plan.dp % z.s_os or z.s_os % z.s_p:
        raise PlanError(f"ZeRO factors s_p={z.s_p}, s_os={z.s_os} must divide each other and "
                        f"dp={plan.dp} (s_p | s_os | dp)")
    return (plan.pp, plan.dp // z.s_os, z.s_os // z.s_p, z.s_p, plan.tp)


def build_mesh(plan: Plan, topology: Topology, devices=None):
    """The mesh for `plan`: devices[plan.mesh_ranks()], dp factored into its ZeRO sub-axes."""
    from jax.sharding import AxisType, Mesh

    if devices is None:
        devices = topology.jax_devices()
    if len(devices) != plan.num_devices:
        raise PlanError(f"plan uses {plan.num_devices} devices but {len(devices)} were given")
    arr = np.empty(plan.num_devices, dtype=object)
    arr[:] = list(devices)
    grid = arr[plan.mesh_ranks()].reshape(mesh_shape(plan))
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


# --- Holmes' group formulas (1-indexed ranks, as in the paper) ------------------------------
def holmes_tp_group(i: int, t: int, d: int, p: int) -> list[int]:
    """TP group i (1..p*d): ranks (i-1)*t + j, j = 1..t."""
    return [(i - 1) * t + j for j in range(1, t + 1)]


def holmes_pp_group(i: int, t: int, d: int, p: int) -> list[int]:
    """PP group i (1..t*d): ranks i + (j-1)*t*d, j = 1..p."""
    return [i + (j - 1) * t * d for j in range(1, p + 1)]


def holmes_dp_group(i: int, t: int, d: int, p: int) -> list[int]:
    """DP group i (1..p*t): ranks ((i-1) mod t) + (floor((i-1)/t)*d + j - 1)*t + 1, j = 1..d."""
    return [((i - 1) % t) + ((i - 1) // t * d + j - 1) * t + 1 for j in range(1, d + 1)]


# --- placement rules ---------------------------------------------------------------------------
def placement_problems(plan: Plan, topology: Topology) -> list[str]:
    """Human-readable reasons this plan breaks the placement rules ([] if it keeps them)."""
    problems = []
    for g in plan.tp_groups():
        nodes = {topology.devices[r].global_node for r in g}
        if len(nodes) > 1:
            problems.append(f"TP group {g} spans {len(nodes)} nodes, so every layer's "
                            f"all-reduce crosses {topology.group_link(g).kind}")
            break
    # With fewer stages than clusters some stage must span clusters (check_placement notes
    # it); otherwise every stage has to fit in one, whatever the cluster sizes.
    if plan.pp >= len(topology.clusters):
        for s in range(plan.pp):
            ranks = plan.stage_ranks(s)
            clusters = {topology.devices[r].cluster for r in ranks}
            if len(clusters) > 1:
                problems.append(f"stage {s} spans clusters "
                                f"{sorted(topology.clusters[c].name for c in clusters)}, so its "
                                f"DP reduction crosses {topology.group_link(ranks).kind}")
                break
    return problems


def check_placement(plan: Plan, topology: Topology, allow_straddle: bool = False) -> list[str]:
    """Raise PlanError for a TP group across nodes or a stage across clusters.

    With `allow_straddle`, warn instead. Also returns notes on unavoidable crossings (pp = 1
    on a multi-cluster topology puts DP across clusters).
    """
    problems = placement_problems(plan, topology)
    if problems and not allow_straddle:
        raise PlanError("the layout breaks hetjax's placement rules: " + "; ".join(problems) +
                        ". Fix: choose tp <= devices per node and pp so each stage fits in a "
                        "cluster, or set --config.parallel.allow_straddle=True to accept it.")
    for p in problems:
        warnings.warn(f"hetjax: allowed by parallel.allow_straddle: {p}", stacklevel=2)
    notes = list(problems)
    if plan.pp < len(topology.clusters) and len(topology.clusters) > 1:
        crossing = [g for g in plan.dp_groups()
                    if len({topology.devices[r].cluster for r in g}) > 1]
        if crossing:
            notes.append(f"{len(crossing)} DP groups span clusters and reduce gradients over "
                         f"{topology.group_link(crossing[0]).kind}; pp >= "
                         f"{len(topology.clusters)} would keep them inside one cluster")
    return notes

"""Plan + Topology -> `jax.sharding.Mesh` with axes ('pp', 'dp', 'dp_os', 'dp_p', 'expert', 'tp').

Axes run slowest first. The data-parallel devices of a stage are factored into three sub-axes
for ZeRO sharding (AMSP): 'dp' (replicas), 'dp_os' and 'dp_p', with sizes
dp / s_os, s_os / s_p and s_p. Parameters shard over 'dp_p', optimizer states over
('dp_p', 'dp_os') -- 'dp_p' major -- so every optimizer-state shard lies inside its device's
parameter shard (parallel/zero_sharding.py).
Anything that means "all data-parallel devices" uses `DP_AXES`. With plain data parallelism
the two sub-axes have size 1. 'expert' (size ep, 1 unless an MoE model's experts are split)
is the innermost data axis: the batch is split over it too, the experts' leading axis is split
over it, and the other parameters are replicated over it like over 'dp'.

The mesh is the plan's device order reshaped to (pp, dp, tp). Where groups may sit (a TP group
inside a node, a stage inside a cluster) is a planning rule: hetjax/planner/placement.py owns
it and checks it before a Plan gets here. The axis names are the Plan's (hetjax/core/plan.py).

The dp and tp axes are `AxisType.Auto`: Flax modules do not pass `out_sharding` to their
contractions, which Explicit axes demand, so the compiler places activations from the logical
constraints instead. The pipeline makes 'pp' manual with shard_map.
"""

from __future__ import annotations

import numpy as np

from hetjax.errors import PlanError
from hetjax.core.plan import DP_AXES, MESH_AXES as AXES, Plan  # noqa: F401 - DP_AXES re-exported
from hetjax.core.topology import Topology


def mesh_shape(plan: Plan) -> tuple[int, ...]:
    """Sizes of AXES for a plan: (pp, dp / (s_os ep), s_os / s_p, s_p, ep, tp)."""
    z = plan.zero
    if plan.dp % (z.s_os * plan.ep) or z.s_os % z.s_p:
        raise PlanError(f"ZeRO factors s_p={z.s_p}, s_os={z.s_os} and ep={plan.ep} must divide "
                        f"dp={plan.dp} (s_p | s_os, s_os x ep | dp)")
    return (plan.pp, plan.dp // (z.s_os * plan.ep), z.s_os // z.s_p, z.s_p, plan.ep, plan.tp)


def stage_mesh_shape(plan: Plan, s: int) -> tuple[int, ...]:
    """Sizes of AXES[1:] for stage s: (dp_s / (s_os ep), s_os / s_p, s_p, ep, tp_s)."""
    dp, tp = plan.stage_shape(s)
    z = plan.zero
    if dp % (z.s_os * plan.ep) or z.s_os % z.s_p:
        raise PlanError(f"ZeRO factors s_p={z.s_p}, s_os={z.s_os} and ep={plan.ep} must divide "
                        f"stage {s}'s dp={dp} (s_p | s_os, s_os x ep | dp)")
    return (dp // (z.s_os * plan.ep), z.s_os // z.s_p, z.s_p, plan.ep, tp)


def _by_rank(plan: Plan, topology: Topology, devices) -> np.ndarray:
    """The devices as an array indexed by topology rank (`devices`: the topology's, in rank
    order; default all of them), checked to hold every rank the plan uses."""
    if devices is None:
        devices = topology.jax_devices()
    if max(plan.device_order) >= len(devices):
        raise PlanError(f"plan uses ranks up to {max(plan.device_order)} but {len(devices)} "
                        "devices were given")
    arr = np.empty(len(devices), dtype=object)
    arr[:] = list(devices)
    return arr


def build_mesh(plan: Plan, topology: Topology, devices=None):
    """The mesh for `plan` (its stages sharing one shape): devices[plan.mesh_ranks()], dp
    factored into its ZeRO sub-axes. `devices` are the topology's in rank order (default all
    of them); the plan may leave some out."""
    from jax.sharding import AxisType, Mesh

    grid = _by_rank(plan, topology, devices)[plan.mesh_ranks()].reshape(mesh_shape(plan))
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def build_stage_mesh(plan: Plan, topology: Topology, s: int, devices=None):
    """Stage s's own mesh, axes AXES[1:] ('dp', 'dp_os', 'dp_p', 'expert', 'tp'): its (dp_s, tp_s)
    ranks, dp factored into the ZeRO sub-axes (the MPMD executors' sub-meshes)."""
    from jax.sharding import AxisType, Mesh

    grid = _by_rank(plan, topology, devices)[plan.stage_mesh(s)].reshape(
        stage_mesh_shape(plan, s))
    return Mesh(grid, AXES[1:], axis_types=(AxisType.Auto,) * (len(AXES) - 1))

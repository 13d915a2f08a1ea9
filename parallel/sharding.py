"""Logical axis names -> mesh axes, and the shardings of parameters and batches.

Layers name their axes (embed, heads, mlp, vocab, ...); the rules here say which mesh axis
each name is split over: the batch over all data-parallel axes, heads / kv_heads / mlp / vocab over 'tp',
everything else replicated. Parameter shardings come from the parameters' logical names, so a
new layer needs no change here.
"""

from __future__ import annotations

import flax.linen as nn
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from hetjax.core.plan import EXPERT_AXIS
from hetjax.parallel.mesh import DP_AXES

LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", DP_AXES + (EXPERT_AXIS,)),
    ("expert", EXPERT_AXIS),
    ("vocab", "tp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("embed", None),
    ("head_dim", None),
    ("length", None),
    ("layers", None),
    ("stage", "pp"),
)


def logical_specs(boxed_params):
    """Tree of PartitionSpecs of logical names, from params boxed by nn.with_logical_partitioning."""
    return nn.get_partition_spec(boxed_params)


def param_specs(boxed_params, rules=LOGICAL_RULES):
    """Tree of mesh PartitionSpecs for (abstract) boxed parameters."""
    return jax.tree.map(lambda s: nn.logical_to_mesh_axes(tuple(s), rules),
                        logical_specs(boxed_params), is_leaf=lambda x: isinstance(x, P))


def named(mesh, specs):
    """NamedShardings on `mesh` for a tree of PartitionSpecs."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def batch_spec(microbatched: bool = True) -> P:
    """[micro-batch, batch, length] with the batch over the data axes (or [batch, length])."""
    rows = DP_AXES + (EXPERT_AXIS,)
    return P(None, rows, None) if microbatched else P(rows, None)


def replicated() -> P:
    return P()


def _names(entry) -> tuple[str, ...]:
    return entry if isinstance(entry, tuple) else (entry,) if entry else ()


def without_axes(rules, axes):
    """Logical rules with `axes` removed: for code that places those axes itself, e.g. a
    vmapped per-device dimension with spmd_axis_name=axes (parallel/zero_sharding.py), inside which
    the batch dimension is each device's own slice."""
    out = []
    for name, target in rules:
        kept = tuple(a for a in _names(target) if a not in axes)
        out.append((name, kept if len(kept) > 1 else (kept[0] if kept else None)))
    return tuple(out)


# Logical name of a leading per-device dimension: index i holds data-parallel device i's own
# slice (parallel/zero_sharding.py per_device), so it is split over all data-parallel axes.
DEVICE = "device"


def per_device_rules(rules):
    """Rules for code that holds the batch as [dp, b / dp, ...]: the data-parallel axes move
    from 'batch' (now each device's own rows) to the leading DEVICE dimension."""
    return without_axes(rules, DP_AXES) + ((DEVICE, DP_AXES),)

"""ZeRO / AMSP sharding of the model states: parameters (P), gradients (G), optimizer states (OS).

Each component has its own sharding factor over the data-parallel devices of a stage
(`ZeroFactors(s_p, s_g, s_os)`, see ../shared/spec/amsp.md and docs/zero.md). This module
executes a Plan's point: its specs and collectives. Which points exist and are valid (presets,
the ordering and node rules, the config's choice) is the planner's (hetjax/planner/zero_factors.py),
and so is the list of collectives a point issues (`expected_collectives`), which the compiled
step is audited against (hetjax/core/hlo.py).

- **Specs.** The mesh factors dp into ('dp', 'dp_os', 'dp_p') (parallel/mesh.py). P shards
  over 'dp_p', OS over ('dp_p', 'dp_os') -- 'dp_p' major, so each OS shard is a slice of the
  device's own P shard -- and G over the P axes (s_g = s_p) or the OS axes (s_g = s_os). Each
  parameter is split on one dimension: the largest one not already on a mesh axis (tp, pp) nor
  a stacked layer axis, divisible by s_os. JAX shards only evenly, so a parameter with no such
  dimension stays replicated and is listed in `ZeroSpecs.unsharded`.
- **Execution.** `accumulate_gradients`: parameters are all-gathered inside the P group once
  per step; each micro-batch's gradient is computed as per-device partial sums and
  reduce-scattered inside the G group into a G-sharded accumulator; only after the loop are
  the sums reduce-scattered to OS shards and all-reduced across the replicas -- once per step.
  AdamW then updates OS shards; the trainer constrains the new parameters back to the P spec,
  which XLA does as an all-gather inside the OS sub-group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

from hetjax.core.plan import Plan, ZeroAxes, ZeroFactors
from hetjax.parallel import sharding as shd
from hetjax.parallel.mesh import AXES, DP_AXES, mesh_shape

# Logical names of stacked dimensions: sharding them would split layers (or stages) between
# devices instead of splitting every layer.
STACKED = ("layers", "stage")


# --- specs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Unsharded:
    """A parameter that stays replicated over the ZeRO axes, and why."""

    path: str
    shape: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class ZeroSpecs:
    """PartitionSpecs of P, G and OS (trees shaped like the parameters), the dimension each
    parameter is split on (`dims`, -1: not split), and the parameters that could not be."""

    factors: ZeroFactors
    axes: ZeroAxes
    base: Any  # the parameters' own specs (tp, pp), before ZeRO
    p: Any
    g: Any
    os: Any
    dims: Any
    unsharded: tuple[Unsharded, ...] = field(default=())

    def in_stage(self) -> "ZeroSpecs":
        """The specs as the pipeline's shard_map, manual over 'pp', sees them: a stage-stacked
        leaf [pp, L, ...] is one stage's [L, ...] there, so its specs lose their leading 'pp'
        and its split dimension moves down by one. Other leaves are unchanged."""
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        stacked = jax.tree.map(lambda s: tuple(s)[:1] == ("pp",), self.base, is_leaf=is_spec)

        def drop(specs):
            return jax.tree.map(lambda s, k: P(*tuple(s)[1:]) if k else s, specs, stacked,
                                is_leaf=is_spec)

        return replace(self, base=drop(self.base), p=drop(self.p), g=drop(self.g),
                       os=drop(self.os), dims=jax.tree.map(
                           lambda d, k: d - 1 if k and d >= 0 else d, self.dims, stacked))

    def describe(self) -> str:
        z, a = self.factors, self.axes
        lines = [f"zero={z.name} (s_p={z.s_p}, s_g={z.s_g}, s_os={z.s_os}): P over "
                 f"{a.p or '-'}, G over {a.g or '-'}, OS over {a.os or '-'}"]
        lines += [f"  replicated (not split): {u.path} {u.shape}: {u.reason}"
                  for u in self.unsharded]
        return "\n".join(lines)


def _free_dims(shape, spec, logical) -> list[int]:
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    logical = tuple(logical) + (None,) * (len(shape) - len(logical))
    return [i for i in range(len(shape)) if spec[i] is None and logical[i] not in STACKED]


def shard_dim(shape, spec, logical, s: int) -> tuple[int | None, str]:
    """The dimension to split over s devices -- the largest free one divisible by s -- or None
    with the reason it stays replicated."""
    free = _free_dims(shape, spec, logical)
    fits = [i for i in free if shape[i] % s == 0]
    if fits:
        return max(fits, key=lambda i: (shape[i], -i)), ""
    if not free:
        return None, "every dimension is on a mesh axis or stacked"
    return None, (f"no free dimension divisible by s_os = {s} "
                  f"(free sizes {[shape[i] for i in free]})")


def _with_axes(spec, ndim: int, dim: int | None, axes: tuple[str, ...]) -> P:
    parts = list(tuple(spec) + (None,) * (ndim - len(spec)))
    if dim is not None and axes:
        parts[dim] = axes[0] if len(axes) == 1 else axes
    return P(*parts)


def zero_specs(abstract_params, param_specs, logical_specs, z: ZeroFactors) -> ZeroSpecs:
    """P, G and OS specs for parameters whose mesh specs (tp, pp) are `param_specs`.

    Stage-agnostic: a dimension already on a mesh axis (a stacked 'pp' dimension, tp splits)
    keeps it, and the ZeRO axes go on another dimension."""
    axes = ZeroAxes.of(z)
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(abstract_params)[0])
    specs = jax.tree.leaves(param_specs, is_leaf=is_spec)
    logical = jax.tree.leaves(logical_specs, is_leaf=is_spec)
    dims, unsharded = [], []
    for path, leaf, spec, names in zip(paths, leaves, specs, logical):
        dim, reason = shard_dim(leaf.shape, spec, names, z.s_os) if z.s_os > 1 else (None, "")
        dims.append(dim)
        if reason:
            unsharded.append(Unsharded(jax.tree_util.keystr(path), tuple(leaf.shape), reason))
    treedef = jax.tree.structure(abstract_params)

    def component(ax):
        return treedef.unflatten([_with_axes(s, leaf.ndim, d, ax)
                                  for s, leaf, d in zip(specs, leaves, dims)])

    # None is not a pytree leaf, so dims are kept as -1 for "replicated".
    return ZeroSpecs(z, axes, param_specs, component(axes.p), component(axes.g),
                     component(axes.os),
                     treedef.unflatten([-1 if d is None else d for d in dims]),
                     tuple(unsharded))


# --- bytes ---------------------------------------------------------------------------------------
def abstract_mesh(plan: Plan) -> AbstractMesh:
    """The plan's mesh without devices: enough to compute shard shapes at any scale."""
    return AbstractMesh(mesh_shape(plan), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _leaf_bytes(abstract_tree, specs, mesh) -> list[int]:
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return [math.prod(NamedSharding(mesh, s).shard_shape(a.shape)) * a.dtype.itemsize
            for a, s in zip(jax.tree.leaves(abstract_tree), spec_leaves)]


def shard_bytes(abstract_tree, specs, mesh) -> int:
    """Bytes one device holds of a tree of arrays sharded by `specs` on `mesh` (or an
    AbstractMesh), computed from shard shapes; nothing is allocated."""
    return sum(_leaf_bytes(abstract_tree, specs, mesh))


def split_bytes(abstract_params, zs: ZeroSpecs, mesh) -> tuple[int, int]:
    """Per-device bytes of the parameters (after tp/pp, before ZeRO) that ZeRO splits, and of
    those it leaves replicated: the sizes the collectives move."""
    sizes = _leaf_bytes(abstract_params, zs.base, mesh)
    split = [d >= 0 for d in jax.tree.leaves(zs.dims)]
    return (sum(b for b, s in zip(sizes, split) if s),
            sum(b for b, s in zip(sizes, split) if not s))


# --- execution ---------------------------------------------------------------------------------
# The model runs under the compiler (tp and pp stay automatic, so tensor parallelism keeps its
# shardings), while every ZeRO collective runs in a small shard_map that is manual over *all*
# mesh axes: a partially manual shard_map would re-lay-out the automatic axes (replicate tp) at
# its boundary. To keep a micro-batch's gradient as per-device partial sums without shard_map
# around the model, each data-parallel device's slice of the micro-batch is one index of a
# leading dimension sharded over DP_AXES (`per_device`, a vmap with spmd_axis_name): its
# gradient is then [dp, ...] with device i holding its own partial sum, and nothing is reduced
# until a collective below says so.
#
# The same kernels run inside the pipeline's shard_map, which is manual over 'pp'
# (parallel/pipeline.py): there they are nested shard_maps manual over every other axis, on the
# specs of one stage (`ZeroSpecs.in_stage`).
def _lead(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _leading(specs, zs: ZeroSpecs, lead_of: Callable[[int], tuple[str, ...]]):
    """Specs with a leading per-device dimension over the axes `lead_of(dim)` names."""
    return jax.tree.map(lambda s, d: P(_lead(lead_of(d)), *s), specs, zs.dims,
                        is_leaf=lambda x: isinstance(x, P))


def _acc_replicas(zs: ZeroSpecs, dim: int) -> tuple[str, ...]:
    """Data-parallel axes over which an accumulated gradient still holds partial sums."""
    return DP_AXES if dim < 0 else tuple(a for a in DP_AXES if a not in zs.axes.g)


def _manual(f, mesh, in_specs, out_specs):
    """`f` in a shard_map manual over every mesh axis not already manual in the context (all of
    them at top level; all but 'pp' inside the pipeline, where the context's abstract mesh
    must be used)."""
    context = jax.sharding.get_abstract_mesh()
    outer = set(context.manual_axes) if not context.empty else set()
    # check_vma=False: the kernels' outputs are equal across the axes their specs leave out
    # (gathered or summed there), which the varying-axes check cannot see through all_gather.
    return jax.shard_map(f, mesh=context if outer else mesh, in_specs=in_specs,
                         out_specs=out_specs, axis_names=set(mesh.axis_names) - outer,
                         check_vma=False)


def dp_size(mesh) -> int:
    """Data-parallel devices of a stage: the product of DP_AXES."""
    return math.prod(mesh.shape[a] for a in DP_AXES)


def split_devices(x, n: int, axis: int = 0):
    """[..., b, ...] -> [..., n, b / n, ...] at `axis`: data-parallel device i's rows (the
    batch is split over DP_AXES) at index i of the new dimension."""
    return x.reshape(*x.shape[:axis], n, x.shape[axis] // n, *x.shape[axis + 1:])


def per_device(f: Callable, in_axes) -> Callable:
    """`f` on one data-parallel device's slice, mapped over a leading [dp] dimension placed on
    DP_AXES: gradients of unmapped parameters come out per device ([dp, ...] partial sums).
    Trace it under `sharding.per_device_rules`, where 'batch' is a device's own rows."""
    return jax.vmap(f, in_axes=in_axes, spmd_axis_name=DP_AXES)


def new_accumulator(like, zs: ZeroSpecs, mesh):
    """Zeros in the G accumulator's layout for gradients shaped like `like`: [r, ...] with the
    leading dimension over the data-parallel axes whose partial sums it still keeps apart (all
    of them for an unsplit parameter) and the rest G-sharded. Needs the mesh in context."""
    acc = jax.tree.map(lambda a, d: jnp.zeros(
        (math.prod(mesh.shape[x] for x in _acc_replicas(zs, d)), *a.shape), a.dtype), like,
        zs.dims)
    return jax.lax.with_sharding_constraint(
        acc, _leading(zs.g, zs, lambda d: _acc_replicas(zs, d)))


def gather_params(params, zs: ZeroSpecs, mesh):
    """P shards -> full parameters (tp/pp shardings kept): all-gather inside the P group."""
    if not zs.axes.p:
        return params
    return _manual(lambda ps: jax.tree.map(lambda x, d: x if d < 0 else jax.lax.all_gather(
        x, zs.axes.p, axis=d, tiled=True), ps, zs.dims), mesh, (zs.p,), zs.base)(params)


def scatter_grads(grads, zs: ZeroSpecs, mesh):
    """One micro-batch's per-device gradients [dp, ...] -> their G shards: reduce-scatter
    inside the G group. The result [dp / s_g, ...] still holds partial sums across replicas."""
    grads = jax.lax.with_sharding_constraint(grads, _leading(zs.base, zs, lambda d: DP_AXES))
    if not zs.axes.g:
        return grads
    return _manual(lambda gs: jax.tree.map(lambda g, d: g if d < 0 else jax.lax.psum_scatter(
        g, zs.axes.g, scatter_dimension=d + 1, tiled=True), gs, zs.dims), mesh,
        (_leading(zs.base, zs, lambda d: DP_AXES),),
        _leading(zs.g, zs, lambda d: _acc_replicas(zs, d)))(grads)


def finish_grads(acc, losses, zs: ZeroSpecs, mesh, scale: float):
    """After the micro-batch loop, once per step: G shards -> OS shards (reduce-scatter over
    the OS axes G does not cover), then the sum across replicas (all-reduce); parameters
    that are not split are summed over all data-parallel devices. Also sums the per-device
    losses [dp]. Both are multiplied by `scale`."""
    extra = tuple(a for a in zs.axes.os if a not in zs.axes.g)

    def finish(g, d):
        g = g[0]
        if d < 0:
            return jax.lax.psum(g, DP_AXES) * scale
        if extra:
            g = jax.lax.psum_scatter(g, extra, scatter_dimension=d, tiled=True)
        return (jax.lax.psum(g, zs.axes.replica) if zs.axes.replica else g) * scale

    def local(acc, losses):
        return jax.tree.map(finish, acc, zs.dims), jax.lax.psum(losses[0], DP_AXES) * scale

    return _manual(local, mesh, (_leading(zs.g, zs, lambda d: _acc_replicas(zs, d)),
                                 P(DP_AXES)), (zs.os, P()))(acc, losses)


def accumulate_gradients(grad_fn: Callable, params, batch, zs: ZeroSpecs, mesh, rules,
                         has_aux: bool = False):
    """Mean loss and gradients over the micro-batches of `batch` ([M, b, S] arrays), pp = 1.

    `params` are in the P spec; `grad_fn(params, inputs, targets, segment_ids) -> (loss,
    grads)` is the value-and-grad of one micro-batch slice on full parameters (segment_ids
    None when the batch has none). Gathers P once, reduce-scatters
    each micro-batch's gradient into a G-sharded accumulator, and reduces across replicas once,
    after the loop. Returns the loss and the gradients in the OS spec. Trace it with `mesh`
    in context. With `has_aux`, `grad_fn` returns ((loss, aux), grads) and the mean of the
    pytree `aux` over devices and micro-batches comes third."""
    n, m = dp_size(mesh), batch["inputs"].shape[0]
    full = gather_params(params, zs, mesh)
    segments = "segment_ids" in batch
    vgrad = per_device(grad_fn, (None, 0, 0, 0 if segments else None))

    def body(carry, mb):
        losses, acc = carry
        with nn.logical_axis_rules(shd.per_device_rules(rules)):
            loss, grads = vgrad(full, split_devices(mb["inputs"], n),
                                split_devices(mb["targets"], n),
                                split_devices(mb["segment_ids"], n) if segments else None)
        loss, aux = loss if has_aux else (loss, None)
        return (losses + loss, jax.tree.map(jnp.add, acc, scatter_grads(grads, zs, mesh))), aux

    losses = jax.lax.with_sharding_constraint(jnp.zeros((n,), jnp.float32), P(DP_AXES))
    (losses, acc), aux = jax.lax.scan(body, (losses, new_accumulator(full, zs, mesh)), batch)
    # Each device's loss and gradient are means over its own slice of the micro-batch.
    grads, loss = finish_grads(acc, losses, zs, mesh, 1.0 / (m * n))
    if has_aux:
        return loss, grads, jax.tree.map(lambda a: jnp.mean(a, axis=(0, 1)), aux)
    return loss, grads


__all__ = ["ZeroAxes", "ZeroSpecs", "Unsharded", "shard_dim", "zero_specs", "abstract_mesh",
           "shard_bytes", "split_bytes", "gather_params", "scatter_grads", "finish_grads",
           "accumulate_gradients"]

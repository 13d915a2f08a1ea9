"""What a pipeline keeps between a piece's forward and its backward: the residuals of the
piece's `jax.vjp` pullback, chosen by the recompute policy (`model.remat`).

Both pipeline executors run a piece (a layer, the embedding, the head) under `jax.vjp` in F and
call the pullback in B, possibly in another program (MPMD) or another tick (SPMD). The pullback
is a pytree whose leaves are its residuals, so it can be stashed as data: `vjp_stash` returns
the leaves with the piece's own parameters taken out (a residual that *is* a parameter input is
replaced by a reference, so a stash holds activations, not weight copies) and a `Residuals`
spec; `pullback` rebuilds the function from the spec, the parameters and the stashed leaves.
`layer_fn` is one decoder layer under the policy: `none` keeps every intermediate (three
forwards' work per layer per step), `dots` keeps the matmul outputs, `full` keeps only the
layer's input and recomputes the layer in the backward (four forwards).
`auto` (the config default) means what each executor did before recompute was a choice:
no recompute, except in the SPMD pipeline, which recomputes every layer
(`hetjax.core.plan.effective_remat`, shared with the cost model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax

from hetjax.core.plan import effective_remat
from hetjax.layers import block_apply
from hetjax.layers.model import REMAT_JAX_POLICIES


def layer_fn(model_cfg, remat: str) -> Callable:
    """(layer params, input, segment ids or None) -> output of one decoder layer,
    rematerialised per `remat`."""
    def layer(p, h, segment_ids=None):
        return block_apply(model_cfg, p, h, segment_ids)

    if remat not in REMAT_JAX_POLICIES:  # 'none'
        return layer
    return jax.checkpoint(layer, prevent_cse=False, policy=REMAT_JAX_POLICIES[remat])


@dataclass(frozen=True, eq=False)
class Residuals:
    """How to rebuild a pullback: its tree structure and, per leaf, the index of the parameter
    leaf it is (-1: a stashed residual)."""

    treedef: Any
    where: tuple[int, ...]

    def stashed(self, leaves: list) -> list:
        """The leaves a stash keeps (the non-parameter ones), in order."""
        return [leaf for leaf, w in zip(leaves, self.where) if w < 0]


def vjp_stash(fn: Callable, params, *args):
    """`jax.vjp(fn, params, *args)` -> (output, stashed residual leaves, `Residuals`).
    `args` may be empty (a piece with no differentiable input, like the embedding)."""
    out, pb = jax.vjp(fn, params, *args)
    where_param = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(params))}
    leaves, treedef = jax.tree.flatten(pb)
    spec = Residuals(treedef, tuple(where_param.get(id(leaf), -1) for leaf in leaves))
    return out, spec.stashed(leaves), spec


def pullback(spec: Residuals, params, stashed: list) -> Callable:
    """The pullback `vjp_stash` took apart, from the same parameters and its stashed leaves."""
    p, rest = jax.tree.leaves(params), iter(stashed)
    return jax.tree.unflatten(spec.treedef, [p[w] if w >= 0 else next(rest)
                                             for w in spec.where])


__all__ = ["Residuals", "effective_remat", "layer_fn", "vjp_stash", "pullback"]

"""Pipeline parallelism with uneven stages: the stage-stacked parameter layout and the
shard_map executor that runs a schedule's tick program over the 'pp' mesh axis.

Layout. The decoder blocks of stage s are layers `plan.layer_range(s)`. In the natural layout
(the model's own) every block leaf is `[n_layers, ...]` under `params['layers']['block']`; in the
stage-stacked layout it is `[pp, max_layers, ...]`, sharded over 'pp' (logical axis 'stage'),
and stage s uses slots `0 .. n_s - 1`; the other slots are padding, zero, and never change.
`to_stages` / `from_stages` convert any tree holding such leaves (parameters, gradients,
optimizer states; boxed or not; numpy or jax) and are exact inverses on the valid slots.
Embedding, final norm and output projection stay unstacked and replicated over 'pp'.

Executor. `Pipeline.loss_and_grads` runs one training step's forward and backward as a loop
over the ticks of `hetjax.core.tick_program`, inside `jax.shard_map` with only 'pp' manual (dp and
tp stay with the compiler, which places them from the parameter shardings and the layers'
logical constraints). At every tick each stage does what its column of the program says
(`StageStep`, the shard_map's body, has one method per tick kind):
- F(m): stage 0 embeds the tokens of micro-batch m, the others take the activation waiting
  in their inbox; then the stage runs its n_s layers (a `fori_loop` whose trip count is n_s,
  so a short stage really does less work and padded slots cost nothing), each under `jax.vjp`,
  and stashes each layer's pullback residuals (`hetjax.parallel.residuals`) and the stage output.
- B(m): the last stage starts from the loss (head and cross-entropy under `jax.vjp`), the
  others from the output gradient waiting in their inbox; then layers n_s - 1 .. 0 each rebuild
  their pullback from the stash and pull the gradient back, accumulating parameter gradients;
  stage 0 ends with the embedding's pullback.
- F(m) + B(m') (schedules that co-execute two strands, `strands`): one loop whose step j runs
  forward layer j of m and backward layer n_s - 1 - j of m', so the two independent strands
  sit in one loop body and XLA's scheduler may overlap one's collectives with the other's
  compute.
Every F and B is vmapped over a leading per-device dimension (`zero.per_device`): the batch
is split [dp, b / dp, ...] and a B yields each data-parallel device's own partial gradients,
which the ZeRO kernels (parallel/zero_sharding.py, nested shard_maps manual over every axis but 'pp')
reduce-scatter into the G accumulator after each B and reduce across replicas to OS shards
once, after the tick loop. Parameters are gathered from their P shards before the shard_map.
Then outputs move with two `ppermute`s (activations s -> s + 1, gradients s -> s - 1), skipped
on ticks where no stage sends.

Recompute follows `model.remat` ('auto', the default, is 'full' here). With 'full' a layer's
residuals are its input alone: between its F and B a micro-batch keeps max_layers + 1
activations [b, S, d] on its stage, during B one layer's activations exist at a time, and each
layer costs four forwards (F, then recompute plus the two of the backward in B). With 'none'
the stash keeps every intermediate of every layer slot (three forwards per layer; far more
memory: the attention probabilities too), with 'dots' the matmul outputs. Parameters a pullback
holds are not stashed (B passes them back in). The stash has the schedule's `max_in_flight`
slots: M for GPipe, pp for 1F1B whatever M is.

Folded placement (`plan.placement == 'folded'`, DHelix's W / ZB-V's V). Each device holds two
model chunks: chunk k on device k for k < pp and on device 2 pp - 1 - k for k >= pp, so device 0
runs the first (embedding) and the last (head). Device d's `stage_layers[d]` layers split
ceil / floor into its down chunk (slots 0 ..) and its up chunk (the slots after), and
`to_stages` puts those layers in its slots (`Plan.device_layers`). The executor plays the
schedule's grid for a virtual pipeline of 2 pp stages: each tick runs the device's down-chunk
action (virtual stage d), then its up-chunk action (2 pp - 1 - d), each with its own inboxes and
stash; then down-chunk activations and up-chunk gradients move d -> d + 1, up-chunk activations
and down-chunk gradients d -> d - 1 (`folded_sends`), and at the turn device pp - 1 keeps its
own down output (and up gradient) with no send. The shared parameters are stacked over 'pp' as
well, real on device 0 and zero (frozen) elsewhere, so their gradients never leave device 0.

Shared parameters (looped). The embedding is used by stage 0 (lookup) and, tied, by the last stage
(logits); final norm and output projection by the last stage. Their gradient contributions,
reduced inside each stage to OS shards first, are summed over the stages by passing them
around the ring of stages with `ppermute`, so
the only collectives between stages (clusters) are point-to-point. Every non-zero contribution
comes from stage 0 or the last stage and the others add exact zeros, so every stage ends with
bit-identical sums and the replicas stay identical. The loss is summed the same way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from hetjax.core.plan import Plan, raise_first, resolve_schedule, schedule_problem
from hetjax.layers import ModelConfig, Transformer
from hetjax.core import schedules as sch
from hetjax.core import tick_program as tp
from hetjax.parallel import sharding as shd
from hetjax.parallel import zero_sharding as zero
from hetjax.parallel.residuals import effective_remat, layer_fn, pullback, vjp_stash

STAGE_AXIS = "stage"  # logical name of the leading axis of stage-stacked leaves ('pp')


# --- the stage-stacked layout ------------------------------------------------------------------
def _is_block_path(path) -> bool:
    keys = [getattr(k, "key", None) for k in path]
    return any(a == "layers" and b == "block" for a, b in zip(keys, keys[1:]))


SHARED_KEYS = ("embedder", "final_norm", "lm_head")  # the model's unstacked parameters


def _is_shared_path(path) -> bool:
    return not _is_block_path(path) and any(getattr(k, "key", None) in SHARED_KEYS
                                            for k in path)


def _map_blocks(fn: Callable, tree, with_names: Callable | None = None,
                shared: Callable | None = None):
    """Apply `fn` to every leaf under a `layers/block` path (nn.Partitioned boxes included:
    `fn` gets the value, `with_names` the logical names), and `shared`, when given, to every
    embedding / final norm / head leaf (in parameters and in optimizer moments alike)."""
    def leaf(path, x):
        f = fn if _is_block_path(path) else shared if _is_shared_path(path) else None
        if f is None:
            return x
        if isinstance(x, nn.Partitioned):
            return x.replace(value=f(x.value), names=with_names(x.names))
        return f(x)

    return jax.tree_util.tree_map_with_path(leaf, tree,
                                            is_leaf=lambda x: isinstance(x, nn.Partitioned))


def _xp(x):
    return np if isinstance(x, np.ndarray) else jnp


def stack_layers(x, plan: Plan):
    """One block leaf [n_layers, ...] -> [pp, max_layers, ...], padded slots zero. Device s
    holds `plan.device_layers(s)` (its layer range; folded: its down then its up chunk)."""
    xp, L = _xp(x), plan.max_stage_layers
    stages = []
    for s in range(plan.pp):
        if plan.placement == "looped":
            r = plan.layer_range(s)
            part = x[r.start:r.stop]
        else:
            part = x[np.asarray(plan.device_layers(s), np.int32)]
        pad = [(0, L - part.shape[0])] + [(0, 0)] * (x.ndim - 1)
        stages.append(xp.pad(part, pad))
    return xp.stack(stages)


def unstack_layers(x, plan: Plan):
    """One block leaf [pp, max_layers, ...] -> [n_layers, ...], padded slots dropped."""
    xp = _xp(x)
    held = xp.concatenate([x[s, :n] for s, n in enumerate(plan.stage_layers)])
    if plan.placement == "looped":
        return held
    order = np.concatenate([plan.device_layers(s) for s in range(plan.pp)])
    return held[np.argsort(order)]


def _stacks_shared(plan: Plan) -> bool:
    """Folded: the embedding, final norm and head live on device 0 only (it runs the first
    and the last chunk), stacked [pp, ...] over 'pp' with zero padding on the other devices,
    so their gradients never cross the pipeline axis. Looped: replicated over 'pp'."""
    return plan.placement == "folded"


def to_stages(tree, plan: Plan):
    """Natural layout -> stage-stacked layout for every `layers/block` leaf of `tree` (and,
    folded, every shared leaf: [pp, ...], the real value on device 0, zeros elsewhere).

    Works on parameters, gradients and optimizer states, boxed (the logical names gain a
    leading 'stage') or plain, numpy (host) or jax arrays; other leaves are returned as is."""
    def shared(x):
        xp = _xp(x)
        return xp.concatenate([x[None], xp.zeros((plan.pp - 1, *x.shape), x.dtype)])

    return _map_blocks(lambda x: stack_layers(x, plan), tree,
                       lambda names: (STAGE_AXIS,) + tuple(names),
                       shared if _stacks_shared(plan) else None)


def from_stages(tree, plan: Plan):
    """Stage-stacked layout -> natural layout; the exact inverse of `to_stages`."""
    return _map_blocks(lambda x: unstack_layers(x, plan), tree, lambda names: tuple(names[1:]),
                       (lambda x: x[0]) if _stacks_shared(plan) else None)


def slot_mask(plan: Plan) -> np.ndarray:
    """[pp, max_layers] bool: True where a stage slot holds a real layer."""
    return np.arange(plan.max_stage_layers)[None, :] < np.asarray(plan.stage_layers)[:, None]


def freeze_padding(tx: optax.GradientTransformation,
                   plan: Plan) -> optax.GradientTransformation:
    """`tx` with the updates of padded slots zeroed, so they never change.

    Their gradients are zero already, but weight decay or any other update that does not come
    from the gradient would still move them. The optimizer state is `tx`'s own (same tree as
    without a pipeline), so checkpoints of it do not depend on the plan. Folded, the shared
    parameters' padding (devices 1 .. pp - 1) is frozen the same way."""
    mask = slot_mask(plan)
    first = np.arange(plan.pp) == 0

    def masked(m):
        return lambda u: u * m.reshape(m.shape + (1,) * (u.ndim - m.ndim)).astype(u.dtype)

    def update(grads, state, params=None):
        updates, state = tx.update(grads, state, params)
        return _map_blocks(masked(mask), updates,
                           shared=masked(first) if _stacks_shared(plan) else None), state

    return optax.GradientTransformation(tx.init, update)


class StageLayout:
    """`hetjax.checkpoint.Layout` for a trainer state in the stage-stacked layout: checkpoints
    hold the natural state (block leaves [n_layers, ...] in global layer order, no padding,
    optimizer moments alike), whatever the plan.

    `state_sharding` is the trainer's state sharding tree (stage-stacked); natural block leaves
    take the same specs without the leading 'pp' entry, so every device holds all layers of its
    tp / dp shard between a restore and `from_natural`."""

    def __init__(self, plan: Plan, abstract_state, state_sharding):
        self.plan = plan
        self.sharding = state_sharding
        unstack = lambda sh: NamedSharding(sh.mesh, P(*sh.spec[1:]))  # noqa: E731
        self.natural_sharding = _map_blocks(unstack, state_sharding,
                                            shared=unstack if _stacks_shared(plan) else None)
        natural = jax.eval_shape(lambda s: from_stages(s, plan), abstract_state)
        self.target = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), natural,
            self.natural_sharding)

    def to_natural(self, state):
        return jax.jit(lambda s: from_stages(s, self.plan),
                       out_shardings=self.natural_sharding)(state)

    def natural_target(self):
        return self.target

    def from_natural(self, natural):
        return jax.jit(lambda s: to_stages(s, self.plan), out_shardings=self.sharding)(natural)


# --- validation --------------------------------------------------------------------------------
def check_plan(plan: Plan, n_layers: int) -> None:
    """Raise PlanError for a pipeline the executor cannot run (the Plan's rules,
    `Plan.problems`)."""
    raise_first(plan.problems(n_layers=n_layers))


# --- the executor ------------------------------------------------------------------------------
def _at(i, offset):
    """Slot of a chunk's layer i in its device's blocks (`offset` None: the chunk starts at 0)."""
    return i if offset is None else offset + i


def folded_sends(schedule: sch.Schedule, pp: int) -> dict[str, np.ndarray]:
    """Which of the folded pipeline's four point-to-point moves happen after each tick of the
    virtual (2 pp stage) grid: 'down_x' (a down chunk's activation, device d -> d + 1),
    'up_x' (an up chunk's activation, d -> d - 1), 'up_dy' (an up chunk's input gradient,
    d -> d + 1), 'down_dy' (a down chunk's input gradient, d -> d - 1). The turn (virtual
    stage pp - 1 <-> pp) stays on device pp - 1 and is no send."""
    ticks = len(sch.tick_table(schedule))
    out = {k: np.zeros(ticks, bool) for k in ("down_x", "up_x", "up_dy", "down_dy")}
    for tr in tp.transfers(schedule):
        if tr.kind == "activation" and tr.src != pp - 1:
            out["down_x" if tr.src < pp - 1 else "up_x"][tr.tick] = True
        elif tr.kind == "gradient" and tr.src != pp:
            out["up_dy" if tr.src > pp else "down_dy"][tr.tick] = True
    return out


class Pipeline:
    """Runs one step's forward and backward of `model_cfg` under `plan` on `mesh`.

    Parameters are in the stage-stacked layout (`to_stages`). `loss_and_grads` must be traced
    with `mesh` and the logical-axis rules active (the Trainer's context)."""

    def __init__(self, plan: Plan, model_cfg: ModelConfig, mesh):
        check_plan(plan, model_cfg.n_layers)
        self.plan = plan
        self.cfg = model_cfg
        self.mesh = mesh
        self.model = Transformer(model_cfg)
        # Folded: the schedule's grid for a virtual pipeline of 2 pp stages (chunks); device d
        # runs virtual stages d (down) and 2 pp - 1 - d (up) in every tick.
        self.folded = plan.placement == "folded"
        schedule = resolve_schedule(plan)
        self.schedule = schedule.base if self.folded else schedule
        # whatever executor the plan names, this engine runs the tick grid: the rule of the
        # registry's tick-grid executor (a plan built for another one may reach it in tests)
        raise_first([p for p in (schedule_problem("spmd", plan.schedule),) if p])
        self.program = tp.tick_program(self.schedule)
        self.remat = effective_remat(model_cfg.remat, spmd_pipeline=True)
        self._layer_fn = layer_fn(model_cfg, self.remat)
        self._residuals = None  # residuals.Residuals of a layer, set when the step is traced

    # layout helpers bound to this plan (what the Trainer and checkpoints use)
    def to_stages(self, tree):
        return to_stages(tree, self.plan)

    def from_stages(self, tree):
        return from_stages(tree, self.plan)

    def freeze_padding(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        return freeze_padding(tx, self.plan)

    def describe(self) -> str:
        p = self.program
        kept = {"none": "all residuals", "dots": "matmul outputs",
                "full": "layer inputs, recomputed in B"}[self.remat]
        fold = (f", folded (down/up layers per device {[list(c) for c in self.plan.chunk_layers()]}"
                f", {2 * self.plan.pp} virtual stages)" if self.folded else "")
        return (f"pipeline: {self.schedule.name}{fold}, {self.plan.microbatches} micro-batches in "
                f"{p.ticks} ticks, layers per stage {list(self.plan.stage_layers)} in "
                f"{self.plan.max_stage_layers} slots, stash of {p.stash_slots} micro-batches "
                f"per device ({kept}; model.remat={self.cfg.remat})")

    # --- pieces of one stage -------------------------------------------------------------------
    def _layer(self, blocks, i):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), blocks)

    def residual_shapes(self, blocks, act_shape, dtype, segments: bool = False):
        """One layer's stashed residuals on one device's rows ([b / dp, S, d] input): their
        shapes, and the `residuals.Residuals` spec every layer's pullback is rebuilt from
        (the same for every layer: one block function, one input shape). `segments`: the
        layers see document segment ids ([b / dp, S]), whose masks are residuals too."""
        specs = []

        def probe(p, h, seg):
            _, kept, spec = vjp_stash(self._bound_layer(seg), p, h)
            specs.append(spec)
            return kept

        seg = jax.ShapeDtypeStruct(act_shape[:-1], jnp.int32) if segments else None
        shapes = jax.eval_shape(probe, self._layer(blocks, 0),
                                jax.ShapeDtypeStruct(act_shape, dtype), seg)
        return shapes, specs[0]

    def _bound_layer(self, seg):
        """The layer function of (params, input) with the micro-batch's segment ids bound."""
        return lambda p, h: self._layer_fn(p, h, seg)

    def new_stash(self, blocks, act_shape, dtype, layers: int):
        """An empty stash for `layers` layers run on one [b, S, d] input (what one stash slot of
        a stage program holds), for calling `layers_forward` / `layers_backward` directly."""
        shapes, self._residuals = self.residual_shapes(blocks, act_shape, dtype)
        return {"res": [jnp.zeros((layers, *r.shape), r.dtype) for r in shapes],
                "out": jnp.zeros(act_shape, dtype)}

    def layers_forward(self, blocks, x, n_layers, kept, seg=None, offset=None):
        """Run layers 0 .. n_layers - 1 under `jax.vjp`; kept['res'][k][i] = residual k of
        layer i's pullback (per `model.remat`), kept['out'] = the stage's output. `offset`:
        the chunk's first slot in `blocks` (folded up chunks); the stash is the chunk's own."""
        def layer(i, carry):
            h, res = carry
            y, new, _ = vjp_stash(self._bound_layer(seg), self._layer(blocks, _at(i, offset)),
                                  h)
            return y, [r.at[i].set(v) for r, v in zip(res, new)]

        y, res = jax.lax.fori_loop(0, n_layers, layer, (x, kept["res"]))
        return y, {"res": res, "out": y}

    def layers_backward(self, blocks, kept, dy, n_layers, grads, offset=None):
        """Pull dy back through layers n_layers - 1 .. 0 from their stashed residuals (a layer
        stashed with remat 'full' recomputes its forward here); adds the parameter gradients
        into `grads`; returns (input gradient, grads)."""
        def layer(j, carry):
            dh, grads = carry
            i = n_layers - 1 - j
            p = self._layer(blocks, _at(i, offset))
            dp, dh = pullback(self._residuals, p, [r[i] for r in kept["res"]])(dh)
            return dh, jax.tree.map(lambda g, d: g.at[_at(i, offset)].add(d), grads, dp)

        return jax.lax.fori_loop(0, n_layers, layer, (dy, grads))

    def layers_strands(self, blocks, x, kept_f, kept_b, dy, n_layers, grads, seg=None,
                       offset=None):
        """One tick of two strands: the forward of one micro-batch (input x, stash kept_f)
        and the backward of another (stash kept_b, output gradient dy) in one loop, step j
        running forward layer j and backward layer n_layers - 1 - j. The two are independent,
        and sitting in one loop body lets XLA's scheduler overlap one's collectives with the
        other's compute. Returns (output, new stash, input gradient, grads)."""
        def layer(j, carry):
            h, res, dh, grads = carry
            y, new, _ = vjp_stash(self._bound_layer(seg), self._layer(blocks, _at(j, offset)),
                                  h)
            i = n_layers - 1 - j
            dp, dh = pullback(self._residuals, self._layer(blocks, _at(i, offset)),
                              [r[i] for r in kept_b["res"]])(dh)
            return (y, [r.at[j].set(v) for r, v in zip(res, new)], dh,
                    jax.tree.map(lambda g, d: g.at[_at(i, offset)].add(d), grads, dp))

        y, res, dx, grads = jax.lax.fori_loop(0, n_layers, layer,
                                              (x, kept_f["res"], dy, grads))
        return y, {"res": res, "out": y}, dx, grads

    def _embed(self, shared, tokens):
        return self.model.apply({"params": shared}, tokens, method=Transformer.embed)

    def _head_loss(self, shared, y, targets):
        logits = self.model.apply({"params": shared}, y, method=Transformer.head)
        return onehot_cross_entropy(logits, targets)

    # --- the tick loop -------------------------------------------------------------------------
    def _stage_program(self, zs, blocks, shared, inputs, targets, segs=None):
        """Body of the shard_map: one stage's whole step (`StageStep`)."""
        return StageStep(self, zs, blocks, shared, inputs, targets, segs).run()

    def _buffer(self, shape, dtype, names):
        return nn.with_logical_constraint(jnp.zeros(shape, dtype), names)

    def loss_and_grads(self, params, batch, zs: zero.ZeroSpecs) -> tuple[jax.Array, Any]:
        """Mean loss over all micro-batches and its gradients, both layouts stage-stacked.

        params: stage-stacked, in the P spec of `zs`; batch: {'inputs', 'targets'} of
        [M, B / M, S] over dp. The gradients come back in the OS spec, reduced across the
        data-parallel replicas once, after the tick loop (zero.finish_grads)."""
        # before the loop, once per step
        shared, blocks = split_shared(zero.gather_params(params, zs, self.mesh))
        n = zero.dp_size(self.mesh)
        inputs, targets = (zero.split_devices(batch[k], n, axis=1) for k in ("inputs", "targets"))
        segs = (zero.split_devices(batch["segment_ids"], n, axis=1) if "segment_ids" in batch
                else None)
        sp = P("pp") if self.folded else P()  # folded: shared parameters live on device 0
        # check_vma=False: the body derives its gradients with explicit vjps and sums the
        # replicated ones itself (ring_sum), so no implicit psum over 'pp' may be inserted
        # and outputs declared P() are replicated by construction.
        run = jax.shard_map(functools.partial(self._stage_program, zs.in_stage()),
                            mesh=self.mesh, in_specs=(P("pp"), sp, P(), P()) + (
                                (P(),) if segs is not None else ()),
                            out_specs=(P(), P("pp"), sp), axis_names={"pp"}, check_vma=False)
        with nn.logical_axis_rules(shd.per_device_rules(nn.get_logical_axis_rules())):
            loss, g_blocks, g_shared = run(blocks, shared, inputs, targets,
                                           *(() if segs is None else (segs,)))
        return loss, join_shared(g_shared, g_blocks)


@dataclass(frozen=True)
class ChunkTick:
    """What one chunk's action in one tick reads: its chunk (`StageStep.chunks`), its column
    of the tick program at this tick, its buffers, the running accumulator and loss sum, the
    stash slot of its action, its micro-batch's rows, and its per-device layer loops."""

    ch: dict
    c: dict
    x_inbox: Any
    dy_inbox: Any
    stash: Any
    acc: Any
    losses: Any
    kept: Any
    tokens: Any
    tgt: Any
    seg: Any
    forward: Callable
    backward: Callable
    strands: Callable


class StageStep:
    """One stage's whole step: the body of `Pipeline`'s shard_map, traced once. `run()` scans
    `tick` over the tick program; in a tick each chunk's action is one of `idle_tick`,
    `forward_tick`, `backward_tick` and `strands_tick` (an F and a B of two micro-batches),
    switched on the program's action, and then the outputs move between stages (`move`,
    `receive`). After the loop the stage reduces its gradients and sums the loss.

    blocks: this stage's gathered [1, L, ...]; shared: gathered embedding / head (folded:
    [1, ...], real on device 0 only); inputs, targets: [M, dp, b / dp, S], data-parallel
    device i's rows at index i; segs: their segment ids, like inputs, or None (one document
    per row); zs: the ZeRO specs of one stage (`ZeroSpecs.in_stage`). `run` returns the mean
    loss and the gradients in the OS spec (blocks [1, L, ...]), reduced over the stage's
    data-parallel devices.

    Looped, the device runs one chunk (virtual stage = stage). Folded, it runs two chunks per
    tick, one after the other: the down chunk (virtual stage d, layers from slot 0) and the up
    chunk (virtual stage 2 pp - 1 - d, layers after the down chunk's); the first embeds on
    device 0, the second ends in the head on device 0."""

    def __init__(self, pipe: "Pipeline", zs, blocks, shared, inputs, targets, segs=None):
        self.pipe, self.zs, self.mesh = pipe, zs, pipe.mesh
        self.inputs, self.targets, self.segs = inputs, targets, segs
        pp, prog = pipe.plan.pp, pipe.program
        self.pp, self.prog, self.folded = pp, prog, pipe.folded
        self.stage = stage = jax.lax.axis_index("pp")
        if self.folded:
            shared = jax.tree.map(lambda a: a[0], shared)
            sizes = jnp.asarray(pipe.plan.chunk_layers(), jnp.int32)[stage]
            self.chunks = [
                dict(vstage=stage, first=stage == 0, last=False, n=sizes[0], offset=None),
                dict(vstage=2 * pp - 1 - stage, first=False, last=stage == 0, n=sizes[1],
                     offset=sizes[0])]
            L = max(max(c) for c in pipe.plan.chunk_layers())
        else:
            self.chunks = [dict(vstage=stage, first=stage == 0, last=stage == pp - 1,
                                n=jnp.asarray(pipe.plan.stage_layers, jnp.int32)[stage],
                                offset=None)]
            L = pipe.plan.max_stage_layers
        self.shared = shared
        self.blocks = blocks = jax.tree.map(lambda a: a[0], blocks)
        self.paired = prog.paired  # some tick runs two strands (an F and a B)
        keys = ["action", "microbatch", "x_slot", "stash_slot", "dy_slot", "x_recv_slot",
                "dy_recv_slot"] + (["b_microbatch", "b_stash_slot"] if self.paired else [])
        self.columns = [{k: jnp.asarray(getattr(prog, k))[:, ch["vstage"]] for k in keys}
                        for ch in self.chunks]
        if self.folded:
            self.sends = {k: jnp.asarray(v) for k, v in folded_sends(pipe.schedule, pp).items()}
        else:
            self.sends = {"send_x": jnp.asarray(prog.sends_activation),
                          "send_dy": jnp.asarray(prog.sends_gradient)}

        # Every value of a micro-batch is per data-parallel device: activations [dp, b / dp, S,
        # d], and parameter gradients [dp, ...] partial sums (zero.per_device), which only the
        # ZeRO kernels reduce -- G-group reduce-scatter after each B, the rest after the loop.
        self.n_dp = n_dp = inputs.shape[1]
        self.act = act = (n_dp, *inputs.shape[2:], pipe.cfg.d_model)
        self.dtype = dtype = jnp.dtype(pipe.cfg.dtype)
        self.act_names = (shd.DEVICE, "batch", "length", "embed")
        self.zero_act = pipe._buffer(act, dtype, self.act_names)
        self.zero_shared = jax.tree.map(lambda a: jnp.zeros((n_dp, *a.shape), a.dtype), shared)
        # With s_g = 1 the accumulator holds each device's own partial sums [dp, ...], so a B
        # adds its layer gradients into it in place; otherwise a B's gradients start from zero
        # (mapped to [dp, ...] by the vmap) and are reduce-scattered into it.
        self.in_place = not zs.axes.g
        self.zero_blocks = jax.tree.map(jnp.zeros_like, blocks)

        self.embed = zero.per_device(pipe._embed, (None, 0))
        self.embed_pullback = zero.per_device(
            lambda sh, tokens, dx: jax.vjp(lambda s: pipe._embed(s, tokens), sh)[1](dx)[0],
            (None, 0, 0))
        self.head = zero.per_device(self._head, (None, 0, 0))

        # One extra scratch slot each. A stash slot holds every layer's residuals (the layer
        # inputs alone with remat 'full') and the stage output.
        self.shapes, pipe._residuals = pipe.residual_shapes(blocks, act[1:], dtype,
                                                            segs is not None)
        self.slots = prog.stash_slots + 1
        self.L = L
        self.forward_pairs = [(s, s + 1) for s in range(pp - 1)]
        self.backward_pairs = [(s + 1, s) for s in range(pp - 1)]

    def _head(self, sh, kept, tgt):  # the last stage's B starts from the loss of its rows
        loss, pb = jax.vjp(lambda s, y: self.pipe._head_loss(s, y, tgt), sh, kept["out"])
        g_head, dy = pb(jnp.float32(1.0))
        return loss, dy, g_head

    # --- buffers ---------------------------------------------------------------------------
    def read(self, buf, slot, names):  # cond branches must agree on sharding, so pin the read
        return nn.with_logical_constraint(buf[slot], names)

    def read_stash(self, stash, slot):
        return {"res": [r[slot] for r in stash["res"]],
                "out": self.read(stash["out"], slot, self.act_names)}

    def new_buffers(self):
        """(activation inbox, gradient inbox, stash) of one chunk."""
        prog, act, dtype, names = self.prog, self.act, self.dtype, self.act_names
        return (self.pipe._buffer((prog.x_slots + 1, *act), dtype, (None, *names)),
                self.pipe._buffer((prog.dy_slots + 1, *act), dtype, (None, *names)),
                {"res": [jnp.zeros((self.slots, self.n_dp, self.L, *r.shape), r.dtype)
                         for r in self.shapes],
                 "out": self.pipe._buffer((self.slots, *act), dtype, (None, *names))})

    # --- one chunk's action in a tick ------------------------------------------------------
    def chunk_tick(self, ch, c, bufs, acc, losses):
        """One chunk's action in this tick: (output, input gradient, buffers, acc, losses)."""
        pipe, in_place = self.pipe, self.in_place
        x_inbox, dy_inbox, stash = bufs
        m = c["microbatch"]
        t = ChunkTick(
            ch=ch, c=c, x_inbox=x_inbox, dy_inbox=dy_inbox, stash=stash, acc=acc, losses=losses,
            forward=zero.per_device(functools.partial(pipe.layers_forward, offset=ch["offset"]),
                                    (None, 0, None, 0, 0)),
            backward=zero.per_device(
                functools.partial(pipe.layers_backward, offset=ch["offset"]),
                (None, 0, 0, None, 0 if in_place else None)),
            strands=zero.per_device(
                functools.partial(pipe.layers_strands, offset=ch["offset"]),
                (None, 0, 0, 0, 0, None, 0 if in_place else None, 0)),
            tokens=self.inputs[m], tgt=self.targets[m],
            seg=None if self.segs is None else self.segs[m],
            # Only the stash slots in use go through the switch (the whole stash would be
            # copied): the action's, and in a two-strand tick also the backward's.
            kept=self.read_stash(stash, c["stash_slot"]))
        branches = [self.idle_tick, self.forward_tick, self.backward_tick]
        if self.paired:
            branches.append(self.strands_tick)
        y, dx, kept, acc, losses = jax.lax.switch(c["action"], [functools.partial(b, t)
                                                                for b in branches])
        written = jnp.where(c["action"] == tp.BACKWARD, self.prog.stash_slots, c["stash_slot"])
        stash = jax.tree.map(lambda buf, v: buf.at[written].set(v), stash, kept)
        return y, dx, (x_inbox, dy_inbox, stash), acc, losses

    def start_forward(self, t: ChunkTick):
        return jax.lax.cond(t.ch["first"], lambda: self.embed(self.shared, t.tokens),
                            lambda: self.read(t.x_inbox, t.c["x_slot"], self.act_names))

    def start_backward(self, t: ChunkTick, kept, tgt):
        """(loss, output gradient, head gradients): from the loss on the last chunk."""
        return jax.lax.cond(
            t.ch["last"], lambda: self.head(self.shared, kept, tgt),
            lambda: (jnp.zeros((self.n_dp,), jnp.float32),
                     self.read(t.dy_inbox, t.c["dy_slot"], self.act_names), self.zero_shared))

    def finish_backward(self, t: ChunkTick, tokens, dx, g_head, g_blocks, loss):
        """(accumulator, loss sum) after a backward: the embedding's pullback on the first
        chunk, then every gradient into the accumulator."""
        acc_shared, _ = split_shared(t.acc)
        g_embed = jax.lax.cond(t.ch["first"],
                               lambda: self.embed_pullback(self.shared, tokens, dx),
                               lambda: self.zero_shared)
        g_shared = jax.tree.map(jnp.add, g_head, g_embed)
        if self.in_place:
            acc_new = join_shared(jax.tree.map(jnp.add, acc_shared, g_shared), g_blocks)
        else:
            acc_new = jax.tree.map(jnp.add, t.acc, zero.scatter_grads(
                join_shared(g_shared, g_blocks), self.zs, self.mesh))
        return acc_new, t.losses + loss

    def grads_into(self, t: ChunkTick):
        return split_shared(t.acc)[1] if self.in_place else self.zero_blocks

    def idle_tick(self, t: ChunkTick):
        return self.zero_act, self.zero_act, t.kept, t.acc, t.losses

    def forward_tick(self, t: ChunkTick):
        y, kept_new = t.forward(self.blocks, self.start_forward(t), t.ch["n"], t.kept, t.seg)
        return y, self.zero_act, kept_new, t.acc, t.losses

    def backward_tick(self, t: ChunkTick):
        loss, dy, g_head = self.start_backward(t, t.kept, t.tgt)
        dx, g_blocks = t.backward(self.blocks, t.kept, dy, t.ch["n"], self.grads_into(t))
        return (self.zero_act, dx, t.kept) + self.finish_backward(t, t.tokens, dx, g_head,
                                                                   g_blocks, loss)

    def strands_tick(self, t: ChunkTick):
        """F of `microbatch` and B of `b_microbatch`."""
        mb = t.c["b_microbatch"]
        kept_b = self.read_stash(t.stash, t.c["b_stash_slot"])
        loss, dy, g_head = self.start_backward(t, kept_b, self.targets[mb])
        y, kept_new, dx, g_blocks = t.strands(self.blocks, self.start_forward(t), t.kept, kept_b,
                                              dy, t.ch["n"], self.grads_into(t), t.seg)
        return (y, dx, kept_new) + self.finish_backward(t, self.inputs[mb], dx, g_head,
                                                        g_blocks, loss)

    # --- between ticks ---------------------------------------------------------------------
    def move(self, flag, value, pairs):  # the flags are the same on every stage: one branch
        return jax.lax.cond(flag, lambda: jax.lax.ppermute(value, "pp", pairs),
                            lambda: self.zero_act)

    def receive(self, bufs, c, x_recv, dy_recv):
        x_inbox, dy_inbox, stash = bufs
        return (x_inbox.at[c["x_recv_slot"]].set(x_recv),
                dy_inbox.at[c["dy_recv_slot"]].set(dy_recv), stash)

    def tick(self, carry, xs):
        bufs, acc, losses = carry
        cols, f = xs
        outs, new = [], []
        for ch, c, b in zip(self.chunks, cols, bufs):
            y, dx, b, acc, losses = self.chunk_tick(ch, c, b, acc, losses)
            outs.append((y, dx))
            new.append(b)
        fwd, bwd = self.forward_pairs, self.backward_pairs
        if not self.folded:  # activations s -> s + 1, gradients s -> s - 1
            (y, dx), = outs
            x_recv = self.move(f["send_x"], y, fwd)
            dy_recv = self.move(f["send_dy"], dx, bwd)
            return ((self.receive(new[0], cols[0], x_recv, dy_recv),), acc, losses), None
        # Folded: down chunks pass activations down (+1) and gradients up (-1), up chunks
        # the other way; at the turn device pp - 1 hands its own outputs over.
        (y_down, dx_down), (y_up, dx_up) = outs
        turn = self.stage == self.pp - 1
        x_down = self.move(f["down_x"], y_down, fwd)
        x_up = jnp.where(turn, y_down, self.move(f["up_x"], y_up, bwd))
        dy_up = self.move(f["up_dy"], dx_up, fwd)
        dy_down = jnp.where(turn, dx_up, self.move(f["down_dy"], dx_down, bwd))
        return ((self.receive(new[0], cols[0], x_down, dy_down),
                 self.receive(new[1], cols[1], x_up, dy_up)), acc, losses), None

    def run(self):
        pp, zs, n_dp = self.pp, self.zs, self.n_dp
        like = join_shared(self.shared, self.blocks)
        losses = nn.with_logical_constraint(jnp.zeros((n_dp,), jnp.float32), (shd.DEVICE,))
        carry = (tuple(self.new_buffers() for _ in self.chunks),
                 zero.new_accumulator(like, zs, self.mesh), losses)
        (_, acc, losses), _ = jax.lax.scan(self.tick, carry, (self.columns, self.sends))
        # Once per step, in the stage: reduce over its data-parallel devices to OS shards ...
        grads, loss = zero.finish_grads(acc, losses, zs, self.mesh,
                                        1.0 / (self.pipe.plan.microbatches * n_dp))
        g_shared, g_blocks = split_shared(grads)
        if self.folded:  # only device 0 has shared gradients, and keeps them
            loss = ring_sum(loss, pp)
            return loss, jax.tree.map(lambda g: g[None], g_blocks), jax.tree.map(
                lambda g: g[None], g_shared)
        # ... then sum the shared parameters' OS shards and the loss around the ring of stages.
        loss, g_shared = ring_sum((loss, g_shared), pp)
        return loss, jax.tree.map(lambda g: g[None], g_blocks), g_shared


def split_shared(tree) -> tuple[dict, Any]:
    """A parameter-shaped tree -> (its unstacked part: embedding, final norm, head; its
    `layers/block` leaves)."""
    return {k: v for k, v in tree.items() if k != "layers"}, tree["layers"]["block"]


def join_shared(shared: dict, blocks):
    """The inverse of `split_shared`."""
    return {**shared, "layers": {"block": blocks}}


def onehot_cross_entropy(logits, targets):
    """`layers.cross_entropy` (mean next-token NLL) picking the target's log-probability with a
    one-hot contraction instead of a gather: XLA 0.10's SPMD partitioner aborts on
    `take_along_axis` over the tp-sharded vocabulary inside a shard_map with manual 'pp'.
    The one-hot sum adds exact zeros, so values and gradients are the same bits."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(targets, logp.shape[-1], dtype=logp.dtype),
                             axis=-1))


def ring_sum(tree, pp: int):
    """Sum over the 'pp' axis by passing every stage's contribution around the ring of stages
    (pp - 1 ppermutes), so stages exchange data only point-to-point. Inside shard_map over
    'pp'; each stage adds the same values in its own order, so the results are bit-identical
    when at most two stages contribute non-zeros (a + b == b + a, x + 0 == x)."""
    ring = [(s, (s + 1) % pp) for s in range(pp)]
    total = passed = tree
    for _ in range(pp - 1):
        passed = jax.lax.ppermute(passed, "pp", ring)
        total = jax.tree.map(jnp.add, total, passed)
    return total


__all__ = ["Pipeline", "StageLayout", "to_stages", "from_stages", "stack_layers",
           "unstack_layers", "slot_mask", "freeze_padding", "check_plan", "ring_sum", "onehot_cross_entropy",
           "STAGE_AXIS"]

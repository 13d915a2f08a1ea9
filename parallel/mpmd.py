"""The MPMD pipeline executor: one compiled program per stage, stages run asynchronously.

Each stage s lives on its own sub-mesh (the plan's dp x tp devices of stage s; axes
`DP_AXES + ('tp',)`) and holds exactly its own parameters and optimizer state: the embedding
only on the first stage, its layers `plan.layer_range(s)` (no padding), the final norm and the
head only on the last. A tied embedding is held by both the first and the last stage; its
gradient is summed between those two stages only, so both copies take identical updates.

A stage's work is cut into *pieces* (the embedding, each layer, the head + loss). Every program
runs per data-parallel device (`zero.per_device`: activations [dp, b / dp, ...], parameter
gradients [dp, ...] partial sums) on the stage's sub-mesh, with the ZeRO kernels of
`hetjax.parallel.zero_sharding` -- gather P once per step, reduce-scatter each backward's gradients into the G
accumulator, reduce across replicas once:

- F(m): the stage's forward of micro-batch m, taking a `jax.vjp` of every piece; the pullbacks'
  residuals are the stash. Parameters a pullback holds as residuals are not stashed again: at
  trace time a residual that *is* one of the program's parameter inputs is replaced by a
  reference to it, and B passes the parameters back in (so a stash holds activations, not
  weight copies). What the residuals are follows `model.remat`: `none` keeps every
  intermediate (three forwards' work per layer per step), `dots` keeps matmul outputs, `full`
  keeps only each layer's input and recomputes the layer in the backward (four forwards).
- B(m): pull the output gradient back through the pieces (the last stage starts from the loss),
  accumulating parameter gradients; or, split for zero-bubble schedules, I(m) pulls back only
  the activation gradients (XLA drops the weight-gradient work) and keeps each piece's output
  gradient, and W(m) computes the weight gradients from them.
- A stage's last backward of the step is followed by the reduction of its gradients across
  its replicas, while other stages still work: in the same program (so XLA may overlap it with
  the remaining layers' backward) when that backward sends nothing on, else in its own.
- The update: the global gradient norm is summed from one scalar per stage; each stage clips
  with it and applies the optimizer to its own OS shards.

The schedule is lowered once to a program (`hetjax.core.program`: per stage, run F / B / I / W,
send, receive, reduce, free, interleaved in the issue order, the schedule's unit-time timeline,
so no global tick exists). One controller (this Python thread) interprets it, one method per
op kind; JAX dispatches the stages' programs asynchronously, each waiting only for its own
inputs, and a send is a `jax.device_put` onto the receiving stage, also asynchronous. (On one
CPU process the simulated devices do not really run in parallel; see docs/pipeline.md for
where the timing is measured.)
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hetjax import checkpoint as hckpt
from hetjax.layers import Transformer
from hetjax.core import program as pg
from hetjax.parallel import sharding as shd
from hetjax.parallel import zero_sharding as zero
from hetjax.parallel.train_state import Executor, TrainState, opt_state_specs, skip_unless_finite
from hetjax.parallel.mesh import DP_AXES, build_mesh, build_stage_mesh
from hetjax.parallel.pipeline import check_plan, onehot_cross_entropy
from hetjax.parallel.residuals import Residuals, effective_remat, layer_fn, pullback, vjp_stash
from hetjax.core.plan import even_split, resolve_schedule

@flax.struct.dataclass
class MpmdState:
    """The train state of every stage, each on its own sub-mesh, in the stage's own layout:
    `{'embedder'?, 'layers': {'block': [n_s, ...]}, 'final_norm'?, 'lm_head'?}`."""

    stages: tuple[TrainState, ...]

    @property
    def step(self):
        return self.stages[0].step


# --- the natural layout <-> one tree per stage ------------------------------------------------
@dataclass(frozen=True)
class Chunk:
    """One model chunk (virtual stage): `index` in model order, run by pipeline stage `stage`
    as its chunk number `position`, with model layers `layers`, which sit at
    `offset .. offset + len(layers) - 1` of that stage's stacked layers."""

    index: int
    stage: int
    position: int
    layers: range
    offset: int
    first: bool  # starts from the tokens (embedding)
    last: bool  # ends with the head and the loss


def model_chunks(stage_layers, placement) -> list[Chunk]:
    """The model cut into chunks in model order: `placement[k]` is the stage running model
    chunk k; each stage's `stage_layers[s]` layers are split as evenly as possible over its
    chunks (earlier chunks take the remainder)."""
    count = [list(placement).count(s) for s in range(len(stage_layers))]
    sizes = {s: list(even_split(stage_layers[s], count[s])) for s in range(len(stage_layers))
             if count[s]}
    chunks, start, seen, offset = [], 0, [0] * len(stage_layers), [0] * len(stage_layers)
    for k, s in enumerate(placement):
        n = sizes[s][seen[s]]
        chunks.append(Chunk(k, s, seen[s], range(start, start + n), offset[s], k == 0,
                            k == len(placement) - 1))
        start += n
        seen[s] += 1
        offset[s] += n
    return chunks


def _shared_keys(chunks: list[Chunk], tied: bool) -> tuple[str, ...]:
    """Top-level parameters a stage running `chunks` holds besides its layers."""
    keys = ["embedder"] if any(c.first for c in chunks) else []
    if any(c.last for c in chunks):
        keys += ["final_norm", "embedder" if tied else "lm_head"]
    return tuple(dict.fromkeys(keys))


def stage_tree(tree: dict, chunks: list[Chunk], tied: bool) -> dict:
    """A stage's part of a natural parameter-shaped tree (boxed or not): its shared
    parameters and its chunks' layers of every block leaf, stacked in chunk order."""
    def cut(x):
        if isinstance(x, nn.Partitioned):
            return x.replace(value=cut(x.value))
        xp = np if isinstance(x, np.ndarray) else jnp
        return xp.concatenate([x[c.layers.start:c.layers.stop] for c in chunks])

    out = {k: tree[k] for k in _shared_keys(chunks, tied)}
    out["layers"] = {"block": jax.tree.map(cut, tree["layers"]["block"],
                                           is_leaf=lambda x: isinstance(x, nn.Partitioned))}
    return out


def merge_trees(trees: list[dict], chunks_of: list[list[Chunk]]) -> dict:
    """The natural tree from the stages' trees (the inverse of `stage_tree`): shared
    parameters from the first stage that holds them, block leaves in model layer order."""
    out: dict[str, Any] = {}
    for t in trees:
        for k, v in t.items():
            if k != "layers":
                out.setdefault(k, v)
    parts = sorted((c.layers.start, s, c) for s, cs in enumerate(chunks_of) for c in cs)

    def merge(*xs):
        return jnp.concatenate([xs[s][c.offset:c.offset + len(c.layers)] for _, s, c in parts])

    out["layers"] = {"block": jax.tree.map(merge, *[t["layers"]["block"] for t in trees])}
    return out


def _map_param_trees(fn, leaf_fn, *trees):
    """Walk optimizer-state-like trees in parallel: `fn(*subtrees)` on every parameter-shaped
    dict (one with a 'layers' entry), `leaf_fn(*leaves)` on everything else (counts)."""
    t = trees[0]
    if isinstance(t, dict) and "layers" in t:
        return fn(*trees)
    if isinstance(t, tuple) and hasattr(t, "_fields"):
        return type(t)(*(_map_param_trees(fn, leaf_fn, *xs) for xs in zip(*trees)))
    if isinstance(t, (tuple, list)):
        return type(t)(_map_param_trees(fn, leaf_fn, *xs) for xs in zip(*trees))
    if isinstance(t, dict):
        return {k: _map_param_trees(fn, leaf_fn, *(x[k] for x in trees)) for k in t}
    return leaf_fn(*trees)


def merge_states(states: list[TrainState], chunks_of: list[list[Chunk]]) -> TrainState:
    """The natural TrainState (what checkpoints hold) from every stage's state, in stage
    order: parameters and optimizer moments merged in model layer order (`merge_trees`)."""
    return TrainState(
        step=states[0].step, params=merge_trees([t.params for t in states], chunks_of),
        opt_state=_map_param_trees(lambda *ts: merge_trees(list(ts), chunks_of),
                                   lambda *xs: xs[0], *[t.opt_state for t in states]))


# --- one stage -----------------------------------------------------------------------------
class Stage:
    """Pipeline stage s: its sub-mesh, shardings and compiled programs, for each of the model
    chunks it runs (one, or several with virtual stages)."""

    def __init__(self, ex: "MpmdExecutor", s: int, mesh: Mesh, chunks: list[Chunk],
                 boxed: dict):
        plan, cfg = ex.plan, ex.model_cfg
        self.ex = ex
        self.index = s
        self.mesh = mesh
        self.chunks = chunks
        self.holds_embedding = any(c.first for c in chunks)
        self.holds_head = any(c.last for c in chunks)
        self.n_dp = plan.ep_replicas(s)
        self.rules = shd.LOGICAL_RULES
        self.abstract = nn.unbox(boxed)
        self.zs = zero.zero_specs(self.abstract, shd.param_specs(boxed, self.rules),
                                  shd.logical_specs(boxed), plan.zero)
        abstract_opt = jax.eval_shape(ex.tx.init, self.abstract)
        self.state_sharding = shd.named(mesh, TrainState(
            step=P(), params=self.zs.p,
            opt_state=opt_state_specs(ex.tx, abstract_opt, self.zs.os)))
        self.os_sharding = shd.named(mesh, self.zs.os)
        self.activation = NamedSharding(mesh, P(DP_AXES))  # [dp, b / dp, S, d]
        self.rows = self.activation  # [b, S, d], the rows split over dp: what crosses shapes
        self.scalar = NamedSharding(mesh, P())
        self.batch = NamedSharding(mesh, shd.batch_spec())
        self.model = Transformer(cfg)
        self.remat = effective_remat(cfg.remat)
        # (chunk position, piece) -> how to rebuild its pullback, found while tracing F
        self._residuals: dict[tuple[int, int], Residuals] = {}
        self._jit()
        self._constants = None

    @property
    def constants(self) -> tuple:
        """(zeros [dp], ones [dp], the micro-batch indices): built once, on the stage's devices
        by a program. A `jax.device_put` of host values onto a mesh spanning processes would
        first check them equal across the processes (a blocking all-gather between them, which
        waits for their queued work) every time it is called."""
        if self._constants is None:
            dp, m = self.n_dp, self.ex.plan.microbatches
            with self.context():
                self._constants = jax.jit(
                    lambda: (jnp.zeros((dp,), jnp.float32), jnp.ones((dp,), jnp.float32),
                             tuple(jnp.int32(i) for i in range(m))),
                    out_shardings=(self.activation, self.activation, self.scalar))()
        return self._constants

    def context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(self.rules))
        return stack

    def per_device_rules(self):
        return nn.logical_axis_rules(shd.per_device_rules(self.rules))

    # --- pieces ------------------------------------------------------------------------------
    def pieces(self, full: dict) -> list[list]:
        """Gathered stage parameters -> for each chunk, the parameters of its pieces in forward
        order: the embedding (first model chunk), one tree per layer, the head (last)."""
        shared = {k: v for k, v in full.items() if k != "layers"}
        blocks = full["layers"]["block"]
        out = []
        for c in self.chunks:
            ps = [{"embedder": shared["embedder"]}] if c.first else []
            ps += [jax.tree.map(lambda a, i=i: a[i], blocks)
                   for i in range(c.offset, c.offset + len(c.layers))]
            if c.last:
                ps.append({k: shared[k] for k in shared if k != "embedder" or self.ex.tied})
            out.append(ps)
        return out

    def stage_grads(self, c: int, piece_grads: list) -> dict:
        """Chunk c's per-piece gradients -> the stage's parameter-shaped tree (its layers at
        their place in the stage's stack, zeros elsewhere)."""
        chunk, g = self.chunks[c], list(piece_grads)
        out = {k: jax.tree.map(jnp.zeros_like, v) for k, v in self.abstract.items()
               if k != "layers"}
        shared = ([g.pop(0)] if chunk.first else []) + ([g.pop()] if chunk.last else [])
        for piece in shared:  # zeros + g is exact
            out.update({k: jax.tree.map(jnp.add, out[k], v) for k, v in piece.items()})

        def place(leaf, *layer_grads):
            if not layer_grads:  # a chunk without layers (it passes its input on)
                return jnp.zeros(leaf.shape, leaf.dtype)
            before = jnp.zeros((chunk.offset, *leaf.shape[1:]), leaf.dtype)
            after = jnp.zeros((leaf.shape[0] - chunk.offset - len(layer_grads),
                               *leaf.shape[1:]), leaf.dtype)
            return jnp.concatenate([before, jnp.stack(layer_grads), after])

        out["layers"] = {"block": jax.tree.map(place, self.abstract["layers"]["block"], *g)}
        return out

    def _piece_fns(self, c: int, tokens, targets):
        """One function (params, input) -> output per piece of chunk c; the embedding's input
        is None (it starts from `tokens`), the head's output is the loss of `targets`."""
        model, layer, chunk = self.model, layer_fn(self.ex.model_cfg, self.remat), self.chunks[c]
        fns = []
        if chunk.first:
            fns.append(lambda p, _: model.apply({"params": p}, tokens, method=Transformer.embed))
        fns += [layer] * len(chunk.layers)
        if chunk.last:
            fns.append(lambda p, h: onehot_cross_entropy(
                model.apply({"params": p}, h, method=Transformer.head), targets))
        return fns

    # --- the programs (one device's rows; vmapped over data-parallel devices) -----------------
    def _forward_one(self, c, pieces, x, tokens, targets):
        """F of chunk c on one device's rows: returns the output (the loss after the last
        chunk) and, per piece, its pullback's residuals without the piece's parameters
        (`hetjax.parallel.residuals`)."""
        stash = []
        h = x
        for k, (fn, p) in enumerate(zip(self._piece_fns(c, tokens, targets), pieces)):
            if h is None:  # the embedding: no input gradient
                h, kept, self._residuals[c, k] = vjp_stash(lambda p_, fn=fn: fn(p_, None), p)
            else:
                h, kept, self._residuals[c, k] = vjp_stash(fn, p, h)
            stash.append(kept)
        return h, stash

    def _pullback(self, c: int, k: int, pieces: list, residuals: list):
        return pullback(self._residuals[c, k], pieces[k], residuals)

    def _input_grads_one(self, c, pieces, stash, dy):
        """I of chunk c on one device's rows: the gradient of the chunk's input, and the output
        gradient of every piece (what W needs)."""
        douts = [None] * len(stash)
        for k in reversed(range(len(stash))):
            douts[k] = dy
            grads = self._pullback(c, k, pieces, stash[k])(dy)
            dy = grads[1] if len(grads) > 1 else None
        return dy, douts

    def _backward_one(self, c, pieces, stash, dy):
        """B of chunk c on one device's rows: every pullback once, giving the chunk input's
        gradient and every piece's parameter gradient."""
        grads = [None] * len(stash)
        for k in reversed(range(len(stash))):
            g = self._pullback(c, k, pieces, stash[k])(dy)
            grads[k], dy = g[0], (g[1] if len(g) > 1 else None)
        return dy, self.stage_grads(c, grads)

    def _weight_grads_one(self, c, pieces, stash, douts):
        """W of chunk c on one device's rows: every piece's parameter gradient."""
        return self.stage_grads(c, [self._pullback(c, k, pieces, stash[k])(douts[k])[0]
                                    for k in range(len(stash))])

    def _jit(self):
        per_device = zero.per_device
        n = self.n_dp

        def gather(params):
            return self.pieces(zero.gather_params(params, self.zs, self.mesh))

        def forward(c, pieces, x, inputs, targets, m):
            chunk = self.chunks[c]
            tokens = zero.split_devices(inputs, n, axis=1)[m] if chunk.first else None
            tgt = zero.split_devices(targets, n, axis=1)[m] if chunk.last else None
            with self.per_device_rules():
                out, stash = per_device(functools.partial(self._forward_one, c),
                                        (None, 0, 0, 0))(pieces, x, tokens, tgt)
            if not chunk.last:
                out = jax.lax.with_sharding_constraint(out, self.activation)
            return out, stash

        def input_grads(c, pieces, stash, dy):
            with self.per_device_rules():
                dx, douts = per_device(functools.partial(self._input_grads_one, c),
                                       (None, 0, 0))(pieces, stash, dy)
            if dx is not None:
                dx = jax.lax.with_sharding_constraint(dx, self.activation)
            return dx, douts

        def weight_grads(c, pieces, stash, douts, acc):
            with self.per_device_rules():
                g = per_device(functools.partial(self._weight_grads_one, c),
                               (None, 0, 0))(pieces, stash, douts)
            return jax.tree.map(jnp.add, acc, zero.scatter_grads(g, self.zs, self.mesh))

        def backward(c, pieces, stash, dy, acc):
            with self.per_device_rules():
                dx, g = per_device(functools.partial(self._backward_one, c),
                                   (None, 0, 0))(pieces, stash, dy)
            if dx is not None:
                dx = jax.lax.with_sharding_constraint(dx, self.activation)
            return dx, jax.tree.map(jnp.add, acc, zero.scatter_grads(g, self.zs, self.mesh))

        def new_accumulator(params):
            return zero.new_accumulator(params, self.zs, self.mesh)

        def finish(acc, losses):
            # Every gradient descends from the loss, summed over the head stage's devices of
            # each micro-batch's mean: the mean loss divides by the head's dp, on every stage
            # (stages with different shapes have different dp).
            scale = 1.0 / (self.ex.plan.microbatches * self.ex.loss_dp)
            return zero.finish_grads(acc, losses, self.zs, self.mesh, scale)

        def squared_norm(grads):
            # The tied embedding's (summed) gradient counts once: on the stage of the first
            # model chunk.
            return optax.tree.norm({k: v for k, v in grads.items() if not (
                k == "embedder" and not self.holds_embedding)}, squared=True)

        def update(state, grads, g_norm):
            clip = self.ex.grad_clip
            if clip > 0:  # the global norm's clip; the optimizer's own clip then sees <= clip
                grads = jax.tree.map(lambda t: jax.lax.select(
                    g_norm < clip, t, (t / g_norm.astype(t.dtype)) * clip), grads)
            params = jax.lax.with_sharding_constraint(state.params, self.os_sharding)
            updates, opt_state = self.ex.tx.update(grads, state.opt_state, params)
            params = optax.apply_updates(params, updates)
            params = jax.lax.with_sharding_constraint(params, self.state_sharding.params)
            # g_norm is NaN when the loss is (MpmdExecutor.step): one flag for every stage.
            params, opt_state = skip_unless_finite(0.0, g_norm, (params, opt_state),
                                                   (state.params, state.opt_state))
            return TrainState(step=state.step + 1, params=params, opt_state=opt_state)

        def eval_forward(c, pieces, x, inputs, targets, m):
            out, _ = forward(c, pieces, x, inputs, targets, m)
            return out

        def last_backward(c, pieces, stash, dy, acc, losses):
            # The step's last backward of this stage and its gradient reduction in one
            # program, so XLA may overlap the reduction with the backward's remaining layers.
            dx, acc = backward(c, pieces, stash, dy, acc)
            return dx, finish(acc, losses)

        def last_weight_grads(c, pieces, stash, douts, acc, losses):
            return finish(weight_grads(c, pieces, stash, douts, acc), losses)

        chunked = dict(static_argnums=0)
        self.gather = jax.jit(gather)
        self.forward = jax.jit(forward, **chunked)
        self.backward = jax.jit(backward, donate_argnums=4, **chunked)
        self.last_backward = jax.jit(last_backward, donate_argnums=4, **chunked)
        self.input_grads = jax.jit(input_grads, **chunked)
        self.weight_grads = jax.jit(weight_grads, donate_argnums=4, **chunked)
        self.last_weight_grads = jax.jit(last_weight_grads, donate_argnums=4, **chunked)
        self.eval_forward = jax.jit(eval_forward, **chunked)
        self.new_accumulator = jax.jit(new_accumulator)
        self.finish = jax.jit(finish, donate_argnums=0)
        self.squared_norm = jax.jit(squared_norm)
        self.update = jax.jit(update, out_shardings=self.state_sharding, donate_argnums=0)
        self.add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
        # [dp, b / dp, ...] <-> [b, ...]: each device keeps its own rows (no traffic), so a
        # boundary between stages of different dp moves whole rows from device to device
        self.to_rows = jax.jit(lambda x: x.reshape(-1, *x.shape[2:]),
                               out_shardings=self.rows)
        self.from_rows = jax.jit(lambda x: zero.split_devices(x, n),
                                 out_shardings=self.activation)

    def run(self, fn, *args):
        with self.context():
            return fn(*args)


# --- the executor ----------------------------------------------------------------------------
@dataclass(eq=False)
class StepRun:
    """One step's run of the program on this process's stages: the position in `ops`, the
    buffers (stage, `program.Buffer`) -> value, and per stage the gathered pieces, the
    gradient accumulator and the loss sum (the head's; zeros elsewhere)."""

    ops: list
    inputs: Any
    targets: Any
    task_times: dict | None
    pieces: dict[int, list]
    acc: dict[int, Any]
    losses: dict[int, Any]
    buffers: dict[tuple[int, pg.Buffer], Any] = field(default_factory=dict)
    transit: dict[tuple[int, pg.Buffer], Any] = field(default_factory=dict)  # sent, not received
    finished: dict[int, Any] = field(default_factory=dict)
    position: int = 0


class MpmdExecutor(Executor):
    """Runs the plan's pipeline as one program per stage (see the module docstring)."""

    def __init__(self, plan, topology, model_cfg, tx, lr_schedule, grad_clip: float = 0.0):
        super().__init__(plan, topology, model_cfg, tx, lr_schedule)
        self._lower(grad_clip)
        devices = topology.jax_devices()
        # every stage's devices: checkpoints pass through it (replicated), so it needs no
        # shape; one (pp, ...) mesh when the stages share one
        self.mesh = build_mesh(plan, topology, devices) if plan.uniform else Mesh(
            np.array([devices[r] for r in plan.device_order]), ("devices",))
        boxed = jax.eval_shape(self._init_boxed, jax.random.key(0))
        self.stages = []
        for s in range(plan.pp):
            chunks = self.chunks_of(s)
            self.stages.append(Stage(
                self, s, build_stage_mesh(plan, topology, s, devices), chunks,
                jax.eval_shape(lambda b, c=chunks: stage_tree(b, c, self.tied), boxed)))
        first = self.stages[self.chunks[0].stage]
        last = self.stages[self.chunks[-1].stage]
        self.batch_sharding = {"inputs": first.batch, "targets": last.batch}
        self.local = list(range(plan.pp))  # the stages this process's state holds
        self._rows = None

    def _lower(self, grad_clip: float) -> None:
        """What every staged executor keeps of its plan: the schedule, its program (the ops
        each stage runs) and the model chunks it places."""
        check_plan(self.plan, self.model_cfg.n_layers)
        self.grad_clip = grad_clip
        self.tied = self.model_cfg.tie_embeddings
        self.schedule = resolve_schedule(self.plan)
        self.program = pg.lower(self.schedule)
        self.chunks = model_chunks(self.plan.stage_layers, self.schedule.placement())
        # the head stage's per-device loss slices (dp_s / ep)
        self.loss_dp = self.plan.ep_replicas(self.chunks[-1].stage)

    @classmethod
    def create(cls, plan, topology, model_cfg, optimizer, runtime):
        """Clipping by the global norm spans the stages' programs: the executor applies it."""
        return cls(plan, topology, model_cfg, optimizer.tx, optimizer.lr_schedule,
                   optimizer.grad_clip)

    def chunks_of(self, s: int) -> list[Chunk]:
        """The model chunks stage s runs, in its chunk order."""
        return sorted((c for c in self.chunks if c.stage == s), key=lambda c: c.position)

    def _init_boxed(self, key):
        tokens = jnp.zeros((1, self.plan.seq_len), jnp.int32)
        return self.model.init(key, tokens)["params"]

    def describe(self) -> str:
        kept = {"none": "all residuals kept", "dots": "matmul outputs kept",
                "full": "layers recomputed"}[effective_remat(self.model_cfg.remat)]
        shapes = "" if self.plan.uniform else " (its own mesh, dp x tp " + ", ".join(
            f"{d}x{t}" for d, t in self.plan.stage_shapes) + ")"
        return (f"pipeline: mpmd, {self.schedule.name}, {self.plan.microbatches} micro-batches, "
                f"one program per stage{shapes}, layers per stage "
                f"{list(self.plan.stage_layers)} "
                f"(no padding), at most {max(self.schedule.max_in_flight(s) for s in range(self.plan.pp))} "
                f"micro-batches stashed per stage ({kept}; model.remat={self.model_cfg.remat})")

    # --- state ---------------------------------------------------------------------------------
    def init_state(self, seed: int) -> MpmdState:
        natural = jax.jit(lambda k: nn.unbox(self._init_boxed(k)))(jax.random.key(seed))
        return self.from_natural_params(natural)

    def from_natural_params(self, natural) -> MpmdState:
        """Fresh optimizer states for natural parameters, split over the (local) stages."""
        stages = []
        for st in (self.stages[s] for s in self.local):
            params = stage_tree(natural, st.chunks, self.tied)

            def init(p):
                return TrainState(step=jnp.zeros((), jnp.int32), params=p,
                                  opt_state=self.tx.init(p))

            with st.context():
                stages.append(jax.jit(init, out_shardings=st.state_sharding)(
                    jax.device_put(params, st.state_sharding.params)))
        return MpmdState(stages=tuple(stages))

    def from_natural_state(self, natural: TrainState) -> MpmdState:
        """The (local) stages' states cut from a natural TrainState (what checkpoints hold):
        the one `from_natural` of every staged layout (`MpmdLayout`, `WorldsLayout`)."""
        stages = []
        for st in (self.stages[s] for s in self.local):
            def cut(tree, chunks=st.chunks):
                return stage_tree(tree, chunks, self.tied)

            stages.append(jax.device_put(TrainState(
                step=natural.step, params=cut(natural.params),
                opt_state=_map_param_trees(cut, lambda x: x, natural.opt_state)),
                st.state_sharding))
        return MpmdState(stages=tuple(stages))

    def params(self, state: MpmdState):
        return self._natural(lambda t: t.params, state)

    def _natural(self, get, state, sharding=None):
        """A natural tree merged from the stages' `get(stage state)` trees, on the full mesh
        (replicated unless `sharding` says otherwise)."""
        sharding = sharding or NamedSharding(self.mesh, P())
        parts = [jax.device_put(get(s), sharding) for s in state.stages]
        chunks_of = [st.chunks for st in self.stages]
        return jax.jit(lambda ps: merge_trees(ps, chunks_of), out_shardings=sharding)(parts)

    def checkpoint_layout(self, state) -> hckpt.Layout:
        return MpmdLayout(self, state)

    # --- the step ------------------------------------------------------------------------------
    def step(self, state: MpmdState, batch):
        lr = self.lr_at(state.step)  # before the update donates the state
        loss, grads, g_norm = self.stage_loss_and_grads(state, batch)
        # The non-finite guard: a non-finite loss marks the step so every stage skips it.
        first = self.stages[self.local[0]]
        g_norm = jnp.where(jnp.isfinite(jax.device_put(loss, first.scalar)), g_norm, jnp.nan)
        new = tuple(self.stages[s].run(self.stages[s].update, st, g,
                                       jax.device_put(g_norm, self.stages[s].scalar))
                    for s, st, g in zip(self.local, state.stages, grads))
        return MpmdState(stages=new), {"loss": loss, "grad_norm": g_norm, "lr": lr}

    def loss_and_grads(self, state: MpmdState, batch):
        """The mean loss and its gradients in the natural layout (on the full mesh)."""
        loss, grads, _ = self.stage_loss_and_grads(state, batch)
        return loss, self._natural(lambda g: g, MpmdState(stages=tuple(grads)))

    def stage_loss_and_grads(self, state: MpmdState, batch,
                             task_times: dict[tuple[int, str], list[float]] | None = None):
        """Run the schedule's tasks: the mean loss, each stage's gradients (OS shards, reduced
        across its replicas, the tied embedding's summed) and the global gradient norm.

        With `task_times` (for benchmarks) every task is waited for and its seconds appended
        under (stage, kind), which serialises the stages."""
        stages, chunks = self.stages, self.chunks
        finished = self.run_tasks(dict(enumerate(state.stages)), batch, task_times)
        head = stages[chunks[-1].stage]
        finished = [finished[s] for s in range(self.plan.pp)]
        grads = [g for g, _ in finished]
        embed = stages[chunks[0].stage]
        if self.tied and head is not embed:
            # the embedding's two gradients, summed between its two stages only
            a, b = grads[embed.index]["embedder"], grads[head.index]["embedder"]
            grads[embed.index] = {**grads[embed.index], "embedder": embed.run(
                embed.add, a, jax.device_put(b, embed.os_sharding["embedder"]))}
            grads[head.index] = {**grads[head.index], "embedder": head.run(
                head.add, jax.device_put(a, head.os_sharding["embedder"]), b)}
        sq = sum(jax.device_put(st.run(st.squared_norm, g), stages[0].scalar)
                 for st, g in zip(stages, grads))
        return finished[head.index][1], grads, jnp.sqrt(sq)

    def run_tasks(self, mine: dict[int, TrainState], batch,
                  task_times: dict[tuple[int, str], list[float]] | None = None) -> dict:
        """Interpret the step's program (`hetjax.core.program`) for the stages in `mine` (stage ->
        its state): one method per op kind, in the program's order. Returns, per stage, what
        its reduction gave: (its gradients reduced across its replicas, the mean loss on the
        head's stage)."""
        stages = self.stages
        step = StepRun(
            ops=[op for op in self.program.ops if op.stage in mine],
            inputs=batch.get("inputs"), targets=batch.get("targets"), task_times=task_times,
            pieces={s: stages[s].run(stages[s].gather, mine[s].params) for s in mine},
            acc={s: stages[s].run(stages[s].new_accumulator, mine[s].params) for s in mine},
            losses={s: stages[s].constants[0] for s in mine})
        handlers = {pg.Run: self.run_op, pg.Send: self.send, pg.Recv: self.recv,
                    pg.Reduce: self.reduce, pg.Free: self.free}
        for i, op in enumerate(step.ops):
            step.position = i
            handlers[type(op)](step, op)
        return step.finished

    def _call(self, step: "StepRun", s: int, key: str, fn, *args):
        """Stage s's program `fn`; waited for and timed under (s, key) with `task_times`."""
        if step.task_times is None:
            return self.stages[s].run(fn, *args)
        return _timed(self.stages[s], (s, key), step.task_times, fn, *args)

    def run_op(self, step: "StepRun", op: pg.Run) -> None:
        """One task of a stage: F, B, I or W of one model chunk and micro-batch."""
        {"F": self._forward, "B": self._backward, "I": self._input_grads,
         "W": self._weight_grads}[op.kind](step, op, self.stages[op.stage])

    def _forward(self, step, op, st):
        s, c, x = op.stage, op.stage_chunk, op.read("activation")
        out, step.buffers[s, op.written("stash")] = self._call(
            step, s, op.kind, st.forward, c, step.pieces[s][c],
            None if x is None else step.buffers[s, x], step.inputs, step.targets,
            st.constants[2][op.microbatch])
        y = op.written("activation")
        if y is None:  # the last model chunk: its output is the loss
            step.losses[s] = step.losses[s] + out
        else:
            step.buffers[s, y] = out

    def _pulled_back(self, step, op, st) -> tuple:
        """(chunk position, its pieces, its stash, its output gradient): what B and I read."""
        s, c, dy = op.stage, op.stage_chunk, op.read("gradient")
        return (c, step.pieces[s][c], step.buffers[s, op.read("stash")],
                st.constants[1] if dy is None else step.buffers[s, dy])  # the loss's: ones

    def _backward(self, step, op, st):
        s = op.stage
        if op.reduce:
            _, step.finished[s] = self._call(step, s, op.kind, st.last_backward,
                                             *self._pulled_back(step, op, st), step.acc[s],
                                             step.losses[s])
            return
        dx, step.acc[s] = self._call(step, s, op.kind, st.backward,
                                     *self._pulled_back(step, op, st), step.acc[s])
        if op.written("gradient") is not None:
            step.buffers[s, op.written("gradient")] = dx

    def _input_grads(self, step, op, st):
        s = op.stage
        dx, step.buffers[s, op.written("douts")] = self._call(
            step, s, op.kind, st.input_grads, *self._pulled_back(step, op, st))
        if op.written("gradient") is not None:
            step.buffers[s, op.written("gradient")] = dx

    def _weight_grads(self, step, op, st):
        s, c = op.stage, op.stage_chunk
        args = (c, step.pieces[s][c], step.buffers[s, op.read("stash")],
                step.buffers[s, op.read("douts")], step.acc[s])
        if op.reduce:
            step.finished[s] = self._call(step, s, op.kind, st.last_weight_grads, *args,
                                          step.losses[s])
        else:
            step.acc[s] = self._call(step, s, op.kind, st.weight_grads, *args)

    def reduce(self, step: "StepRun", op: pg.Reduce) -> None:
        """The stage's gradients reduced across its replicas, in a program of its own."""
        s = op.stage
        step.finished[s] = self._call(step, s, "reduce", self.stages[s].finish, step.acc[s],
                                      step.losses[s])

    def send(self, step: "StepRun", op: pg.Send) -> None:
        """Hand a buffer to another stage: an asynchronous device-to-device copy."""
        step.transit[op.peer, op.buffer] = self.move(step.buffers[op.stage, op.buffer],
                                                     op.stage, op.peer)

    def move(self, x, s: int, to: int):
        """An activation or its gradient ([dp_s, b / dp_s, ...] on stage s) onto stage `to`:
        one copy when the two stages split the rows alike (their tp may differ: activations
        are replicated over tp), else each row to the device of `to` that holds it there."""
        a, b = self.stages[s], self.stages[to]
        if a.n_dp == b.n_dp:
            return jax.device_put(x, b.activation)
        return b.run(b.from_rows, jax.device_put(a.run(a.to_rows, x), b.rows))

    def recv(self, step: "StepRun", op: pg.Recv) -> None:
        """The buffer another stage sent (the program sends before it receives)."""
        step.buffers[op.stage, op.buffer] = step.transit.pop((op.stage, op.buffer))

    def free(self, step: "StepRun", op: pg.Free) -> None:
        del step.buffers[op.stage, op.buffer]

    # --- batches and evaluation --------------------------------------------------------------
    def eval_loss(self, state: MpmdState, batch: dict[str, np.ndarray]) -> float:
        dev = self.put_batch(batch)
        pieces = [st.run(st.gather, s.params) for st, s in zip(self.stages, state.stages)]
        total = 0.0
        for m in range(self.plan.microbatches):
            x, prev = None, self.chunks[0].stage
            for chunk in self.chunks:
                st = self.stages[chunk.stage]
                x = None if x is None else self.move(x, prev, chunk.stage)
                prev = chunk.stage
                x = st.run(st.eval_forward, chunk.position, pieces[st.index][chunk.position], x,
                           dev["inputs"], dev["targets"], st.constants[2][m])
            total += float(jnp.mean(x))
        return total / self.plan.microbatches


def _timed(stage: Stage, key, times: dict, fn, *args):
    t = time.perf_counter()
    out = jax.block_until_ready(stage.run(fn, *args))
    times.setdefault(key, []).append(time.perf_counter() - t)
    return out


class MpmdLayout:
    """`hetjax.checkpoint.Layout` for an MPMD state: checkpoints hold the natural TrainState
    (parameters and optimizer moments merged from the stages, in global layer order). Between a
    restore and `from_natural` the natural state sits replicated on the plan's devices."""

    def __init__(self, ex: MpmdExecutor, state: MpmdState):
        self.ex = ex
        self.sharding = NamedSharding(ex.mesh, P())
        chunks_of = [st.chunks for st in ex.stages]
        self._merge = jax.jit(lambda states: merge_states(states, chunks_of),
                              out_shardings=self.sharding)
        self.target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.sharding),
            jax.eval_shape(self.to_natural, state))

    def to_natural(self, state: MpmdState) -> TrainState:
        return self._merge([jax.device_put(s, self.sharding) for s in state.stages])

    def natural_target(self):
        return self.target

    def from_natural(self, natural: TrainState) -> MpmdState:
        return self.ex.from_natural_state(natural)


__all__ = ["MpmdExecutor", "MpmdState", "MpmdLayout", "Stage", "Chunk", "model_chunks",
           "stage_tree", "merge_trees", "merge_states", "StepRun"]

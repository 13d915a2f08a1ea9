"""Executors: what runs one training step of a model under a Plan.

The Trainer (hetjax/train.py) owns the loop, the data and the hooks; it asks an `Executor` for
everything that depends on how the step is executed: the initial train state in its shardings,
one optimizer step on a batch, the parameters in the model's natural layout, the checkpoint
layout, how a host batch becomes device arrays, and the loss of a batch. `make_executor` is
the one place that chooses the implementation, from the Plan, the executor registry
(`hetjax.core.registry`) and the process's `Runtime`:

- `SingleProgramExecutor` -- the whole step is one jitted SPMD program over the plan's mesh.
  With pp = 1 the loss and gradients come from the ZeRO micro-batch loop
  (`hetjax.parallel.zero_sharding.accumulate_gradients`).
- `SpmdPipelineExecutor` -- the same single program, with the loss and gradients of the
  shard_map pipeline (`hetjax.parallel.pipeline.Pipeline`), parameters in the stage-stacked layout.
- the MPMD pipeline executor (`hetjax.parallel.mpmd`) -- one program per stage; across JAX worlds
  `hetjax.parallel.mpmd_worlds`.
- the DiLoCo executor (`hetjax.parallel.diloco`) -- for a `DilocoPlan`: sites that train alone on
  their own plans and exchange pseudo-gradients every few steps.

Executors get the optimizer (`Optimizer`: an optax transform, its learning-rate schedule and
clipping threshold) and the process's `Runtime` from the caller, so nothing below the Plan
reads the config or the environment. The interface itself and the train state
are in `hetjax.parallel.train_state`.
"""

from __future__ import annotations

import contextlib
import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from hetjax import checkpoint as hckpt
from hetjax.errors import PlanError
from hetjax.core.plan import DilocoPlan, Plan, raise_first
from hetjax.core.topology import Topology
from hetjax.layers import ModelConfig, moe
from hetjax.parallel import sharding as shd
from hetjax.parallel import zero_sharding as zero
from hetjax.parallel.mesh import build_mesh
from hetjax.core.registry import COMPOSITE, EXECUTORS, SINGLE_PROGRAM
from hetjax.parallel.train_state import (Executor, Optimizer, Runtime, TrainState, opt_state_specs,
                                  skip_unless_finite)


class SingleProgramExecutor(Executor):
    """The whole train step as one jitted SPMD program over the plan's mesh (pp = 1).

    The step takes the global batch as [micro-batches, batch / micro-batches, length],
    accumulates gradients over the micro-batches (ZeRO-sharded, `hetjax.parallel.zero_sharding`) and applies the
    optimizer on the optimizer-state shards. Parameter and optimizer-state shardings follow the
    parameters' logical axis names."""

    def __init__(self, plan, topology, model_cfg, tx, lr_schedule):
        super().__init__(plan, topology, model_cfg, tx, lr_schedule)
        self.mesh = build_mesh(plan, topology)
        self.rules = shd.LOGICAL_RULES
        self._build_shardings()
        # The batch comes placed by put_batch (batch_sharding); its keys vary (segment ids
        # only with document masks), so its shardings are taken from the arrays.
        self._step_fn = jax.jit(self._train_step,
                                in_shardings=(self.state_sharding, None),
                                out_shardings=(self.state_sharding, None), donate_argnums=0)
        self._eval_fn = None

    # --- layout hooks for subclasses --------------------------------------------------------
    def to_layout(self, boxed):
        """Natural (boxed) parameters -> the layout this executor keeps them in."""
        return boxed

    def from_layout(self, tree):
        """The inverse of `to_layout` on parameter-shaped trees."""
        return tree

    def loss_and_grads(self, params, batch):
        """Mean loss and gradients over the micro-batches of `batch` ([M, b, S] arrays).

        `params` are in the P spec. Gradients are accumulated in the G spec and reduced across
        data-parallel replicas once, after the micro-batch loop; they come back in the OS spec
        (parallel/zero_sharding.py accumulate_gradients). An MoE model's gradients include
        the routers' auxiliary losses (its loss is the cross-entropy)."""
        return self.loss_grads_metrics(params, batch)[:2]

    def loss_grads_metrics(self, params, batch):
        """`loss_and_grads` and the step's metrics besides them ({} for a dense model; an MoE
        model's `moe.moe_metrics`)."""
        if not self.model_cfg.is_moe:
            return (*zero.accumulate_gradients(jax.value_and_grad(self.loss_fn), params, batch,
                                               self.zero_specs, self.mesh, self.rules), {})
        loss, grads, stats = zero.accumulate_gradients(
            jax.value_and_grad(self.moe_loss_fn, has_aux=True), params, batch,
            self.zero_specs, self.mesh, self.rules, has_aux=True)
        return loss, grads, moe.moe_metrics(stats, moe.moe_loss(stats, self.model_cfg))

    # --- shardings and state ----------------------------------------------------------------
    def _init_boxed(self, key):
        tokens = jnp.zeros((1, self.plan.seq_len), jnp.int32)
        return self.to_layout(self.model.init(key, tokens)["params"])

    def _build_shardings(self):
        boxed = jax.eval_shape(self._init_boxed, jax.random.key(0))
        self.logical_specs = shd.logical_specs(boxed)
        abstract_params = nn.unbox(boxed)
        # ZeRO (parallel/zero_sharding.py): parameters are stored in the P spec, optimizer states in the
        # OS spec; gradients are accumulated in the G spec inside loss_and_grads.
        self.zero_specs = zero.zero_specs(abstract_params, shd.param_specs(boxed, self.rules),
                                          self.logical_specs, self.plan.zero)
        self.param_specs = self.zero_specs.p
        abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
        self.state_specs = TrainState(step=P(), params=self.param_specs,
                                      opt_state=opt_state_specs(self.tx, abstract_opt,
                                                                self.zero_specs.os))
        self.state_sharding = shd.named(self.mesh, self.state_specs)
        self.os_param_sharding = shd.named(self.mesh, self.zero_specs.os)
        self.batch_sharding = shd.named(self.mesh, {"inputs": shd.batch_spec(),
                                                    "targets": shd.batch_spec(),
                                                    "segment_ids": shd.batch_spec()})

    def context(self):
        """Mesh and logical-axis rules, active while tracing so activation constraints apply."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(self.rules))
        return stack

    def generation_context(self):
        """One stage: decode under the plan's mesh, its tp sharding kept; the few prompts are not
        split over the data axes."""
        if self.plan.pp != 1:
            return None
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(
            [(n, None if n == "batch" else a) for n, a in self.rules]))
        return stack

    def init_state(self, seed: int) -> TrainState:
        def init(key):
            params = nn.unbox(self._init_boxed(key))
            return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                              opt_state=self.tx.init(params))

        with self.context():
            return jax.jit(init, out_shardings=self.state_sharding)(jax.random.key(seed))

    def params(self, state):
        return self.from_layout(state.params)

    def checkpoint_layout(self, state) -> hckpt.Layout:
        return hckpt.NaturalLayout(hckpt.abstract_with_shardings(state, self.state_sharding))

    # --- the step ---------------------------------------------------------------------------
    def _train_step(self, state: TrainState, batch):
        loss, grads, extra = self.loss_grads_metrics(state.params, batch)
        # AdamW on the OS shards: each device updates the slice of its P shard it owns (a
        # local slice, no communication) ...
        params = jax.lax.with_sharding_constraint(state.params, self.os_param_sharding)
        updates, opt_state = self.tx.update(grads, state.opt_state, params)
        params = optax.apply_updates(params, updates)
        # ... and the refreshed parameters are re-gathered inside the OS sub-group to P.
        params = jax.lax.with_sharding_constraint(params, self.state_sharding.params)
        g_norm = optax.tree.norm(grads)
        # A non-finite loss or gradient skips the update inside the program (so every executor
        # built on this step does): the state keeps its parameters and moments, only the step
        # (and with it the data position) advances. The Trainer counts and reports such steps.
        params, opt_state = skip_unless_finite(loss, g_norm, (params, opt_state),
                                               (state.params, state.opt_state))
        metrics = {"loss": loss, "grad_norm": g_norm, "lr": self.lr_schedule(state.step), **extra}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    def step(self, state, batch):
        with self.context():
            return self._step_fn(state, batch)

    def compiled_step(self, state, segments: bool = False):
        """The compiled train step (for reading its HLO, cost and memory analyses); `segments`:
        of batches with segment ids (data.document_mask)."""
        keys = ("inputs", "targets") + (("segment_ids",) if segments else ())
        abstract_batch = {k: jax.ShapeDtypeStruct(
            (self.plan.microbatches, self.plan.microbatch_size, self.plan.seq_len), jnp.int32,
            sharding=self.batch_sharding[k]) for k in keys}
        with self.context():
            return self._step_fn.lower(state, abstract_batch).compile()

    def eval_loss(self, state, batch: dict[str, np.ndarray]) -> float:
        dev = self.put_batch(batch)

        def f(params, b):
            return jnp.mean(jax.vmap(lambda i, t, s: self.loss_fn(params, i, t, s))(
                b["inputs"], b["targets"], b.get("segment_ids")))

        if self._eval_fn is None:  # compile once, not at every evaluation
            self._eval_fn = jax.jit(f)
        with self.context():
            return float(self._eval_fn(self.params(state), dev))


class SpmdPipelineExecutor(SingleProgramExecutor):
    """The shard_map pipeline (`hetjax.parallel.pipeline`) as one SPMD program: parameters,
    gradients and optimizer states in the stage-stacked layout, padded slots frozen."""

    def __init__(self, plan, topology, model_cfg, tx, lr_schedule):
        from hetjax.parallel.pipeline import Pipeline, freeze_padding

        mesh = build_mesh(plan, topology)
        self.pipeline = Pipeline(plan, model_cfg, mesh)
        super().__init__(plan, topology, model_cfg, freeze_padding(tx, plan), lr_schedule)

    def to_layout(self, boxed):
        return self.pipeline.to_stages(boxed)

    def from_layout(self, tree):
        return self.pipeline.from_stages(tree)

    def loss_and_grads(self, params, batch):
        """The pipeline's loss and stage-stacked gradients in the OS spec, reduced across
        data-parallel replicas once, after its tick loop."""
        return self.pipeline.loss_and_grads(params, batch, self.zero_specs)

    def loss_grads_metrics(self, params, batch):
        return (*self.loss_and_grads(params, batch), {})

    def checkpoint_layout(self, state) -> hckpt.Layout:
        from hetjax.parallel.pipeline import StageLayout

        abstract = hckpt.abstract_with_shardings(state, self.state_sharding)
        return StageLayout(self.plan, abstract, self.state_sharding)

    def describe(self) -> str:
        return self.pipeline.describe()


def _load(target: str) -> type[Executor]:
    """The Executor subclass a registry entry names as "module:Class"."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def make_executor(plan: Plan | DilocoPlan, topology: Topology, model_cfg: ModelConfig,
                  optimizer: Optimizer, runtime: Runtime = Runtime()) -> Executor:
    """The executor that runs `plan`: the only place that chooses one.

    A plan of plans (a `DilocoPlan`) runs the executor its kind names
    (`hetjax.core.registry.COMPOSITE`); a multi-world job (`runtime.worlds`) runs the world
    executor of the plan's executor (`ExecutorKind.worlds`); a plan of one stage runs as one
    program (`SINGLE_PROGRAM`); a pipeline runs the executor the plan names
    (`hetjax.core.registry.EXECUTORS`). A plan with problems (`Plan.problems`: against the
    topology and the model) is one PlanError."""
    if plan.executor in COMPOSITE:  # each site's plan is checked by its own make_executor
        return _load(COMPOSITE[plan.executor]).create(plan, topology, model_cfg, optimizer,
                                                      runtime)
    # Every executor runs only a plan without problems (the Plan's rules, one definition).
    raise_first(plan.problems(topology, model_cfg.n_layers if model_cfg is not None else 0,
                              model_cfg))
    kind = EXECUTORS[plan.executor]
    if runtime.multi_world:
        if not kind.worlds:
            runs = [k.name for k in EXECUTORS.values() if k.worlds]
            raise PlanError(f"a multi-world job needs an executor that runs worlds, not "
                            f"{kind.name!r}. Fix: set --config.pipeline.executor="
                            f"{' or '.join(runs)}")
        target = kind.worlds
    elif plan.pp == 1:
        target = SINGLE_PROGRAM
    else:
        target = kind.build
    return _load(target).create(plan, topology, model_cfg, optimizer, runtime)


__all__ = ["Executor", "Optimizer", "Runtime", "SingleProgramExecutor", "SpmdPipelineExecutor",
           "TrainState", "make_executor", "opt_state_specs"]

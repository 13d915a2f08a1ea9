"""The train state and the executor interface every executor implements.

`TrainState` is the pytree one program's step updates (step, parameters, optimizer state);
`Executor` is what the Trainer asks of any executor (parallel/executor.py chooses one):
the initial state, one optimizer step, natural parameters, the checkpoint layout, batches and
evaluation. What an executor is built from besides the Plan comes in two small records:
`Optimizer` (the optax transform, its learning rate, its clipping threshold) and `Runtime`
(what the process's environment says: the worlds of a multi-world job and this process's
place in them), which the caller builds once. `opt_state_specs` maps parameter PartitionSpecs
through an optax state tree.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from typing import Any, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from hetjax import checkpoint as hckpt
from hetjax.errors import HetjaxError
from hetjax.core.plan import Plan
from hetjax.core.topology import Topology
from hetjax.layers import ModelConfig, Transformer, cross_entropy
from hetjax.layers import moe
from hetjax.layers.model import chunked_head_loss


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def skip_unless_finite(loss, grad_norm, new, old):
    """`new` (a pytree) when the step's loss and gradient norm are finite, else `old`: the
    non-finite guard every executor applies to its update."""
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def opt_state_specs(tx, abstract_opt_state, specs):
    """PartitionSpecs of the optimizer state: each parameter-shaped leaf takes its parameter's
    spec (optax.tree_map_params walks every transform of the chain); the rest is replicated."""
    return optax.tree_map_params(
        tx, lambda _, spec: spec, abstract_opt_state, specs,
        transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))


def batch_rows(plan: Plan, inputs_sharding) -> np.ndarray:
    """Rows of the global batch [B, S] that this process's devices hold, ascending (all rows in
    a single-process run), given the sharding of the [M, B / M, S] inputs.

    The batch is fed as [M, B / M, S] (row r is micro-batch r // (B / M)) with the middle axis
    split over data parallelism, so a process holds, in every micro-batch, the slices of its
    data-parallel positions."""
    m, b = plan.microbatches, plan.microbatch_size
    held = np.zeros((m, b), bool)
    for idx in inputs_sharding.addressable_devices_indices_map((m, b, plan.seq_len)).values():
        held[idx[0], idx[1]] = True
    return np.flatnonzero(held)


@dataclass(frozen=True)
class Optimizer:
    """The optimizer an executor applies: `tx`, its learning rate per step `lr_schedule`
    (reported as a metric), and `grad_clip`, the global-norm clipping threshold inside `tx`
    (0: none), which an executor whose gradients live on several programs applies itself."""

    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    grad_clip: float = 0.0


@dataclass(frozen=True)
class Runtime:
    """What an executor learns from its process rather than from the Plan. The caller builds it
    once from the environment the launcher set (`hetjax.train.runtime_from_environ`); the
    default is a single-world job.

    `worlds`: the job's worlds (`hetjax.planner.worlds.World`), empty unless the launcher
    started this process as one world of a multi-world job; `world` this
    process's index among them, `owner[rank]` the process (bridge rank) that runs topology rank
    `rank`, `bridge` this process's `hetjax.parallel.bridge.Bridge` to the other worlds;
    `init_timeout_s` how long the launcher lets processes wait for their peers (None: not
    launched)."""

    worlds: tuple = ()
    world: int = 0
    owner: Mapping[int, int] = field(default_factory=dict)
    bridge: Any = None
    init_timeout_s: float | None = None

    @property
    def multi_world(self) -> bool:
        return bool(self.worlds)


class Executor(abc.ABC):
    """Runs training steps of `model_cfg` under `plan` on `topology`'s devices.

    `tx` is the optimizer and `lr_schedule` its learning rate per step (reported as a metric).
    Everything the Trainer calls is declared here; the optional parts have defaults (the
    introspection of a single program -- mesh, shardings, the compiled step -- is None or a
    clear error for executors that run several programs).
    """

    pipeline = None  # the SPMD pipeline executor's shard_map `Pipeline`; None elsewhere
    writes_checkpoints = True  # False where another process of the job writes them (worlds)
    mesh = None  # the single program's mesh; None where there are several programs
    zero_specs = None  # its ZeRO PartitionSpecs (hetjax.parallel.zero_sharding.ZeroSpecs)
    state_sharding = None  # its train state's shardings
    # whether the step runs the Plan the caller planned (its memory prediction and lines
    # apply); False where it runs plans of its own (DiLoCo: each site's)
    runs_whole_plan = True

    @classmethod
    def create(cls, plan: Plan, topology: Topology, model_cfg: ModelConfig,
               optimizer: Optimizer, runtime: Runtime) -> "Executor":
        """The executor for `plan` (what `hetjax.parallel.executor.make_executor` calls): by default
        the optimizer's transform and learning rate; an executor that needs more (the clipping
        threshold, the runtime's worlds) overrides this."""
        return cls(plan, topology, model_cfg, optimizer.tx, optimizer.lr_schedule)

    def __init__(self, plan: Plan, topology: Topology, model_cfg: ModelConfig,
                 tx: optax.GradientTransformation, lr_schedule: optax.Schedule):
        self.plan = plan
        self.topology = topology
        self.model_cfg = model_cfg
        self.model = Transformer(model_cfg)
        self.tx = tx
        self.lr_schedule = lr_schedule
        self.lr_at = jax.jit(lr_schedule)  # one program, not the schedule's ops one by one
        self._rows = None

    @abc.abstractmethod
    def init_state(self, seed: int):
        """Fresh parameters and optimizer state from `seed`, in the executor's shardings."""

    @abc.abstractmethod
    def step(self, state, batch) -> tuple[Any, dict[str, jax.Array]]:
        """One optimizer step on a device batch (`put_batch`); returns the new state and the
        step's metrics (loss, grad_norm, lr) as device scalars (asynchronously dispatched)."""

    @abc.abstractmethod
    def params(self, state):
        """The parameters of `state` in the model's natural layout."""

    @abc.abstractmethod
    def checkpoint_layout(self, state) -> hckpt.Layout:
        """How `state` maps to the plan-independent checkpoint layout."""

    # --- batches: `batch_sharding` {"inputs", "targets"[, "segment_ids"]} of [M, B / M, S] ---
    @property
    def data_rows(self) -> np.ndarray:
        """Rows of the global batch [B, S] that this process's devices hold (`batch_rows`)."""
        if self._rows is None:
            self._rows = batch_rows(self.plan, self.batch_sharding["inputs"])
        return self._rows

    def put_batch(self, batch: dict[str, np.ndarray], rows: np.ndarray | None = None):
        """Numpy batch -> sharded device arrays [M, B / M, S] of the global batch [B, S].

        `batch` holds the global batch's rows `rows` (ascending; default all B rows); it must
        include every row this process's devices hold (`data_rows`)."""
        m, b = self.plan.microbatches, self.plan.microbatch_size
        rows = np.arange(m * b) if rows is None else np.asarray(rows)
        where = np.full(m * b, -1)  # global row -> its position in `batch`
        where[rows] = np.arange(len(rows))

        def shard(v, idx):
            pos = where[np.arange(m)[idx[0]][:, None] * b + np.arange(b)[idx[1]][None, :]]
            if (pos < 0).any():
                raise ValueError(f"process {jax.process_index()} was given batch rows "
                                 f"{rows.tolist()} but its devices hold rows "
                                 f"{self.data_rows.tolist()}")
            return v[pos][..., idx[2]]

        out = {}
        for k, v in batch.items():
            v = np.asarray(v, np.int32)
            out[k] = jax.make_array_from_callback((m, b, v.shape[1]), self.batch_sharding[k],
                                                  lambda idx, v=v: shard(v, idx))
        return out

    @abc.abstractmethod
    def eval_loss(self, state, batch: dict[str, np.ndarray]) -> float:
        """Mean loss of `state`'s parameters on a host global batch (no update)."""

    def finish(self) -> None:
        """After the last step, before the process ends (worlds: until the peers pulled this
        process's last messages). Nothing to do by default."""

    def describe(self) -> str:
        """Lines about the execution (schedule, stages) for `Trainer.describe`; may be ''."""
        return ""

    def exchanged_after(self, step: int) -> bool:
        """Whether an update beside the optimizer's own followed step `step` (DiLoCo: an
        outer step), so the next step's loss may be blamed on it. None by default."""
        return False

    def context(self):
        """The context tracing runs under (a single program: its mesh and logical-axis rules).
        Nothing by default."""
        return contextlib.nullcontext()

    def generation_context(self):
        """A context under which the natural parameters (`params`) decode where they are, or
        None (the default): gather them onto one device first."""
        return None

    def loss_and_grads(self, params, batch):
        """The loss and gradients of one batch without an update (HLO audits, tests)."""
        raise HetjaxError(f"the {type(self).__name__} has no loss_and_grads of its own; use a "
                          "plan with pp = 1 or pipeline.executor=spmd or mpmd")

    def compiled_step(self, state, segments: bool = False):
        """The compiled train step, for reading its HLO and analyses: only where the step is one
        program."""
        raise HetjaxError(f"the {type(self).__name__} runs its step as several programs, so "
                          "there is no single compiled step; use a plan with pp = 1 or "
                          "pipeline.executor=spmd")

    def loss_fn(self, params, inputs, targets, segment_ids=None):
        """The model's mean next-token loss on natural-layout parameters (segment_ids: the
        packer's documents, which attention does not cross; None: one per row)."""
        if self.model_cfg.loss_chunk_tokens:  # the f32 logits are never whole (memory)
            x = self.model.apply({"params": params}, self.model.apply(
                {"params": params}, inputs, method=Transformer.embed), segment_ids,
                method=Transformer.blocks)
            return chunked_head_loss(self.model, params, x, targets,
                                     self.model_cfg.loss_chunk_tokens)
        logits = self.model.apply({"params": params}, inputs, segment_ids)
        return cross_entropy(logits, targets)

    def moe_loss_fn(self, params, inputs, targets, segment_ids=None):
        """An MoE model's loss and its records: (cross-entropy, per-layer records
        (`moe.layer_stats`)). Its gradient includes the routers' auxiliary losses, which the
        layers add to the backward themselves (`moe.with_aux_gradient`)."""
        mutable = [moe.STATS]
        if self.model_cfg.loss_chunk_tokens:
            x = self.model.apply({"params": params}, inputs, method=Transformer.embed)
            x, st = self.model.apply({"params": params}, x, segment_ids,
                                     method=Transformer.blocks, mutable=mutable)
            ce = chunked_head_loss(self.model, params, x, targets,
                                   self.model_cfg.loss_chunk_tokens)
        else:
            logits, st = self.model.apply({"params": params}, inputs, segment_ids,
                                          mutable=mutable)
            ce = cross_entropy(logits, targets)
        return ce, moe.layer_stats(st)


__all__ = ["Executor", "Optimizer", "Runtime", "TrainState", "batch_rows", "opt_state_specs",
           "skip_unless_finite"]

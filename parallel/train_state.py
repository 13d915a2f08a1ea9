"""The train state and the executor interface every executor implements.

`TrainState` is the pytree one program's step updates (step, parameters, optimizer state);
`Executor` is what the Trainer asks of any executor (parallel/executor.py chooses one):
the initial state, one optimizer step, natural parameters, the checkpoint layout, batches and
evaluation. `opt_state_specs` maps parameter PartitionSpecs through an optax state tree.
"""

from __future__ import annotations

import abc
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from hetjax import checkpoint as hckpt
from hetjax.plan import Plan
from hetjax.topology import Topology
from layers import ModelConfig, Transformer, cross_entropy
from layers.model import chunked_head_loss


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


class Executor(abc.ABC):
    """Runs training steps of `model_cfg` under `plan` on `topology`'s devices.

    `tx` is the optimizer and `lr_schedule` its learning rate per step (reported as a metric).
    Everything the Trainer calls is declared here; the optional parts have defaults.
    """

    pipeline = None  # the SPMD pipeline executor's shard_map `Pipeline`; None elsewhere
    writes_checkpoints = True  # False where another process of the job writes them (worlds)

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


__all__ = ["Executor", "TrainState", "batch_rows", "opt_state_specs", "skip_unless_finite"]

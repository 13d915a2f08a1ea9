"""The trainer: builds model, optimizer, mesh and shardings from a config and a Plan, and runs
the jitted train step in a loop with metrics, progress and a final summary.

`Trainer(config)` is the Python entry point (`hetjax train` uses it too). `train()` resumes
from the latest checkpoint in the work directory, saves every `checkpoint.every` steps in the
background and at the end (`hetjax.checkpoint`), and reports how long each step waited for
input. The train step takes the global batch as [micro-batches, batch / micro-batches, length],
accumulates gradients over the micro-batches (ZeRO-sharded, `parallel.zero`), and applies AdamW
(warmup + cosine decay, global-norm clipping). Parameter and optimizer-state shardings follow
the parameters' logical axis names; optimizer-state specs are mapped from parameter specs
through the optax state tree.

With pp > 1 the trainer keeps the parameters (and so gradients and optimizer states) in the
stage-stacked layout of `parallel.pipeline` and hands forward and backward to its executor;
`Trainer.params` always returns the natural layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from hetjax import __version__, config as hconfig
from hetjax import checkpoint as hckpt
from hetjax.data import make_loader, padded_vocab
from hetjax.errors import HetjaxError
from hetjax.metrics import MetricsWriter, Progress, read_metrics
from hetjax.plan import Plan
from hetjax.planner import check_placement, plan_from_config
from hetjax.tokenizer import load_tokenizer
from hetjax.topology import Topology
from layers import ModelConfig, Transformer, cross_entropy
from parallel import sharding as shd
from parallel import zero
from parallel.mesh import build_mesh
from parallel.pipeline import Pipeline, StageLayout


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def learning_rate_schedule(t) -> optax.Schedule:
    """Linear warmup to `t.lr`, cosine decay to `t.lr * t.min_lr_ratio` at `t.steps`."""
    warmup = hconfig.warmup_steps(t)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=warmup,
        decay_steps=max(t.steps, warmup + 1), end_value=t.lr * t.min_lr_ratio)


def decay_mask(params):
    """Weight decay on matrices only: not on norm scales."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) != "scale", params)


def make_optimizer(t) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = learning_rate_schedule(t)
    adamw = optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                        mask=decay_mask)
    tx = optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw) if t.grad_clip > 0 else adamw
    return tx, schedule


def opt_state_specs(tx, abstract_opt_state, specs):
    """PartitionSpecs of the optimizer state: each parameter-shaped leaf takes its parameter's
    spec (optax.tree_map_params walks every transform of the chain); the rest is replicated."""
    return optax.tree_map_params(
        tx, lambda _, spec: spec, abstract_opt_state, specs,
        transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))


class Trainer:
    """Train a hetjax model from a config.

    >>> trainer = Trainer(load_config("configs/default.py", ["--config.train.steps=20"]))
    >>> summary = trainer.train()
    """

    def __init__(self, config, *, topology: Topology | None = None, plan: Plan | None = None,
                 workdir: str | None = None, quiet: bool = False):
        hconfig.validate(config)
        self.config = config
        self.quiet = quiet
        self.topology = topology or hconfig.build_topology(config)
        self.plan = plan or plan_from_config(config, self.topology)
        self.notes = check_placement(self.plan, self.topology, config.parallel.allow_straddle)
        self.workdir = workdir or config.workdir
        self.mesh = build_mesh(self.plan, self.topology)
        self.rules = shd.LOGICAL_RULES
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        self.model_cfg = ModelConfig.from_config(config.model,
                                                 padded_vocab(self.tokenizer.vocab_size))
        self.model = Transformer(self.model_cfg)
        self.pipeline = Pipeline(self.plan, self.model_cfg, self.mesh) if self.plan.pp > 1 \
            else None
        self.tx, self.schedule = make_optimizer(config.train)
        if self.pipeline:
            self.tx = self.pipeline.freeze_padding(self.tx)
        self.tokens_per_step = self.plan.global_batch * self.plan.seq_len
        self.flops_per_step = self.model_cfg.flops_per_token(self.plan.seq_len) * \
            self.tokens_per_step
        self._build_shardings()
        self._step_fn = jax.jit(self._train_step, in_shardings=(self.state_sharding,
                                                                self.batch_sharding),
                                out_shardings=(self.state_sharding, None), donate_argnums=0)
        self.state = self.init_state()
        # This process loads only the rows of each global batch that its devices hold.
        self.data_rows = self.process_batch_rows()
        self.data, self.data_spec = make_loader(config, self.tokenizer, self.data_rows)
        # Built now when evaluation is on, so missing held-out data stops the run before step 1.
        self._eval_data = make_loader(config, self.tokenizer, split="eval")[0] \
            if config.eval.every else None
        self._eval_fn = None
        self._checkpointer = None

    # --- shardings and state ------------------------------------------------------------------
    def _init_boxed(self, key):
        tokens = jnp.zeros((1, self.plan.seq_len), jnp.int32)
        boxed = self.model.init(key, tokens)["params"]
        return self.pipeline.to_stages(boxed) if self.pipeline else boxed

    def _build_shardings(self):
        boxed = jax.eval_shape(self._init_boxed, jax.random.key(0))
        self.logical_specs = shd.logical_specs(boxed)
        abstract_params = nn.unbox(boxed)
        # ZeRO (parallel/zero.py): parameters are stored in the P spec, optimizer states in the
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
                                                    "targets": shd.batch_spec()})

    def process_batch_rows(self) -> np.ndarray:
        """Rows of the global batch [B, S] that this process's devices hold, ascending (all
        rows in a single-process run).

        The batch is fed as [M, B / M, S] (row r is micro-batch r // (B / M)) with the middle
        axis split over data parallelism, so a process holds, in every micro-batch, the slices
        of its data-parallel positions."""
        m, b = self.plan.microbatches, self.plan.microbatch_size
        held = np.zeros((m, b), bool)
        index_map = self.batch_sharding["inputs"].addressable_devices_indices_map(
            (m, b, self.plan.seq_len))
        for idx in index_map.values():
            held[idx[0], idx[1]] = True
        return np.flatnonzero(held)

    def init_state(self) -> TrainState:
        """Fresh parameters from train.seed, created directly in their shardings."""
        def init(key):
            params = nn.unbox(self._init_boxed(key))
            return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                              opt_state=self.tx.init(params))

        with self._context():
            return jax.jit(init, out_shardings=self.state_sharding)(
                jax.random.key(self.config.train.seed))

    @property
    def params(self):
        """The current parameters in the model's natural layout (block leaves [n_layers, ...],
        no pipeline padding), whatever the plan."""
        p = self.state.params
        return self.pipeline.from_stages(p) if self.pipeline else p

    def _context(self):
        """Mesh and logical-axis rules, active while tracing so activation constraints apply."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(self.rules))
        return stack

    # --- the step -----------------------------------------------------------------------------
    def loss_fn(self, params, inputs, targets):
        logits = self.model.apply({"params": params}, inputs)
        return cross_entropy(logits, targets)

    def loss_and_grads(self, params, batch):
        """Mean loss and gradients over the micro-batches of `batch` ([M, b, S] arrays).

        `params` are in the P spec. Gradients are accumulated in the G spec and reduced across
        data-parallel replicas once, after the micro-batch loop; they come back in the OS spec
        (parallel/zero.py accumulate_gradients). With pp > 1 the pipeline executor runs the
        micro-batches with the same ZeRO kernels inside each stage (reduced once, after its
        tick loop) and returns the stage-stacked gradients in the OS spec."""
        if self.pipeline:
            return self.pipeline.loss_and_grads(params, batch, self.zero_specs)
        return zero.accumulate_gradients(jax.value_and_grad(self.loss_fn), params, batch,
                                         self.zero_specs, self.mesh, self.rules)

    def _train_step(self, state: TrainState, batch):
        loss, grads = self.loss_and_grads(state.params, batch)
        # AdamW on the OS shards: each device updates the slice of its P shard it owns (a
        # local slice, no communication) ...
        params = jax.lax.with_sharding_constraint(state.params, self.os_param_sharding)
        updates, opt_state = self.tx.update(grads, state.opt_state, params)
        params = optax.apply_updates(params, updates)
        # ... and the refreshed parameters are re-gathered inside the OS sub-group to P.
        params = jax.lax.with_sharding_constraint(params, self.state_sharding.params)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "lr": self.schedule(state.step)}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    def put_batch(self, batch: dict[str, np.ndarray], rows: np.ndarray | None = None):
        """Numpy batch -> sharded device arrays [M, B / M, S] of the global batch [B, S].

        `batch` holds the global batch's rows `rows` (ascending; default all B rows); it must
        include every row this process's devices hold (`self.data_rows`)."""
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

    def step(self, batch: dict[str, np.ndarray] | None = None) -> dict[str, jax.Array]:
        """One optimizer step on `batch` (default: the next batch of the data stream)."""
        batch = (self.put_batch(next(self.data), self.data_rows) if batch is None
                 else self.put_batch(batch))
        with self._context():
            self.state, metrics = self._step_fn(self.state, batch)
        return metrics

    def compiled_step(self):
        """The compiled train step (for reading its HLO, cost and memory analyses)."""
        abstract_batch = {k: jax.ShapeDtypeStruct(
            (self.plan.microbatches, self.plan.microbatch_size, self.plan.seq_len), jnp.int32,
            sharding=s) for k, s in self.batch_sharding.items()}
        with self._context():
            return self._step_fn.lower(self.state, abstract_batch).compile()

    def evaluate(self, batch: dict[str, np.ndarray]) -> float:
        """Loss of the current parameters on a global batch (no update)."""
        dev = self.put_batch(batch)

        def f(params, b):
            return jnp.mean(jax.vmap(lambda i, t: self.loss_fn(params, i, t))(
                b["inputs"], b["targets"]))

        if self._eval_fn is None:  # compile once, not at every evaluation
            self._eval_fn = jax.jit(f)
        with self._context():
            return float(self._eval_fn(self.params, dev))

    def eval_loss(self) -> float:
        """Mean loss on `eval.batches` fixed global batches of held-out data (every process
        reads them whole: evaluation is rare and rows are slices of a memory map)."""
        if self._eval_data is None:
            self._eval_data, _ = make_loader(self.config, self.tokenizer, split="eval")
        return float(np.mean([self.evaluate(self._eval_data.batch(k))
                              for k in range(self.config.eval.batches)]))

    # --- checkpoints --------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> str:
        return self.config.checkpoint.dir or os.path.join(self.workdir, "checkpoints")

    @property
    def checkpointer(self) -> hckpt.Checkpointer:
        if self._checkpointer is None:
            k = self.config.checkpoint
            self._checkpointer = hckpt.Checkpointer(self.checkpoint_dir, k.every, k.keep,
                                                    k.keep_best, k.async_save)
        return self._checkpointer

    def layout(self) -> hckpt.Layout:
        """How this trainer's state maps to the plan-independent checkpoint layout."""
        abstract = hckpt.abstract_with_shardings(self.state, self.state_sharding)
        if self.pipeline:
            return StageLayout(self.plan, abstract, self.state_sharding)
        return hckpt.NaturalLayout(abstract)

    def save(self, *, eval_loss: float | None = None, wait: bool = False) -> int:
        """Checkpoint the current step (state, data position, config, plan); returns the step.

        The save is asynchronous unless checkpoint.async_save is off or `wait` is set."""
        step = int(self.state.step)
        meta = {"step": step, "config": json.loads(self.config.to_json_best_effort()),
                "plan": self.plan.to_dict(), "data": self.data_spec.to_dict(),
                # All randomness is a function of the seed and the step: parameters are
                # initialised from the seed, the data order from the seed and the data state.
                "rng": {"seed": self.config.train.seed,
                        "prng_impl": str(jax.config.jax_default_prng_impl)},
                "hetjax_version": __version__}
        self.checkpointer.save(step, self.state, self.layout(), self.data.get_state(), meta,
                               eval_loss=eval_loss)
        if wait:
            self.checkpointer.wait()
        return step

    def restore(self, step: int | None = None) -> int | None:
        """Load checkpoint `step` (default: the latest complete one) into this trainer's plan
        and shardings, with the data position; returns its step, or None if there is none."""
        r = self.checkpointer.restore(self.layout(), step)
        if r is None:
            return None
        if r.meta.get("data") != self.data_spec.to_dict():
            raise HetjaxError(
                f"checkpoint {r.step} in {self.checkpoint_dir} was written for other data "
                f"({r.meta.get('data')}), this run reads {self.data_spec.to_dict()}; resume "
                "with the same data.*, train.seq_len, train.batch_size and train.seed, or use "
                "another workdir")
        self.state = r.state
        self.data.set_state(r.data_state)
        return r.step

    # --- the loop -----------------------------------------------------------------------------
    def describe(self) -> str:
        lines = [self.topology.describe(), self.plan.describe(self.topology)]
        lines += [f"  note: {n}" for n in self.notes]
        if self.pipeline:
            lines.append(self.pipeline.describe())
        m = self.model_cfg
        lines.append(f"model: {m.num_params / 1e6:.2f}M parameters, {m.n_layers} layers, "
                     f"d_model {m.d_model}, heads {m.n_heads} (kv {m.n_kv_heads}), d_ff {m.d_ff},"
                     f" vocab {m.vocab_size}, {m.dtype} compute")
        return "\n".join(lines)

    def _write_run_files(self):
        os.makedirs(self.workdir, exist_ok=True)
        with open(os.path.join(self.workdir, "plan.json"), "w") as f:
            f.write(self.plan.to_json(indent=1))
        with open(os.path.join(self.workdir, "topology.json"), "w") as f:
            f.write(self.topology.to_json(indent=1))
        with open(os.path.join(self.workdir, "config.json"), "w") as f:
            f.write(self.config.to_json_best_effort(indent=1))

    def train(self, steps: int | None = None) -> dict[str, Any]:
        """Train until step `steps` (default train.steps); returns the run summary.

        A fresh trainer first resumes from the latest checkpoint in its checkpoint directory."""
        cfg, ckpt = self.config.train, self.config.checkpoint
        total = steps if steps is not None else cfg.steps
        primary = jax.process_index() == 0
        resumed = self.restore() if ckpt.every and int(self.state.step) == 0 else None
        if primary:
            self._write_run_files()
            if resumed is not None:  # rows logged after that checkpoint were lost with it
                _drop_metrics_after(os.path.join(self.workdir, "metrics.jsonl"), resumed)
        writer = MetricsWriter(self.workdir, self.config.tensorboard, primary)
        progress = Progress(total, int(self.state.step), cfg.progress and not self.quiet,
                            cfg.log_every, primary)
        if resumed is not None and primary and not self.quiet:
            print(f"resumed from checkpoint {resumed} in {self.checkpoint_dir}", flush=True)
        start = int(self.state.step)
        first_loss = last = None
        t_start = time.perf_counter()
        t_after_first = t_mark = None
        mark_step = start
        waited_mark = waited_start = self.data.waited_s  # seconds next() blocked, so far
        # Evaluation and checkpoint saves are not training: their time is kept out of the
        # step time, tokens/s and MFU.
        aside = aside_mark = 0.0
        last_eval = None
        try:
            for step in range(start, total):
                metrics = self.step()
                done = step + 1
                e = self.config.eval.every
                evaluate = bool(e) and (done % e == 0 or done == total)
                save = bool(ckpt.every) and (done == total or self.checkpointer.should_save(done))
                if evaluate or save:
                    # The step is dispatched asynchronously: let it finish first, or its
                    # compute would be timed as evaluation or saving, not as training.
                    jax.block_until_ready((metrics, self.state))
                t_aside = time.perf_counter()
                eval_loss = self.eval_loss() if evaluate else None
                if save:
                    self.save(eval_loss=eval_loss)
                aside += time.perf_counter() - t_aside
                last_eval = eval_loss if eval_loss is not None else last_eval
                if done == start + 1 or done % cfg.log_every == 0 or done == total or \
                        eval_loss is not None:
                    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    now = time.perf_counter()
                    m["input_wait_s"] = (self.data.waited_s - waited_mark) / (done - mark_step)
                    waited_mark = self.data.waited_s
                    if eval_loss is not None:
                        m["eval_loss"] = eval_loss
                    if t_mark is None:  # the first step includes compilation: time it apart
                        t_after_first = t_mark = now
                        aside_first = aside
                        m["compile_and_step_s"] = now - t_start
                        first_loss = m["loss"]
                    else:
                        dt = (now - t_mark - (aside - aside_mark)) / (done - mark_step)
                        m["step_s"] = dt
                        m["tokens_per_s"] = self.tokens_per_step / dt
                        m["mfu"] = self.flops_per_step / dt / self.topology.peak_flops
                        t_mark = now
                    aside_mark = aside
                    mark_step = done
                    last = m
                    writer.write(done, m)
                    progress.update(done, m)
                else:
                    progress.update(done, None)
        finally:
            progress.close()
            writer.close()
            if self._checkpointer is not None:
                self._checkpointer.wait()  # an in-flight save completes before we return
        wall = time.perf_counter() - t_start
        steady_steps = total - start - 1
        steady = (time.perf_counter() - t_after_first - (aside - aside_first)) \
            if t_after_first else 0.0
        tps = self.tokens_per_step * steady_steps / steady if steady_steps > 0 and steady else 0.0
        summary = {
            "steps": total, "first_loss": first_loss,
            "final_loss": last["loss"] if last else None,
            "eval_loss": last_eval,
            "tokens_per_s": tps,
            "mfu": self.flops_per_step * steady_steps / steady / self.topology.peak_flops
            if tps else 0.0,
            "wall_s": wall,
            "compile_and_first_step_s": (t_after_first - t_start) if t_after_first else None,
            "input_wait_s": (self.data.waited_s - waited_start) / max(total - start, 1),
            "resumed_from": resumed,
            "workdir": os.path.abspath(self.workdir),
            "metrics": os.path.abspath(writer.path),
            "tensorboard": os.path.abspath(writer.tb_dir) if writer.tb_dir else None,
        }
        if ckpt.every:
            saved = self.checkpointer.steps()
            summary["checkpoints"] = f"{self.checkpoint_dir} (steps {', '.join(map(str, saved))})"
            if resumed is not None:
                summary["checkpoints"] += f", resumed from {resumed}"
        if primary and not self.quiet:
            print(format_summary(summary), flush=True)
        return summary


def _drop_metrics_after(path: str, step: int) -> None:
    """Rewrite a metrics file without the rows after `step`."""
    if not os.path.exists(path):
        return
    rows = [r for r in read_metrics(path) if r["step"] <= step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


def format_summary(s: dict[str, Any]) -> str:
    def num(v, fmt):
        return format(v, fmt) if v is not None else "-"

    rows = [
        ("steps", str(s["steps"])),
        ("loss", f"{num(s['first_loss'], '.4f')} -> {num(s['final_loss'], '.4f')}"),
        *([("eval loss", f"{s['eval_loss']:.4f} (held-out documents)")]
          if s.get("eval_loss") is not None else []),
        ("tokens/s", f"{s['tokens_per_s']:,.0f} (after the first step)"),
        ("MFU", f"{s['mfu']:.2%} of the topology's peak"),
        ("compile + first step", f"{num(s['compile_and_first_step_s'], '.1f')} s"),
        ("input wait", f"{s.get('input_wait_s', 0.0) * 1e3:.2f} ms per step"),
        ("wall time", f"{s['wall_s']:.1f} s"),
        ("metrics", s["metrics"]),
    ]
    if s.get("tensorboard"):
        rows.append(("tensorboard", s["tensorboard"]))
    if s.get("checkpoints"):
        rows.append(("checkpoints", s["checkpoints"]))
    w = max(len(k) for k, _ in rows)
    return "summary\n" + "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


__all__ = ["Trainer", "TrainState", "make_optimizer", "format_summary"]

"""The trainer: the step loop over an executor, with evaluation, checkpoints, metrics, progress
and timing as hooks.

`Trainer.from_config(config)` (or `Trainer(config)`) is the Python entry point (`hetjax train`
uses it too). The Trainer is built from parts: `TrainerParts.from_config` validates the config
and builds, once each, the topology, the Plan, the tokenizer, the model, the optimizer, the
runtime, the executor (`hetjax.parallel.executor`), the attention kernel and the memory check;
`Trainer(parts)` runs them and builds nothing itself. The executor answers everything that
depends on how a step runs: the train state in its shardings, one optimizer step, the parameters
in the natural layout, the checkpoint layout. The Trainer owns the loop and the data. Nothing is
compiled or loaded until it is needed: the state is created on first use, the loaders when
training starts.

The loop (`iter_steps`) yields a `StepInfo` after every step and runs the hooks that are due
(`hetjax.hooks.Hook`: a function with an interval). `train()` installs the standard hooks --
evaluation, checkpoints (both kept out of the step time), timing, the metrics file / TensorBoard
and the progress bar, the loss plot -- resumes from the latest checkpoint, runs the loop and
returns the run summary with its history (`hetjax.history.RunSummary`: a dict with `.history`). The
end of a run writes `<workdir>/loss.png`; a run that is already complete says so and trains
nothing. A user adds their own with `trainer.add_hook(fn, every=50)`; `fn(info)` sees the step and
its metrics.

Guards (docs/reliability.md): executors skip an update whose loss or gradient norm is not finite;
the loop reports each such step and stops after `train.max_bad_steps` in a row. SIGTERM during
a single-process `train()` saves the current step and raises `Preempted` (CLI exit code 75),
SIGINT (Ctrl-C) the same as `Interrupted` (exit 130; a second Ctrl-C stops at once and says
which steps are lost); the processes of a multi-process job agree on the step to save at SIGINT
or the launcher's stop line (`hetjax.stopping`). A run resumes from any checkpoint in its
directory, whatever `checkpoint.every`. `train()` holds the workdir lock (`hetjax.lock`) and
cuts metrics.jsonl back to the step it starts from, so no step is logged twice. An OSError while training (a full
disk) becomes one error naming the path, after the checkpoint in flight is drained.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import jax
import numpy as np
import optax

from hetjax import __version__, config as hconfig
from hetjax import checkpoint as hckpt
from hetjax.corpus_size import check_corpus_size, source_line
from hetjax.data import make_loader
from hetjax.errors import (ConfigError, HetjaxError, Interrupted, PlanError, Preempted,
                           os_error_message)
from hetjax.hooks import Checkpointing, Hook, StepInfo, Timing
from hetjax.history import LOSS_PNG, History, RunSummary, format_summary, summary_rows
from hetjax.lock import WorkdirLock
from hetjax.files import replace_file
from hetjax.metrics import MetricsWriter, Progress, rebuild_tensorboard, truncate_metrics
from hetjax.core.plan import Plan, vocab_shards
from hetjax.core.local_preset import describe_jax_devices, device_mismatch
from hetjax.planner import check_placement, model_from_config, plan_job
from hetjax.planner.config_plan import predict_for_config
from hetjax.planner.diloco_pricing import plan_to_run
from hetjax.planner.memory import asked_bytes, fit_problem, is_out_of_memory, oom_message
from hetjax.profile import StepProfiler, summarise
from hetjax.stopping import NoAgreement, StopFlag
from hetjax.tokenizer import tokenizer_from_config
from hetjax.core.topology import Topology
from hetjax.layers import ModelConfig
from hetjax.layers.attention_kernels import choose_local
from hetjax.parallel.executor import (Executor, Optimizer, Runtime, TrainState, make_executor,
                                     opt_state_specs)
from hetjax.parallel.nic import ENV_WORLD
from hetjax.core.registry import EXECUTORS


def learning_rate_schedule(t) -> optax.Schedule:
    """Linear warmup to `t.lr`, cosine decay to `t.lr * t.min_lr_ratio` at `t.steps`."""
    warmup = hconfig.warmup_steps(t)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=warmup,
        decay_steps=max(t.steps, warmup + 1), end_value=t.lr * t.min_lr_ratio)


def decay_mask(params):
    """Weight decay on matrices only: not on norm scales or projection biases."""
    def decays(path, _):
        key = getattr(path[-1], "key", None) or ""
        return key != "scale" and not key.endswith("_bias")

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(t) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = learning_rate_schedule(t)
    adamw = optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                        mask=decay_mask)
    tx = optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw) if t.grad_clip > 0 else adamw
    return tx, schedule


def runtime_from_environ(config, plan: Plan, topology: Topology, env=None) -> Runtime:
    """What this process's environment says about its job (`hetjax.parallel.train_state.Runtime`),
    read once: the launcher's init timeout, and for one world of a job whose worlds the bridge
    joins (`hetjax launch` set the HETJAX_BRIDGE_* variables: several worlds, or processes the
    plan leaves out) the plan's worlds (`hetjax.planner.worlds`), which process runs which
    rank, this world's index and its bridge to the others."""
    from hetjax.distributed import ENV_INIT_TIMEOUT

    env = os.environ if env is None else env
    timeout = float(env[ENV_INIT_TIMEOUT]) if env.get(ENV_INIT_TIMEOUT) else None
    from hetjax.parallel.bridge import ENV_BRIDGE_HOSTS, bridge_from_environ, bridged

    if not bridged(env):
        return Runtime(init_timeout_s=timeout)
    from hetjax.distributed import process_slots
    from hetjax.planner.worlds import plan_worlds

    slots = process_slots(topology, len(env[ENV_BRIDGE_HOSTS].split(",")))
    worlds = plan_worlds(plan, topology, slots)
    owner = {r: slot.index for slot in slots for r in slot.ranks}
    return Runtime(worlds=tuple(worlds), world=int(env[ENV_WORLD]), owner=owner,
                   bridge=bridge_from_environ(env, codec=config.pipeline.boundary_codec),
                   init_timeout_s=timeout)


@dataclass(frozen=True)
class TrainerParts:
    """What a Trainer runs with, each part built once, in this order, by `from_config`: the
    validated config, the topology, the Plan (and what `check_placement` notes about it), the
    tokenizer, the model, the optimizer (transform and learning-rate schedule), the runtime
    this process's environment describes, the executor, the attention kernel its devices run,
    and the plan's predicted memory (a plan predicted not to fit is refused here).

    `Trainer(parts)` runs with them; a caller may build parts itself or replace one
    (`dataclasses.replace(parts, executor=...)`) -- the Trainer builds nothing of its own."""

    config: Any
    topology: Topology
    plan: Plan
    notes: tuple
    tokenizer: Any
    model_cfg: ModelConfig
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    runtime: Runtime
    executor: Executor
    attention: Any
    predicted: dict

    @classmethod
    def from_config(cls, config, *, topology: Topology | None = None, plan: Plan | None = None,
                    reading: bool = False) -> "TrainerParts":
        """Build every part from the config (`topology` / `plan`: given instead of built);
        `reading`: for a run that only restores a checkpoint (eval, sample)."""
        hconfig.validate(config, reading)  # reading: only restores (eval, sample)
        check_corpus_size(config)  # from the files alone, before anything is built
        topology = topology or hconfig.build_topology(config)
        # the one path from config to (model, plan): the model the planner priced is this one
        if plan is None:
            job = plan_job(config, topology)
            plan, model_cfg = job.plan, job.model
        else:
            model_cfg = model_from_config(config, topology, plan)
        notes = check_placement(plan, topology, config.parallel.allow_straddle,
                                sites=bool(config.diloco.inner_steps))
        tokenizer = tokenizer_from_config(config.data)
        # the plan, or under DiLoCo (sites training alone between exchanges) the sites' plan;
        # the model's embedding and head are padded for the tensor parallelism it runs with
        run_plan = plan_to_run(config, topology, plan)
        if vocab_shards(run_plan) != vocab_shards(plan):
            model_cfg = model_from_config(config, topology, plan, shards=vocab_shards(run_plan))
        if (config.data.document_mask and plan.pp > 1
                and not EXECUTORS[plan.executor].document_masks):
            masks = [k.name for k in EXECUTORS.values() if k.document_masks]
            raise ConfigError("data.document_mask", f"the {plan.executor} pipeline executor "
                              f"(here pp = {plan.pp}) does not pass segment ids to its "
                              "stages", f"--config.pipeline.executor={' or '.join(masks)}, or "
                              "--config.data.document_mask=false")
        tx, schedule = make_optimizer(config.train)
        optimizer = Optimizer(tx, schedule, config.train.grad_clip)
        runtime = runtime_from_environ(config, plan, topology)
        executor = make_executor(run_plan, topology, model_cfg, optimizer, runtime)
        # The attention kernel this process's devices run (a named one they cannot run is a
        # ConfigError here, before anything compiles); shown in `describe` and the summary.
        # After the executor: it asks JAX for the topology's devices (simulated CPU devices
        # must be requested before JAX starts, and this looks at the devices).
        attention = choose_local(model_cfg.attention, model_cfg.dtype, model_cfg.head_dim,
                                 plan.seq_len, model_cfg.sliding_window)
        predicted = check_memory(config, plan, topology, executor, model_cfg)
        return cls(config, topology, plan, tuple(notes), tokenizer, model_cfg, tx, schedule,
                   runtime, executor, attention, predicted)


def check_memory(config, plan: Plan, topology: Topology, executor: Executor,
                 model_cfg: ModelConfig) -> dict[str, Any]:
    """The plan's predicted memory; refuses a plan predicted not to fit, in the words
    `hetjax plan` prints for it."""
    predicted = plan.predicted
    # (per-stage (dp, tp) shapes: the cost model prices one shape, so no prediction)
    if "stage_memory_gib" not in predicted and executor.runs_whole_plan and plan.uniform:
        predicted = predict_for_config(config, plan, topology).as_dict()
    problem = fit_problem(predicted, model_cfg.remat, plan.microbatches, plan.zero.name)
    if problem:
        raise PlanError(problem)
    return predicted


class Trainer:
    """Train a hetjax model: the step loop over an executor, from its parts.

    >>> trainer = Trainer.from_config(load_config("configs/default.py",
    ...                                           ["--config.train.steps=20"]))
    >>> trainer.add_hook(lambda info: print(info.step, info.metrics["loss"]), every=5)
    >>> summary = trainer.train()

    `Trainer(parts)` takes built `TrainerParts`; `Trainer(config, ...)` is
    `Trainer.from_config(config, ...)`."""

    def __init__(self, parts, *, topology: Topology | None = None, plan: Plan | None = None,
                 workdir: str | None = None, quiet: bool = False, reading: bool = False):
        if not isinstance(parts, TrainerParts):  # a config: build the parts from it
            parts = TrainerParts.from_config(parts, topology=topology, plan=plan,
                                             reading=reading)
        elif topology is not None or plan is not None:
            raise HetjaxError("Trainer(parts): the parts hold the topology and the plan; give "
                              "them to TrainerParts.from_config (or dataclasses.replace)")
        self.parts = parts
        self.config, self.topology, self.plan = parts.config, parts.topology, parts.plan
        self.notes, self.tokenizer, self.model_cfg = parts.notes, parts.tokenizer, parts.model_cfg
        self.tx, self.schedule, self.runtime = parts.tx, parts.schedule, parts.runtime
        self.executor, self.attention = parts.executor, parts.attention
        self.predicted = parts.predicted
        self.quiet = quiet
        self.workdir = workdir or self.config.workdir
        # MFU is a fraction of the topology's peak: say so when JAX runs on other devices
        # (a multi-world job's process sees only its own world's devices)
        self.mfu_warning = None if self.runtime.multi_world else device_mismatch(
            self.topology, describe_jax_devices(jax.devices()))
        self.tokens_per_step = self.plan.global_batch * self.plan.seq_len
        self.flops_per_step = self.model_cfg.flops_per_token(self.plan.seq_len) * \
            self.tokens_per_step
        self.hooks: list[Hook] = []  # the user's, run after the standard ones
        self._state = None
        self._data = None
        self._eval_data = None
        self._checkpointer = None
        self._last_saved = None
        self._tokenizer_saved = False
        self._first_loss = None  # the run's first loss: divergence is measured against it

    @classmethod
    def from_config(cls, config, *, topology: Topology | None = None, plan: Plan | None = None,
                    workdir: str | None = None, quiet: bool = False,
                    reading: bool = False) -> "Trainer":
        """A Trainer whose parts `TrainerParts.from_config` builds from `config`."""
        return cls(TrainerParts.from_config(config, topology=topology, plan=plan,
                                            reading=reading), workdir=workdir, quiet=quiet)

    def _out_of_memory(self, error: BaseException) -> PlanError:
        """The one message a run ends with when XLA runs out of device memory."""
        need = self.predicted.get("stage_memory_gib")
        caps = [d.memory_bytes for d in describe_jax_devices(jax.local_devices()[:1])]
        capacity = caps[0] or self.topology.accelerator_of(0).memory_bytes
        return PlanError(oom_message(max(need) * 2**30 if need else None, asked_bytes(error),
                                     capacity, self.model_cfg.remat, self.plan.microbatches,
                                     self.plan.zero.name))

    # --- state and data (created on first use) --------------------------------------------------
    @property
    def state(self):
        if self._state is None:
            self._state = self.init_state()
        return self._state

    @state.setter
    def state(self, value) -> None:
        self._state = value

    def init_state(self):
        """Fresh parameters from train.seed, created directly in their shardings; with
        model.init_from, the parameters of that HuggingFace checkpoint instead (each process
        reads only the slices its devices hold)."""
        try:
            state = self.executor.init_state(self.config.train.seed)
        except jax.errors.JaxRuntimeError as e:
            if is_out_of_memory(e):
                raise self._out_of_memory(e) from None
            raise
        if self.config.model.init_from:
            from hetjax.interop.hf_checkpoint import init_from_hf, unused_message

            state, reader = init_from_hf(self.executor, state, self.config.model.init_from,
                                         self.model_cfg)
            self.init_from_bytes = reader.bytes_read
            if unused_message(reader) and jax.process_index() == 0:
                print(unused_message(reader), flush=True)
            if not self.quiet:
                print(f"hetjax: model.init_from: process {jax.process_index()} read "
                      f"{reader.bytes_read} bytes of {self.config.model.init_from}", flush=True)
        return state

    @property
    def params(self):
        """The current parameters in the model's natural layout (block leaves [n_layers, ...],
        no pipeline padding), whatever the plan and executor."""
        return self.executor.params(self.state)

    @property
    def data_rows(self) -> np.ndarray:
        """Rows of each global batch this process's devices consume."""
        return self.executor.data_rows

    @property
    def data(self):
        """The training batch stream (this process's rows)."""
        if self._data is None:
            self._data, self._data_spec = make_loader(self.config, self.tokenizer,
                                                      self.data_rows)
        return self._data

    @property
    def data_spec(self):
        self.data  # noqa: B018 - opening the loader sets it
        return self._data_spec

    # --- what single-program executors expose (HLO audits, tests, benches) ---------------------
    @property
    def mesh(self):
        return self.executor.mesh

    @property
    def pipeline(self):
        """The shard_map pipeline of an SPMD pipeline plan, else None."""
        return self.executor.pipeline

    @property
    def zero_specs(self):
        return self.executor.zero_specs

    @property
    def state_sharding(self):
        return self.executor.state_sharding

    def _context(self):
        return self.executor.context()

    def loss_fn(self, params, inputs, targets, segment_ids=None):
        return self.executor.loss_fn(params, inputs, targets, segment_ids)

    def loss_and_grads(self, params, batch):
        return self.executor.loss_and_grads(params, batch)

    def compiled_step(self):
        """The compiled train step (for reading its HLO, cost and memory analyses)."""
        if self.config.data.document_mask:  # batches then carry segment ids
            return self.executor.compiled_step(self.state, segments=True)
        return self.executor.compiled_step(self.state)

    # --- steps ----------------------------------------------------------------------------------
    def put_batch(self, batch: dict[str, np.ndarray], rows: np.ndarray | None = None):
        """Host batch (rows `rows` of the global batch, default all) -> device batch."""
        return self.executor.put_batch(batch, rows)

    def step(self, batch: dict[str, np.ndarray] | None = None) -> dict[str, jax.Array]:
        """One optimizer step on `batch` (default: the next batch of the data stream)."""
        batch = (self.put_batch(next(self.data), self.data_rows) if batch is None
                 else self.put_batch(batch))
        try:  # the first call compiles: XLA may run out of memory then or while running
            self.state, metrics = self.executor.step(self.state, batch)
        except jax.errors.JaxRuntimeError as e:
            if is_out_of_memory(e):
                raise self._out_of_memory(e) from None
            raise
        return metrics

    def evaluate(self, batch: dict[str, np.ndarray]) -> float:
        """Loss of the current parameters on a global batch (no update)."""
        return self.executor.eval_loss(self.state, batch)

    _eval_cut_said = False

    def _open_eval_data(self):
        if self._eval_data is None:
            self._eval_data, _ = make_loader(self.config, self.tokenizer, split="eval")
        return self._eval_data

    def eval_loss(self) -> float:
        """Mean loss on `eval.batches` fixed global batches of held-out data (every process
        reads them whole: evaluation is rare and rows are slices of a memory map)."""
        data = self._open_eval_data()
        return float(np.mean([self.evaluate(data.batch(k)) for k in range(self.eval_batches)]))

    @property
    def eval_batches(self) -> int:
        """The evaluation's batches: eval.batches, or fewer when the held-out split has not
        that many distinct batches (the stream would repeat rows; said once)."""
        data, asked = self._open_eval_data(), self.config.eval.batches
        distinct = data.sequences // data.batch_size
        if distinct < asked and not self._eval_cut_said:
            self._eval_cut_said = True
            print(f"hetjax: eval.batches = {asked}, but the held-out split packs into "
                  f"{data.sequences} sequences, {distinct} distinct batch"
                  f"{'es' * (distinct != 1)} of {data.batch_size}: evaluating {distinct}, "
                  "none twice (raise data.eval_fraction for more)", file=sys.stderr, flush=True)
        return min(asked, distinct)

    # --- generation -----------------------------------------------------------------------------
    def generate(self, prompts: str | list[str], max_new_tokens: int = 64, *,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 stop_tokens: tuple[int, ...] | None = None, seed: int = 0) -> str | list[str]:
        """The text the current parameters continue each prompt with (one string for one
        prompt): a jitted KV-cache decode (layers/generate.py), greedy at temperature 0, else
        sampled with `seed` from the top_k / top_p cut. A row stops at a stop token (default:
        the tokenizer's end of document) or after `max_new_tokens`. A pp = 1 plan runs under
        its mesh (parameters stay sharded over tp); a pipeline plan's parameters are gathered
        onto one device (for large models, open the checkpoint with pp = 1: hetjax.sampling)."""
        import contextlib

        from hetjax.layers.generate import generate
        from hetjax.layers.model import Transformer

        single = isinstance(prompts, str)
        prompts = [prompts] if single else list(prompts)
        # as training documents begin: BOS first when the tokenizer adds it
        ids = [self.tokenizer.encode_document(p).tolist() for p in prompts]
        for name, v, ok in (("max_new_tokens", max_new_tokens, max_new_tokens >= 1),
                            ("temperature", temperature, temperature >= 0),
                            ("top_k", top_k, top_k >= 0), ("top_p", top_p, 0 < top_p <= 1)):
            if not ok:
                raise HetjaxError(f"{name} = {v} is out of range; use max_new_tokens >= 1, "
                                  "temperature >= 0 (0: greedy), top_k >= 0 (0: all), "
                                  "0 < top_p <= 1 (1: all)")
        if not all(prompts):
            raise HetjaxError("an empty prompt has nothing to continue; give at least one "
                              "character")
        longest = max(map(len, ids)) + max_new_tokens
        if longest > self.model_cfg.max_seq_len:
            raise HetjaxError(
                f"the longest prompt ({max(map(len, ids))} tokens) plus max_new_tokens = "
                f"{max_new_tokens} exceeds the model's model.max_seq_len = "
                f"{self.model_cfg.max_seq_len}; shorten the prompt or lower max_new_tokens")
        params, ctx = self.params, self.executor.generation_context()
        if ctx is None:  # a pipeline's stages: its parameters are gathered onto one device
            params, ctx = jax.device_get(params), contextlib.nullcontext()
        stops = (self.tokenizer.eos_id,) if stop_tokens is None else tuple(stop_tokens)
        with ctx:
            out = generate(Transformer(self.model_cfg), params, ids, max_new_tokens,
                           temperature=temperature, top_k=top_k, top_p=top_p,
                           stop_tokens=stops, seed=seed, vocab_limit=self.tokenizer.vocab_size)
        texts = [self.tokenizer.decode(t) for t in out]
        return texts[0] if single else texts

    # --- checkpoints ----------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> str:
        return self.config.checkpoint.dir or os.path.join(self.workdir, "checkpoints")

    @property
    def checkpointer(self) -> hckpt.Checkpointer:
        if self._checkpointer is None:
            k = self.config.checkpoint
            # one writer per job (world 0 of a multi-world job; its other worlds read)
            self._checkpointer = hckpt.Checkpointer(
                self.checkpoint_dir, k.every, k.keep, k.keep_best, k.async_save,
                writer=self.executor.writes_checkpoints)
        return self._checkpointer

    def layout(self) -> hckpt.Layout:
        """How this trainer's state maps to the plan-independent checkpoint layout."""
        return self.executor.checkpoint_layout(self.state)

    def save(self, *, eval_loss: float | None = None, wait: bool = False) -> int:
        """Checkpoint the current step (state, data position, config, plan); returns the step.

        The save is asynchronous unless checkpoint.async_save is off or `wait` is set. A step
        already checkpointed (train() saves its last one) is not written again."""
        step = int(self.state.step)
        meta = {"step": step, "config": json.loads(self.config.to_json_best_effort()),
                "plan": self.plan.to_dict(), "data": self.data_spec.to_dict(),
                # All randomness is a function of the seed and the step: parameters are
                # initialised from the seed, the data order from the seed and the data state.
                "rng": {"seed": self.config.train.seed,
                        "prng_impl": str(jax.config.jax_default_prng_impl)},
                "hetjax_version": __version__, "first_loss": self._first_loss}
        self.checkpointer.save(step, self.state, self.layout(), self.data.get_state(), meta,
                               eval_loss=eval_loss)
        self._save_tokenizer()
        self._last_saved = step
        if wait:
            self.checkpointer.wait()
        return step

    @property
    def tokenizer_dir(self) -> str:
        """Where checkpoints keep their tokenizer (`load_tokenizer` reads it back)."""
        return os.path.join(self.checkpoint_dir, "tokenizer")

    def _save_tokenizer(self) -> None:
        """Copy the tokenizer beside the checkpoints once per run, so a resume, an export or a
        sample of any of them finds the exact tokenizer it was trained with."""
        if self._tokenizer_saved or not self.executor.writes_checkpoints \
                or jax.process_index() != 0:
            return
        self.tokenizer.save(self.tokenizer_dir)
        self._tokenizer_saved = True

    def restore(self, step: int | None = None) -> int | None:
        """Load checkpoint `step` (default: the latest complete one) into this trainer's plan
        and shardings, with the data position; returns its step, or None if there is none."""
        r = self.checkpointer.restore(self.layout(), step)
        if r is None:
            return None
        saved, now = r.meta.get("data") or {}, self.data_spec.to_dict()
        same_data = saved == now
        if not same_data:
            diff = ", ".join(f"{k} = {saved.get(k)!r} there, {now.get(k)!r} now"
                             for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k))
            if not self.config.checkpoint.allow_other_data:
                raise HetjaxError(
                    f"checkpoint {r.step} in {self.checkpoint_dir} was written for other data "
                    f"({diff}); resume with the same data.*, train.seq_len, train.batch_size "
                    "and train.seed, use another workdir, or continue this run on the new data"
                    " with --config.checkpoint.allow_other_data=True")
            if jax.process_index() == 0:  # said loudly: the run's data changes here
                print(f"hetjax: WARNING: checkpoint.allow_other_data: continuing checkpoint "
                      f"{r.step} on OTHER data ({diff}); the new data is read from its start "
                      f"and the run's metrics before step {r.step} are of the old data",
                      file=sys.stderr, flush=True)
        self.state = r.state
        if same_data:  # a data position means nothing in another stream
            self.data.set_state(r.data_state)
        self._first_loss = r.meta.get("first_loss", self._first_loss)
        return r.step

    # --- the loop -------------------------------------------------------------------------------
    def describe(self) -> str:
        lines = [self.topology.describe()]
        if self.executor.runs_whole_plan:  # else its own plans (the executor's lines) run
            lines.append(self.plan.describe(self.topology))
        lines += [f"  note: {n}" for n in self.notes]
        if self.executor.describe():
            lines.append(self.executor.describe())
        m = self.model_cfg
        lines.append(f"model: {m.num_params / 1e6:.2f}M parameters, {m.n_layers} layers, "
                     f"d_model {m.d_model}, heads {m.n_heads} (kv {m.n_kv_heads}), d_ff {m.d_ff},"
                     f" vocab {m.vocab_size}"
                     + (f" (padded to {m.vocab_rows} rows for tp)" if m.vocab_rows > m.vocab_size
                        else "") + f", {m.dtype} compute")
        lines.append(f"attention: {self.attention}"
                     + (", document masks" if self.config.data.document_mask else ""))
        lines.append(source_line(self.config.data))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """Notebooks: the topology and plan tables, the device map and simulated timeline as
        an inline figure, and the model line."""
        import base64
        import html
        import io

        from hetjax.planner.plot import plan_figure

        png = io.BytesIO()
        plan_figure(self.plan, self.topology, self.model_cfg).savefig(png, format="png", dpi=80)
        image = base64.b64encode(png.getvalue()).decode()
        model_lines = [line for line in self.describe().splitlines()
                       if line.startswith(("model:", "attention:"))]
        return (self.topology._repr_html_() + self.plan._repr_html_()
                + f"<img src='data:image/png;base64,{image}' style='max-width:100%'/>"
                + "".join(f"<p>{html.escape(line)}</p>" for line in model_lines))

    def add_hook(self, fn: Callable[[StepInfo], Any], every: int = 1, **kw) -> Hook:
        """Run `fn(info)` after every `every`-th step of `train()` / `iter_steps()` (after the
        standard hooks, so `info.metrics` holds the step's timing and eval loss when they ran);
        `first`, `last`, `aside` and `also` as in `Hook`."""
        hook = Hook(fn, every, **kw)
        self.hooks.append(hook)
        return hook

    def iter_steps(self, steps: int | None = None, hooks: list[Hook] | None = None,
                   profiler: StepProfiler | None = None) -> Iterator[StepInfo]:
        """Train until step `steps` (default train.steps), yielding a `StepInfo` after each step
        once its due hooks (`hooks`, default the user's) have run; `profiler` traces its
        steps."""
        total = steps if steps is not None else self.config.train.steps
        hooks = self.hooks if hooks is None else hooks
        start = int(self.state.step)
        aside = 0.0
        previous, bad = None, 0
        for done in range(start + 1, total + 1):
            if profiler is not None:
                profiler.before(done)
            metrics = self.step()
            if profiler is not None:
                profiler.after(done, (metrics, self.state))
            if previous is not None:
                # The step before this one is read only now, so the device is never idle
                # waiting for the host check.
                bad = self._check_finite(*previous, bad)
            previous = (done, metrics)
            info = StepInfo(self, done, done == start + 1, done == total, metrics, aside)
            due = [h for h in hooks if h.due(info)]
            if any(h.aside for h in due):
                # The step is dispatched asynchronously: let it finish first, or its compute
                # would be timed as evaluation or saving, not as training.
                jax.block_until_ready((metrics, self.state))
            for h in due:
                t = time.perf_counter()
                h.fn(info)
                if h.aside:
                    aside += time.perf_counter() - t
                    info.aside_s = aside
            yield info
        if previous is not None:
            self._check_finite(*previous, bad)

    def _check_finite(self, step: int, metrics: dict[str, jax.Array], bad: int) -> int:
        """Report a step the executor skipped for a non-finite loss or gradient norm; raise
        after train.max_bad_steps in a row. Returns the count of skipped steps in a row."""
        loss, g_norm = (float(v) for v in jax.device_get((metrics["loss"],
                                                          metrics["grad_norm"])))
        if np.isfinite(loss) and np.isfinite(g_norm):
            self._check_diverged(step, loss)
            return 0
        bad += 1
        limit = self.config.train.max_bad_steps
        if jax.process_index() == 0:
            print(f"hetjax: step {step}: loss {loss}, grad_norm {g_norm}: update skipped "
                  f"({bad} in a row, train.max_bad_steps = {limit})", file=sys.stderr,
                  flush=True)
        if bad >= limit:
            first = step - bad + 1
            # After a DiLoCo outer step, the parameters it made (and saved) are what failed.
            removed = self._remove_checkpoint_before(first, "them") if self._after_outer_step(
                first) else ""
            raise HetjaxError(
                f"train.max_bad_steps: {bad} steps in a row ({first}-{step}) had a "
                f"non-finite loss or gradient norm; training stopped, {removed}nothing of them "
                f"was saved (checkpoints in {self.checkpoint_dir}); fix: {self._blame(first)}, "
                + ("" if removed else "check model.vocab_size and the data, ")
                + "then rerun to resume from the latest checkpoint")
        return bad

    def _check_diverged(self, step: int, loss: float) -> None:
        """Stop (HetjaxError) when a finite loss is train.max_loss_ratio times the run's first
        loss: a run that blew up must not go on to exit 0, nor save its parameters."""
        ratio = self.config.train.max_loss_ratio
        if not np.isfinite(loss):
            return
        if self._first_loss is None:
            self._first_loss = loss
            return
        if ratio and loss > ratio * self._first_loss:
            removed = self._remove_checkpoint_before(step, "this loss")
            raise HetjaxError(
                f"train.max_loss_ratio: the run diverged: step {step}'s loss {loss:.4g} is "
                f"{loss / self._first_loss:.1f}x its first loss {self._first_loss:.4g} (limit "
                f"{ratio:g}x); training stopped, {removed}nothing after the latest checkpoint "
                f"was saved (checkpoints in {self.checkpoint_dir}); fix: {self._blame(step)}, "
                "then rerun to resume from the latest checkpoint")

    def _remove_checkpoint_before(self, step: int, what: str) -> str:
        """Step N's loss is that of the parameters after step N - 1 (a DiLoCo outer step, say):
        when N - 1 was just saved, that checkpoint holds the parameters that gave `what`, so it
        is removed. Returns the words saying so (empty when nothing was removed)."""
        if self._last_saved != step - 1:
            return ""
        self.checkpointer.wait()
        self.checkpointer.manager.delete(step - 1)
        self._last_saved = None
        return f"checkpoint {step - 1}, whose parameters gave {what}, was removed; "

    def _after_outer_step(self, step: int) -> bool:
        """Whether `step` is the first step after a DiLoCo exchange (an outer step)."""
        return self.executor.exchanged_after(step - 1)

    def _blame(self, step: int) -> str:
        """What to lower for a blow-up first seen at `step`: DiLoCo's outer step when the step
        is the first after an exchange, else the inner learning rate."""
        d, t = self.config.diloco, self.config.train
        if self._after_outer_step(step):
            return (f"lower diloco.outer_lr (= {d.outer_lr:g}) or diloco.outer_momentum "
                    f"(= {d.outer_momentum:g}): it came right after the outer step of step "
                    f"{step - 1}")
        return f"lower train.lr (= {t.lr:g}) or train.grad_clip (= {t.grad_clip:g})"

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.workdir, "metrics.jsonl")

    @property
    def history(self) -> History:
        """The logged rows of this workdir's run so far (`metrics.jsonl`), as columns."""
        return History.load(self.metrics_path)

    def train(self, steps: int | None = None) -> RunSummary:
        """Train until step `steps` (default train.steps) with the standard hooks and the
        user's; returns the run summary with its history (`summary.history.columns()`).

        A fresh trainer first resumes from the latest checkpoint in its checkpoint directory; a
        run already at `steps` trains nothing and says it is complete."""
        total = steps if steps is not None else self.config.train.steps
        # one metrics writer per job: process 0 of world 0 (every world has the loss)
        primary = jax.process_index() == 0 and self.runtime.world == 0
        lock = WorkdirLock(self.workdir)
        if primary:  # one run per workdir: before anything in it is read or written
            lock.acquire()
        try:
            return self._train(total, primary)
        finally:
            lock.release()

    def _train(self, total: int, primary: bool) -> RunSummary:
        cfg, ckpt = self.config.train, self.config.checkpoint
        if int(self.state.step) == 0:  # a new run measures divergence from its own start
            self._first_loss = None
        # Any checkpoint resumes the run, also one a preemption saved with checkpoint.every = 0.
        resumed = self.restore() if int(self.state.step) == 0 and (
            ckpt.every or os.path.isdir(self.checkpoint_dir)) else None
        if int(self.state.step) >= total:
            return self._complete(total, resumed)
        if self.config.eval.every:  # opened now, so missing held-out data stops us before step 1
            self._open_eval_data()
        if primary:
            self._write_run_files()
            # Rows logged after the step we start from were lost with that run's state (or
            # belong to a run that left no checkpoint): cut them, so no step is logged twice.
            start = int(self.state.step)
            dropped, torn = truncate_metrics(self.metrics_path, start)
            if dropped or torn:
                print(f"hetjax: {self.metrics_path}: "
                      + ", ".join(([f"dropped {dropped} rows after step {start} (not in a "
                                    "checkpoint; trained again now)"] if dropped else [])
                                  + (["repaired a torn last line"] if torn else [])),
                      file=sys.stderr, flush=True)
            if (resumed is not None or dropped) and self.config.tensorboard:
                rebuild_tensorboard(self.workdir)  # TensorBoard shows what the file holds
        writer = MetricsWriter(self.workdir, self.config.tensorboard, primary,
                               wandb={**self.config.wandb.to_dict(),
                                      "config": self.config.to_dict()})
        progress = Progress(total, int(self.state.step), cfg.progress and not self.quiet,
                            cfg.log_every, primary)
        if resumed is not None and primary and not self.quiet:
            print(f"resumed from checkpoint {resumed} in {self.checkpoint_dir}", flush=True)
        if self.mfu_warning and primary and not self.quiet:
            print(f"warning: {self.mfu_warning}", flush=True)
        timing = Timing(self, int(self.state.step))
        last_eval: list[float] = []

        def evaluate(info):
            info.add(eval_loss=self.eval_loss())
            last_eval.append(info.added["eval_loss"])

        rows: list[dict[str, float]] = []  # this process's log rows (process 0 has the file)
        plot_path = os.path.join(self.workdir, LOSS_PNG)

        def plot(info):
            marks = {resumed: f"resumed from step {resumed}"} if resumed is not None else None
            self.history.plot(plot_path, title=self._plot_title(resumed), marks=marks)

        # A log row after the first and the last step, every log_every steps and whenever an
        # evaluation ran; the progress bar moves every step.
        log = dict(every=cfg.log_every, first=True, last=True,
                   also=lambda info: "eval_loss" in info.added)
        standard = []
        if self.config.eval.every:
            standard.append(Hook(evaluate, self.config.eval.every, last=True, aside=True))
        if ckpt.every:
            standard.append(Checkpointing(self).hook())
        standard += [
            Hook(timing, **log),
            Hook(lambda info: writer.write(info.step, info.metrics), **log),
            Hook(lambda info: rows.append({"step": info.step, **info.metrics}), **log),
            Hook(lambda info: progress.update(info.step, info.metrics
                                              if timing.mark_step == info.step else None)),
        ]
        if primary:  # aside: drawing is not training time
            standard.append(Hook(plot, 0, last=True, aside=True))
        aside = 0.0
        stop = StopFlag(int(self.state.step))
        done = int(self.state.step)
        profiler = (StepProfiler(self.workdir, max(cfg.profile_from, int(self.state.step) + 1),
                                 cfg.profile_steps) if cfg.profile_steps else None)
        failed = False
        try:
            for info in self.iter_steps(total, standard + self.hooks, profiler):
                aside, done = info.aside_s, info.step
                if stop.due(info.step) and not info.last:
                    self._stop_preempted(info.step, stop.signal)
            self.executor.finish()  # worlds: peers pull our last messages first
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, say exactly what is lost
            failed = True
            raise self._interrupted_unsaved(max(done, int(self.state.step))) from None
        except NoAgreement as e:  # a peer never answered: a save would wait for it forever
            failed = True
            raise self._interrupted_unsaved(done, f"{stop.signal}, {e}") from None
        except OSError as e:  # a full disk, a file removed under us: one line, not a traceback
            failed = True
            raise HetjaxError(self._os_error_message(e)) from None
        except BaseException:
            failed = True
            raise
        finally:
            if profiler is not None:
                profiler.stop()  # a run that ends inside the traced steps still writes it
            stop.restore()
            progress.close()
            try:
                writer.close()
            except OSError:
                if not failed:
                    raise
            if self._checkpointer is not None:
                # An in-flight save completes before we return. When the run already failed,
                # the save's own error (a full disk again) must not replace the first.
                try:
                    self._checkpointer.wait()
                except Exception as e:  # noqa: BLE001 - orbax raises many kinds
                    if not failed:
                        if isinstance(e, OSError):
                            raise HetjaxError(self._os_error_message(e)) from None
                        raise
        summary = timing.summary(total, aside)
        history = self.history if primary else History(rows)
        summary.update({
            "eval_loss": last_eval[-1] if last_eval else None,
            "attention": str(self.attention),
            "resumed_from": resumed,
            "workdir": os.path.abspath(self.workdir),
            "metrics": os.path.abspath(writer.path),
            "tensorboard": os.path.abspath(writer.tb_dir) if writer.tb_dir else None,
            "wandb": writer.wandb_url,
            "plot": os.path.abspath(plot_path) if primary and os.path.exists(plot_path) else None,
        })
        if ckpt.every:
            saved = self.checkpointer.steps()
            summary["checkpoints"] = f"{self.checkpoint_dir} (steps {', '.join(map(str, saved))})"
            if resumed is not None:
                summary["checkpoints"] += f", resumed from {resumed}"
        if profiler is not None and profiler.path:
            summary["profile"] = profiler.path
            if not self.quiet:  # every process: each traced its own programs
                traced = min(profiler.last, total) - profiler.first + 1
                print("\n".join(summarise(profiler.path).lines(traced)), flush=True)
        summary = RunSummary(summary, history)
        if primary and not self.quiet:
            print(format_summary(summary), flush=True)
        return summary

    def _plot_title(self, resumed: int | None = None) -> str:
        """What ran: model size, topology and plan (the plan of the steps since `resumed`, when
        resumed). Not the workdir, whose name is often a temporary directory's."""
        p = self.plan
        since = f" since step {resumed}" if resumed is not None else ""
        return (f"{self.model_cfg.num_params / 1e6:.2f}M parameters on {self.topology.name}: "
                f"pp={p.pp} {p.degrees()}{since}")

    def _complete(self, total: int, resumed: int | None) -> RunSummary:
        """The summary of a run that is already at step `total`: from its metrics file."""
        step = int(self.state.step)
        history = self.history
        plot_path = os.path.join(self.workdir, LOSS_PNG)
        primary = jax.process_index() == 0
        if primary and len(history) and not os.path.exists(plot_path):
            history.plot(plot_path, title=self._plot_title())
        where = (f"checkpoint {resumed}" if resumed is not None
                 else "this trainer's state")
        message = (f"run complete at step {step} of {total} ({where}); nothing to train. "
                   "Raise --config.train.steps (or call train(steps=N)) to go on, or use "
                   "another workdir.")
        summary = RunSummary({
            "steps": step, "complete": True, "message": message, "resumed_from": resumed,
            "first_loss": history.rows[0].get("loss") if len(history) else None,
            "final_loss": history.last("loss"), "eval_loss": history.last("eval_loss"),
            "tokens_per_s": history.last("tokens_per_s") or 0.0,
            "mfu": history.last("mfu") or 0.0,
            "workdir": os.path.abspath(self.workdir),
            "metrics": os.path.abspath(self.metrics_path),
            "plot": os.path.abspath(plot_path) if os.path.exists(plot_path) else None,
        }, history)
        if primary and not self.quiet:
            print(format_summary(summary), flush=True)
        return summary

    def _stop_preempted(self, step: int, signame: str = "SIGTERM") -> None:
        """SIGTERM or SIGINT arrived: checkpoint this step (unless a hook just did) and stop."""
        if self._last_saved != step:
            self.save(wait=True)
        self.checkpointer.wait()
        error, what = (Interrupted, "interrupted") if signame == "SIGINT" else \
            (Preempted, "preempted")
        raise error(f"{what} ({signame}) after step {step}: saved checkpoint {step} in "
                    f"{self.checkpoint_dir}; rerun the same command to resume (exit code "
                    f"{error.EXIT_CODE})")

    def _latest_saved(self) -> int | None:
        """The newest checkpoint step on disk (None when there is none)."""
        if self._checkpointer is None and not os.path.isdir(self.checkpoint_dir):
            return None
        return self.checkpointer.latest_step()

    def _interrupted_unsaved(self, done: int, why: str = "second SIGINT") -> Interrupted:
        """A second Ctrl-C (or a stop the processes could not agree on) stopped the run
        without saving: which steps are lost."""
        last = self._latest_saved()
        since = f"checkpoint {last}" if last is not None else "the start (no checkpoint)"
        lost = f"steps {(last or 0) + 1}-{done} are lost" if done > (last or 0) else \
            "no finished step is lost"
        return Interrupted(f"interrupted ({why}) after step {done}, without saving: "
                           f"{lost}; rerun the same command to resume from {since} (exit code "
                           f"{Interrupted.EXIT_CODE})")

    def _os_error_message(self, e: OSError) -> str:
        last = self._latest_saved()
        keep = (f"checkpoint {last} in {self.checkpoint_dir} is kept" if last is not None
                else "no checkpoint was saved")
        fix = f"then rerun the same command to resume ({keep})"
        return f"training stopped: {os_error_message(e, fix)}"

    def _write_run_files(self):
        os.makedirs(self.workdir, exist_ok=True)
        # replaced, not written through: a link planted in the workdir stays a link elsewhere
        for name, text in (("plan.json", self.plan.to_json(indent=1)),
                           ("topology.json", self.topology.to_json(indent=1)),
                           ("config.json", self.config.to_json_best_effort(indent=1))):
            replace_file(os.path.join(self.workdir, name), lambda f, t=text: f.write(t), "w")


__all__ = ["Trainer", "TrainerParts", "check_memory", "TrainState", "Hook", "StepInfo",
           "make_optimizer", "opt_state_specs", "format_summary", "summary_rows", "History",
           "RunSummary"]

"""The trainer: the step loop over an executor, with evaluation, checkpoints, metrics, progress
and timing as hooks.

`Trainer(config)` is the Python entry point (`hetjax train` uses it too). It turns the config
into a topology, a Plan and an optimizer, and asks an executor (`parallel.executor`) for
everything that depends on how a step runs: the train state in its shardings, one optimizer
step, the parameters in the natural layout, the checkpoint layout. The Trainer owns the loop and
the data. Nothing is compiled or loaded until it is needed: the state is created on first use,
the loaders when training starts.

The loop (`iter_steps`) yields a `StepInfo` after every step and runs the hooks that are due
(`Hook`: a function with an interval). `train()` installs the standard hooks -- evaluation,
checkpoints (both kept out of the step time), timing, the metrics file / TensorBoard and the
progress bar, the loss plot -- resumes from the latest checkpoint, runs the loop and returns the
run summary with its history (`hetjax.history.RunSummary`: a dict with `.history`). The end of
a run writes `<workdir>/loss.png`; a run that is already complete says so and trains nothing.
A user adds their own with `trainer.add_hook(fn, every=50)`; `fn(info)` sees the step and its
metrics.

Guards (docs/reliability.md): executors skip an update whose loss or gradient norm is not finite;
the loop reports each such step and stops after `train.max_bad_steps` in a row. SIGTERM during
a single-process `train()` saves the current step and raises `Preempted` (CLI exit code 75).
"""

from __future__ import annotations

import dataclasses

import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import jax
import numpy as np
import optax

from hetjax import __version__, config as hconfig
from hetjax import checkpoint as hckpt
from hetjax.data import make_loader, padded_vocab
from hetjax.errors import HetjaxError, Preempted
from hetjax.history import LOSS_PNG, History, RunSummary
from hetjax.metrics import MetricsWriter, Progress, read_metrics, rebuild_tensorboard
from hetjax.plan import Plan
from hetjax.planner import check_placement, plan_from_config
from hetjax.profile import StepProfiler, summarise
from hetjax.tokenizer import load_tokenizer
from hetjax.topology import Topology
from layers import ModelConfig
from parallel.executor import TrainState, make_executor, opt_state_specs
from parallel.nic import ENV_WORLD, ENV_WORLDS


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


# --- hooks -------------------------------------------------------------------------------------
class StepInfo:
    """What a hook sees after a step: the step number (steps done), whether it is the run's
    first or last step, the trainer, and the step's metrics.

    `metrics` fetches the step's device metrics on first access (so hooks that do not read them
    never wait for the step) and holds what earlier hooks added with `add` (eval_loss, step_s,
    tokens_per_s, ...)."""

    def __init__(self, trainer: "Trainer", step: int, first: bool, last: bool,
                 device_metrics: dict[str, jax.Array], aside_s: float):
        self.trainer = trainer
        self.step = step
        self.first = first
        self.last = last
        self.aside_s = aside_s  # seconds spent so far in hooks that are not training
        self.added: dict[str, float] = {}
        self._device = device_metrics
        self._values: dict[str, float] | None = None

    @property
    def metrics(self) -> dict[str, float]:
        if self._values is None:
            self._values = {k: float(v) for k, v in jax.device_get(self._device).items()}
            self._values.update(self.added)
        return self._values

    def add(self, **values: float) -> None:
        self.added.update(values)
        if self._values is not None:
            self._values.update(values)


@dataclass
class Hook:
    """`fn(info)` after every `every`-th step (0: never by interval), also after the run's
    first step when `first`, its last when `last`, and whenever `also(info)` says so.

    `aside` hooks (evaluation, checkpoints) are not training: the loop lets the step finish
    before running them and keeps their time out of the step time, tokens/s and MFU."""

    fn: Callable[[StepInfo], Any]
    every: int = 1
    first: bool = False
    last: bool = False
    aside: bool = False
    also: Callable[[StepInfo], bool] | None = None

    def due(self, info: StepInfo) -> bool:
        return bool((self.every and info.step % self.every == 0) or (self.first and info.first)
                    or (self.last and info.last) or (self.also and self.also(info)))


class Timing:
    """The timing hook: step time, tokens/s and MFU over each interval since the last call, and
    the totals for the summary. The first step (compilation) is timed apart; the time of aside
    hooks (evaluation, checkpoints) is left out."""

    def __init__(self, trainer: "Trainer", start: int):
        self.trainer = trainer
        self.start = start
        self.t_start = time.perf_counter()
        self.t_first = self.t_mark = None  # when the first step's metrics were read
        self.aside_first = self.aside_mark = 0.0
        self.mark_step = start
        self.waited_start = self.waited_mark = trainer.data.waited_s  # seconds next() blocked
        self.first_loss = None
        self.last: dict[str, float] | None = None  # the metrics of the last call

    def __call__(self, info: StepInfo) -> None:
        tr = self.trainer
        m = info.metrics  # waits for the step
        now = time.perf_counter()
        info.add(input_wait_s=(tr.data.waited_s - self.waited_mark) / (info.step - self.mark_step))
        self.waited_mark = tr.data.waited_s
        if self.t_mark is None:  # the first step includes compilation: time it apart
            self.t_first = self.t_mark = now
            self.aside_first = info.aside_s
            info.add(compile_and_step_s=now - self.t_start)
            self.first_loss = m["loss"]
        else:
            dt = (now - self.t_mark - (info.aside_s - self.aside_mark)) / \
                (info.step - self.mark_step)
            info.add(step_s=dt, tokens_per_s=tr.tokens_per_step / dt,
                     mfu=tr.flops_per_step / dt / tr.topology.peak_flops)
            self.t_mark = now
        self.aside_mark = info.aside_s
        self.mark_step = info.step
        self.last = info.metrics

    def summary(self, total: int, aside_s: float) -> dict[str, Any]:
        tr = self.trainer
        steady_steps = total - self.start - 1
        steady = (time.perf_counter() - self.t_first - (aside_s - self.aside_first)) \
            if self.t_first else 0.0
        tps = tr.tokens_per_step * steady_steps / steady if steady_steps > 0 and steady else 0.0
        return {
            "steps": total, "first_loss": self.first_loss,
            "final_loss": self.last["loss"] if self.last else None,
            "tokens_per_s": tps,
            "mfu": tr.flops_per_step * steady_steps / steady / tr.topology.peak_flops
            if tps else 0.0,
            "wall_s": time.perf_counter() - self.t_start,
            "compile_and_first_step_s": (self.t_first - self.t_start) if self.t_first else None,
            "input_wait_s": (tr.data.waited_s - self.waited_start) / max(total - self.start, 1),
        }


def worlds_job() -> bool:
    """Whether this process is one world of a multi-world MPMD job (`hetjax launch` set it)."""
    return int(os.environ.get(ENV_WORLDS, "1")) > 1


def make_worlds_executor(config, plan: Plan, topology: Topology, model_cfg, tx, schedule):
    """This world's `parallel.mpmd_worlds.WorldsExecutor`: the plan's worlds
    (`hetjax.planner.worlds`), this process's bridge, which process runs which rank."""
    from hetjax.distributed import process_slots
    from hetjax.planner.worlds import plan_worlds
    from parallel.bridge import ENV_BRIDGE_HOSTS, bridge_from_environ
    from parallel.mpmd_worlds import WorldsExecutor

    if plan.executor != "mpmd":
        raise HetjaxError(f"{ENV_WORLDS} > 1 needs the MPMD executor; set "
                          "--config.pipeline.executor=mpmd")
    slots = process_slots(topology, len(os.environ[ENV_BRIDGE_HOSTS].split(",")))
    worlds = plan_worlds(plan, topology, slots)
    owner = {r: slot.index for slot in slots for r in slot.ranks}
    return WorldsExecutor(plan, topology, model_cfg, tx, schedule, config.train.grad_clip,
                          worlds, int(os.environ[ENV_WORLD]), owner,
                          bridge_from_environ(codec=config.pipeline.boundary_codec))


class Trainer:
    """Train a hetjax model from a config.

    >>> trainer = Trainer(load_config("configs/default.py", ["--config.train.steps=20"]))
    >>> trainer.add_hook(lambda info: print(info.step, info.metrics["loss"]), every=5)
    >>> summary = trainer.train()
    """

    def __init__(self, config, *, topology: Topology | None = None, plan: Plan | None = None,
                 workdir: str | None = None, quiet: bool = False):
        hconfig.validate(config)
        self.config = config
        self.quiet = quiet
        self.topology = topology or hconfig.build_topology(config)
        self.plan = plan or plan_from_config(config, self.topology)
        self.notes = check_placement(self.plan, self.topology, config.parallel.allow_straddle,
                                     sites=bool(config.diloco.inner_steps))
        self.workdir = workdir or config.workdir
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        self.model_cfg = ModelConfig.from_config(config.model,
                                                 padded_vocab(self.tokenizer.vocab_size))
        if self.plan.remat:  # the planner chose the recompute policy (model.remat = 'auto')
            self.model_cfg = dataclasses.replace(self.model_cfg, remat=self.plan.remat)
        self.tx, self.schedule = make_optimizer(config.train)
        if config.diloco.inner_steps:  # sites train alone between exchanges (hetjax/diloco.py)
            from hetjax.diloco import DilocoExecutor

            self.executor = DilocoExecutor(config, self.topology, self.model_cfg, self.tx,
                                           self.schedule)
        elif worlds_job():
            self.executor = make_worlds_executor(config, self.plan, self.topology,
                                                 self.model_cfg, self.tx, self.schedule)
        else:
            self.executor = make_executor(self.plan, self.topology, self.model_cfg, self.tx,
                                          self.schedule, config.train.grad_clip)
        self.tokens_per_step = self.plan.global_batch * self.plan.seq_len
        self.flops_per_step = self.model_cfg.flops_per_token(self.plan.seq_len) * \
            self.tokens_per_step
        self.hooks: list[Hook] = []  # the user's, run after the standard ones
        self._state = None
        self._data = None
        self._eval_data = None
        self._checkpointer = None
        self._last_saved = None

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
        """Fresh parameters from train.seed, created directly in their shardings."""
        return self.executor.init_state(self.config.train.seed)

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
        return getattr(self.executor, "pipeline", None)

    @property
    def zero_specs(self):
        return self.executor.zero_specs

    @property
    def state_sharding(self):
        return self.executor.state_sharding

    def _context(self):
        return self.executor.context()

    def loss_fn(self, params, inputs, targets):
        return self.executor.loss_fn(params, inputs, targets)

    def loss_and_grads(self, params, batch):
        return self.executor.loss_and_grads(params, batch)

    def compiled_step(self):
        """The compiled train step (for reading its HLO, cost and memory analyses)."""
        return self.executor.compiled_step(self.state)

    # --- steps ----------------------------------------------------------------------------------
    def put_batch(self, batch: dict[str, np.ndarray], rows: np.ndarray | None = None):
        """Host batch (rows `rows` of the global batch, default all) -> device batch."""
        return self.executor.put_batch(batch, rows)

    def step(self, batch: dict[str, np.ndarray] | None = None) -> dict[str, jax.Array]:
        """One optimizer step on `batch` (default: the next batch of the data stream)."""
        batch = (self.put_batch(next(self.data), self.data_rows) if batch is None
                 else self.put_batch(batch))
        self.state, metrics = self.executor.step(self.state, batch)
        return metrics

    def evaluate(self, batch: dict[str, np.ndarray]) -> float:
        """Loss of the current parameters on a global batch (no update)."""
        return self.executor.eval_loss(self.state, batch)

    def _open_eval_data(self):
        if self._eval_data is None:
            self._eval_data, _ = make_loader(self.config, self.tokenizer, split="eval")
        return self._eval_data

    def eval_loss(self) -> float:
        """Mean loss on `eval.batches` fixed global batches of held-out data (every process
        reads them whole: evaluation is rare and rows are slices of a memory map)."""
        data = self._open_eval_data()
        return float(np.mean([self.evaluate(data.batch(k))
                              for k in range(self.config.eval.batches)]))

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
                writer=getattr(self.executor, "writes_checkpoints", True))
        return self._checkpointer

    def layout(self) -> hckpt.Layout:
        """How this trainer's state maps to the plan-independent checkpoint layout."""
        return self.executor.checkpoint_layout(self.state)

    def save(self, *, eval_loss: float | None = None, wait: bool = False) -> int:
        """Checkpoint the current step (state, data position, config, plan); returns the step.

        The save is asynchronous unless checkpoint.async_save is off or `wait` is set. A step
        already checkpointed (train() saves its last one) is not written again."""
        step = int(self.state.step)
        if step in self.checkpointer.steps():
            if wait:
                self.checkpointer.wait()
            return step
        meta = {"step": step, "config": json.loads(self.config.to_json_best_effort()),
                "plan": self.plan.to_dict(), "data": self.data_spec.to_dict(),
                # All randomness is a function of the seed and the step: parameters are
                # initialised from the seed, the data order from the seed and the data state.
                "rng": {"seed": self.config.train.seed,
                        "prng_impl": str(jax.config.jax_default_prng_impl)},
                "hetjax_version": __version__}
        self.checkpointer.save(step, self.state, self.layout(), self.data.get_state(), meta,
                               eval_loss=eval_loss)
        self._last_saved = step
        if wait:
            self.checkpointer.wait()
        return step

    def restore(self, step: int | None = None) -> int | None:
        """Load checkpoint `step` (default: the latest complete one) into this trainer's plan
        and shardings, with the data position; returns its step, or None if there is none."""
        r = self.checkpointer.restore(self.layout(), step)
        if r is None:
            return None
        saved, now = r.meta.get("data") or {}, self.data_spec.to_dict()
        if saved != now:
            diff = ", ".join(f"{k} = {saved.get(k)!r} there, {now.get(k)!r} now"
                             for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k))
            raise HetjaxError(
                f"checkpoint {r.step} in {self.checkpoint_dir} was written for other data "
                f"({diff}); resume with the same data.*, train.seq_len, train.batch_size and "
                "train.seed, or use another workdir")
        self.state = r.state
        self.data.set_state(r.data_state)
        return r.step

    # --- the loop -------------------------------------------------------------------------------
    def describe(self) -> str:
        lines = [self.topology.describe()]
        if not self.config.diloco.inner_steps:  # under DiLoCo the sites' own plans (the
            lines.append(self.plan.describe(self.topology))  # executor's lines) are what runs
        lines += [f"  note: {n}" for n in self.notes]
        if self.executor.describe():
            lines.append(self.executor.describe())
        m = self.model_cfg
        lines.append(f"model: {m.num_params / 1e6:.2f}M parameters, {m.n_layers} layers, "
                     f"d_model {m.d_model}, heads {m.n_heads} (kv {m.n_kv_heads}), d_ff {m.d_ff},"
                     f" vocab {m.vocab_size}, {m.dtype} compute")
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
        model_line = self.describe().splitlines()[-1]
        return (self.topology._repr_html_() + self.plan._repr_html_()
                + f"<img src='data:image/png;base64,{image}' style='max-width:100%'/>"
                + f"<p>{html.escape(model_line)}</p>")

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
            return 0
        bad += 1
        limit = self.config.train.max_bad_steps
        if jax.process_index() == 0:
            print(f"hetjax: step {step}: loss {loss}, grad_norm {g_norm}: update skipped "
                  f"({bad} in a row, train.max_bad_steps = {limit})", file=sys.stderr,
                  flush=True)
        if bad >= limit:
            raise HetjaxError(
                f"train.max_bad_steps: {bad} steps in a row ({step - bad + 1}-{step}) had a "
                f"non-finite loss or gradient norm; training stopped, nothing of them was saved"
                f" (checkpoints in {self.checkpoint_dir}); fix: lower train.lr "
                f"(= {self.config.train.lr:g}) or train.grad_clip, check model.vocab_size and "
                "the data, then rerun to resume from the latest checkpoint")
        return bad

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
        cfg, ckpt = self.config.train, self.config.checkpoint
        total = steps if steps is not None else cfg.steps
        # one metrics writer per job: process 0 of world 0 (every world has the loss)
        primary = jax.process_index() == 0 and os.environ.get(ENV_WORLD, "0") == "0"
        resumed = self.restore() if ckpt.every and int(self.state.step) == 0 else None
        if int(self.state.step) >= total:
            return self._complete(total, resumed)
        if self.config.eval.every:  # opened now, so missing held-out data stops us before step 1
            self._open_eval_data()
        if primary:
            self._write_run_files()
            if resumed is not None:  # rows logged after that checkpoint were lost with it
                _drop_metrics_after(os.path.join(self.workdir, "metrics.jsonl"), resumed)
                if self.config.tensorboard:  # and TensorBoard shows what the file holds
                    rebuild_tensorboard(self.workdir)
        writer = MetricsWriter(self.workdir, self.config.tensorboard, primary,
                               wandb={**self.config.wandb.to_dict(),
                                      "config": self.config.to_dict()})
        progress = Progress(total, int(self.state.step), cfg.progress and not self.quiet,
                            cfg.log_every, primary)
        if resumed is not None and primary and not self.quiet:
            print(f"resumed from checkpoint {resumed} in {self.checkpoint_dir}", flush=True)
        timing = Timing(self, int(self.state.step))
        last_eval: list[float] = []

        def evaluate(info):
            info.add(eval_loss=self.eval_loss())
            last_eval.append(info.added["eval_loss"])

        def checkpoint(info):
            self.save(eval_loss=info.added.get("eval_loss"))

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
            standard.append(Hook(checkpoint, 0, last=True, aside=True,
                                 also=lambda info: self.checkpointer.should_save(info.step)))
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
        preempted = _SigtermFlag()
        profiler = (StepProfiler(self.workdir, max(cfg.profile_from, int(self.state.step) + 1),
                                 cfg.profile_steps) if cfg.profile_steps else None)
        try:
            for info in self.iter_steps(total, standard + self.hooks, profiler):
                aside = info.aside_s
                if preempted.is_set() and not info.last:
                    self._stop_preempted(info.step)
            if hasattr(self.executor, "finish"):  # worlds: peers pull our last messages first
                self.executor.finish()
        finally:
            if profiler is not None:
                profiler.stop()  # a run that ends inside the traced steps still writes it
            preempted.restore()
            progress.close()
            writer.close()
            if self._checkpointer is not None:
                self._checkpointer.wait()  # an in-flight save completes before we return
        summary = timing.summary(total, aside)
        history = self.history if primary else History(rows)
        summary.update({
            "eval_loss": last_eval[-1] if last_eval else None,
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
                f"pp={p.pp} dp={p.dp} tp={p.tp}{since}")

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

    def _stop_preempted(self, step: int) -> None:
        """SIGTERM arrived: checkpoint this step (unless a hook just did) and stop."""
        if self._last_saved != step:
            self.save(wait=True)
        self.checkpointer.wait()
        raise Preempted(f"preempted (SIGTERM) after step {step}: saved checkpoint {step} in "
                        f"{self.checkpoint_dir}; rerun the same command to resume (exit code "
                        f"{Preempted.EXIT_CODE})")

    def _write_run_files(self):
        os.makedirs(self.workdir, exist_ok=True)
        with open(os.path.join(self.workdir, "plan.json"), "w") as f:
            f.write(self.plan.to_json(indent=1))
        with open(os.path.join(self.workdir, "topology.json"), "w") as f:
            f.write(self.topology.to_json(indent=1))
        with open(os.path.join(self.workdir, "config.json"), "w") as f:
            f.write(self.config.to_json_best_effort(indent=1))


class _SigtermFlag(threading.Event):
    """Set by SIGTERM while a single-process `train()` runs; `restore()` puts the previous
    handler back. (In a multi-process run the handler is not installed: every process would
    have to stop at the same step, so SIGTERM ends it as before and the run resumes from its
    latest periodic checkpoint.)"""

    def __init__(self):
        super().__init__()
        self._previous = None
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, lambda *_: self.set())

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _drop_metrics_after(path: str, step: int) -> None:
    """Rewrite a metrics file without the rows after `step`."""
    if not os.path.exists(path):
        return
    rows = [r for r in read_metrics(path) if r["step"] <= step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


def _shown_path(path: str) -> str:
    """A path as the summary shows it: relative when under the working directory (the summary
    dict keeps it absolute), so a log reads runs/default/... rather than this machine's tree."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary as (label, text) rows, for the terminal table and the notebook's HTML."""
    def num(v, fmt):
        return format(v, fmt) if v is not None else "-"

    s = {**s, **{k: _shown_path(s[k]) for k in ("workdir", "metrics", "tensorboard", "plot")
                 if s.get(k)}}

    if s.get("complete"):
        rows = [("status", s["message"]), ("workdir", s["workdir"]),
                ("loss", f"{num(s['first_loss'], '.4f')} -> {num(s['final_loss'], '.4f')}")]
        if s.get("eval_loss") is not None:
            rows.append(("eval loss", f"{s['eval_loss']:.4f} (held-out documents)"))
        rows.append(("metrics", s["metrics"]))
        if s.get("plot"):
            rows.append(("loss curve", s["plot"]))
        return rows
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
    if s.get("wandb"):
        rows.append(("wandb", s["wandb"]))
    if s.get("checkpoints"):
        rows.append(("checkpoints", s["checkpoints"]))
    if s.get("plot"):
        rows.append(("loss curve", s["plot"]))
    if s.get("profile"):
        rows.append(("profile", f"{s['profile']} (open at ui.perfetto.dev)"))
    return rows


def format_summary(s: dict[str, Any]) -> str:
    rows = summary_rows(s)
    w = max(len(k) for k, _ in rows)
    return "summary\n" + "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


__all__ = ["Trainer", "TrainState", "Hook", "StepInfo", "make_optimizer", "opt_state_specs",
           "format_summary", "summary_rows", "History", "RunSummary"]

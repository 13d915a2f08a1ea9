"""The step loop's hooks: what a hook sees after a step (`StepInfo`), when it runs (`Hook`: a
function with an interval), the timing hook (`Timing`: step time, tokens/s and MFU, and the
run's totals) and the checkpointer's (`Checkpointing`: saves at `checkpoint.every` and at the
run's end, never a blown-up run). `hetjax.train.Trainer` runs them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import jax
import numpy as np

if TYPE_CHECKING:
    from hetjax.train import Trainer


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
            "mfu_warning": tr.mfu_warning,
            "wall_s": time.perf_counter() - self.t_start,
            "compile_and_first_step_s": (self.t_first - self.t_start) if self.t_first else None,
            "input_wait_s": (tr.data.waited_s - self.waited_start) / max(total - self.start, 1),
        }


class Checkpointing:
    """The checkpointer as a hook: after the steps the trainer's checkpointer is due to save
    (`checkpoint.every`, `Checkpointer.should_save`) and after the run's last step, save the
    state with the step's eval loss -- after the divergence check (a run that blew up is
    stopped, not saved) and never the state of a skipped update. Aside: not training time."""

    def __init__(self, trainer: "Trainer"):
        self.trainer = trainer

    def __call__(self, info: StepInfo) -> None:
        tr = self.trainer
        tr._check_diverged(info.step, info.metrics["loss"])  # never save a blown-up run
        if not (np.isfinite(info.metrics["loss"]) and np.isfinite(info.metrics["grad_norm"])):
            # A skipped update: the state is the last step's, or (a DiLoCo outer step after a
            # blow-up) worse; the loop's finiteness check reports it a step later.
            return
        tr.save(eval_loss=info.added.get("eval_loss"))

    def hook(self) -> Hook:
        return Hook(self, 0, last=True, aside=True,
                    also=lambda info: self.trainer.checkpointer.should_save(info.step))

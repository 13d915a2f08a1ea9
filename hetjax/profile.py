"""Profiling a few training steps: `train.profile_steps` steps from `train.profile_from` are
traced with `jax.profiler` (every process writes its own trace), and each trace is summarised:
how long the steps took, how much of it every thread was busy, and which programs ran.

The trace is the profiler's own (a TensorBoard profile and a Perfetto `perfetto_trace.json.gz`
under `<workdir>/profile/<world>-<process>/`, open it at ui.perfetto.dev); the summary reads the
Perfetto file's complete events ("ph": "X"). On the CPU client, the `python` thread shows the
dispatch of each jitted call (`PjitFunction(name)`) and the XLA threads the programs' execution
(`ThunkExecutor::Execute`, one event per run); on a GPU the device streams appear instead.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections import defaultdict
from dataclasses import dataclass

import jax

from hetjax.errors import HetjaxError
from hetjax.parallel.nic import ENV_WORLD

PROGRAM = "ThunkExecutor::Execute (wait for completion)"  # one program run on one device
COLLECTIVE = "Rendezvous"  # devices waiting for each other inside a collective
DISPATCH = "PjitFunction("  # the python thread's event for one jitted call


def trace_dir(workdir: str) -> str:
    """This process's trace directory under `workdir`."""
    return os.path.join(workdir, "profile",
                        f"{os.environ.get(ENV_WORLD, '0')}-{jax.process_index()}")


class StepProfiler:
    """Traces steps `first .. first + count - 1` of a run: `before(step)` before each step is
    dispatched, `after(step, outputs)` after it (which waits for the last traced step)."""

    def __init__(self, workdir: str, first: int, count: int):
        self.dir = trace_dir(workdir)
        self.first, self.last = first, first + count - 1
        self.active = False
        self.path: str | None = None

    def before(self, step: int) -> None:
        if step == self.first and not self.active:
            os.makedirs(self.dir, exist_ok=True)
            jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
            self.active = True

    def after(self, step: int, outputs) -> None:
        if step == self.first - 1:  # the trace starts with nothing of earlier steps in flight
            jax.block_until_ready(outputs)
        if self.active and step == self.last:
            jax.block_until_ready(outputs)
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            found = sorted(glob.glob(os.path.join(self.dir, "**", "perfetto_trace.json.gz"),
                                     recursive=True), key=os.path.getmtime)
            self.path = found[-1] if found else None


@dataclass
class TraceSummary:
    """What one process's trace says: the traced span, each device's (XLA client thread's)
    time running programs, the time inside collectives, and the jitted functions by
    dispatch count and python dispatch time."""

    path: str
    span_s: float
    programs: dict[str, tuple[int, float]]  # XLA client thread -> (program runs, busy seconds)
    collective_s: float
    dispatches: dict[str, tuple[int, float]]  # jitted function -> (calls, python seconds)

    def lines(self, steps: int) -> list[str]:
        per = max(1, steps)
        out = [f"profile {self.path}: {steps} steps, {self.span_s / per:.3f} s per step"]
        for i, (name, (runs, busy)) in enumerate(sorted(self.programs.items())):
            out.append(f"  XLA thread {i}: {runs / per:.1f} program runs per step, busy "
                       f"{busy / per:.3f} s/step ({100 * busy / max(self.span_s, 1e-12):.0f}%)")
        if self.collective_s:
            out.append(f"  inside collectives (all threads): {self.collective_s / per:.3f} s/step")
        calls = sum(n for n, _ in self.dispatches.values())
        py = sum(s for _, s in self.dispatches.values())
        out.append(f"  jitted calls: {calls / per:.0f} per step, {py / per:.3f} s/step of "
                   "python dispatch")
        for name, (n, s) in sorted(self.dispatches.items(), key=lambda kv: -kv[1][1])[:8]:
            out.append(f"    {name[:50]:50s} {n / per:6.1f} calls {s / per:.4f} s/step")
        return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarise(path: str) -> TraceSummary:
    """Summarise a Perfetto trace written by `StepProfiler` (times in the trace are in us)."""
    try:
        with gzip.open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise HetjaxError(f"profile: cannot read the trace {path}: {e}") from None
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    runs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    dispatches: dict[str, list] = defaultdict(lambda: [0, 0.0])
    collective = 0.0
    lo, hi = float("inf"), float("-inf")
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or e["name"].startswith("$profiler.py"):
            continue  # (start_trace / stop_trace themselves)
        start, dur = float(e["ts"]), float(e["dur"])
        lo, hi = min(lo, start), max(hi, start + dur)
        if e["name"] == PROGRAM:
            runs[names.get((e.get("pid"), e.get("tid")), str(e.get("tid")))].append(
                (start, start + dur))
        elif e["name"] == COLLECTIVE:
            collective += dur * 1e-6
        elif e["name"].startswith(DISPATCH):
            d = dispatches[e["name"][len(DISPATCH):].rstrip(")")]
            d[0] += 1
            d[1] += dur * 1e-6
    if hi < lo:
        raise HetjaxError(f"profile: the trace {path} holds no events")
    return TraceSummary(path, (hi - lo) * 1e-6,
                        {k: (len(v), _union(v) * 1e-6) for k, v in runs.items()}, collective,
                        {k: (int(n), s) for k, (n, s) in dispatches.items()})

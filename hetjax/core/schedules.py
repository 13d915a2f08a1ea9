"""Pipeline schedules as data, in one registry: the executors, the simulator, the planner, config
validation and the plots all read it.

A schedule gives, for every stage, the ordered list of tasks it performs in one training step.
A `Task` names its kind, micro-batch, stage and chunk: F(m) runs a forward of micro-batch m,
B(m) its backward; schedules that split the backward (zero bubble) run I(m), the input
gradient that the previous stage waits for, and later W(m), the weight gradient that nobody
waits for. A stage may run several model chunks (virtual stages): `stage_chunk` is the task's
chunk in its stage's chunk order (`Schedule.model_chunk(task)` its index in model order), and `Schedule.placement()` says which stage runs each chunk of the
model, in model order (the default loops: model chunk k on stage k mod pp, Megatron's
interleaved placement). Dependencies are implicit: F of model chunk k needs F of chunk k - 1
(its input activation); B or I of chunk k needs B or I of chunk k + 1 (the gradient of its
output) and its own F; W needs its own I.

Adding a schedule is one `Schedule` subclass decorated with `@register`: its `build()` returns
the orders (or its `order_codes()` gives them as integer arrays, as the registered schedules
do, so that the planner plays thousands of micro-batches without building Task objects); class
attributes say how many chunks per stage it runs (`virtual`) and whether it
splits the backward. Only schedules with one chunk per stage and a whole backward run on the
SPMD executor's tick grid (`spmd_compatible`); every schedule runs on the MPMD executor.

`play(schedule, duration, hop)` plays the orders: each stage runs its tasks in order, each as
soon as its inputs have arrived, and the `Event`s say when each task starts and ends. With unit
durations and no transfer time it gives the tick grid (`tick_table`) the SPMD executor runs: at
tick t, stage s performs `tick_table[t][s]` (or idles), and activations / gradients move between
ticks; `tick_codes` is that grid as integer codes (a schedule may give its codes without
building tasks: `Schedule.grid_codes`). Played with measured durations, the orders are the
timeline simulator (`hetjax.core.timeline`); the grid lowered to the SPMD executor's tables is
`hetjax.core.tick_program`, the orders lowered to the MPMD executor's per-stage ops
`hetjax.core.program`; the grid priced in lockstep is `hetjax.planner.lockstep`.

GPipe runs all forwards, then all backwards, so a stage holds the activations of all M
micro-batches. 1F1B (PipeDream-Flush) starts backwards as soon as possible: stage s runs
pp - 1 - s warm-up forwards, then alternates one forward and one backward, so it never holds
more than pp - s micro-batches of activations. Interleaved 1F1B (Megatron-LM) runs v chunks per
stage, which divides the bubble by v; ZB-H1 (zero bubble) fills the cool-down with the
weight-gradient tasks it held back.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np

BACKWARD_KINDS = ("B", "I")  # the tasks that send a gradient to the previous chunk
RELEASE_KINDS = ("B", "W")  # the tasks after which a micro-batch's stash is freed
TASK_KINDS = ("F", "B", "I", "W")  # a kind's index here is its code in `Schedule.order_codes`
_F, _B, _I, _W = range(4)


@dataclass(frozen=True)
class Task:
    """One task of a stage: `kind` F, B, I (input gradient) or W (weight gradient), of
    micro-batch `microbatch`, on the stage's chunk `stage_chunk` (0 .. virtual - 1, in the
    stage's own order; `Schedule.model_chunk` gives the chunk's index in model order)."""

    kind: str
    microbatch: int
    stage_chunk: int = 0
    stage: int = 0

    def __str__(self) -> str:
        chunk = f".{self.stage_chunk}" if self.stage_chunk else ""
        return f"{self.kind}{self.microbatch}{chunk}"


SCHEDULES: dict[str, type["Schedule"]] = {}


def register(cls: type["Schedule"]) -> type["Schedule"]:
    """Class decorator: make a schedule available by its `name` everywhere."""
    if not getattr(cls, "name", ""):
        raise TypeError(f"{cls.__name__} needs a class attribute 'name'")
    SCHEDULES[cls.name] = cls
    return cls


class Schedule:
    """A pipeline schedule for `stages` stages and `microbatches` micro-batches (see the module
    docstring). Subclasses set `name`, optionally `virtual` and `splits_backward`, implement
    `build()` or `order_codes()`, and may refuse sizes in `check()`."""

    name: ClassVar[str] = ""
    virtual: ClassVar[int] = 1  # model chunks per stage
    splits_backward: ClassVar[bool] = False  # B split into I and W
    spmd_compatible: ClassVar[bool] = True  # the SPMD executor's tick grid can run it
    # A tick of the SPMD grid may run an F and a B of different micro-batches (two strands);
    # such a schedule gives its grid itself (`tick_grid`).
    co_executes: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.spmd_compatible = cls.virtual == 1 and not cls.splits_backward

    def __init__(self, stages: int, microbatches: int):
        if stages < 1 or microbatches < 1:
            raise ValueError(f"a schedule needs stages >= 1 and microbatches >= 1, got "
                             f"{stages}, {microbatches}")
        self.check(stages, microbatches)
        self.stages, self.microbatches = stages, microbatches

    @functools.cached_property
    def orders(self) -> tuple[tuple[Task, ...], ...]:
        """Every stage's tasks in order (built on first use: the planner plays schedules from
        `order_codes` alone, which is much cheaper for thousands of micro-batches)."""
        if type(self).order_codes is not Schedule.order_codes:  # the rule is given as codes
            return tuple(tuple(Task(TASK_KINDS[k], m, c, s) for k, m, c in codes.tolist())
                         for s, codes in enumerate(self.order_codes()))
        return tuple(tuple(Task(t.kind, t.microbatch, t.stage_chunk, s) for t in order)
                     for s, order in enumerate(self.build()))

    @classmethod
    def check(cls, stages: int, microbatches: int) -> None:
        """Raise ValueError (saying what to change) if the schedule cannot run these sizes."""

    def build(self) -> list[list[Task]]:
        """Every stage's order of tasks (their `stage` is set afterwards). A schedule gives
        this or `order_codes`."""
        if type(self).order_codes is Schedule.order_codes:
            raise NotImplementedError(f"{type(self).__name__} gives neither build() nor "
                                      f"order_codes()")
        return [[Task(TASK_KINDS[k], m, c) for k, m, c in codes.tolist()]
                for codes in self.order_codes()]

    def order_codes(self) -> tuple[np.ndarray, ...]:
        """Every stage's order as integer codes [tasks, 3]: kind (index in TASK_KINDS),
        micro-batch, stage chunk. From `orders` by default; the registered schedules give
        their rule here (as numpy) and their Task orders are built from it."""
        return tuple(np.array([(TASK_KINDS.index(a.kind), a.microbatch, a.stage_chunk)
                               for a in order], dtype=np.int64).reshape(-1, 3)
                     for order in self.orders)

    def tick_grid(self) -> list[list["Cell"]]:
        """The SPMD tick grid of a co-executing schedule (see `tick_table`)."""
        raise NotImplementedError

    @classmethod
    def grid_codes(cls, stages: int, microbatches: int) -> np.ndarray:
        """`tick_codes(tick_table(cls(stages, microbatches)))`: the grid as codes [ticks,
        stages]. Played by default; a schedule whose grid has a closed form gives it here, so
        the planner prices thousands of micro-batches without building Task objects (tests
        compare every override with the played grid)."""
        return tick_codes(tick_table(cls(stages, microbatches)))

    @classmethod
    def stash_peaks(cls, stages: int, microbatches: int) -> tuple[float, ...]:
        """`activation_share(s)` of every stage (played by default, closed form where a
        schedule gives one; tests compare them)."""
        table = cls(stages, microbatches)
        return tuple(table.activation_share(s) for s in range(stages))

    def placement(self) -> tuple[int, ...]:
        """The stage that runs each model chunk, in model order."""
        return tuple(k % self.stages for k in range(self.stages * self.virtual))

    def model_chunk(self, task: Task) -> int:
        """The model chunk (index in model order) a task works on."""
        if not hasattr(self, "_chunk_index"):  # built once: the simulator asks per task
            seen: dict[int, int] = {}
            self._chunk_index = {}
            for k, s in enumerate(self.placement()):
                seen[s] = seen.get(s, -1) + 1
                self._chunk_index[s, seen[s]] = k
        try:
            return self._chunk_index[task.stage, task.stage_chunk]
        except KeyError:
            raise ValueError(f"stage {task.stage} has no chunk {task.stage_chunk} in "
                             f"{self.name}") from None

    def max_in_flight(self, stage: int) -> int:
        """Most (chunk, micro-batch) pairs whose stash stage `stage` holds at once (F done,
        its B or W not yet)."""
        live = peak = 0
        for a in self.orders[stage]:
            live += 1 if a.kind == "F" else -1 if a.kind in RELEASE_KINDS else 0
            peak = max(peak, live)
        return peak

    def activation_share(self, stage: int) -> float:
        """`max_in_flight` in units of one micro-batch's activations for the whole stage (a
        chunk holds 1 / virtual of the stage's layers)."""
        return self.max_in_flight(stage) / self.virtual

    def bubble(self, fwd: float = 1.0, bwd: float = 2.0) -> float:
        """The schedule's idle share with equal stages, no transfers, and per-micro-batch times
        fwd / bwd per stage (W taking half of bwd), by its formula: (p - 1) idle slots of
        F + B for GPipe and 1F1B. Exact for M >= p (tests play the timeline against it)."""
        p, m = self.stages, self.microbatches
        idle = (p - 1) * self.bubble_slot(fwd, bwd)
        return idle / (m * (fwd + bwd) + idle)

    def bubble_slot(self, fwd: float, bwd: float) -> float:
        """Idle time per stage of the pipeline's depth (see `bubble`)."""
        return fwd + bwd

    def __repr__(self) -> str:
        return f"{type(self).__name__}(stages={self.stages}, microbatches={self.microbatches})"


@register
class GPipe(Schedule):
    """All forwards, then all backwards: every stage holds all M micro-batches."""

    name = "gpipe"

    def order_codes(self):
        M = self.microbatches
        m = np.arange(M)
        return tuple(_order(np.arange(2 * M), np.repeat([_F, _B], M), np.concatenate([m, m]))
                     for _ in range(self.stages))

    @classmethod
    def grid_codes(cls, stages, microbatches):
        # F(m) on stage s at tick s + m; the backwards drain from the last stage, B(m) on
        # stage s at tick M + 2 (S - 1) - s + m.
        S, M = stages, microbatches
        s, m = np.arange(S)[:, None], np.arange(M)[None, :]
        return _codes(2 * M + 2 * S - 2, S, s + m, M + 2 * (S - 1) - s + m)

    @classmethod
    def stash_peaks(cls, stages, microbatches):
        return (float(microbatches),) * stages


@register
class OneFOneB(Schedule):
    """PipeDream-Flush: pp - 1 - s warm-up forwards, then one forward and one backward."""

    name = "1f1b"

    def order_codes(self):
        M = self.microbatches
        return tuple(_order(np.arange(2 * M), *warm_up_then_alternate(min(self.stages - 1 - s, M), M))
                     for s in range(self.stages))

    @classmethod
    def grid_codes(cls, stages, microbatches):
        # Stage s warms up with w = min(S - 1 - s, M) forwards at ticks s + m (m <= w); from
        # then on its backwards are paced by the last stage's, B(m) at tick 2 S - 1 - s + 2 m,
        # and each later forward F(m) runs in the tick before B(m - w): tick s + 2 m.
        S, M = stages, microbatches
        s, m = np.arange(S)[:, None], np.arange(M)[None, :]
        w = np.minimum(S - 1 - s, M)
        return _codes(2 * M + 2 * S - 2, S, np.where(m <= w, s + m, s + 2 * m),
                      2 * S - 1 - s + 2 * m)

    @classmethod
    def stash_peaks(cls, stages, microbatches):
        return tuple(float(min(stages - s, microbatches)) for s in range(stages))


def warm_up_then_alternate(warmup: int, total: int) -> tuple[np.ndarray, np.ndarray]:
    """`warmup` forwards, then one forward and one backward until the forwards run out, then
    the remaining backwards: (kind codes, i) of the order, the i-th forward or backward."""
    pairs = total - warmup
    kinds = np.concatenate([np.full(warmup, _F), np.tile([_F, _B], pairs), np.full(warmup, _B)])
    i = np.concatenate([np.arange(warmup),
                        np.stack([np.arange(warmup, total), np.arange(pairs)], 1).ravel(),
                        np.arange(pairs, total)])
    return kinds, i


@register
class Interleaved(Schedule):
    """Megatron-LM's interleaved 1F1B with v = 2 model chunks per stage, placed in a loop
    (chunk k on stage k mod pp). Forwards go through micro-batches in groups of pp, chunk by
    chunk; stage s warms up with 2 (pp - 1 - s) + (v - 1) pp forwards. The bubble is 1/v of
    1F1B's; M must be a multiple of pp."""

    name = "interleaved"
    virtual = 2

    @classmethod
    def check(cls, stages, microbatches):
        if stages > 1 and microbatches % stages:
            raise ValueError(f"the interleaved schedule needs the micro-batches ({microbatches}) "
                             f"to be a multiple of the pipeline stages ({stages})")

    def order_codes(self):
        p, v, M = self.stages, self.virtual, self.microbatches
        total, out = M * v, []
        for s in range(p):
            kinds, i = warm_up_then_alternate(min(2 * (p - 1 - s) + (v - 1) * p, total), total)
            group = (i // p) % v
            out.append(_order(np.arange(2 * total), kinds, (i // (p * v)) * p + i % p,
                              np.where(kinds == _F, group, v - 1 - group)))
        return tuple(out)

    @classmethod
    def stash_peaks(cls, stages, microbatches):
        # w warm-up forwards, then each (F, B) pair peaks at w + 1, in units of 1 / v
        cls.check(stages, microbatches)
        p, v, total = stages, cls.virtual, microbatches * cls.virtual
        return tuple(min(min(2 * (p - 1 - s) + (v - 1) * p, total) + 1, total) / v
                     for s in range(p))

    def bubble_slot(self, fwd, bwd):
        return (fwd + bwd) / self.virtual


@register
class ZeroBubbleH1(Schedule):
    """ZB-H1 (Qi et al., zero bubble pipeline parallelism): 1F1B with each backward split into
    I (the input gradient, which the previous stage waits for) and W (the weight gradient,
    which nobody waits for). Stage s holds back s of its W tasks, so the later stages pass
    input gradients upstream without pausing for weight gradients, and runs them in the
    cool-down. The bubble shrinks from (p - 1)(F + B) to (p - 1)(F + I - W); every stage holds
    at most p micro-batches' stashes (1F1B's peak, on its first stage; a stash lives until W)."""

    name = "zb-h1"
    splits_backward = True

    def order_codes(self):
        # Stage s: `warmup` forwards; then iteration b = 0 .. M - 1 runs F(warmup + b) (while
        # forwards remain), I(b), and W(b - s) once s W tasks are held back; then the held-back
        # W tasks. Sorted by the key 3 (b + 1) + (0 F, 1 I, 2 W); warm-up before, tail after.
        p, M, out = self.stages, self.microbatches, []
        b = np.arange(M)
        for s in range(p):
            warmup = min(p - 1 - s, M)
            late_f, late_w = b[:M - warmup], b[s:]
            tail = np.arange(max(M - s, 0), M)
            out.append(_order(
                np.concatenate([np.arange(warmup) - warmup, 3 * (late_f + 1), 3 * (b + 1) + 1,
                                3 * (late_w + 1) + 2, 3 * (M + 1) + tail]),
                np.repeat([_F, _F, _I, _W, _W], [warmup, len(late_f), M, len(late_w), len(tail)]),
                np.concatenate([np.arange(warmup), warmup + late_f, b, late_w - s, tail])))
        return tuple(out)

    @classmethod
    def stash_peaks(cls, stages, microbatches):
        # A stash lives from F to W: by the F of iteration b, min(w + b + 1, M) forwards ran
        # and max(0, b - s) W tasks, which peaks at b = min(s, M - 1).
        M = microbatches
        return tuple(float(min(min(stages - 1 - s, M) + min(s, M - 1) + 1, M))
                     for s in range(stages))

    def bubble_slot(self, fwd, bwd):
        return fwd  # F + I - W, with I = W = B / 2


@register
class Strands(Schedule):
    """DHelix's strand interleaving on the SPMD tick grid: stage s runs F(m) at tick m + s and
    B(m) at tick m + 2 pp - 1 - s. After 2 (pp - s) - 1 warm-up forwards every tick of a stage
    holds the forward of one micro-batch and the backward of another (two strands), which the
    SPMD executor runs in one traced body so XLA may overlap one's collectives with the
    other's compute; then cool-down backwards. In lockstep a tick of both costs F + B and the
    grid has M - 1 of them plus pp ticks of F and pp of B: (M + pp - 1)(F + B), GPipe's step.
    A stage holds at most 2 (pp - s) micro-batches (`max_in_flight`; the executor needs
    2 (pp - s) - 1 stash slots, the tick's B freeing its slot before the F takes one): flat in
    M, against GPipe's M."""

    name = "strands"
    co_executes = True

    def lag(self, stage: int) -> int:
        """Ticks between a micro-batch's F and its B on `stage`: F(m + lag) pairs with B(m)."""
        return 2 * (self.stages - stage) - 1

    def order_codes(self):
        # i = 0 .. M + lag - 1: F(i) while forwards remain, then B(i - lag) once lag ticks in
        M, m = self.microbatches, np.arange(self.microbatches)
        return tuple(_order(np.concatenate([2 * m, 2 * (m + self.lag(s)) + 1]),
                            np.repeat([_F, _B], M), np.concatenate([m, m]))
                     for s in range(self.stages))

    def tick_grid(self):
        p, M = self.stages, self.microbatches
        grid: list[list[Cell]] = [[None] * p for _ in range(M + 2 * p - 1)]
        for s, order in enumerate(self.orders):
            for a in order:
                t = a.microbatch + (s if a.kind == "F" else s + self.lag(s))
                cell = grid[t][s]
                grid[t][s] = a if cell is None else (cell, a)  # (F, B)
        while grid and not any(grid[-1]):
            grid.pop()
        return grid

    @classmethod
    def grid_codes(cls, stages, microbatches):
        # `tick_grid`'s ticks: F(m) at m + s, B(m) at m + s + lag(s) = m + 2 S - 1 - s.
        S, M = stages, microbatches
        s, m = np.arange(S)[:, None], np.arange(M)[None, :]
        return _codes(M + 2 * S - 1, S, s + m, 2 * S - 1 - s + m)

    @classmethod
    def stash_peaks(cls, stages, microbatches):
        # F(i) then B(i - lag): the stash grows to lag + 1 once a backward has started.
        return tuple(float(min(microbatches, 2 * (stages - s))) for s in range(stages))


class Folded(Schedule):
    """Any grid schedule on the folded placement (DHelix's W, ZB-V's V), for executors that
    take per-stage orders (MPMD): v = 2 chunks per stage, model chunk k on stage k for k < p
    and on stage 2 p - 1 - k for k >= p, so stage 0 runs the first chunk and the last.

    The orders come from the base schedule's played tick grid for a virtual pipeline of 2 p
    stages: stage d takes, tick by tick, the tasks of its down chunk (virtual stage d, chunk 0)
    and then of its up chunk (virtual stage 2 p - 1 - d, chunk 1). Every task's inputs are
    produced at earlier ticks, so these orders are a topological order of the dependencies and
    cannot deadlock, and the timeline reproduces the grid's density (a naive V issue order
    built from warm-up-then-alternate does neither). Not registered by name: `folded(name, ...)`
    wraps a registered schedule; the SPMD executor runs the virtual grid itself."""

    virtual = 2

    def __init__(self, base: str, stages: int, microbatches: int):
        self.base = make_schedule(base, 2 * stages, microbatches)
        self.name = f"{base} (folded)"
        super().__init__(stages, microbatches)

    def build(self):
        p, orders = self.stages, [[] for _ in range(self.stages)]
        for row in tick_table(self.base):
            for d in range(p):
                for chunk, k in ((0, d), (1, 2 * p - 1 - d)):
                    orders[d] += [Task(a.kind, a.microbatch, chunk) for a in cell_tasks(row[k])]
        return orders

    def placement(self) -> tuple[int, ...]:
        p = self.stages
        return tuple(range(p)) + tuple(reversed(range(p)))

    def bubble_slot(self, fwd, bwd):
        return self.base.bubble_slot(fwd, bwd)


def folded(name: str, stages: int, microbatches: int) -> Folded:
    """The registered schedule `name` on the folded placement (`Folded`)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if not SCHEDULES[name].spmd_compatible:
        raise ValueError(f"the folded placement takes a tick-grid schedule (one of "
                         f"{', '.join(spmd_schedules())}), not {name!r}")
    return Folded(name, stages, microbatches)


def make_schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The registered schedule `name` for these sizes."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](stages, microbatches)


def spmd_schedules() -> tuple[str, ...]:
    """The registered schedules the SPMD executor's tick grid can run."""
    return tuple(n for n, cls in SCHEDULES.items() if cls.spmd_compatible)


@dataclass(frozen=True)
class Event:
    """One task played: its stage, the task, and when it starts and ends."""

    stage: int
    action: Task
    start: float
    end: float


@dataclass(frozen=True)
class _Dependencies:
    """A schedule's tasks flattened stage by stage (`offsets[s]` is stage s's first) with what
    each waits for, as indices into that list: `wait` is the task whose end it needs (F: the
    previous model chunk's F, -1 for the first chunk, which starts at 0; B / I: its own F; W:
    its own I), `grad` (B / I) the next model chunk's B / I whose gradient it needs (-1 on the
    last chunk), `src` the stage that input arrives from (the hop it pays), -1 if none. A task
    that never runs is index `never` (its end stays unknown: `play` reports the deadlock)."""

    offsets: list[int]
    stage: np.ndarray
    cell: np.ndarray  # stage * len(TASK_KINDS) + kind code
    kind: list[int]
    wait: list[int]
    grad: list[int]
    src: np.ndarray
    never: int


def _dependencies(schedule: Schedule) -> _Dependencies:
    """`_Dependencies` of the schedule, built once per schedule object (it is immutable)."""
    deps = schedule.__dict__.get("_dependencies")
    if deps is not None:
        return deps
    codes = schedule.order_codes()
    S = schedule.stages
    lens = [len(c) for c in codes]
    offsets = [0, *itertools.accumulate(lens)]
    N = offsets[-1]
    flat = np.concatenate(codes) if N else np.zeros((0, 3), dtype=np.int64)
    stage = np.repeat(np.arange(S), lens)
    kind, mb, sc = flat[:, 0], flat[:, 1], flat[:, 2]
    placement = schedule.placement()
    V = len(placement)
    chunks = np.zeros(S, dtype=np.int64)  # chunk index of (stage, stage chunk), model order
    index = np.full((S, V), -1, dtype=np.int64)
    for k, s in enumerate(placement):
        index[s, chunks[s]] = k
        chunks[s] += 1
    ok = (sc >= 0) & (sc < chunks[stage])
    if not ok.all():
        i = int(np.argmin(ok))
        raise ValueError(f"stage {stage[i]} has no chunk {sc[i]} in {schedule.name}")
    chunk = index[stage, sc]
    # the end of each (F | G | W, model chunk, micro-batch), G being a B or an I
    slot = np.select([kind == _F, kind == _W], [0, 2], 1)
    m = mb - (mb.min() if N else 0)
    width = int(m.max()) + 1 if N else 1
    key = (slot * V + chunk) * width + m
    table = np.full(3 * V * width, N, dtype=np.int64)
    table[key] = np.arange(N)
    twice = np.flatnonzero(table[key] != np.arange(N))  # a later task has the same key
    if len(twice):
        i = int(twice[0])
        raise ValueError(f"schedule {schedule.name} runs {TASK_KINDS[kind[i]]}{mb[i]} of chunk "
                         f"{sc[i]} twice on stage {stage[i]}")
    first, last = chunk == 0, chunk == V - 1
    prev = table[(0 * V + np.maximum(chunk - 1, 0)) * width + m]
    own_f = table[(0 * V + chunk) * width + m]
    own_g = table[(1 * V + chunk) * width + m]
    next_g = table[(1 * V + np.minimum(chunk + 1, V - 1)) * width + m]
    is_f, is_w = kind == _F, kind == _W
    wait = np.where(is_f, np.where(first, -1, prev), np.where(is_w, own_g, own_f))
    backward = ~is_f & ~is_w
    grad = np.where(backward & ~last, next_g, -1)
    place = np.asarray(placement)
    src = np.where(is_f & ~first, place[np.maximum(chunk - 1, 0)],
                   np.where(backward & ~last, place[np.minimum(chunk + 1, V - 1)], -1))
    deps = _Dependencies(offsets, stage, stage * len(TASK_KINDS) + kind, kind.tolist(), wait.tolist(), grad.tolist(), src, N)
    schedule.__dict__["_dependencies"] = deps
    return deps


def _hop_times(deps: _Dependencies, hop: Callable[[int, int], float]) -> list:
    """Each task's input hop time (`hop(src, dst)`, asked once per pair of stages)."""
    S = len(deps.offsets) - 1
    out = [0.0] * deps.never
    if deps.never:
        pair = np.where(deps.src >= 0, deps.src * S + deps.stage, -1)
        pairs, inverse = np.unique(pair, return_inverse=True)
        times = [0.0 if p < 0 else hop(int(p) // S, int(p) % S) for p in pairs.tolist()]
        out = [times[j] for j in inverse.ravel().tolist()]
    return out


def _run(schedule: Schedule, deps: _Dependencies, duration: list, hops: list
         ) -> tuple[list[float], list[float], list[tuple[int, int]]]:
    """Play the flattened tasks (see `play`): their starts and ends, and the order they ran
    in as ranges of indices (a stage runs a range of its tasks at each visit)."""
    kind, wait, grad, never = deps.kind, deps.wait, deps.grad, deps.never
    end: list = [None] * (never + 1)
    start: list = [0.0] * never
    ran: list[tuple[int, int]] = []
    pos, stop = deps.offsets[:-1], deps.offsets[1:]
    clock = [0.0] * len(pos)
    remaining = never
    while remaining:
        progressed = False
        for s in range(len(pos)):
            i, e, c = pos[s], stop[s], clock[s]
            while i < e:
                k = kind[i]
                if k == _F:
                    j = wait[i]
                    if j < 0:
                        dep = 0.0
                    else:
                        x = end[j]
                        if x is None:
                            break
                        dep = x + hops[i]
                elif k == _W:
                    dep = end[wait[i]]
                    if dep is None:
                        break
                else:
                    own = end[wait[i]]
                    if own is None:
                        break
                    j = grad[i]
                    if j < 0:
                        up = own
                    else:
                        x = end[j]
                        if x is None:
                            break
                        up = x + hops[i]
                    dep = up if up > own else own  # max(own, up)
                c = dep if dep > c else c  # max(clock, dep): the task starts
                start[i] = c
                c = c + duration[i]
                end[i] = c
                i += 1
            if i > pos[s]:
                ran.append((pos[s], i))
                progressed = True
                remaining -= i - pos[s]
                pos[s], clock[s] = i, c
        if not progressed:
            raise ValueError(f"schedule {schedule.name} deadlocks: its orders wait on each other")
    return start, end, ran


def play(schedule: Schedule, duration: Callable[[int, Task], float],
         hop: Callable[[int, int], float]) -> list[Event]:
    """Play the schedule's orders: each stage runs its tasks in order, each as soon as its
    inputs have arrived; `duration(stage, task)` is a task's time, `hop(src, dst)` a move's
    (a function of the two stages). Raises ValueError when the orders wait on each other.
    Stages are visited in turn, each running as far as its inputs allow, and the events come
    in that order."""
    deps = _dependencies(schedule)
    tasks = [a for order in schedule.orders for a in order]
    stage = deps.stage.tolist()
    start, end, ran = _run(schedule, deps, [duration(s, a) for s, a in zip(stage, tasks)],
                           _hop_times(deps, hop))
    return [Event(stage[i], tasks[i], start[i], end[i]) for a, b in ran for i in range(a, b)]


def play_ends(schedule: Schedule, duration: Callable[[int, str], float],
              hop: Callable[[int, int], float]) -> list[list[float]]:
    """`play`'s end times, stage by stage in each stage's order, without building tasks or
    events (the planner plays schedules of thousands of micro-batches): a task's time here
    depends only on its stage and kind, `duration(stage, kind)`."""
    deps = _dependencies(schedule)
    table = [duration(s, k) for s in range(schedule.stages) for k in TASK_KINDS]
    _, end, _ = _run(schedule, deps, [table[c] for c in deps.cell.tolist()],
                     _hop_times(deps, hop))
    return [end[a:b] for a, b in zip(deps.offsets, deps.offsets[1:])]


Cell = "Task | tuple[Task, Task] | None"  # one stage's tick: idle, a task, or (F, B)


def cell_tasks(cell) -> tuple[Task, ...]:
    """The tasks of one cell of a tick grid, F before B."""
    return () if cell is None else cell if isinstance(cell, tuple) else (cell,)


def tick_table(schedule: Schedule) -> list[list[Task | None]]:
    """The unit-time grid: table[t][s] is what stage s does at tick t (None = idle); every
    task takes one tick and transfers take none. A co-executing schedule gives its own grid,
    whose cells may hold a pair (F, B) of two strands (`cell_tasks`)."""
    if schedule.co_executes:
        return schedule.tick_grid()
    events = play(schedule, lambda s, a: 1.0, lambda src, dst: 0.0)
    ticks = int(max(e.end for e in events))
    table: list[list[Task | None]] = [[None] * schedule.stages for _ in range(ticks)]
    for e in events:
        table[int(e.start)][e.stage] = e.action
    return table


def _order(keys: np.ndarray, kinds, microbatches, chunks=0) -> np.ndarray:
    """Order codes [tasks, 3] (`Schedule.order_codes`) of the tasks sorted by their distinct
    `keys`."""
    kinds, microbatches = np.asarray(kinds), np.asarray(microbatches)
    codes = np.stack([kinds, microbatches, np.broadcast_to(chunks, kinds.shape)], 1)
    return codes[np.argsort(keys, kind="stable")].astype(np.int64)


def _codes(ticks: int, stages: int, f_tick: np.ndarray, b_tick: np.ndarray) -> np.ndarray:
    """Codes [ticks, stages] from the tick of every forward and backward ([stages, M] each):
    1 forward, 2 backward, 3 both (two strands)."""
    codes = np.zeros((ticks, stages), dtype=np.int8)
    col = np.broadcast_to(np.arange(stages)[:, None], f_tick.shape)
    codes[f_tick, col] = 1
    codes[b_tick, col] += 2
    return codes


def tick_codes(table: list[list[Task | None]]) -> np.ndarray:
    """A tick grid as codes [ticks, stages]: 0 idle, 1 forward, 2 backward, 3 both (two
    strands)."""
    return np.array([[0 if a is None else 3 if isinstance(a, tuple) else 1 if a.kind == "F"
                      else 2 for a in row] for row in table], dtype=np.int8)


def format_table(schedule: Schedule) -> str:
    """The tick grid as text: one row per stage, one column per tick."""
    table = tick_table(schedule)
    rows = [f"{schedule.name} (stages={schedule.stages}, microbatches={schedule.microbatches})"]
    for s in range(schedule.stages):
        cells = ["+".join(map(str, cell_tasks(table[t][s]))) or "." for t in range(len(table))]
        rows.append(f"  stage {s}: " + " ".join(f"{c:>3}" for c in cells))
    return "\n".join(rows)

"""Pipeline schedules as data, in one registry: the executors, the simulator, the planner, config
validation and the plots all read it.

A schedule gives, for every stage, the ordered list of tasks it performs in one training step.
A `Task` names its kind, micro-batch, stage and chunk: F(m) runs a forward of micro-batch m,
B(m) its backward; schedules that split the backward (zero bubble) run I(m), the input
gradient that the previous stage waits for, and later W(m), the weight gradient that nobody
waits for. A stage may run several model chunks (virtual stages): `chunk` is the task's chunk
in its stage's chunk order, and `Schedule.placement()` says which stage runs each chunk of the
model, in model order (the default loops: model chunk k on stage k mod pp, Megatron's
interleaved placement). Dependencies are implicit: F of model chunk k needs F of chunk k - 1
(its input activation); B or I of chunk k needs B or I of chunk k + 1 (the gradient of its
output) and its own F; W needs its own I.

Adding a schedule is one `Schedule` subclass decorated with `@register`: its `build()` returns
the orders; class attributes say how many chunks per stage it runs (`virtual`) and whether it
splits the backward. Only schedules with one chunk per stage and a whole backward run on the
SPMD executor's tick grid (`spmd_compatible`); every schedule runs on the MPMD executor.

`timeline(schedule, fwd, bwd, ...)` plays the orders with per-stage durations and per-boundary
transfer times and returns when each task starts and ends; with unit durations and no transfer
time it gives the tick grid (`tick_table`) the SPMD executor runs: at tick t, stage s performs
`tick_table[t][s]` (or idles), and activations / gradients move between ticks. `transfers`
lists those moves, and `tick_program` turns the grid into the integer tables the SPMD executor
indexes: which action, which micro-batch, and which buffer slot each stage reads, and where each
arriving activation or gradient is kept until it is used.

GPipe runs all forwards, then all backwards, so a stage holds the activations of all M
micro-batches. 1F1B (PipeDream-Flush) starts backwards as soon as possible: stage s runs
pp - 1 - s warm-up forwards, then alternates one forward and one backward, so it never holds
more than pp - s micro-batches of activations. Interleaved 1F1B (Megatron-LM) runs v chunks per
stage, which divides the bubble by v; ZB-H1 (zero bubble) fills the cool-down with the
weight-gradient tasks it held back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import numpy as np

BACKWARD_KINDS = ("B", "I")  # the tasks that send a gradient to the previous chunk
RELEASE_KINDS = ("B", "W")  # the tasks after which a micro-batch's stash is freed


@dataclass(frozen=True)
class Task:
    """One task of a stage: `kind` F, B, I (input gradient) or W (weight gradient), of
    micro-batch `microbatch`, on the stage's chunk `chunk` (0 .. virtual - 1)."""

    kind: str
    microbatch: int
    chunk: int = 0
    stage: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


Action = Task  # the name the SPMD executor's tick tables use

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
    `build()`, and may refuse sizes in `check()`."""

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
        self.orders: tuple[tuple[Task, ...], ...] = tuple(
            tuple(Task(t.kind, t.microbatch, t.chunk, s) for t in order)
            for s, order in enumerate(self.build()))

    @classmethod
    def check(cls, stages: int, microbatches: int) -> None:
        """Raise ValueError (saying what to change) if the schedule cannot run these sizes."""

    def build(self) -> list[list[Task]]:
        raise NotImplementedError

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
            return self._chunk_index[task.stage, task.chunk]
        except KeyError:
            raise ValueError(f"stage {task.stage} has no chunk {task.chunk} in "
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

    def build(self):
        M = self.microbatches
        return [[Task("F", m) for m in range(M)] + [Task("B", m) for m in range(M)]
                for _ in range(self.stages)]

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

    def build(self):
        M = self.microbatches
        return [warm_up_then_alternate(min(self.stages - 1 - s, M), M, Task)
                for s in range(self.stages)]

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


def warm_up_then_alternate(warmup: int, total: int, task) -> list[Task]:
    """`warmup` forwards, then one forward and one backward until the forwards run out, then
    the remaining backwards; `task(kind, i)` makes the i-th forward or backward."""
    order = [task("F", i) for i in range(warmup)]
    for f, b in zip(range(warmup, total), range(total)):
        order += [task("F", f), task("B", b)]
    return order + [task("B", i) for i in range(total - warmup, total)]


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

    def build(self):
        p, v, M = self.stages, self.virtual, self.microbatches
        total = M * v

        def task(kind, i):
            group = (i // p) % v
            return Task(kind, (i // (p * v)) * p + i % p,
                        group if kind == "F" else v - 1 - group)

        return [warm_up_then_alternate(min(2 * (p - 1 - s) + (v - 1) * p, total), total, task)
                for s in range(p)]

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

    def build(self):
        orders = []
        p, M = self.stages, self.microbatches
        for s in range(p):
            warmup = min(p - 1 - s, M)
            order = [Task("F", m) for m in range(warmup)]
            w = 0  # next W to run
            for b in range(M):
                if warmup + b < M:
                    order.append(Task("F", warmup + b))
                order.append(Task("I", b))
                if b - w >= s:  # s W tasks held back
                    order.append(Task("W", w))
                    w += 1
            order += [Task("W", m) for m in range(w, M)]
            orders.append(order)
        return orders

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

    def build(self):
        M, orders = self.microbatches, []
        for s in range(self.stages):
            order = []
            for i in range(M + self.lag(s)):
                if i < M:
                    order.append(Task("F", i))
                if i >= self.lag(s):
                    order.append(Task("B", i - self.lag(s)))
            orders.append(order)
        return orders

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
    stage: int
    action: Task
    start: float
    end: float


def timeline(schedule: Schedule, fwd: Sequence[float], bwd: Sequence[float],
             send_fwd: Sequence[float] = (), send_bwd: Sequence[float] = (),
             weight_share: float = 0.5) -> list[Event]:
    """Play the schedule: each stage runs its tasks in order, each as soon as its inputs
    have arrived. fwd[s] / bwd[s]: time of one forward / backward of a micro-batch through all
    of stage s (a chunk takes 1 / virtual of it; W takes `weight_share` of a backward, I the
    rest); send_fwd[s] / send_bwd[s]: time to move an activation / gradient across boundary s
    (stage s <-> s + 1; a move between stages further apart, such as the interleaved
    schedule's wrap from the last stage to the first, costs the slowest boundary's time).
    Returns every task's start and end (a stage does one task at a time)."""
    v = schedule.virtual
    share = {"F": None, "B": 1.0, "I": 1.0 - weight_share, "W": weight_share}

    def duration(s: int, a: Task) -> float:
        return (fwd[s] if a.kind == "F" else bwd[s] * share[a.kind]) / v

    return _play(schedule, duration, _hops(schedule.stages, send_fwd, send_bwd))


def _hops(stages: int, send_fwd: Sequence[float], send_bwd: Sequence[float]
          ) -> Callable[[int, int], float]:
    sends = {+1: list(send_fwd) or [0.0] * max(stages - 1, 0),
             -1: list(send_bwd) or [0.0] * max(stages - 1, 0)}

    def hop(src: int, dst: int) -> float:
        if src == dst:
            return 0.0
        times = sends[1 if dst > src else -1]
        return times[min(src, dst)] if abs(src - dst) == 1 else max(times, default=0.0)

    return hop


def _play(schedule: Schedule, duration: Callable[[int, Task], float],
          hop: Callable[[int, int], float]) -> list[Event]:
    placement = schedule.placement()
    last_chunk = len(placement) - 1
    ends: dict[tuple[str, int, int], float] = {}  # (F | G | W, model chunk, micro-batch) -> end
    orders = schedule.orders
    chunk_of = [[schedule.model_chunk(a) for a in order] for order in orders]
    pos = [0] * schedule.stages
    clock = [0.0] * schedule.stages
    events: list[Event] = []
    remaining = sum(len(o) for o in orders)

    def arrival(key, src_stage, dst_stage):
        done = ends.get(key)
        return None if done is None else done + hop(src_stage, dst_stage)

    while remaining:
        progressed = False
        for s in range(schedule.stages):
            while pos[s] < len(orders[s]):
                a, k = orders[s][pos[s]], chunk_of[s][pos[s]]
                m = a.microbatch
                if a.kind == "F":
                    dep = 0.0 if k == 0 else arrival(("F", k - 1, m), placement[k - 1], s)
                elif a.kind == "W":
                    dep = ends.get(("G", k, m))
                else:
                    own = ends.get(("F", k, m))
                    up = own if k == last_chunk else arrival(("G", k + 1, m), placement[k + 1], s)
                    dep = None if own is None or up is None else max(own, up)
                if dep is None:
                    break
                start = max(clock[s], dep)
                end = start + duration(s, a)
                ends["F" if a.kind == "F" else "W" if a.kind == "W" else "G", k, m] = end
                clock[s] = end
                events.append(Event(s, a, start, end))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule.name} deadlocks: its orders wait on each other")
    return events


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
    events = _play(schedule, lambda s, a: 1.0, lambda src, dst: 0.0)
    ticks = int(max(e.end for e in events))
    table: list[list[Task | None]] = [[None] * schedule.stages for _ in range(ticks)]
    for e in events:
        table[int(e.start)][e.stage] = e.action
    return table


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


def lockstep_ticks(codes: np.ndarray, fwd: Sequence[float], bwd: Sequence[float],
                   send_fwd: Sequence[float] = (), send_bwd: Sequence[float] = ()) -> np.ndarray:
    """Duration of each tick of a grid (`tick_codes`) run in lockstep, which is how one SPMD
    program runs it (the sends after each tick couple neighbouring stages): the tick's slowest
    action, then the slowest activation sent forward and the slowest gradient sent back.

    Equals `timeline` for GPipe with equal stages (all stages do the same kind of action in a
    tick); 1F1B's steady state pairs an F on one stage with a B on the next, so its ticks cost
    max(F, B) each. A two-strand tick (code 3) costs F + B and sends both ways: strands
    keep a bound like 1F1B's (2 (pp - s)) at GPipe's lockstep step time."""
    S = codes.shape[1]
    f, b = np.asarray(fwd, float), np.asarray(bwd, float)
    ahead, back = np.zeros(S), np.zeros(S)
    ahead[:S - 1] = list(send_fwd) or 0.0  # stage s sends its output across boundary s
    back[1:] = list(send_bwd) or 0.0  # stage s sends its input gradient across boundary s - 1
    compute = np.select([codes == 1, codes == 2, codes == 3], [f, b, f + b], 0.0).max(axis=1)
    return (compute + np.where((codes == 1) | (codes == 3), ahead, 0.0).max(axis=1)
            + np.where((codes == 2) | (codes == 3), back, 0.0).max(axis=1))


def lockstep_time(schedule: Schedule, fwd: Sequence[float], bwd: Sequence[float],
                  send_fwd: Sequence[float] = (), send_bwd: Sequence[float] = ()) -> float:
    """Step time of the schedule's tick grid run in lockstep (see `lockstep_ticks`)."""
    codes = tick_codes(tick_table(schedule))
    return float(lockstep_ticks(codes, fwd, bwd, send_fwd, send_bwd).sum())


def folded_lockstep_ticks(codes: np.ndarray, fwd: Sequence[float], bwd: Sequence[float],
                          send_fwd: Sequence[float] = (), send_bwd: Sequence[float] = (),
                          down_share: Sequence[float] = ()) -> np.ndarray:
    """`lockstep_ticks` for the folded placement: `codes` is the grid of a virtual pipeline of
    2 p stages (chunks), chunk k on device k (k < p) or 2 p - 1 - k; fwd / bwd are per device
    (its two chunks together), `down_share[d]` the part of device d's layers in its down
    chunk (default 1/2). A device runs its two chunks' actions of a tick one after the other,
    so a tick costs its busiest device's down plus up action; then the four moves the
    executor makes in turn (down activations d -> d + 1, up activations d -> d - 1, up
    gradients d -> d + 1, down gradients d -> d - 1), each as long as its slowest boundary.
    The turn (chunk p - 1 -> p) stays on device p - 1 and costs nothing."""
    p = codes.shape[1] // 2
    f, b = np.asarray(fwd, float), np.asarray(bwd, float)
    share = np.asarray(list(down_share) or [0.5] * p, float)
    down, up = codes[:, :p], codes[:, ::-1][:, :p]  # [T, p]: device d's down / up chunk

    def cost(c, scale):
        return np.select([c == 1, c == 2, c == 3], [f * scale, b * scale, (f + b) * scale], 0.0)

    compute = (cost(down, share) + cost(up, 1.0 - share)).max(axis=1)
    fwd_link = np.zeros(p)  # boundary d (devices d, d + 1), indexed by the lower device
    fwd_link[:p - 1] = list(send_fwd) or 0.0
    bwd_link = np.zeros(p)
    bwd_link[:p - 1] = list(send_bwd) or 0.0
    sends_f, sends_b = (down == 1) | (down == 3), (down == 2) | (down == 3)
    up_f, up_b = (up == 1) | (up == 3), (up == 2) | (up == 3)
    below = np.roll(fwd_link, 1)  # device d's boundary to d - 1 (d >= 1)
    below[0] = 0.0
    below_b = np.roll(bwd_link, 1)
    below_b[0] = 0.0
    moves = (np.where(sends_f, fwd_link, 0.0).max(axis=1)  # down chunk: d -> d + 1
             + np.where(up_f, below, 0.0).max(axis=1)  # up chunk: d -> d - 1
             + np.where(up_b, bwd_link, 0.0).max(axis=1)  # up chunk's gradient: d -> d + 1
             + np.where(sends_b, below_b, 0.0).max(axis=1))  # down chunk's gradient: d -> d - 1
    return compute + moves


def folded_lockstep_time(schedule: Schedule, fwd: Sequence[float], bwd: Sequence[float],
                         send_fwd: Sequence[float] = (), send_bwd: Sequence[float] = (),
                         down_share: Sequence[float] = ()) -> float:
    """Step time of a folded pipeline in lockstep: `schedule` is the virtual schedule of
    2 p stages (see `folded_lockstep_ticks`)."""
    codes = tick_codes(tick_table(schedule))
    return float(folded_lockstep_ticks(codes, fwd, bwd, send_fwd, send_bwd, down_share).sum())


@dataclass(frozen=True)
class Transfer:
    """One point-to-point move: sent at the end of tick `tick`, usable by `dst` from tick + 1."""

    tick: int
    kind: str  # "activation" (stage s -> s + 1, after F) or "gradient" (s -> s - 1, after B)
    src: int
    dst: int
    microbatch: int


def transfers(schedule: Schedule) -> list[Transfer]:
    """Every send of the tick grid: each F of a model chunk but the last sends its output
    activation to the next chunk's stage, each B or I of a chunk but the first sends its input
    gradient to the previous chunk's stage (moves within a stage are not sends)."""
    placement = schedule.placement()
    out = []
    for t, row in enumerate(tick_table(schedule)):
        for s, a in ((s, a) for s, cell in enumerate(row) for a in cell_tasks(cell)):
            k = schedule.model_chunk(a)
            if a.kind == "F" and k < len(placement) - 1 and placement[k + 1] != s:
                out.append(Transfer(t, "activation", s, placement[k + 1], a.microbatch))
            elif a.kind in BACKWARD_KINDS and k > 0 and placement[k - 1] != s:
                out.append(Transfer(t, "gradient", s, placement[k - 1], a.microbatch))
    return out


IDLE, FORWARD, BACKWARD, BOTH = 0, 1, 2, 3


@dataclass(frozen=True, eq=False)
class TickProgram:
    """The tick grid as the integer tables an SPMD executor indexes, all [ticks, stages].

    Every stage has three buffers of slots:
    - an activation inbox (`x_slots`): an activation waits there from its arrival until the
      stage's F of that micro-batch reads it;
    - a stash (`stash_slots`): F keeps what the micro-batch's B will need, from F until B;
      a stage never holds more than `schedule.max_in_flight(stage)` (pp - s for 1F1B);
    - a gradient inbox (`dy_slots`): an output gradient waits there from arrival until B.
    Slot index `x_slots` (resp. `stash_slots`, `dy_slots`) is a scratch slot: reads and writes
    that do not matter go there (stage 0 has no activation inbox, the last stage no gradient
    inbox, idle ticks read nothing), so the executor needs no branches around buffer accesses.
    """

    schedule: Schedule
    action: np.ndarray  # IDLE, FORWARD, BACKWARD or BOTH (an F and a B: two strands)
    microbatch: np.ndarray  # micro-batch of the action (of the F when BOTH; 0 when idle)
    x_slot: np.ndarray  # inbox slot F reads its input activation from
    stash_slot: np.ndarray  # stash slot F writes and B reads (F's when BOTH)
    dy_slot: np.ndarray  # gradient-inbox slot B reads
    x_recv_slot: np.ndarray  # inbox slot the activation arriving after this tick goes to
    dy_recv_slot: np.ndarray  # gradient-inbox slot the gradient arriving after this tick goes to
    sends_activation: np.ndarray  # [ticks] bool: some stage sends forward after this tick
    sends_gradient: np.ndarray  # [ticks] bool: some stage sends backward after this tick
    b_microbatch: np.ndarray  # micro-batch of the B when BOTH
    b_stash_slot: np.ndarray  # stash slot the B reads when BOTH
    x_slots: int
    stash_slots: int
    dy_slots: int

    @property
    def ticks(self) -> int:
        return self.action.shape[0]

    @property
    def paired(self) -> bool:
        """Whether some tick runs two strands (the executor then compiles that branch)."""
        return bool((self.action == BOTH).any())


class _Slots:
    """Lowest-free-slot allocation of one stage's buffer."""

    def __init__(self):
        self.held: dict[int, int] = {}  # micro-batch -> slot
        self.size = 0  # slots ever used

    def take(self, microbatch: int) -> int:
        slot = min(set(range(len(self.held) + 1)) - set(self.held.values()))
        self.held[microbatch] = slot
        self.size = max(self.size, slot + 1)
        return slot


def tick_program(schedule: Schedule) -> TickProgram:
    """Allocate buffer slots for the tick grid (see `TickProgram`).

    Within a tick a stage first reads its buffers, then writes; a slot whose last read is this
    tick can take this tick's arrival, because the executor reads before it writes."""
    if not schedule.spmd_compatible:
        raise ValueError(f"the {schedule.name} schedule runs several chunks per stage or splits "
                         f"the backward, which the SPMD executor's tick grid cannot; use "
                         f"pipeline.executor=mpmd, or one of {', '.join(spmd_schedules())}")
    grid = tick_table(schedule)
    T, S = len(grid), schedule.stages
    tab = {k: np.zeros((T, S), np.int32) for k in ("action", "microbatch", "b_microbatch")}
    slot_tab = {k: np.full((T, S), -1, np.int32) for k in
                ("x_slot", "stash_slot", "dy_slot", "x_recv_slot", "dy_recv_slot",
                 "b_stash_slot")}
    bufs = {b: [_Slots() for _ in range(S)] for b in ("x", "stash", "dy")}
    sends = {"activation": np.zeros(T, bool), "gradient": np.zeros(T, bool)}
    arrivals: dict[int, list[Transfer]] = {}
    for tr in transfers(schedule):
        arrivals.setdefault(tr.tick, []).append(tr)
    for t in range(T):
        for s, cell in enumerate(grid[t]):
            tasks = cell_tasks(cell)
            if not tasks:
                continue
            both = len(tasks) == 2
            tab["action"][t, s] = BOTH if both else FORWARD if tasks[0].kind == "F" else BACKWARD
            # The B first: it reads (and frees) its stash slot before the F writes one.
            for a in sorted(tasks, key=lambda a: a.kind != "B"):
                m = a.microbatch
                if a.kind == "F":
                    tab["microbatch"][t, s] = m
                    if m in bufs["x"][s].held:  # stage 0 makes its input from the tokens
                        slot_tab["x_slot"][t, s] = bufs["x"][s].held.pop(m)
                    slot_tab["stash_slot"][t, s] = bufs["stash"][s].take(m)
                    continue
                tab["b_microbatch" if both else "microbatch"][t, s] = m
                slot_tab["b_stash_slot" if both else "stash_slot"][t, s] = \
                    bufs["stash"][s].held.pop(m)
                if m in bufs["dy"][s].held:  # the last stage starts from the loss
                    slot_tab["dy_slot"][t, s] = bufs["dy"][s].held.pop(m)
        for tr in arrivals.get(t, []):
            sends[tr.kind][t] = True
            b = "x" if tr.kind == "activation" else "dy"
            slot_tab[f"{b}_recv_slot"][t, tr.dst] = bufs[b][tr.dst].take(tr.microbatch)
    size = {b: max(1, max(sl.size for sl in bufs[b])) for b in bufs}
    for k, v in slot_tab.items():  # unused reads and writes go to the scratch slot
        v[v < 0] = size["stash" if "stash" in k else k.split("_")[0]]
    return TickProgram(schedule=schedule, **tab, **slot_tab,
                       sends_activation=sends["activation"], sends_gradient=sends["gradient"],
                       x_slots=size["x"], stash_slots=size["stash"], dy_slots=size["dy"])


def format_table(schedule: Schedule) -> str:
    """The tick grid as text: one row per stage, one column per tick."""
    table = tick_table(schedule)
    rows = [f"{schedule.name} (stages={schedule.stages}, microbatches={schedule.microbatches})"]
    for s in range(schedule.stages):
        cells = ["+".join(map(str, cell_tasks(table[t][s]))) or "." for t in range(len(table))]
        rows.append(f"  stage {s}: " + " ".join(f"{c:>3}" for c in cells))
    return "\n".join(rows)


def plot_timeline(events: list[Event], path: str, title: str = "",
                  stage_labels: Sequence[str] = (), time_unit: str = "s") -> str:
    """Draw a timeline (one row per stage, F blue / B or I orange / W green, labelled by
    micro-batch and chunk) as PNG; `time_unit` names the events' unit on the time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages = max(e.stage for e in events) + 1
    end = max(e.end for e in events)
    fig, ax = plt.subplots(figsize=(max(6.0, min(18.0, 0.45 * len(events) / stages + 4)),
                                    0.6 * stages + 1.2))
    for e in events:
        color = {"F": "#4C72B0", "W": "#55A868"}.get(e.action.kind, "#DD8452")
        ax.broken_barh([(e.start, e.end - e.start)], (stages - 1 - e.stage - 0.4, 0.8),
                       facecolors=color, edgecolors="white")
        ax.text((e.start + e.end) / 2, stages - 1 - e.stage, str(e.action), ha="center",
                va="center", fontsize=7, color="white")
    names = {"F": "forward", "B": "backward", "I": "input gradient", "W": "weight gradient"}
    kinds = [k for k in names if any(e.action.kind == k for e in events)]
    ax.legend(handles=[Patch(color={"F": "#4C72B0", "W": "#55A868"}.get(k, "#DD8452"),
                             label=names[k]) for k in kinds],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(kinds), frameon=False,
              fontsize=8, borderaxespad=0.2)
    ax.set_yticks(range(stages))
    labels = list(stage_labels) or [f"stage {s}" for s in range(stages)]
    ax.set_yticklabels(labels[::-1])
    ax.set_xlim(0, end)
    ax.set_xlabel(f"time ({time_unit})")
    busy = sum(e.end - e.start for e in events)
    ax.set_title(title or f"bubble {1 - busy / (stages * end):.0%}", loc="left", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Pipeline schedules as pure data: one definition for the executor, the simulator and the plot.

A schedule gives, for every stage, the ordered list of actions it performs in one training
step: F(m) runs the forward of micro-batch m, B(m) its backward. Dependencies are implicit:
F(m) on stage s needs F(m) of stage s - 1 (its input activation), B(m) on stage s needs B(m) of
stage s + 1 (the gradient of its output) and F(m) of stage s itself.

`timeline(schedule, fwd, bwd, ...)` plays the orders with per-stage durations and per-boundary
transfer times and returns when each action starts and ends; with unit durations and no
transfer time it gives the tick grid (`tick_table`) the SPMD executor runs: at tick t, stage s
performs `tick_table[t][s]` (or idles), and activations / gradients move between ticks.
`transfers` lists those moves (the sends and receives), and `tick_program` turns the grid into
the integer tables the executor indexes: which action, which micro-batch, and which buffer slot
each stage reads, and where each arriving activation or gradient is kept until it is used.

GPipe runs all forwards, then all backwards, so a stage holds the activations of all M
micro-batches. 1F1B (PipeDream-Flush) starts backwards as soon as possible: stage s runs
pp - 1 - s warm-up forwards, then alternates one forward and one backward, so it never holds
more than pp - s micro-batches of activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int
    microbatches: int
    orders: tuple[tuple[Action, ...], ...]  # orders[s] = the actions of stage s, in order

    def max_in_flight(self, stage: int) -> int:
        """Most micro-batches whose activations stage `stage` holds at once (F done, B not)."""
        live = peak = 0
        for a in self.orders[stage]:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        return peak


def gpipe(stages: int, microbatches: int) -> Schedule:
    orders = tuple(
        tuple(Action("F", m) for m in range(microbatches)) +
        tuple(Action("B", m) for m in range(microbatches))
        for _ in range(stages))
    return Schedule("gpipe", stages, microbatches, orders)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    orders = []
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        order = [Action("F", m) for m in range(warmup)]
        f, b = warmup, 0
        while f < microbatches:
            order.append(Action("F", f))
            f += 1
            order.append(Action("B", b))
            b += 1
        order += [Action("B", m) for m in range(b, microbatches)]
        orders.append(tuple(order))
    return Schedule("1f1b", stages, microbatches, tuple(orders))


def make_schedule(name: str, stages: int, microbatches: int) -> Schedule:
    if stages < 1 or microbatches < 1:
        raise ValueError(f"a schedule needs stages >= 1 and microbatches >= 1, got "
                         f"{stages}, {microbatches}")
    if name == "gpipe":
        return gpipe(stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stages, microbatches)
    raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


@dataclass(frozen=True)
class Event:
    stage: int
    action: Action
    start: float
    end: float


def timeline(schedule: Schedule, fwd: Sequence[float], bwd: Sequence[float],
             send_fwd: Sequence[float] = (), send_bwd: Sequence[float] = ()) -> list[Event]:
    """Play the schedule: each stage runs its actions in order, each as soon as its inputs
    have arrived. fwd[s] / bwd[s]: time of one forward / backward on stage s; send_fwd[s] /
    send_bwd[s]: time to move an activation / gradient across boundary s (stage s <-> s + 1).
    Returns every action's start and end (a stage does one action at a time)."""
    S, M = schedule.stages, schedule.microbatches
    send_fwd = list(send_fwd) or [0.0] * max(S - 1, 0)
    send_bwd = list(send_bwd) or [0.0] * max(S - 1, 0)
    f_end = [[None] * M for _ in range(S)]
    b_end = [[None] * M for _ in range(S)]
    pos = [0] * S
    clock = [0.0] * S
    events: list[Event] = []
    remaining = sum(len(o) for o in schedule.orders)
    while remaining:
        progressed = False
        for s in range(S):
            while pos[s] < len(schedule.orders[s]):
                a = schedule.orders[s][pos[s]]
                if a.kind == "F":
                    dep = 0.0 if s == 0 else _arrival(f_end[s - 1][a.microbatch], send_fwd[s - 1])
                    dur = fwd[s]
                else:
                    own = f_end[s][a.microbatch]
                    up = own if s == S - 1 else _arrival(b_end[s + 1][a.microbatch], send_bwd[s])
                    dep = None if own is None or up is None else max(own, up)
                    dur = bwd[s]
                if dep is None:
                    break
                start = max(clock[s], dep)
                end = start + dur
                (f_end if a.kind == "F" else b_end)[s][a.microbatch] = end
                clock[s] = end
                events.append(Event(s, a, start, end))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule {schedule.name} deadlocks: its orders wait on each other")
    return events


def _arrival(done: float | None, transfer: float) -> float | None:
    return None if done is None else done + transfer


def tick_table(schedule: Schedule) -> list[list[Action | None]]:
    """The unit-time grid: table[t][s] is what stage s does at tick t (None = idle)."""
    S = schedule.stages
    events = timeline(schedule, [1.0] * S, [1.0] * S)
    ticks = int(max(e.end for e in events))
    table: list[list[Action | None]] = [[None] * S for _ in range(ticks)]
    for e in events:
        table[int(e.start)][e.stage] = e.action
    return table


def tick_codes(table: list[list[Action | None]]) -> np.ndarray:
    """A tick grid as codes [ticks, stages]: 0 idle, 1 forward, 2 backward."""
    return np.array([[0 if a is None else 1 if a.kind == "F" else 2 for a in row]
                     for row in table], dtype=np.int8)


def lockstep_ticks(codes: np.ndarray, fwd: Sequence[float], bwd: Sequence[float],
                   send_fwd: Sequence[float] = (), send_bwd: Sequence[float] = ()) -> np.ndarray:
    """Duration of each tick of a grid (`tick_codes`) run in lockstep, which is how one SPMD
    program runs it (the sends after each tick couple neighbouring stages): the tick's slowest
    action, then the slowest activation sent forward and the slowest gradient sent back.

    Equals `timeline` for GPipe with equal stages (all stages do the same kind of action in a
    tick); 1F1B's steady state pairs an F on one stage with a B on the next, so its ticks cost
    max(F, B) each. Keeping 1F1B's memory bound, no denser grid avoids this."""
    S = codes.shape[1]
    f, b = np.asarray(fwd, float), np.asarray(bwd, float)
    ahead, back = np.zeros(S), np.zeros(S)
    ahead[:S - 1] = list(send_fwd) or 0.0  # stage s sends its output across boundary s
    back[1:] = list(send_bwd) or 0.0  # stage s sends its input gradient across boundary s - 1
    compute = np.where(codes == 1, f, np.where(codes == 2, b, 0.0)).max(axis=1)
    return (compute + np.where(codes == 1, ahead, 0.0).max(axis=1)
            + np.where(codes == 2, back, 0.0).max(axis=1))


def lockstep_time(schedule: Schedule, fwd: Sequence[float], bwd: Sequence[float],
                  send_fwd: Sequence[float] = (), send_bwd: Sequence[float] = ()) -> float:
    """Step time of the schedule's tick grid run in lockstep (see `lockstep_ticks`)."""
    codes = tick_codes(tick_table(schedule))
    return float(lockstep_ticks(codes, fwd, bwd, send_fwd, send_bwd).sum())


@dataclass(frozen=True)
class Transfer:
    """One point-to-point move: sent at the end of tick `tick`, usable by `dst` from tick + 1."""

    tick: int
    kind: str  # "activation" (stage s -> s + 1, after F) or "gradient" (s -> s - 1, after B)
    src: int
    dst: int
    microbatch: int


def transfers(schedule: Schedule) -> list[Transfer]:
    """Every send of the tick grid: each F on a non-last stage sends its output activation to
    the next stage, each B on a non-first stage sends its input gradient to the previous one."""
    out = []
    for t, row in enumerate(tick_table(schedule)):
        for s, a in enumerate(row):
            if a is None:
                continue
            if a.kind == "F" and s < schedule.stages - 1:
                out.append(Transfer(t, "activation", s, s + 1, a.microbatch))
            elif a.kind == "B" and s > 0:
                out.append(Transfer(t, "gradient", s, s - 1, a.microbatch))
    return out


IDLE, FORWARD, BACKWARD = 0, 1, 2


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
    action: np.ndarray  # IDLE, FORWARD or BACKWARD
    microbatch: np.ndarray  # micro-batch of the action (0 when idle)
    x_slot: np.ndarray  # inbox slot F reads its input activation from
    stash_slot: np.ndarray  # stash slot F writes and B reads
    dy_slot: np.ndarray  # gradient-inbox slot B reads
    x_recv_slot: np.ndarray  # inbox slot the activation arriving after this tick goes to
    dy_recv_slot: np.ndarray  # gradient-inbox slot the gradient arriving after this tick goes to
    sends_activation: np.ndarray  # [ticks] bool: some stage sends forward after this tick
    sends_gradient: np.ndarray  # [ticks] bool: some stage sends backward after this tick
    x_slots: int
    stash_slots: int
    dy_slots: int

    @property
    def ticks(self) -> int:
        return self.action.shape[0]


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
    grid = tick_table(schedule)
    T, S = len(grid), schedule.stages
    tab = {k: np.zeros((T, S), np.int32) for k in ("action", "microbatch")}
    slot_tab = {k: np.full((T, S), -1, np.int32) for k in
                ("x_slot", "stash_slot", "dy_slot", "x_recv_slot", "dy_recv_slot")}
    bufs = {b: [_Slots() for _ in range(S)] for b in ("x", "stash", "dy")}
    sends = {"activation": np.zeros(T, bool), "gradient": np.zeros(T, bool)}
    arrivals: dict[int, list[Transfer]] = {}
    for tr in transfers(schedule):
        arrivals.setdefault(tr.tick, []).append(tr)
    for t in range(T):
        for s, a in enumerate(grid[t]):
            if a is None:
                continue
            m = a.microbatch
            tab["action"][t, s] = FORWARD if a.kind == "F" else BACKWARD
            tab["microbatch"][t, s] = m
            if a.kind == "F":
                if m in bufs["x"][s].held:  # stage 0 makes its input from the tokens
                    slot_tab["x_slot"][t, s] = bufs["x"][s].held.pop(m)
                slot_tab["stash_slot"][t, s] = bufs["stash"][s].take(m)
            else:
                slot_tab["stash_slot"][t, s] = bufs["stash"][s].held.pop(m)
                if m in bufs["dy"][s].held:  # the last stage starts from the loss
                    slot_tab["dy_slot"][t, s] = bufs["dy"][s].held.pop(m)
        for tr in arrivals.get(t, []):
            sends[tr.kind][t] = True
            b = "x" if tr.kind == "activation" else "dy"
            slot_tab[f"{b}_recv_slot"][t, tr.dst] = bufs[b][tr.dst].take(tr.microbatch)
    size = {b: max(1, max(sl.size for sl in bufs[b])) for b in bufs}
    for k, v in slot_tab.items():  # unused reads and writes go to the scratch slot
        v[v < 0] = size[k.split("_")[0]]
    return TickProgram(schedule=schedule, **tab, **slot_tab,
                       sends_activation=sends["activation"], sends_gradient=sends["gradient"],
                       x_slots=size["x"], stash_slots=size["stash"], dy_slots=size["dy"])


def format_table(schedule: Schedule) -> str:
    """The tick grid as text: one row per stage, one column per tick."""
    table = tick_table(schedule)
    rows = [f"{schedule.name} (stages={schedule.stages}, microbatches={schedule.microbatches})"]
    for s in range(schedule.stages):
        cells = [str(table[t][s]) if table[t][s] else "." for t in range(len(table))]
        rows.append(f"  stage {s}: " + " ".join(f"{c:>3}" for c in cells))
    return "\n".join(rows)


def plot_timeline(events: list[Event], path: str, title: str = "",
                  stage_labels: Sequence[str] = ()) -> str:
    """Draw a timeline (one row per stage, F blue / B orange, labelled by micro-batch) as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = max(e.stage for e in events) + 1
    end = max(e.end for e in events)
    fig, ax = plt.subplots(figsize=(max(6.0, min(18.0, 0.45 * len(events) / stages + 4)),
                                    0.6 * stages + 1.2))
    for e in events:
        color = "#4C72B0" if e.action.kind == "F" else "#DD8452"
        ax.broken_barh([(e.start, e.end - e.start)], (stages - 1 - e.stage - 0.4, 0.8),
                       facecolors=color, edgecolors="white")
        ax.text((e.start + e.end) / 2, stages - 1 - e.stage, str(e.action), ha="center",
                va="center", fontsize=7, color="white")
    ax.set_yticks(range(stages))
    labels = list(stage_labels) or [f"stage {s}" for s in range(stages)]
    ax.set_yticklabels(labels[::-1])
    ax.set_xlim(0, end)
    ax.set_xlabel("time")
    busy = sum(e.end - e.start for e in events)
    ax.set_title(title or f"bubble {1 - busy / (stages * end):.0%}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

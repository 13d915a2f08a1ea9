"""The step simulator: plays a schedule table with per-stage times and adds gradient sync.

`simulate` plays the schedule (the same table the executor runs and the plot draws) with each
stage's forward / backward time per micro-batch and each boundary's transfer time, in one of
two ways:
- asynchronous (`hetjax.core.timeline.timeline`): each stage runs its next action as soon as its
  input has arrived, as Megatron-LM does; each stage's data-parallel gradient sync follows its
  last backward, of which a fraction `overlap` may hide behind that backward;
- lockstep (`lockstep=True`): the tick grid (`hetjax.core.schedules.tick_table`) run as one SPMD
  program, as hetjax's executor does: a tick lasts as long as its slowest action, then the
  activations and the gradients it produced move (one transfer each way, the slowest one);
  the gradient sync follows the last tick.
It returns the step time, the bubble fraction and each stage's idle time. `closed_form` (the
textbook 1F1B / GPipe formula) and `lower_bound` (no schedule run either way beats it) are
cross-checks and pruning bounds, not the model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from hetjax.errors import PlanError
from hetjax.core.plan import ScheduleSpec, resolve_schedule
from hetjax.core.schedules import (SCHEDULES, Event, Schedule, Task, cell_tasks, tick_codes,
                                   tick_table)
from hetjax.core.timeline import timeline, timeline_ends
from hetjax.planner.lockstep import folded_lockstep_ticks
from hetjax.planner.lockstep import lockstep_ticks as schedules_lockstep_ticks


def exposed(comm: float, window: float, overlap: float) -> float:
    """Communication left on the critical path when up to `overlap` of it can hide behind
    `window` seconds of compute."""
    return comm - min(overlap * comm, window)


@dataclass(frozen=True)
class Simulation:
    step_time: float
    bubble: float  # share of stage-time not spent computing
    stage_busy: tuple[float, ...]
    stage_idle: tuple[float, ...]
    sync_exposed: tuple[float, ...]  # gradient sync each stage could not hide
    events: tuple[Event, ...] = field(default=(), repr=False, compare=False)


@functools.lru_cache(maxsize=256)
def schedule_table(name: str, stages: int, microbatches: int,
                   placement: str = "looped") -> Schedule:
    """The schedule object, shared: a schedule is immutable, and it keeps what playing it
    needs (`hetjax.core.schedules.play_ends`) for the next play."""
    return resolve_schedule(ScheduleSpec(name, stages, microbatches, placement))


@functools.lru_cache(maxsize=4096)
def in_flight(name: str, stages: int, microbatches: int) -> tuple[float, ...]:
    """Most micro-batches whose activations each stage holds at once under the schedule.

    GPipe holds all M; 1F1B holds at most pp - s on stage s (its warm-up plus one), as
    hetjax/core/schedules.py defines them (tests check these against Schedule.max_in_flight,
    which the planner cannot afford to build for thousands of micro-batches). Other
    schedules are played from their table, in units of one micro-batch's activations for the
    whole stage (`Schedule.activation_share`)."""
    if name == "gpipe":
        return (microbatches,) * stages
    if name == "1f1b":
        return tuple(min(stages - s, microbatches) for s in range(stages))
    try:  # closed form where the schedule has one (strands), else played from its table
        return SCHEDULES[name].stash_peaks(stages, microbatches)
    except (ValueError, KeyError) as e:
        schedule_table(name, stages, microbatches)  # raises the PlanError that says why
        raise PlanError(str(e)) from None


@functools.lru_cache(maxsize=4096)
def in_flight_folded(name: str, stages: int, microbatches: int) -> tuple[float, ...]:
    """`in_flight` for the folded placement: device d holds the stashes of its two chunks
    (virtual stages d and 2 pp - 1 - d of the schedule's 2 pp stage grid), each chunk half of
    the device's layers, in units of one micro-batch's activations for the whole device."""
    table = schedule_table(name, 2 * stages, microbatches)
    return tuple((table.max_in_flight(d) + table.max_in_flight(2 * stages - 1 - d)) / 2
                 for d in range(stages))


@functools.lru_cache(maxsize=256)
def _ticks(name: str, stages: int, microbatches: int
           ) -> tuple[list[list[Task | None]], np.ndarray]:
    """The tick grid and its codes [ticks, stages]: 0 idle, 1 forward, 2 backward (for the
    events of `simulate`; the estimates need only `grid_codes`)."""
    table = tick_table(schedule_table(name, stages, microbatches))
    return table, tick_codes(table)


@functools.lru_cache(maxsize=1024)
def grid_codes(name: str, stages: int, microbatches: int) -> np.ndarray:
    """The codes of `_ticks`, from the schedule's closed form where it has one (the search
    prices every (schedule, pp, M) it meets; building their Task tables cost a quarter of a
    4,096-device search)."""
    try:
        codes = SCHEDULES[name].grid_codes(stages, microbatches)
    except ValueError as e:
        raise PlanError(str(e)) from None
    codes.flags.writeable = False  # shared by every caller through the cache
    return codes


def lockstep_ticks(schedule: str, microbatches: int, fwd: Sequence[float],
                   bwd: Sequence[float], send_fwd: Sequence[float] = (),
                   send_bwd: Sequence[float] = ()) -> np.ndarray:
    """Duration of each tick of the named schedule's grid run in lockstep
    (`hetjax.planner.lockstep.lockstep_ticks`, with the grid cached)."""
    codes = grid_codes(schedule, len(fwd), microbatches)
    return schedules_lockstep_ticks(codes, fwd, bwd, send_fwd, send_bwd)


def folded_ticks(schedule: str, microbatches: int, fwd: Sequence[float],
                 bwd: Sequence[float], send_fwd: Sequence[float] = (),
                 send_bwd: Sequence[float] = (), down_share: Sequence[float] = ()
                 ) -> np.ndarray:
    """Duration of each tick of a folded pipeline in lockstep: the named schedule's grid for
    2 pp virtual stages, priced per device (`hetjax.planner.lockstep.folded_lockstep_ticks`)."""
    codes = grid_codes(schedule, 2 * len(fwd), microbatches)
    return folded_lockstep_ticks(codes, fwd, bwd, send_fwd, send_bwd, down_share)


def simulate(schedule: str, microbatches: int, fwd: Sequence[float], bwd: Sequence[float],
             send_fwd: Sequence[float] = (), send_bwd: Sequence[float] = (),
             sync: Sequence[float] = (), overlap: float = 0.0,
             lockstep: bool = False, placement: str = "looped",
             down_share: Sequence[float] = (), update: Sequence[float] = (),
             events: bool = True) -> Simulation:
    """Step time of `schedule` with M micro-batches and per-stage fwd / bwd times; each
    stage's gradient sync (partly hidden behind its last backward when asynchronous) and then
    the optimizer updates (`update`, never hidden) end the step. Every stage's update waits
    for every stage's sync: it needs the global gradient norm (clipping, and the non-finite
    guard that skips the step on every stage). Folded (`placement`), fwd /
    bwd are per device (both chunks) and `down_share` the part of each device's work in its
    down chunk (lockstep; asynchronously each chunk takes half, as the timeline of
    `schedules.folded` plays it). `events=False` leaves the events out (the step time does not
    need them; the planner's predictions skip building them)."""
    S, keep_events = len(fwd), events
    sync = list(sync) or [0.0] * S
    update = list(update) or [0.0] * S
    if not lockstep:  # the orders played (folded: per-stage orders from the virtual grid)
        table = schedule_table(schedule, S, microbatches, *(
            (placement,) if placement != "looped" else ()))
        if keep_events:
            events = timeline(table, fwd, bwd, send_fwd, send_bwd)
            ends: list[list[float]] = [[] for _ in range(S)]
            for e in events:
                ends[e.stage].append(e.end)
        else:
            events, ends = [], timeline_ends(table, fwd, bwd, send_fwd, send_bwd)
        last = [functools.reduce(max, stage_ends, 0.0) for stage_ends in ends]
        hidden = [exposed(sync[s], bwd[s], overlap) for s in range(S)]
        step = max(last[s] + hidden[s] for s in range(S)) + max(update)
    elif placement == "folded":
        durations = folded_ticks(schedule, microbatches, fwd, bwd, send_fwd, send_bwd,
                                 down_share)
        share = list(down_share) or [0.5] * S
        starts = np.concatenate([[0.0], np.cumsum(durations)[:-1]])
        events = []
        for t, row in enumerate(_ticks(schedule, 2 * S, microbatches)[0] if keep_events else ()):
            clock = [float(starts[t])] * S  # a device runs its down chunk, then its up chunk
            for k, cell in enumerate(row):  # chunk k on device k or 2 S - 1 - k
                d, part = (k, share[k]) if k < S else (2 * S - 1 - k, 1.0 - share[2 * S - 1 - k])
                for a in cell_tasks(cell):
                    end = clock[d] + part * (fwd[d] if a.kind == "F" else bwd[d])
                    events.append(Event(d, a, clock[d], end))
                    clock[d] = end
        hidden = list(sync)
        step = float(durations.sum()) + max(h + u for h, u in zip(hidden, update))
    else:
        durations = lockstep_ticks(schedule, microbatches, fwd, bwd, send_fwd, send_bwd)
        starts = np.concatenate([[0.0], np.cumsum(durations)[:-1]])
        events = []
        for t, row in enumerate(_ticks(schedule, S, microbatches)[0] if keep_events else ()):
            for s, cell in enumerate(row):
                start = float(starts[t])
                for a in cell_tasks(cell):  # a two-strand tick: its F, then its B
                    end = start + (fwd[s] if a.kind == "F" else bwd[s])
                    events.append(Event(s, a, start, end))
                    start = end
        # One SPMD program reduces the gradients after its loop: nothing hides them.
        hidden = list(sync)
        step = float(durations.sum()) + max(h + u for h, u in zip(hidden, update))
    busy = tuple(microbatches * (fwd[s] + bwd[s]) for s in range(S))
    return Simulation(step_time=step, bubble=1.0 - sum(busy) / (S * step) if step else 0.0,
                      stage_busy=busy, stage_idle=tuple(step - b for b in busy),
                      sync_exposed=tuple(hidden), events=tuple(events))


def closed_form(fwd: Sequence[float], bwd: Sequence[float], microbatches: int,
                send: Sequence[float] = ()) -> float:
    """Textbook pipeline time: every stage once, plus M - 1 periods of the slowest stage, plus
    the transfers in both directions. Exact for equal stages under GPipe and 1F1B."""
    t = [f + b for f, b in zip(fwd, bwd)]
    return sum(t) + (microbatches - 1) * max(t) + 2 * sum(send)


def chain(schedule: str, folded: bool) -> tuple[float, bool]:
    """What of the pipeline's fill and drain `lower_bound` may add to a stage's work under
    `schedule`, as (fill, drain): the share of each forward ahead of a stage that it waits for
    before its first task, and whether the stages ahead then run the last backward. With one
    model chunk per stage, in order, stage s starts after the whole forwards ahead of it
    (fill 1) and the stages ahead then run the last backward (drain). A split backward
    (zero-bubble) drains on input gradients alone: fill only. With V chunks a stage (each a
    V-th of its forward and backward, as `timeline` plays them), any task of stage s waits
    for some micro-batch's first chunk to pass the stages ahead: fill 1 / V, no drain (its
    last backward may run before its other work). The folded placement puts two stages on one
    device group: neither (the full chain overstates their steps by up to 36% on random stage
    times)."""
    spec = SCHEDULES[schedule]
    if folded:
        return 0.0, False
    if spec.virtual > 1:
        return 1.0 / spec.virtual, False
    return 1.0, not spec.splits_backward


def lower_bound(fwd: Sequence[float], bwd: Sequence[float], microbatches: int,
                send_fwd: Sequence[float] = (), send_bwd: Sequence[float] = (),
                sync_exposed: Sequence[float] = (), *, fill: float = 1.0,
                drain: bool = True) -> float:
    """A bound no schedule beats, asynchronous or lockstep (lockstep only adds waiting): every
    stage s must run all its M forwards and backwards and then its exposed sync; it cannot
    start before `fill` of each forward ahead of it and the transfers between (with `fill`
    > 0), and with `drain` the stages ahead must then run the last backward (and stage 0 its
    sync). `chain` says which a schedule allows."""
    S = len(fwd)
    sf = list(send_fwd) or [0.0] * S
    sb = list(send_bwd) or [0.0] * S
    sx = list(sync_exposed) or [0.0] * S
    best = ahead_f = ahead_b = 0.0
    for s in range(S):
        work = microbatches * (fwd[s] + bwd[s])
        best = max(best, ahead_f + work + max(sx[s], ahead_b + sx[0] if s and drain else 0.0))
        if s < S - 1:
            if fill:
                ahead_f += fill * fwd[s] + sf[s]
            if drain:
                ahead_b += bwd[s] + sb[s]
    return best


__all__ = ["Simulation", "simulate", "lockstep_ticks", "folded_ticks", "in_flight_folded",
           "exposed", "in_flight", "closed_form", "chain", "lower_bound", "schedule_table",
           "grid_codes"]

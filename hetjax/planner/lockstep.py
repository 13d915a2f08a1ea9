"""Lockstep pricing: the step time of a tick grid run as one SPMD program, where a tick lasts as
long as its slowest action and then the activations and gradients it produced move.

`lockstep_ticks` prices each tick of a grid given as codes (`hetjax.core.schedules.tick_codes`),
`lockstep_time` a schedule's whole step; the `folded_` pair does the same for the folded
placement (a device runs a down and an up chunk). `hetjax.planner.simulate` prices the SPMD
executor with them; the asynchronous executors are priced by the timeline
(`hetjax.core.timeline`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hetjax.core.schedules import Schedule, tick_codes, tick_table


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

"""The timeline simulator: a schedule's orders played with per-stage durations and per-boundary
transfer times (`timeline`), and drawn (`plot_timeline`).

Each stage runs its tasks in order, each as soon as its inputs have arrived
(`hetjax.core.schedules.play`); a chunk takes 1 / virtual of its stage's time, W `weight_share`
of a backward and I the rest. The planner's simulator (`hetjax.planner.simulate`) prices
asynchronous executors with it, `hetjax.core.program` orders the MPMD program by its unit-time
start, and the benchmarks draw it.
"""

from __future__ import annotations

from typing import Callable, Sequence

from hetjax.core.schedules import Event, Schedule, play, play_ends


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
    duration = _durations(schedule, fwd, bwd, weight_share)
    return play(schedule, lambda s, a: duration(s, a.kind),
                _hops(schedule.stages, send_fwd, send_bwd))


def timeline_ends(schedule: Schedule, fwd: Sequence[float], bwd: Sequence[float],
                  send_fwd: Sequence[float] = (), send_bwd: Sequence[float] = (),
                  weight_share: float = 0.5) -> list[list[float]]:
    """The end times of `timeline`'s tasks, stage by stage in each stage's order, without
    building the events (the planner's simulator needs no more)."""
    return play_ends(schedule, _durations(schedule, fwd, bwd, weight_share),
                     _hops(schedule.stages, send_fwd, send_bwd))


def _durations(schedule: Schedule, fwd: Sequence[float], bwd: Sequence[float],
               weight_share: float) -> Callable[[int, str], float]:
    """A task's time by stage and kind (see `timeline`)."""
    v = schedule.virtual
    share = {"F": None, "B": 1.0, "I": 1.0 - weight_share, "W": weight_share}

    def duration(s: int, kind: str) -> float:
        return (fwd[s] if kind == "F" else bwd[s] * share[kind]) / v

    return duration


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

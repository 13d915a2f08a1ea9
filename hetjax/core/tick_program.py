"""The SPMD lowering: a schedule's tick grid as the integer tables the SPMD executor indexes.

`transfers` lists every point-to-point move of the grid (an activation after each F, a gradient
after each B or I, between chunks on different stages); `tick_program` allocates each stage's
buffer slots (activation inbox, stash, gradient inbox) and returns a `TickProgram`: per tick and
stage, which action (`IDLE`, `FORWARD`, `BACKWARD`, `BOTH` for two strands), which micro-batch,
and which slot each read and each arrival uses. JAX-free: `hetjax.parallel.pipeline` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetjax.core.schedules import BACKWARD_KINDS, Schedule, cell_tasks, spmd_schedules, tick_table


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

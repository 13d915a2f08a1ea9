"""A pipeline schedule lowered to a program: the operations every stage runs in one training
step, in the order one controller issues them. Plain data, no JAX; the MPMD executors
interpret it (`hetjax.parallel.mpmd`, `hetjax.parallel.mpmd_worlds`), tests and docs print it.

`lower(schedule)` walks the schedule's tasks in the issue order (`issue_order`: by start on
the unit-time timeline, a valid order of the dependency graph) and gives each task its ops:

- `Recv`: the task's input from another stage (the activation of the previous model chunk
  for F, the output gradient from the next chunk for B / I);
- `Run`: the task itself (F, B, I or W of one model chunk and micro-batch), reading and
  writing named per-stage buffers (`Buffer`): the input activation, the stash (the pullbacks'
  residuals, F to B or W), the output gradient, and I's per-piece output gradients for W;
- `Send`: the output for a chunk on another stage (within a stage a buffer is just read);
- `Reduce`: the stage's gradient reduction across its replicas, after its last backward;
- `Free`: a buffer dropped.

Frees are not written by hand: a liveness pass (`_add_frees`, as JaxPP's `add_delete_ops`)
puts one right after each buffer's last reader on its stage. The reduction follows the stage's
last B or W; it is fused into that task's program (`Run.reduce`) only when the task writes
nothing (a W, or the first model chunk's B): a program's outputs are ready only when all of it
is done, so a fused reduction would hold back the input gradient the previous stage waits for.
The F of the last model chunk adds its loss to the stage's loss sum, the B / I of the last
chunk starts from the loss (no gradient buffer): the interpreter keeps those two running
values (loss sum and gradient accumulator) per stage, outside the buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from hetjax.core import schedules as sch
from hetjax.core.timeline import timeline


@dataclass(frozen=True)
class Buffer:
    """One value a stage holds between ops: `kind` activation (the input of model chunk
    `model_chunk`), gradient (the gradient of that chunk's output), stash (that chunk's
    residuals, F to B / W) or douts (its pieces' output gradients, I to W), of `microbatch`.
    Activations and gradients keep the *reading* chunk's index on both sides of a send."""

    kind: str
    model_chunk: int
    microbatch: int

    @property
    def source(self) -> int:
        """The model chunk that produces an activation or gradient buffer."""
        return self.model_chunk - 1 if self.kind == "activation" else self.model_chunk + 1

    def __str__(self) -> str:
        return f"{self.kind}(c{self.model_chunk},m{self.microbatch})"


@dataclass(frozen=True)
class Run:
    """Task `kind` (F, B, I, W) of model chunk `model_chunk` (the stage's chunk `stage_chunk`,
    as the schedule's `Task.stage_chunk`) and
    `microbatch`; `reduce`: the stage's gradient reduction runs in the same program."""

    stage: int
    kind: str
    model_chunk: int
    stage_chunk: int
    microbatch: int
    reads: tuple[Buffer, ...] = ()
    writes: tuple[Buffer, ...] = ()
    reduce: bool = False

    def read(self, kind: str) -> Buffer | None:
        return next((b for b in self.reads if b.kind == kind), None)

    def written(self, kind: str) -> Buffer | None:
        return next((b for b in self.writes if b.kind == kind), None)

    def __str__(self) -> str:
        return (f"{self.kind}(c{self.model_chunk},m{self.microbatch})"
                + ("+reduce" if self.reduce else ""))


@dataclass(frozen=True)
class _Transfer:
    stage: int
    buffer: Buffer
    peer: int
    arrow: ClassVar[str] = ""

    def __str__(self) -> str:
        return f"{type(self).__name__.lower()} {self.buffer}{self.arrow}{self.peer}"


class Send(_Transfer):
    """Stage `stage` sends `buffer` to stage `peer` (which receives it with a `Recv`)."""

    arrow = "->"


class Recv(_Transfer):
    """Stage `stage` receives `buffer` from stage `peer`."""

    arrow = "<-"


@dataclass(frozen=True)
class Reduce:
    """Stage `stage` reduces its accumulated gradients across its replicas (once a step)."""

    stage: int

    def __str__(self) -> str:
        return "reduce"


@dataclass(frozen=True)
class Free:
    """Stage `stage` drops `buffer` (after its last reader)."""

    stage: int
    buffer: Buffer
    __str__ = lambda self: f"free {self.buffer}"  # noqa: E731


Op = Run | Send | Recv | Reduce | Free


@dataclass(frozen=True)
class Program:
    """Every stage's ops of one step, interleaved in the issue order (`ops`); `of_stage(s)`
    is stage s's own list."""

    schedule: str
    stages: int
    ops: tuple[Op, ...]

    def of_stage(self, stage: int) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.stage == stage)


def issue_order(schedule: sch.Schedule) -> list[tuple[int, sch.Task]]:
    """Every task as (stage, action) in an order that respects the schedule's dependencies and
    each stage's own order: by start time on the schedule's unit-time timeline."""
    events = timeline(schedule, [1.0] * schedule.stages, [1.0] * schedule.stages)
    return [(e.stage, e.action) for e in sorted(events, key=lambda e: (e.start, e.stage))]


def _task_ops(schedule: sch.Schedule, s: int, a: sch.Task, last_release: bool) -> list[Op]:
    placement = schedule.placement()
    k, m = schedule.model_chunk(a), a.microbatch
    last_chunk = len(placement) - 1
    before: list[Op] = []
    reads: list[Buffer] = []
    writes: list[Buffer] = []

    def take(buffer: Buffer, peer: int) -> None:  # an input, received when made elsewhere
        reads.append(buffer)
        if peer != s:
            before.append(Recv(s, buffer, peer))

    def give(buffer: Buffer, peer: int) -> Send | None:  # an output, sent when read elsewhere
        writes.append(buffer)
        return Send(s, buffer, peer) if peer != s else None

    send = None
    stash = Buffer("stash", k, m)
    if a.kind == "F":
        if k > 0:
            take(Buffer("activation", k, m), placement[k - 1])
        writes.append(stash)
        if k < last_chunk:
            send = give(Buffer("activation", k + 1, m), placement[k + 1])
    elif a.kind in sch.BACKWARD_KINDS:
        reads.append(stash)
        if k < last_chunk:  # the last chunk starts from the loss
            take(Buffer("gradient", k, m), placement[k + 1])
        if a.kind == "I":
            writes.append(Buffer("douts", k, m))
        if k > 0:
            send = give(Buffer("gradient", k - 1, m), placement[k - 1])
    elif a.kind == "W":
        reads += [stash, Buffer("douts", k, m)]
    else:
        raise ValueError(f"schedule {schedule.name} has a task of unknown kind {a.kind!r}")
    fused = last_release and not writes
    ops: list[Op] = before + [Run(s, a.kind, k, a.stage_chunk, m, tuple(reads), tuple(writes),
                                  reduce=fused)]
    ops += [send] if send else []
    return ops + ([Reduce(s)] if last_release and not fused else [])


def _add_frees(ops: list[Op]) -> list[Op]:
    """The liveness pass: a `Free` right after the last op of a buffer's stage that reads it
    (or after its writer, if nothing reads it)."""
    last: dict[tuple[int, Buffer], int] = {}
    for i, op in enumerate(ops):
        if isinstance(op, Run):
            touched = op.writes + op.reads
        elif isinstance(op, (Send, Recv)):
            touched = (op.buffer,)
        else:
            continue
        for b in touched:
            last[op.stage, b] = i
    frees: dict[int, list[Free]] = {}
    for (stage, b), i in last.items():
        frees.setdefault(i, []).append(Free(stage, b))
    out: list[Op] = []
    for i, op in enumerate(ops):
        out.append(op)
        out += frees.get(i, [])
    return out


def lower(schedule: sch.Schedule) -> Program:
    """The schedule's program (see the module docstring)."""
    releases = {s: max((i for i, a in enumerate(order) if a.kind in sch.RELEASE_KINDS),
                       default=-1) for s, order in enumerate(schedule.orders)}
    index = {s: 0 for s in range(schedule.stages)}
    ops: list[Op] = []
    for s, a in issue_order(schedule):
        ops += _task_ops(schedule, s, a, index[s] == releases[s])
        index[s] += 1
    return Program(schedule.name, schedule.stages, tuple(_add_frees(ops)))


def format_program(program: Program) -> str:
    """The program as text: one line per stage, its ops in order."""
    rows = [f"{program.schedule} (stages={program.stages})"]
    for s in range(program.stages):
        rows.append(f"  stage {s}: " + ", ".join(map(str, program.of_stage(s))))
    return "\n".join(rows)


__all__ = ["Buffer", "Run", "Send", "Recv", "Reduce", "Free", "Op", "Program", "lower",
           "issue_order", "format_program"]

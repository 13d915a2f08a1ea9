"""Schedules as data: the registry, valid orders, activation memory, bubbles, the tick grid and
the timeline; a schedule defined in this file runs in the simulator, the plot and the executor."""

import numpy as np
import pytest

from hetjax.planner.simulate import in_flight, simulate
from hetjax.core import schedules as sch
from hetjax.core import tick_program as tp
from hetjax.core.timeline import plot_timeline, timeline
from hetjax.planner.lockstep import lockstep_time

TICK_SCHEDULES = ("gpipe", "1f1b", "strands")
SIZES = [(1, 1), (2, 4), (4, 4), (4, 8), (3, 6), (4, 9), (3, 2)]


def sizes_for(name):
    """The SIZES the schedule accepts (interleaved needs M to be a multiple of pp)."""
    out = []
    for stages, mb in SIZES:
        try:
            sch.SCHEDULES[name].check(stages, mb)
        except ValueError:
            continue
        out.append((stages, mb))
    return out


def test_the_registry_holds_every_schedule_and_says_which_the_spmd_executor_runs():
    assert list(sch.SCHEDULES) == ["gpipe", "1f1b", "interleaved", "zb-h1", "strands"]
    assert sch.spmd_schedules() == TICK_SCHEDULES
    assert sch.SCHEDULES["interleaved"].virtual == 2
    assert sch.SCHEDULES["zb-h1"].splits_backward


@pytest.mark.parametrize("name", list(sch.SCHEDULES))
def test_every_chunk_runs_each_forward_and_backward_once(name):
    for stages, mb in sizes_for(name):
        s = sch.make_schedule(name, stages, mb)
        backward = ["I", "W"] if s.splits_backward else ["B"]
        for st, order in enumerate(s.orders):
            assert {a.stage for a in order} == {st}
            expect = [(k, m, c) for c in range(s.virtual) for m in range(mb)
                      for k in ["F"] + backward]
            assert sorted((a.kind, a.microbatch, a.stage_chunk) for a in order) == sorted(expect)
            seen = set()
            for a in order:  # a backward comes after its own forward, W after its I
                need = {"F": None, "B": "F", "I": "F", "W": "I"}[a.kind]
                assert need is None or (need, a.microbatch, a.stage_chunk) in seen, (name, st, a)
                seen.add((a.kind, a.microbatch, a.stage_chunk))
        # every model chunk is placed on a stage, each stage runs `virtual` of them
        assert sorted(s.placement()) == sorted(list(range(stages)) * s.virtual)


def test_activation_memory_gpipe_grows_the_others_are_bounded():
    for mb in (4, 8, 16):
        g, o = sch.make_schedule("gpipe", 4, mb), sch.make_schedule("1f1b", 4, mb)
        i, z = sch.make_schedule("interleaved", 4, mb), sch.make_schedule("zb-h1", 4, mb)
        assert [g.max_in_flight(s) for s in range(4)] == [mb] * 4
        assert [o.max_in_flight(s) for s in range(4)] == [4, 3, 2, 1]
        # Megatron's warm-up, 2 (pp - 1 - s) + (v - 1) pp chunk forwards, plus one (at most
        # all v M chunk forwards); each chunk holds half of the stage's activations
        expect = [min(2 * mb, 2 * (3 - s) + 4 + 1) for s in range(4)]
        assert [i.max_in_flight(s) for s in range(4)] == expect
        assert [i.activation_share(s) for s in range(4)] == [e / 2 for e in expect]
        # ZB-H1 holds s weight-gradient tasks back: 1F1B's peak, pp, on every stage
        assert [z.max_in_flight(s) for s in range(4)] == [4, 4, 4, 4]
        assert in_flight("zb-h1", 4, mb) == (4.0,) * 4


@pytest.mark.parametrize("name", list(sch.SCHEDULES))
def test_bubbles_follow_their_formulas(name):
    """With equal stages (F = 1, B = 2, W = 1) the played timeline's idle share is the
    schedule's formula: (p - 1)(F + B) for GPipe / 1F1B, divided by v for interleaved,
    (p - 1)(F + I - W) for ZB-H1 -- below 1F1B's for the last two (with M >= p)."""
    for stages, mb in [(p, m) for p, m in sizes_for(name) if m >= p]:
        s = sch.make_schedule(name, stages, mb)
        ev = timeline(s, [1.0] * stages, [2.0] * stages)
        end = max(e.end for e in ev)
        played = 1 - sum(e.end - e.start for e in ev) / (stages * end)
        assert played == pytest.approx(s.bubble(), abs=1e-9), (stages, mb)
        if stages > 1 and name in ("interleaved", "zb-h1"):
            assert s.bubble() < sch.make_schedule("1f1b", stages, mb).bubble()


def test_interleaved_refuses_a_microbatch_count_it_cannot_group():
    with pytest.raises(ValueError, match="multiple of the pipeline stages"):
        sch.make_schedule("interleaved", 4, 6)


def test_the_tick_grid_refuses_schedules_the_spmd_executor_cannot_run():
    for name in ("interleaved", "zb-h1"):
        with pytest.raises(ValueError, match="pipeline.executor=mpmd"):
            tp.tick_program(sch.make_schedule(name, 2, 4))


@pytest.mark.parametrize("name", TICK_SCHEDULES)
def test_tick_grid_respects_dependencies(name):
    s = sch.make_schedule(name, 4, 6)
    table = sch.tick_table(s)
    when = {(a.kind, a.microbatch, st): t for t, row in enumerate(table)
            for st, cell in enumerate(row) for a in sch.cell_tasks(cell)}
    for m in range(6):
        for st in range(1, 4):
            assert when[("F", m, st)] > when[("F", m, st - 1)]
        for st in range(3):
            assert when[("B", m, st)] > when[("B", m, st + 1)]
    # GPipe and 1F1B take 2 * (M + S - 1) unit ticks with F = B = 1; strands, whose ticks
    # may hold an F and a B, M + 2 S - 1
    assert len(table) == (6 + 2 * 4 - 1 if name == "strands" else 2 * (6 + 4 - 1))


def test_timeline_with_uneven_stages_and_transfers():
    s = sch.make_schedule("1f1b", 2, 3)
    ev = timeline(s, fwd=[1.0, 2.0], bwd=[2.0, 4.0], send_fwd=[0.5], send_bwd=[0.5])
    # Critical path: F0 on stage 0 (1) + send (0.5) + stage 1 does 3 F and 3 B (18)
    # + the last gradient back (0.5) + B2 on stage 0 (2) = 22
    assert max(e.end for e in ev) == pytest.approx(22.0)
    by_stage = [sorted((e.start, e.end) for e in ev if e.stage == st) for st in range(2)]
    for spans in by_stage:  # one action at a time per stage
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="gpipe, 1f1b"):
        sch.make_schedule("zigzag", 2, 2)


def test_plot_timeline_writes_png_with_the_time_unit_on_its_axis(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    closed = []
    monkeypatch.setattr(plt, "close", closed.append)  # keep the figure to read its axis
    s = sch.make_schedule("gpipe", 2, 2)
    path = plot_timeline(timeline(s, [1, 1], [2, 2]), str(tmp_path / "t.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    plot_timeline(timeline(s, [1, 1], [2, 2]), str(tmp_path / "u.png"), time_unit="ms")
    assert [f.axes[0].get_xlabel() for f in closed] == ["time (s)", "time (ms)"]


def run_tick_program(prog: tp.TickProgram) -> list[int]:
    """Interpret the program with micro-batch numbers instead of arrays: every read must find
    the micro-batch its action needs (a wrong or scratch slot holds another number or None).
    Returns the most stash slots each stage held at once."""
    S = prog.schedule.stages
    inbox = [[None] * (prog.x_slots + 1) for _ in range(S)]
    stash = [[None] * (prog.stash_slots + 1) for _ in range(S)]
    dy_inbox = [[None] * (prog.dy_slots + 1) for _ in range(S)]
    peak = [0] * S
    for t in range(prog.ticks):
        out_x, out_dy = [None] * S, [None] * S
        for s in range(S):
            kind, m, k = prog.action[t, s], prog.microbatch[t, s], prog.stash_slot[t, s]
            if kind in (tp.BACKWARD, tp.BOTH):
                mb, kb = ((prog.b_microbatch[t, s], prog.b_stash_slot[t, s]) if kind == tp.BOTH
                          else (m, k))
                assert stash[s][kb] == mb, (t, s, "stash")
                stash[s][kb] = None
                assert s == S - 1 or dy_inbox[s][prog.dy_slot[t, s]] == mb, (t, s, "gradient")
                out_dy[s] = mb
            if kind in (tp.FORWARD, tp.BOTH):
                assert s == 0 or inbox[s][prog.x_slot[t, s]] == m, (t, s, "input")
                assert k < prog.stash_slots and stash[s][k] is None, (t, s, "stash in use")
                stash[s][k] = m
                out_x[s] = m
            peak[s] = max(peak[s], sum(v is not None for v in stash[s]))
        assert prog.sends_activation[t] == any(v is not None for v in out_x[:-1])
        assert prog.sends_gradient[t] == any(v is not None for v in out_dy[1:])
        for s in range(S):  # what ppermute delivers: from s - 1 forward, from s + 1 backward
            inbox[s][prog.x_recv_slot[t, s]] = out_x[s - 1] if s > 0 else None
            dy_inbox[s][prog.dy_recv_slot[t, s]] = out_dy[s + 1] if s < S - 1 else None
    return peak


@pytest.mark.parametrize("name", ("gpipe", "1f1b"))
@pytest.mark.parametrize("stages, mb", [(2, 1), (2, 4), (3, 2), (4, 4), (4, 9), (4, 16)])
def test_tick_program_delivers_every_input_and_gradient(name, stages, mb):
    s = sch.make_schedule(name, stages, mb)
    prog = tp.tick_program(s)
    peak = run_tick_program(prog)
    assert prog.ticks == 2 * (mb + stages - 1)
    # the stash holds exactly the micro-batches in flight: M for GPipe, pp - s for 1F1B
    assert peak == [s.max_in_flight(st) for st in range(stages)]
    assert prog.stash_slots == (mb if name == "gpipe" else min(stages, mb))
    assert prog.x_slots == prog.dy_slots == 1  # with unit ticks nothing waits long


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_strands_run_two_strands_per_tick_at_gpipe_lockstep_time_with_a_flat_stash(stages):
    """DHelix on the tick grid: after the warm-up every tick of a stage holds an F and a B of
    different micro-batches; the lockstep step equals GPipe's, and the stash stays within
    2 (pp - s) micro-batches whatever M (2 (pp - s) - 1 slots: B frees one before F takes
    one), where GPipe's grows with M."""
    f, b = [1.0] * stages, [2.5] * stages
    slots = set()
    for mb in (1, 2, 4, 8, 16, 32):
        s = sch.make_schedule("strands", stages, mb)
        g = sch.make_schedule("gpipe", stages, mb)
        assert lockstep_time(s, f, b) == pytest.approx(lockstep_time(g, f, b))
        assert simulate("strands", mb, f, b, lockstep=True).step_time == pytest.approx(
            (mb + stages - 1) * (f[0] + b[0]))
        prog = tp.tick_program(s)
        peak = run_tick_program(prog)
        for st in range(stages):
            assert s.max_in_flight(st) <= 2 * (stages - st)
            assert peak[st] <= 2 * (stages - st) - 1
        assert in_flight("strands", stages, mb) == tuple(
            float(s.max_in_flight(st)) for st in range(stages))
        grid = sch.tick_table(s)
        pairs = [cell for row in grid for cell in row if isinstance(cell, tuple)]
        assert all(a.kind == "F" and b.kind == "B" and a.microbatch != b.microbatch
                   for a, b in pairs)
        assert prog.paired == bool(pairs)
        if mb >= 2 * stages:
            assert len(pairs) == stages * (mb - 2 * stages) + stages * stages
            slots.add(prog.stash_slots)
    assert slots == {2 * stages - 1}  # flat in M


def test_transfers_are_the_sends_of_the_tick_grid():
    s = sch.make_schedule("1f1b", 3, 2)
    tr = tp.transfers(s)
    acts = [(t.src, t.dst, t.microbatch) for t in tr if t.kind == "activation"]
    grads = [(t.src, t.dst, t.microbatch) for t in tr if t.kind == "gradient"]
    assert sorted(acts) == [(0, 1, 0), (0, 1, 1), (1, 2, 0), (1, 2, 1)]
    assert sorted(grads) == [(1, 0, 0), (1, 0, 1), (2, 1, 0), (2, 1, 1)]
    grid = sch.tick_table(s)
    for t in tr:  # a transfer leaves at the end of its sender's action
        assert grid[t.tick][t.src].microbatch == t.microbatch


def test_lockstep_time_of_the_executor_grid():
    # 1F1B, 2 stages, 2 micro-batches, F = 1, B = 3. Grid: [F0 .] [F1 F0] [. B0] [B0 F1]
    # [. B1] [B1 .]; ticks last 1 1 3 3 3 3 = 14, while the asynchronous timeline needs 12.
    s = sch.make_schedule("1f1b", 2, 2)
    assert lockstep_time(s, [1, 1], [3, 3]) == 14
    assert max(e.end for e in timeline(s, [1, 1], [3, 3])) == 12
    # GPipe's ticks hold one kind of action, so lockstep costs nothing with equal stages.
    g = sch.make_schedule("gpipe", 4, 8)
    assert lockstep_time(g, [1] * 4, [3] * 4) == max(e.end for e in
                                                         timeline(g, [1] * 4, [3] * 4))


def test_the_planner_plays_the_timelines_ends_without_events():
    """The planner plays schedules from their order codes without building tasks or events
    (`timeline_ends`, `simulate(events=False)`): the same floats as the timeline's events."""
    from hetjax.core.timeline import timeline_ends

    rng = np.random.default_rng(0)
    for name in sch.SCHEDULES:
        for stages, mb in [(1, 3), (3, 6), (4, 8)]:
            tables = [sch.make_schedule(name, stages, mb)]
            if sch.SCHEDULES[name].spmd_compatible:
                tables.append(sch.folded(name, stages, mb))
            for s in tables:
                fwd, bwd = rng.uniform(0.5, 2, stages).tolist(), rng.uniform(1, 4, stages).tolist()
                send = rng.uniform(0, 0.3, max(stages - 1, 0)).tolist()
                ends = [[] for _ in range(stages)]
                for e in timeline(s, fwd, bwd, send, send[::-1], weight_share=0.3):
                    ends[e.stage].append(e.end)
                assert timeline_ends(s, fwd, bwd, send, send[::-1], weight_share=0.3) == ends
            placement = "folded" if len(tables) > 1 else "looped"
            played = [simulate(name, mb, fwd, bwd, send, send, [0.2] * stages, 0.5,
                               placement=placement, events=events) for events in (True, False)]
            assert played[0] == played[1] and played[0].events and not played[1].events


def test_a_schedule_that_runs_a_task_twice_is_refused():
    class Twice(sch.Schedule):
        name = "twice"

        def build(self):
            return [[sch.Task("F", 0), sch.Task("F", 0), sch.Task("B", 0)]]

    with pytest.raises(ValueError, match="runs F0 of chunk 0 twice on stage 0"):
        timeline(Twice(1, 1), [1.0], [2.0])


# --- a schedule added here, in a test file, runs everywhere -----------------------------------
class AllForwardsThenBackwardsReversed(sch.Schedule):
    """A toy: every forward, then every backward from the last micro-batch to the first."""

    name = "toy-reversed"

    def build(self):
        M = self.microbatches
        return [[sch.Task("F", m) for m in range(M)] +
                [sch.Task("B", m) for m in reversed(range(M))] for _ in range(self.stages)]


@pytest.fixture
def toy_schedule():
    sch.register(AllForwardsThenBackwardsReversed)
    yield AllForwardsThenBackwardsReversed.name
    del sch.SCHEDULES[AllForwardsThenBackwardsReversed.name]


def test_a_schedule_defined_in_a_test_runs_in_simulator_plot_and_executor(toy_schedule,
                                                                           tmp_path):
    from test_pipeline import check_against_reference, pipe_config

    s = sch.make_schedule(toy_schedule, 3, 4)
    assert s.spmd_compatible and s.max_in_flight(0) == 4
    # the simulator plays it both ways; lockstep equals GPipe's (same ticks, reversed B)
    asynchronous = simulate(toy_schedule, 4, [1.0] * 3, [2.0] * 3)
    lockstep = simulate(toy_schedule, 4, [1.0] * 3, [2.0] * 3, lockstep=True)
    gpipe = simulate("gpipe", 4, [1.0] * 3, [2.0] * 3, lockstep=True)
    assert asynchronous.step_time == lockstep.step_time == gpipe.step_time
    assert [e.action.microbatch for e in asynchronous.events if e.action.kind == "B"
            and e.stage == 0] == [3, 2, 1, 0]
    path = plot_timeline(list(asynchronous.events), str(tmp_path / "toy.png"))
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    # the SPMD executor runs its tick grid: loss and gradients equal the plain model's
    trainer = check_against_reference(pipe_config((1, 2), toy_schedule, 2, 2, 4))
    assert trainer.plan.schedule == toy_schedule
    np.testing.assert_array_equal(trainer.pipeline.program.microbatch[-1], [0, 0])


# --- a plan becomes a schedule in one place -----------------------------------------------------
def test_resolve_schedule_is_the_one_way_a_plan_becomes_a_schedule(monkeypatch):
    import inspect

    from hetjax.errors import PlanError
    from hetjax.core.plan import Plan, ScheduleSpec, resolve_schedule
    from hetjax.planner import simulate as sim
    from hetjax.parallel import mpmd, mpmd_worlds, pipeline

    plan = Plan(pp=2, dp=4, tp=1, stage_layers=(1, 1), microbatches=4, global_batch=8,
                seq_len=16, schedule="1f1b")
    s = resolve_schedule(plan)
    assert type(s) is sch.OneFOneB and (s.stages, s.microbatches) == (2, 4)
    v = resolve_schedule(ScheduleSpec("gpipe", 2, 4, "folded"))
    assert isinstance(v, sch.Folded) and v.base.stages == 4
    # one error, naming the fields, whoever asks: the simulator, the executors
    with pytest.raises(PlanError, match=r"needs the micro-batches \(3\).*Fix: change "
                                        r"pipeline.microbatches or pipeline.schedule$"):
        resolve_schedule(ScheduleSpec("interleaved", 2, 3))
    with pytest.raises(PlanError, match="Fix: change .* or pipeline.placement$"):
        resolve_schedule(ScheduleSpec("zb-h1", 2, 4, "folded"))
    sim.schedule_table.cache_clear()
    with pytest.raises(PlanError, match=r"Fix: change pipeline.microbatches"):
        sim.schedule_table("interleaved", 2, 3)
    # the simulator and the pipeline executors call it; none builds a schedule itself
    asked = []
    monkeypatch.setattr(sim, "resolve_schedule", lambda p: asked.append(p) or s)
    sim.schedule_table.cache_clear()
    assert sim.schedule_table("1f1b", 2, 4) is s and asked == [ScheduleSpec("1f1b", 2, 4)]
    sim.schedule_table.cache_clear()
    # the staged executors (MPMD and worlds) both lower their plan in MpmdExecutor._lower
    assert "self._lower(" in inspect.getsource(mpmd_worlds.WorldsExecutor.__init__)
    for owner in (mpmd.MpmdExecutor._lower, pipeline.Pipeline.__init__):
        src = inspect.getsource(owner)
        assert "resolve_schedule(self.plan)" in src or "resolve_schedule(plan)" in src
    for owner in (mpmd.MpmdExecutor, mpmd_worlds.WorldsExecutor, pipeline.Pipeline):
        assert "make_schedule" not in inspect.getsource(owner)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "strands"])
def test_closed_form_grids_and_stash_peaks_equal_the_played_ones(name):
    """The planner prices grids from `grid_codes` / `stash_peaks` without building tasks:
    every closed form must be the grid and stash the played schedule gives (and the base
    class's played default is that by definition)."""
    cls = sch.SCHEDULES[name]
    for stages in range(1, 9):
        for mb in (1, 2, 3, stages - 1, stages, stages + 1, 2 * stages + 3, 17):
            if mb < 1:
                continue
            played = sch.make_schedule(name, stages, mb)
            want = sch.tick_codes(sch.tick_table(played))
            got = cls.grid_codes(stages, mb)
            assert got.shape == want.shape and (got == want).all(), (stages, mb)
            assert cls.stash_peaks(stages, mb) == tuple(
                played.activation_share(s) for s in range(stages)), (stages, mb)
            assert sch.Schedule.grid_codes.__func__(cls, stages, mb).tolist() == want.tolist()


@pytest.mark.parametrize("name", ["interleaved", "zb-h1"])
def test_closed_form_stash_peaks_of_the_mpmd_schedules_equal_the_played_ones(name):
    cls = sch.SCHEDULES[name]
    for stages in range(1, 9):
        for mb in sorted({1, 2, 3, stages - 1, stages, stages + 1, 2 * stages, 3 * stages, 17}):
            if mb < 1:
                continue
            try:
                played = sch.make_schedule(name, stages, mb)
            except ValueError:
                with pytest.raises(ValueError):
                    cls.stash_peaks(stages, mb)
                continue
            assert cls.stash_peaks(stages, mb) == tuple(
                played.activation_share(s) for s in range(stages)), (stages, mb)


# --- the lowering: a schedule as per-stage programs (hetjax/core/program.py) ------------------------
from hetjax.core import program as pg  # noqa: E402

PROGRAM_CASES = [(name, stages, mb) for name in sch.SCHEDULES
                 for stages, mb in sizes_for(name) if (stages, mb) != (4, 9)]
PROGRAM_CASES += [("gpipe (folded)", 2, 4), ("1f1b (folded)", 3, 3)]


def lowered(name, stages, mb):
    if name.endswith("(folded)"):
        s = sch.folded(name.split()[0], stages, mb)
    else:
        s = sch.make_schedule(name, stages, mb)
    return s, pg.lower(s)


def touched(op):
    """(read, written) buffers of an op."""
    if isinstance(op, pg.Run):
        return op.reads, op.writes
    if isinstance(op, pg.Send):
        return (op.buffer,), ()
    if isinstance(op, pg.Recv):
        return (), (op.buffer,)
    return (), ()


@pytest.mark.parametrize("name, stages, mb", PROGRAM_CASES)
def test_every_buffer_is_written_once_read_after_and_freed_once_after_its_last_read(
        name, stages, mb):
    _, program = lowered(name, stages, mb)
    written, freed, last_read = {}, {}, {}
    for i, op in enumerate(program.ops):
        reads, writes = touched(op)
        for b in reads:
            key = op.stage, b
            assert key in written and key not in freed, f"{op} reads {b} before it exists"
            last_read[key] = i
        for b in writes:
            assert (op.stage, b) not in written, f"{op} writes {b} twice"
            written[op.stage, b] = i
        if isinstance(op, pg.Free):
            assert (op.stage, op.buffer) not in freed, f"{op}: freed twice"
            freed[op.stage, op.buffer] = i
    assert set(freed) == set(written)  # nothing lives past the step
    for key, i in freed.items():
        # right after its last reader (the frees of one op follow it in a row)
        last = last_read.get(key, written[key])
        assert i > last and all(isinstance(op, pg.Free) for op in program.ops[last + 1:i])


@pytest.mark.parametrize("name, stages, mb", PROGRAM_CASES)
def test_sends_match_receives_and_every_input_is_the_right_value(name, stages, mb):
    """Play the program with symbolic values: every F reads the previous chunk's output of its
    micro-batch and every B / I the next chunk's input gradient, wherever they were made."""
    schedule, program = lowered(name, stages, mb)
    last_chunk = len(schedule.placement()) - 1
    env, transit = {}, {}
    for i, op in enumerate(program.ops):
        if isinstance(op, pg.Send):
            assert op.peer != op.stage and (op.peer, op.buffer) not in transit
            transit[op.peer, op.buffer] = (env[op.stage, op.buffer], i)
        elif isinstance(op, pg.Recv):
            value, sent = transit.pop((op.stage, op.buffer))  # sent before, to this stage
            assert schedule.placement()[op.buffer.source] == op.peer and sent < i
            env[op.stage, op.buffer] = value
        elif isinstance(op, pg.Free):
            del env[op.stage, op.buffer]
        elif isinstance(op, pg.Run):
            k, m = op.model_chunk, op.microbatch
            assert schedule.placement()[k] == op.stage
            got = {b.kind: env[op.stage, b] for b in op.reads}
            if op.kind == "F":
                assert got == ({} if k == 0 else {"activation": ("y", k - 1, m)})
                made = {"stash": ("stash", k, m), "activation": ("y", k, m)}
            else:
                want = {"stash": ("stash", k, m)}
                if op.kind == "W":
                    want["douts"] = ("douts", k, m)
                elif k < last_chunk:
                    want["gradient"] = ("dx", k + 1, m)
                assert got == want, op
                made = {"gradient": ("dx", k, m), "douts": ("douts", k, m)}
            for b in op.writes:
                env[op.stage, b] = made[b.kind]
    assert not transit and not env


@pytest.mark.parametrize("name, stages, mb", PROGRAM_CASES)
def test_each_stage_runs_its_order_and_reduces_once_after_its_last_backward(name, stages, mb):
    schedule, program = lowered(name, stages, mb)
    for s in range(stages):
        ops = program.of_stage(s)
        runs = [op for op in ops if isinstance(op, pg.Run)]
        assert [(r.kind, r.microbatch, r.stage_chunk) for r in runs] == \
            [(a.kind, a.microbatch, a.stage_chunk) for a in schedule.orders[s]]
        assert [schedule.model_chunk(a) for a in schedule.orders[s]] == [r.model_chunk for r in runs]
        reductions = [i for i, op in enumerate(ops)
                      if isinstance(op, pg.Reduce) or (isinstance(op, pg.Run) and op.reduce)]
        assert len(reductions) == 1
        last = max(i for i, op in enumerate(ops)
                   if isinstance(op, pg.Run) and op.kind in sch.RELEASE_KINDS)
        # fused into the last backward when it sends nothing on, else right after its send
        if ops[last].writes:
            assert reductions[0] > last and not ops[last].reduce
            assert all(isinstance(op, (pg.Send, pg.Free)) for op in ops[last + 1:reductions[0]])
        else:
            assert reductions == [last]


@pytest.mark.parametrize("name, stages, mb", PROGRAM_CASES)
def test_the_live_stashes_peak_at_the_schedules_max_in_flight(name, stages, mb):
    schedule, program = lowered(name, stages, mb)
    for s in range(stages):
        live = peak = 0
        for op in program.of_stage(s):
            if isinstance(op, pg.Run) and op.written("stash"):
                live += 1
            elif isinstance(op, pg.Free) and op.buffer.kind == "stash":
                live -= 1
            peak = max(peak, live)
        assert peak == schedule.max_in_flight(s)


def test_a_lowered_program_reads_as_text():
    text = pg.format_program(pg.lower(sch.make_schedule("1f1b", 2, 2)))
    assert text.splitlines()[1] == (
        "  stage 0: F(c0,m0), send activation(c1,m0)->1, free activation(c1,m0), F(c0,m1), "
        "send activation(c1,m1)->1, free activation(c1,m1), recv gradient(c0,m0)<-1, "
        "B(c0,m0), free stash(c0,m0), free gradient(c0,m0), recv gradient(c0,m1)<-1, "
        "B(c0,m1)+reduce, free stash(c0,m1), free gradient(c0,m1)")
    assert text.splitlines()[2].endswith("send gradient(c0,m1)->0, free gradient(c0,m1), reduce")

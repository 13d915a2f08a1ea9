"""Plan.problems(): every layout rule defined once (hetjax/core/plan.py), read by config validation,
config -> Plan, the planner's search and every executor, with the same words."""

import dataclasses

import pytest

from conftest import tiny_config
from hetjax import config as hconfig
from hetjax.errors import ConfigError, PlanError
from hetjax.core.plan import Plan, ZeroFactors, layout_problems
from hetjax.planner import cost
from hetjax.core.topology import preset
from hetjax.core.registry import EXECUTORS
from hetjax.core.schedules import SCHEDULES


def good_plan(**kw) -> Plan:
    base = dict(pp=2, dp=4, tp=1, stage_layers=(1, 1), microbatches=2, global_batch=8,
                seq_len=16, schedule="1f1b", executor="spmd")
    return Plan(**{**base, **kw})


def test_a_runnable_plan_has_no_problems():
    topology = preset("cpu_hybrid")  # 8 devices
    assert good_plan().problems(topology, n_layers=2) == []
    assert good_plan(executor="mpmd", schedule="zb-h1").problems(topology, n_layers=2) == []


def test_problems_lists_everything_wrong_as_field_problem_fix():
    bad = good_plan(dp=3, stage_layers=(1, 2), microbatches=3, schedule="zb-h1",
                    zero=ZeroFactors(2, 1, 1, "custom"), device_order=(0, 1, 2, 3, 4, 9))
    problems = bad.problems(preset("cpu_hybrid"), n_layers=4)
    fields = [p.field for p in problems]
    assert fields == ["pipeline.schedule", "zero.s_p", "train.batch_size",
                      "pipeline.stage_layers", "parallel"], fields
    assert all(p.problem and p.fix for p in problems)
    assert "multiple of 3" in problems[2].fix  # 8 sequences into 3 micro-batches
    assert "sum to 4" in problems[3].fix
    assert "ranks 9, but topology 'cpu_hybrid' has 8 devices" in problems[-1].problem


def test_a_plan_that_cannot_exist_is_refused_by_the_same_rules():
    with pytest.raises(ValueError, match="choose one of spmd, mpmd$"):
        good_plan(executor="auto")  # 'auto' is a config's word, never a Plan's
    with pytest.raises(ValueError, match="has 1 stages but parallel.pp = 2"):
        good_plan(stage_layers=(2,))


def test_config_validation_and_the_executors_say_the_same_thing():
    """The tick-grid rule: one Problem, raised as a ConfigError by validation and as a
    PlanError by make_executor, with the same problem and fix."""
    from hetjax.parallel.executor import make_executor
    from hetjax.parallel.train_state import Optimizer

    c = tiny_config(**{"pipeline.executor": "spmd", "pipeline.schedule": "zb-h1"})
    with pytest.raises(ConfigError) as e:
        hconfig.validate(c)
    plan = good_plan(schedule="zb-h1")
    (problem,) = plan.problems()
    assert (e.value.field, e.value.problem, e.value.fix) == (problem.field, problem.problem,
                                                             problem.fix)
    with pytest.raises(PlanError) as e2:
        make_executor(plan, preset("cpu_hybrid"), None, Optimizer(None, None))
    assert str(e2.value) == problem.message()
    # a plan placed on devices the topology lacks never reaches an executor (one that leaves
    # some of them out may: tests/test_mpmd.py)
    with pytest.raises(PlanError, match="has 8 devices"):
        make_executor(good_plan(dp=2, device_order=(0, 1, 2, 8)), preset("cpu_hybrid"), None,
                      Optimizer(None, None))


def test_the_cost_model_and_the_search_read_the_plans_schedule_rule():
    for executor in EXECUTORS:
        for name in SCHEDULES:
            runs = not layout_problems(executor=executor, schedule=name)
            assert cost.runs_schedule(executor, name) == runs
    # the cost model's own name for the SPMD executor
    assert cost.runs_schedule("spmd", "1f1b") and not cost.runs_schedule("spmd", "zb-h1")


def test_a_config_left_to_the_planner_is_not_held_to_a_plans_names():
    assert layout_problems(executor="auto", placement="auto", schedule="1f1b") == []
    assert [p.field for p in layout_problems(executor="auto", placement="folded",
                                             schedule="zb-h1")] == ["pipeline.placement"]
    assert dataclasses.replace(good_plan(), placement="folded").problems() == []


def test_a_single_stage_plan_runs_whatever_schedule_it_names():
    """pp = 1 runs as one program (make_executor's SINGLE_PROGRAM): the executor/schedule rule
    is a pipeline's, as the search's `fits_schedule` has it."""
    one = Plan(pp=1, dp=8, tp=1, stage_layers=(2,), microbatches=1, global_batch=8, seq_len=16,
               schedule="zb-h1", executor="spmd")
    assert one.problems(preset("cpu_hybrid"), n_layers=2) == []


# --- per-stage shapes and devices left out --------------------------------------------------
def staged_plan(**kw) -> Plan:
    """pp = 2: stage 0 on a (dp, tp) = (1, 2) mesh, stage 1 on (2, 1), four of the eight
    devices of cpu_hybrid (two of its ib cluster's, two of its roce cluster's)."""
    base = dict(pp=2, dp=0, tp=0, stage_layers=(1, 1), microbatches=2, global_batch=8,
                seq_len=16, executor="mpmd", stage_shapes=((1, 2), (2, 1)),
                device_order=(0, 1, 4, 5))
    return Plan(**{**base, **kw})


def test_a_plan_gives_each_stage_its_own_mesh():
    p = staged_plan()
    assert (p.dp, p.tp) == (1, 2)  # stage 0's
    assert not p.uniform and p.num_devices == 4
    assert p.shapes() == ((1, 2), (2, 1)) and p.stage_shape(1) == (2, 1)
    assert p.stage_mesh(0).tolist() == [[0, 1]] and p.stage_mesh(1).tolist() == [[4], [5]]
    assert p.stage_ranks(1) == [4, 5]
    assert p.tp_groups() == [[0, 1], [4], [5]] and p.dp_groups() == [[0], [1], [4, 5]]
    assert p.pp_groups() == [[0, 1, 4, 5]]  # the boundary's two stages reshard
    with pytest.raises(PlanError, match="stage_mesh"):
        p.mesh_ranks()
    assert Plan.from_json(p.to_json()) == p
    # every stage one shape: the plan is a uniform one, its JSON as one without shapes
    same = staged_plan(stage_shapes=((2, 1), (2, 1)))
    assert same.uniform and (same.dp, same.tp) == (2, 1)
    plain = staged_plan(stage_shapes=(), dp=2, tp=1)
    assert same.to_json() == plain.to_json() and "stage_shapes" not in plain.to_dict()
    assert list(plain.to_dict()) == [
        "pp", "dp", "tp", "stage_layers", "microbatches", "global_batch", "seq_len", "schedule",
        "zero", "executor", "placement", "remat", "device_order", "source", "predicted"]
    for bad, match in (({"dp": 2}, "dp = 2 but stage 0's is 1"),
                       ({"stage_shapes": ((1, 2),)}, "1 stages' .* pp = 2"),
                       ({"device_order": (0, 1, 4, 4)}, "4 distinct"),
                       ({"device_order": (0, 1, 4)}, "list 4 distinct")):
        with pytest.raises(ValueError, match=match):
            staged_plan(**bad)


def test_describe_shows_each_stages_degrees_and_the_devices_left_out():
    p = staged_plan()
    p.predicted["unused"] = {"2": "too slow to help", "3": "too slow to help"}
    text = p.describe(preset("cpu_hybrid"))
    lines = text.splitlines()
    assert "pp=2 dp,tp per stage: 1x2 2x1" in lines[0]
    assert lines[1].split() == ["stage", "layers", "dp", "tp", "ranks", "clusters"]
    assert lines[2].split()[3:5] == ["1", "2"] and lines[3].split()[3:5] == ["2", "1"]
    assert "  unused: ranks 2-3 (ib): too slow to help" in lines
    assert "  unused: ranks 6-7 (roce)" in lines  # left out without a reason given
    assert p.unused_ranks(preset("cpu_hybrid")) == [2, 3, 6, 7]
    assert p.used_ranks() == [0, 1, 4, 5]
    assert p.unused_reasons() == {2: "too slow to help", 3: "too slow to help"}
    # a uniform plan on every device says nothing new
    assert "unused" not in good_plan().describe(preset("cpu_hybrid"))
    assert "dp,tp per stage" not in good_plan().describe()


def test_per_stage_shapes_and_their_rules():
    topology = preset("cpu_hybrid")
    assert staged_plan().problems(topology, n_layers=2) == []
    # only an executor that gives each stage its own sub-mesh runs them
    (p,) = staged_plan(executor="spmd").problems(topology, n_layers=2)
    assert p.field == "pipeline.executor" and "executor=mpmd" in p.fix
    assert not layout_problems(executor="spmd", stage_shapes=((2, 1), (2, 1)))
    # a micro-batch splits over every stage's dp
    (p,) = staged_plan(stage_shapes=((1, 2), (4, 1)), device_order=(0, 1, 4, 5, 6, 7),
                       global_batch=12).problems(topology)
    assert p.field == "train.batch_size" and "least common multiple 4" in p.problem
    # the ZeRO factors divide every stage's dp
    (p,) = staged_plan(zero=ZeroFactors(1, 1, 2, "custom")).problems(topology)
    assert p.field == "zero.s_os" and "every stage's dp [1, 2]" in p.problem
    # every stage's tp splits the model's heads, kv heads and d_ff
    model = hconfig.base_config().model
    model.n_heads, model.n_kv_heads, model.d_ff = 4, 1, 64
    (p,) = staged_plan().problems(topology, model=model)
    assert (p.field, p.problem) == ("parallel.tp", "tp = 2 does not divide model.n_kv_heads "
                                    "= 1; tensor parallelism splits it")
    # the topology's devices, each used once
    (p,) = staged_plan(device_order=(0, 1, 4, 8)).problems(topology)
    assert "ranks 8" in p.problem

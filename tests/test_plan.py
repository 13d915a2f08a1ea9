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
                    zero=ZeroFactors(2, 1, 1, "custom"))
    problems = bad.problems(preset("cpu_hybrid"), n_layers=4)
    fields = [p.field for p in problems]
    assert fields == ["pipeline.schedule", "zero.s_p", "train.batch_size",
                      "parallel.dp", "parallel", "pipeline.stage_layers"], fields
    assert all(p.problem and p.fix for p in problems)
    assert "multiple of 3" in problems[2].fix  # 8 sequences into 3 micro-batches
    assert "sum to 4" in problems[-1].fix


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
    # a plan that does not fit the topology's devices never reaches an executor
    with pytest.raises(PlanError, match="product is 8"):
        make_executor(good_plan(dp=2), preset("cpu_hybrid"), None, Optimizer(None, None))


def test_the_cost_model_and_the_search_read_the_plans_schedule_rule():
    for executor in EXECUTORS:
        for name in SCHEDULES:
            runs = not layout_problems(executor=executor, schedule=name)
            assert cost.runs_schedule(executor, name) == runs
    # the cost model's own name for the SPMD executor
    assert cost.runs_schedule("hetjax", "1f1b") and not cost.runs_schedule("hetjax", "zb-h1")


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

"""The executor registry (hetjax/core/registry.py) and `make_executor`, the one place that chooses
an executor: the names the Plan, the config and the cost model accept are the registry's; an
executor added in a test file is one registry entry, and the config, the planner's pricing and
the Trainer take it; a process's environment reaches the executors only as a `Runtime`."""

import ast
import dataclasses
import os

import numpy as np
import pytest

from conftest import REPO, tiny_config
from hetjax import config as hconfig
from hetjax.errors import ConfigError, PlanError
from hetjax.core.plan import Plan
from hetjax.planner import cost, plan_from_config
from hetjax.core import registry
from hetjax.parallel.executor import SingleProgramExecutor, make_executor
from hetjax.parallel.train_state import Executor, Optimizer, Runtime
from test_pipeline import pipe_config


def test_every_registered_executor_is_an_executor_the_plan_config_and_cost_model_accept():
    for name, kind in registry.EXECUTORS.items():
        for target in (kind.build, kind.worlds or kind.build, registry.SINGLE_PROGRAM):
            module, cls = target.split(":")
            assert issubclass(getattr(__import__(module, fromlist=[cls]), cls), Executor)
        assert Plan(pp=2, dp=4, tp=1, stage_layers=(1, 1), microbatches=2, global_batch=8,
                    seq_len=16, executor=name).executor == name
        assert cost.PLAN_EXECUTORS[name] in cost.PRICED_EXECUTORS
        hconfig.validate(tiny_config(**{"pipeline.executor": name}))
    assert set(cost.PLAN_EXECUTORS) == set(registry.EXECUTORS) == {"spmd", "mpmd"}
    assert cost.PLAN_EXECUTORS["spmd"] == "spmd"  # each of hetjax's executors: its own name
    help_line = hconfig.DESCRIPTIONS["pipeline.executor"]
    assert all(f"{k.name}: {k.help}" in help_line for k in registry.EXECUTORS.values())
    with pytest.raises(ConfigError, match="choose one of spmd, mpmd, auto"):
        hconfig.validate(tiny_config(**{"pipeline.executor": "gspmd"}))
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.EXECUTORS["mpmd"])


def test_the_document_mask_rule_comes_from_the_registry():
    from hetjax.train import Trainer

    c = pipe_config((1, 1), "1f1b", 4, 1, 2, **{"pipeline.executor": "mpmd",
                                                "data.document_mask": True})
    with pytest.raises(ConfigError, match="(?s)the mpmd pipeline executor .* does not pass "
                                          "segment ids.*pipeline.executor=spmd, or"):
        Trainer(c, quiet=True)


def test_the_tick_grid_rule_comes_from_the_registry():
    with pytest.raises(ConfigError, match="(?s)the spmd executor cannot run 'zb-h1'.*"
                                          "pipeline.executor=mpmd"):
        hconfig.validate(tiny_config(**{"pipeline.executor": "spmd",
                                        "pipeline.schedule": "zb-h1"}))
    assert not cost.runs_schedule("spmd", "zb-h1")
    assert cost.runs_schedule("mpmd", "zb-h1") and cost.runs_schedule("spmd", "1f1b")


# --- an executor added here, in a test file, is one registry entry ---------------------------
class CountingExecutor(SingleProgramExecutor):
    """A toy pipeline executor: every stage's devices run the whole model as one program
    (replicated over 'pp'), counting the steps it runs."""

    def __init__(self, *args):
        super().__init__(*args)
        self.steps = 0

    def step(self, state, batch):
        self.steps += 1
        return super().step(state, batch)

    def describe(self) -> str:
        return f"counting ({self.steps} steps so far)"


@pytest.fixture
def toy_executor():
    kind = registry.register(registry.ExecutorKind(
        "toy", f"{__name__}:CountingExecutor", "every stage runs the whole model, counting",
        priced_as="spmd", tick_grid_only=True))
    yield kind.name
    del registry.EXECUTORS[kind.name]


def toy_config(executor: str, schedule: str = "gpipe"):
    return pipe_config((1, 1), schedule, 4, 1, 2, **{"pipeline.executor": executor})


def test_an_executor_defined_in_a_test_is_validated_priced_and_chosen(toy_executor):
    from hetjax.train import Trainer

    c = toy_config(toy_executor)
    hconfig.validate(c)
    assert "toy: every stage runs the whole model" in registry.executor_help()
    with pytest.raises(ConfigError, match="the toy executor cannot run 'zb-h1'"):
        hconfig.validate(toy_config(toy_executor, "zb-h1"))
    # 'auto' prices it beside the built-in ones and names it in its choice
    auto = plan_from_config(toy_config("auto"), hconfig.build_topology(c))
    assert "toy " in auto.predicted["executor_choice"]
    trainer = Trainer(c, quiet=True)  # builds the executor; compiles nothing yet
    assert trainer.plan.executor == toy_executor and type(trainer.executor) is CountingExecutor
    assert "executor=toy" in trainer.plan.describe(trainer.topology)


@pytest.mark.slow  # two compilations, ~20 s on two busy cores
def test_an_executor_defined_in_a_test_trains_like_the_plain_model(toy_executor):
    import jax
    import jax.numpy as jnp

    from hetjax.train import Trainer

    trainer = Trainer(toy_config(toy_executor), quiet=True)
    batch = next(trainer.data)
    params = jax.device_get(trainer.params)
    want = jax.jit(trainer.executor.loss_fn)(params, jnp.asarray(batch["inputs"]),
                                             jnp.asarray(batch["targets"]))
    metrics = trainer.step(batch)
    assert trainer.executor.steps == 1
    np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-6)
    assert "counting (1 steps so far)" in trainer.describe()


# --- a plan of plans (DiLoCo's sites) is one COMPOSITE entry -----------------------------------
DILOCO = {"topology.nodes": 1, "topology.devices_per_node": 2, "diloco.inner_steps": 4,
          "diloco.fragments": 2, "train.batch_size": 8}


def test_the_trainer_gives_a_diloco_plan_to_make_executor_which_picks_the_diloco_entry():
    from hetjax.core.plan import DilocoPlan
    from hetjax.planner.diloco_pricing import plan_to_run
    from hetjax.train import Trainer
    from hetjax.parallel.diloco import DilocoExecutor

    c = tiny_config(**DILOCO)
    topo = hconfig.build_topology(c)
    plan = plan_from_config(c, topo)
    assert plan_to_run(tiny_config(**{**DILOCO, "diloco.inner_steps": 0}), topo, plan) is plan
    dplan = plan_to_run(c, topo, plan)
    assert isinstance(dplan, DilocoPlan) and registry.COMPOSITE[dplan.executor] == \
        "hetjax.parallel.diloco:DilocoExecutor" and dplan.executor not in registry.EXECUTORS
    trainer = Trainer(c, quiet=True)  # builds the executors; compiles nothing yet
    ex = trainer.executor
    assert type(ex) is DilocoExecutor and len(ex.site_execs) == 2 and not ex.runs_whole_plan
    assert all(type(s) is SingleProgramExecutor for s in ex.site_execs)
    # an exchange of one fragment every H / F = 2 steps; other executors have none
    assert [ex.exchanged_after(s) for s in range(7)] == [False, False, True, False, True,
                                                         False, True]
    assert not ex.site_execs[0].exchanged_after(2) and ex.site_execs[0].runs_whole_plan
    assert "DiLoCo: 2 sites" in trainer.describe()
    assert trainer.plan.header() not in trainer.describe()  # the whole plan: not what runs


@dataclasses.dataclass(frozen=True)
class TwoPlans:
    """A toy plan of plans (its executor here runs the first)."""

    executor = "toy_both"
    first: Plan
    second: Plan


class BothExecutor(SingleProgramExecutor):
    @classmethod
    def create(cls, plan, topology, model_cfg, optimizer, runtime):
        return cls(plan.first, topology, model_cfg, optimizer.tx, optimizer.lr_schedule)


def test_a_plan_of_plans_defined_in_a_test_is_one_composite_entry(monkeypatch):
    import optax

    from hetjax.layers import ModelConfig

    monkeypatch.setitem(registry.COMPOSITE, "toy_both", f"{__name__}:BothExecutor")
    c = tiny_config(**{"parallel.pp": 1})
    topo = hconfig.build_topology(c)
    plan = plan_from_config(c, topo)
    ex = make_executor(TwoPlans(plan, plan), topo, ModelConfig.from_config(c.model, 256),
                       Optimizer(optax.sgd(0.1), optax.constant_schedule(0.1)), Runtime())
    assert type(ex) is BothExecutor and ex.plan is plan


# --- the runtime: what the environment says, read once by the caller --------------------------
WORLDS = {"topology.preset": "cpu_hybrid", "model.d_model": 32, "model.d_ff": 64,
          "model.n_layers": 3, "parallel.pp": 2, "parallel.dp": 4, "parallel.tp": 1,
          "pipeline.stage_layers": (1, 2), "pipeline.microbatches": 4}


def test_the_runtime_of_a_multi_world_job_comes_from_its_environment():
    from hetjax.distributed import free_port
    from hetjax.train import runtime_from_environ
    from hetjax.parallel.bridge import bridge_environ
    from hetjax.parallel.nic import ENV_WORLD, ENV_WORLDS

    c = tiny_config(**{**WORLDS, "pipeline.executor": "mpmd"})
    topo = hconfig.build_topology(c)
    plan = plan_from_config(c, topo)
    assert runtime_from_environ(c, plan, topo, env={}) == Runtime()
    env = {ENV_WORLDS: "2", ENV_WORLD: "1",
           **bridge_environ(1, ["127.0.0.1", "127.0.0.1"], free_port(), "socket")}
    rt = runtime_from_environ(c, plan, topo, env=env)
    assert rt.multi_world and rt.world == 1 and [w.stages for w in rt.worlds] == [(0,), (1,)]
    assert rt.bridge.rank == 1 and set(rt.owner.values()) == {0, 1}
    # a multi-world job under an executor without a world executor: one error, naming the fix
    spmd = dataclasses.replace(plan, executor="spmd")
    with pytest.raises(PlanError, match="(?s)needs an executor that runs worlds, not 'spmd'.*"
                                        "pipeline.executor=mpmd"):
        make_executor(spmd, topo, None, Optimizer(None, None), rt)


def test_the_trainer_reads_the_environment_and_probes_executors_nowhere():
    """hetjax/train.py builds the Runtime in one function and never asks an executor whether it
    has an attribute: the Executor base class declares everything the Trainer calls."""
    with open(os.path.join(REPO, "hetjax", "train.py")) as f:
        tree = ast.parse(f.read())
    probes, environ = [], []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and node.args
                    and "executor" in ast.unparse(node.args[0])):
                probes.append(ast.unparse(node))
            if isinstance(node, ast.Attribute) and node.attr == "environ" and \
                    ast.unparse(node.value) == "os":
                environ.append(fn.name)
    assert probes == [] and set(environ) <= {"runtime_from_environ"}, (probes, environ)

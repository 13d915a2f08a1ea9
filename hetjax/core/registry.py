"""The executor registry: the pipeline executors a Plan can name, in one table (no JAX).

Every place that shows or checks an executor name reads `EXECUTORS`: the Plan
(`hetjax.core.plan`), config validation and `--help` (`hetjax.config`), and the cost model, which
prices each under `ExecutorKind.priced_as`. `hetjax.parallel.executor.make_executor` is the only
place that turns a Plan's name into a running executor: it imports the entry's class then, so
the names stay importable by the planner and the Plan without starting JAX (which is why an
entry names its class as "module:Class" rather than holding it).

A plan of plans (DiLoCo's sites) names its executor in `COMPOSITE`.

Adding an executor is one `register(ExecutorKind(...))` entry plus its own module: a subclass
of `hetjax.parallel.train_state.Executor` whose `create(plan, topology, model_cfg, optimizer,
runtime)` builds it (the default passes the optimizer's transform and learning-rate
schedule). tests/test_executor_registry.py adds a toy one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExecutorKind:
    """One pipeline executor a Plan can name.

    `build` is the Executor subclass (as "module:Class") that runs a pipeline plan (pp > 1);
    `worlds` the one that runs one world of a multi-world job, "" when this executor cannot.
    `priced_as` is the cost model's executor (`hetjax.planner.cost.PRICED_EXECUTORS`) that prices
    it (hetjax's own executors: their own name);
    `tick_grid_only`: it runs only the schedules of the SPMD tick grid
    (`hetjax.core.schedules.spmd_schedules`); `document_masks`: it passes the packer's segment
    ids to its stages (`data.document_mask`); `stage_shapes`: it runs each stage on its own
    sub-mesh, so stages may have different (dp, tp) shapes (`Plan.stage_shapes`). `help` is
    its line in `--help`."""

    name: str
    build: str
    help: str
    priced_as: str
    tick_grid_only: bool = False
    worlds: str = ""
    document_masks: bool = False
    stage_shapes: bool = False


# A plan of one stage runs as one program whatever executor it names (there is no pipeline).
SINGLE_PROGRAM = "hetjax.parallel.executor:SingleProgramExecutor"

# Executors of a plan made of plans, by the name its type carries as `executor`
# (`hetjax.core.plan.DilocoPlan.executor`: "diloco", each site's Plan and the exchange between the
# sites). They are not pipeline executors: a Plan cannot name them and `pipeline.executor`
# does not offer them. Adding one is one entry here plus its module and its plan type.
COMPOSITE: dict[str, str] = {
    "diloco": "hetjax.parallel.diloco:DilocoExecutor",
}

EXECUTORS: dict[str, ExecutorKind] = {}


def register(kind: ExecutorKind) -> ExecutorKind:
    if kind.name in EXECUTORS or kind.name == "auto":
        raise ValueError(f"executor {kind.name!r} is already registered (or reserved)")
    EXECUTORS[kind.name] = kind
    return kind


register(ExecutorKind(
    "spmd", "hetjax.parallel.executor:SpmdPipelineExecutor",
    "one shard_map program, stages in lockstep ticks", priced_as="spmd",
    tick_grid_only=True, document_masks=True))
register(ExecutorKind(
    "mpmd", "hetjax.parallel.mpmd:MpmdExecutor",
    "one program per stage, stages run asynchronously", priced_as="mpmd",
    worlds="hetjax.parallel.mpmd_worlds:WorldsExecutor", stage_shapes=True))


def executor_help() -> str:
    """The `pipeline.executor` lines of `--help`: every registered executor, then 'auto'."""
    return "; ".join([f"{k.name}: {k.help}" for k in EXECUTORS.values()] +
                     ["auto: the one the planner predicts faster"])


__all__ = ["COMPOSITE", "EXECUTORS", "ExecutorKind", "SINGLE_PROGRAM", "executor_help",
           "register"]

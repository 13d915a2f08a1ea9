"""The planner: chooses the whole training layout from a topology, a model and a batch.

    from hetjax.planner import plan
    result = plan(topology, model_cfg, global_batch=768, seq_len=2048)
    result.plan          # the best Plan, with result.plan.predicted filled in
    result.runners_up    # the next best Plans

Modules: `cost` (the cost model: compute, communication, memory, per stage), `layout` (a Plan
before its layer split), `network` (collectives and transfers over rank groups), `collectives`
(NCCL's ring and tree algorithms), `compute` (compute by operation kind), `memory` (activation
and runtime memory terms), `simulate` (the schedule simulator), `partition` (layers per stage:
Holmes, HetHub, exact), `assign` (DT-FM's device assignment on slow networks), `zero_factors`
(AMSP's sharding factors: presets, rules, collectives), `placement` (where TP groups and stages
may sit), `search` (the outer search), `config_plan` (config ->
(ModelConfig, Plan, runners-up): `plan_job`, the one path every command takes),
`calibrate` (`hetjax calibrate`'s file), `reference_runs` (published runs and the fits on
them), `fit_range` (the plausibility guard), `scoring` (predicted against measured), `breakdown`
(what a predicted step is made of, and its what-ifs), `formulas`
(the papers' metric formulas). Pure Python + numpy: importing the planner does not start JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetjax.core.plan import Plan
from hetjax.planner.cost import CostModel, CostOptions, LayerProfile, Prediction
from hetjax.planner.config_plan import (JobPlan, model_from_config, options_from_config,
                                        plan_from_config, plan_job)
from hetjax.planner.placement import check_placement, placement_problems
from hetjax.planner.search import PlanResult, plan
from hetjax.core.topology import Topology

if TYPE_CHECKING:
    from hetjax.core.model_config import ModelConfig


def predict(plan_: Plan, topology: Topology, model: "ModelConfig",
            options: CostOptions | None = None) -> Prediction:
    """The cost model's prediction for a given Plan (step time, memory, bubble, ...)."""
    return CostModel(topology, model, options).predict(plan_)


__all__ = ["plan", "plan_job", "JobPlan", "plan_from_config", "options_from_config", "check_placement",
           "placement_problems", "predict", "PlanResult", "CostModel", "CostOptions",
           "LayerProfile", "Prediction", "model_from_config"]

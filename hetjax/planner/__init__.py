"""The planner: chooses the whole training layout from a topology, a model and a batch.

    from hetjax.planner import plan
    result = plan(topology, model_cfg, global_batch=768, seq_len=2048)
    result.plan          # the best Plan, with result.plan.predicted filled in
    result.runners_up    # the next best Plans

Modules: `cost` (the cost model: compute, communication, memory), `collectives` (NCCL's ring
and tree algorithms), `simulate` (the schedule simulator), `partition` (layers per stage: Holmes, HetHub, exact), `assign` (DT-FM's
device assignment on slow networks), `zero` (AMSP's sharding factors), `search` (the outer
search), `calibrate` (fits to measured runs; `hetjax calibrate`'s file), `formulas` (the
papers' metric formulas). Pure Python + numpy: importing the planner
does not start JAX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hetjax.plan import Plan, ZeroFactors
from hetjax.planner.cost import (CostModel, CostOptions, LayerProfile, Prediction,
                                 model_from_config)
from hetjax.planner.search import PlanResult, plan
from hetjax.topology import Topology

if TYPE_CHECKING:
    from layers.config import ModelConfig


def predict(plan_: Plan, topology: Topology, model: "ModelConfig",
            options: CostOptions | None = None) -> Prediction:
    """The cost model's prediction for a given Plan (step time, memory, bubble, ...)."""
    return CostModel(topology, model, options).predict(plan_)


def options_from_config(c, topology: Topology | None = None) -> CostOptions:
    """The cost options a config asks for: usable memory 1 - planner.memory_margin, and the
    measurements of planner.calibration (a `hetjax calibrate` file) when set."""
    options = CostOptions(memory_fraction=1.0 - c.planner.memory_margin)
    if c.planner.calibration:
        from hetjax.planner.calibrate import load_calibration

        options = load_calibration(c.planner.calibration).options(options)
    return options


def plan_for_config(c, topology: Topology, options: CostOptions | None = None,
                    top: int = 5) -> PlanResult:
    """Plan for a hetjax config: degrees at 0 are chosen, fixed ones kept.

    Micro-batches: pipeline.microbatches (or train.microbatches when it is not the default 1,
    or when the layout is fixed) fixes M; otherwise the planner chooses. zero.preset 'auto' lets AMSP's enumeration choose;
    'custom' uses zero.s_p / s_g / s_os; a name picks that point."""
    from hetjax.config import resolve_microbatches

    model = model_from_config(c)
    m = resolve_microbatches(c)
    layout_fixed = bool(c.parallel.pp and c.parallel.tp)  # then only ZeRO is left to choose
    fixed_m = c.pipeline.microbatches or (m if m != 1 or layout_fixed else 0)
    z = c.zero
    zero = ZeroFactors(z.s_p, z.s_g, z.s_os, "custom") if z.preset == "custom" else z.preset
    return plan(topology, model, c.train.batch_size, c.train.seq_len,
                pp=c.parallel.pp, dp=c.parallel.dp, tp=c.parallel.tp, microbatches=fixed_m,
                schedule=c.pipeline.schedule, zero=zero,
                stage_layers=tuple(c.pipeline.stage_layers),
                options=options or options_from_config(c, topology), top=top,
                allow_straddle=c.parallel.allow_straddle)


__all__ = ["plan", "plan_for_config", "options_from_config", "predict", "PlanResult", "CostModel", "CostOptions",
           "LayerProfile", "Prediction", "model_from_config"]

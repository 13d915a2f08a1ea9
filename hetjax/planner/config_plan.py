"""Config -> Plan: the layout a hetjax config asks for, checked against the layout rules.

When parallel.pp or parallel.tp is 0 (or zero.preset is 'auto') the planner's search chooses
(`plan_for_config`); otherwise the config fixes the layout and this module completes it (dp =
the rest, an even layer split, the ZeRO point) and applies the same rules the search keeps:
the placement rules (hetjax/planner/placement.py) and the ZeRO rules (hetjax/planner/zero_factors.py).
`hetjax plan`, `hetjax train` and `hetjax launch` all build their Plan here, so they accept and
refuse the same layouts with the same messages.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from hetjax.errors import ConfigError
from hetjax.core.plan import (UNUSED_KEY, Plan, ZeroFactors, even_split, layout_problems,
                              raise_first, stage_shape_problem)
from hetjax.planner import zero_factors as zr
from hetjax.planner.cost import PLAN_EXECUTORS, CostModel, CostOptions, runs_schedule
from hetjax.planner.placement import placement_problems, refuse_straddle
from hetjax.planner.search import PlanResult, plan
from hetjax.core.topology import Topology

if TYPE_CHECKING:
    from hetjax.core.model_config import ModelConfig


def model_from_config(c, vocab_size: int | None = None,
                      topology: Topology | None = None) -> "ModelConfig":
    """The ModelConfig of a hetjax config (vocab 0: the byte tokenizer's, padded); model.dtype
    'auto' resolved on `topology` (Topology.default_compute_dtype; without one, float32)."""
    from hetjax.tokenizer import ByteTokenizer, padded_vocab
    from hetjax.core.model_config import ModelConfig

    model = ModelConfig.from_config(c.model, vocab_size or padded_vocab(ByteTokenizer.vocab_size))
    if c.model.dtype == "auto" and topology is not None:
        model = dataclasses.replace(model, dtype=topology.default_compute_dtype)
    return model


def resolve_microbatches(c) -> int:
    """train.microbatches, or pipeline.microbatches if the user set that alias instead."""
    pm, tm = c.pipeline.microbatches, c.train.microbatches
    if pm and tm not in (1, pm):
        raise ConfigError("pipeline.microbatches",
                          f"= {pm} disagrees with train.microbatches = {tm}",
                          "set only one of them (they name the same number)")
    return pm or tm


def usable_ranks(c, topology: Topology) -> list[int]:
    """The topology's ranks a config lets the layout use: all but `parallel.exclude`, in rank
    order."""
    gone = set(c.parallel.get("exclude", ()))
    bad = sorted(r for r in gone if r >= topology.num_devices)
    if bad:
        raise ConfigError("parallel.exclude", f"names ranks {bad}, but topology "
                          f"{topology.name!r} has {topology.num_devices} devices (ranks 0-"
                          f"{topology.num_devices - 1})", "list ranks of this topology")
    return [r for r in range(topology.num_devices) if r not in gone]


def searches_layout(c) -> bool:
    """Whether the planner's search chooses the layout: parallel.pp or parallel.tp at 0,
    zero.preset or pipeline.placement 'auto'; per-stage degrees (parallel.stage_dp /
    stage_tp) fix it."""
    p = c.parallel
    if p.get("stage_dp", ()) or p.get("stage_tp", ()):
        return False
    return (not p.pp or not p.tp or c.zero.preset == "auto" or c.pipeline.placement == "auto"
            or (p.get("ep", 1) == 0 and c.model.n_experts > 0))


def stage_shapes_of(c, devices: int) -> tuple[tuple[int, int], ...]:
    """Each stage's (dp, tp) a config fixes with parallel.stage_dp / stage_tp, on `devices`
    usable devices: a stage without its own tp takes parallel.tp (or 1), without its own dp
    parallel.dp or, at 0, its even share of the devices (devices / pp / tp). Empty when the
    config gives no per-stage degrees."""
    p = c.parallel
    sd, st = tuple(p.get("stage_dp", ())), tuple(p.get("stage_tp", ()))
    n = len(sd or st)
    if not n:
        return ()
    tps = st or (p.tp or 1,) * n
    share = devices // n
    dps = sd or tuple(p.dp or max(share // t, 1) for t in tps)
    return tuple(zip(dps, tps))


def validate_layout(c, topology: Topology) -> None:
    """Check the fixed degrees in the config against the devices of the topology it may use
    (less parallel.exclude) (the Plan's rules, `hetjax.core.plan.layout_problems`)."""
    p = c.parallel
    devices = len(usable_ranks(c, topology))
    if devices < topology.num_devices and searches_layout(c):
        raise ConfigError("parallel.exclude", "leaves devices out of a layout the planner "
                          "searches", "fix the layout too (parallel.pp and parallel.tp, or "
                          "parallel.stage_dp / stage_tp), or leave parallel.exclude empty")
    shapes = stage_shapes_of(c, devices)
    raise_first(layout_problems(pp=p.pp, dp=p.dp if not shapes else 0,
                                tp=p.tp if not shapes else 0, devices=devices,
                                topology_name=topology.name, n_layers=c.model.n_layers,
                                stage_layers=tuple(c.pipeline.stage_layers),
                                stage_shapes=shapes), ConfigError)


_WARNED: set[tuple[str, str]] = set()  # (calibration file, topology) pairs warned about


def options_from_config(c, topology: Topology | None = None) -> CostOptions:
    """The cost options a config asks for: usable memory 1 - planner.memory_margin, and the
    measurements of planner.calibration (a `hetjax calibrate` file) when set. With the run's
    `topology`, a calibration measured on other hardware is said once, on stderr."""
    options = CostOptions(memory_fraction=1.0 - c.planner.memory_margin,
                          boundary_codec=c.pipeline.get("boundary_codec", "none"),
                          compute=c.planner.get("compute", "flat"),
                          attention=c.model.get("attention", "auto"))
    if c.planner.calibration:
        from hetjax.planner.calibrate import load_calibration, topology_mismatch

        cal = load_calibration(c.planner.calibration)
        problem = topology_mismatch(cal.topology, topology) if topology is not None else None
        if problem and (c.planner.calibration, topology.name) not in _WARNED:
            import sys

            _WARNED.add((c.planner.calibration, topology.name))
            print(f"hetjax: warning: planner.calibration {c.planner.calibration!r}: {problem}; "
                  "those are priced with nominal constants. fix: run 'hetjax calibrate' on "
                  "this topology", file=sys.stderr, flush=True)
        options = cal.options(options)
    if c.planner.get("profile", ""):
        from hetjax.planner.compute_profile import load_profile

        profile = load_profile(c.planner.profile)
        problem = profile.mismatch(model_from_config(c, topology=topology))
        if problem:
            raise ConfigError("planner.profile", f"{c.planner.profile!r} was {problem}",
                              "measure this model with 'hetjax calibrate --profile=FILE', or "
                              "leave planner.profile empty")
        if options.profile is not None:  # the calibration's rows too: they price what it lacks
            profile = profile.merged(options.profile.rows)
        options = dataclasses.replace(options, profile=profile)
    return options


def plausibility_lines(c, plan_: Plan, topology: Topology) -> list[str]:
    """The plan's predicted MFU beside the range its rates were fitted on (the calibration
    file's, Megatron-LM's table for compute by kind, else Holmes Table 1), with a warning when
    it extrapolates far outside it (hetjax/planner/fit_range.py)."""
    from hetjax.planner.calibrate import calibration_range, load_calibration
    from hetjax.planner.fit_range import plausibility_lines as lines
    from hetjax.planner.reference_runs import holmes_range, megatron_range

    mfu = plan_.predicted.get("mfu")
    if mfu is None:
        return []
    if c.planner.calibration:
        fit = calibration_range(load_calibration(c.planner.calibration), c.planner.calibration)
    elif c.planner.get("compute", "flat") == "kinds":
        fit = megatron_range()
    else:
        fit = holmes_range()
    out = lines(mfu, model_from_config(c), topology, fit)
    source = plan_.predicted.get("compute_source", "flat")
    if "profile" in source:
        out.insert(0, f"compute priced from a measured profile ({source}); the band "
                   f"± {plan_.predicted.get('step_band_s', 0.0):.3g} s: such predictions' "
                   "error on measured steps, the profile's spread and how far it was "
                   f"extrapolated (x{plan_.predicted.get('extrapolation', 1.0):.3g})"
                   + "".join(f"; {n}" for n in plan_.predicted.get("compute_notes", ())))
    return out


def predict_for_config(c, plan_: Plan, topology: Topology, **overrides):
    """The cost model's Prediction for `plan_` as the config runs it: the plan's executor,
    the config's calibration file and memory margin (`overrides`: other CostOptions)."""
    options = dataclasses.replace(options_from_config(c, topology),
                                  executor=PLAN_EXECUTORS[plan_.executor], **overrides)
    return CostModel(topology, model_from_config(c, topology=topology), options).predict(plan_)


# Below this predicted gain `hetjax plan` does not propose int8 pipeline boundaries.
CODEC_PROPOSAL_GAIN = 0.02


def boundary_codec_lines(c, plan_: Plan, topology: Topology) -> list[str]:
    """What `hetjax plan` adds for an MPMD pipeline whose stage boundaries cross clusters with
    uncompressed activations (issue 19): the step priced with int8 boundaries
    (`pipeline.boundary_codec=int8`, which compresses only boundaries between clusters), when
    that is at least CODEC_PROPOSAL_GAIN faster -- slow inter-cluster links."""
    if (plan_.executor != "mpmd" or plan_.pp < 2 or c.pipeline.boundary_codec != "none"
            or "step_time_s" not in plan_.predicted):  # a plan the cost model did not price
        return []
    plain = predict_for_config(c, plan_, topology).step_time
    packed = predict_for_config(c, plan_, topology, boundary_codec="int8").step_time
    if packed > plain * (1 - CODEC_PROPOSAL_GAIN):
        return []
    from hetjax.units import seconds

    return [f"int8 pipeline boundaries (--config.pipeline.boundary_codec=int8): predicted step "
            f"{seconds(packed)} instead of {seconds(plain)} ({1 - packed / plain:.0%} faster); "
            f"activations and their gradients cross clusters as int8 with a scale per row "
            f"(loss over 300 steps: docs/diloco.md)"]


def plan_for_config(c, topology: Topology, options: CostOptions | None = None,
                    top: int = 5) -> PlanResult:
    """Plan for a hetjax config: degrees at 0 are chosen, fixed ones kept.

    Micro-batches: pipeline.microbatches (or train.microbatches when it is not the default 1,
    or when the layout is fixed) fixes M; otherwise the planner chooses. zero.preset 'auto'
    lets AMSP's enumeration choose; 'custom' uses zero.s_p / s_g / s_os; a name picks that
    point."""
    model = model_from_config(c, topology=topology)
    m = resolve_microbatches(c)
    layout_fixed = bool(c.parallel.pp and c.parallel.tp)  # then only ZeRO is left to choose
    fixed_m = c.pipeline.microbatches or (m if m != 1 or layout_fixed else 0)
    z = c.zero
    zero = ZeroFactors(z.s_p, z.s_g, z.s_os, "custom") if z.preset == "custom" else z.preset
    results = []
    for executor in _executors(c):
        opts = dataclasses.replace(options or options_from_config(c, topology),
                                   executor=PLAN_EXECUTORS[executor])
        r = plan(topology, model, c.train.batch_size, c.train.seq_len,
                 pp=c.parallel.pp, dp=c.parallel.dp, tp=c.parallel.tp, microbatches=fixed_m,
                 schedule=c.pipeline.schedule, zero=zero,
                 stage_layers=tuple(c.pipeline.stage_layers), options=opts, top=top,
                 allow_straddle=c.parallel.allow_straddle,
                 placement=c.pipeline.placement, ep=c.parallel.ep)
        results.append(_with_executor(r, executor))
    best = min(results, key=lambda r: r.plan.predicted["step_time_s"])
    if len(results) > 1:
        _note_executor_choice(best.plan, [r.plan for r in results])
    return best


def _executors(c) -> tuple[str, ...]:
    """The pipeline executors to consider: the configured one, or for 'auto' every one that
    can run the configured schedule."""
    if c.pipeline.executor != "auto":
        return (c.pipeline.executor,)
    return tuple(e for e in PLAN_EXECUTORS if runs_schedule(e, c.pipeline.schedule))


def _with_executor(result: PlanResult, executor: str) -> PlanResult:
    """A planner result whose plans name the executor they were priced for."""
    def named(p: Plan) -> Plan:
        return dataclasses.replace(p, executor=executor, predicted=p.predicted)

    return dataclasses.replace(result, plan=named(result.plan),
                               runners_up=tuple(named(p) for p in result.runners_up))


def _note_executor_choice(best: Plan, priced: list[Plan]) -> None:
    """Record in the chosen plan's predictions why its executor won."""
    times = ", ".join(f"{p.executor} {p.predicted['step_time_s']:.4g} s" for p in priced)
    best.predicted["executor_choice"] = f"{best.executor} (predicted step: {times})"


def _choose_executor(c, plan_: Plan, topology: Topology, options: CostOptions | None) -> Plan:
    """A fixed layout's executor name: the configured one, or for 'auto' the one the cost model
    predicts faster for this layout (a single-stage plan needs no pipeline executor). This is
    the planner pricing the registered executors (`hetjax.core.registry`); which executor object
    runs the Plan is `hetjax.parallel.executor.make_executor`'s choice alone."""
    if c.pipeline.executor != "auto":
        return dataclasses.replace(plan_, executor=c.pipeline.executor)
    if plan_.pp == 1:
        return plan_
    model = model_from_config(c, topology=topology)
    priced = []
    runnable = _executors(c)
    if not plan_.uniform:  # per-stage shapes: only the executors that run them
        runnable = [e for e in runnable if stage_shape_problem(e, plan_.pp, plan_.pp) is None]
        if len(runnable) == 1:  # nothing to compare it with
            return dataclasses.replace(plan_, executor=runnable[0])
    for executor in runnable:
        name = PLAN_EXECUTORS[executor]
        cm = CostModel(topology, model, dataclasses.replace(options or CostOptions(),
                                                            executor=name))
        p = dataclasses.replace(plan_, executor=executor, predicted={})
        p.predicted.update(cm.predict(p).as_dict())
        priced.append(p)
    best = min(priced, key=lambda p: p.predicted["step_time_s"])
    _note_executor_choice(best, priced)
    return best


def plan_from_config(c, topology: Topology) -> Plan:
    """The Plan for a config: the planner's choice when parallel.pp or parallel.tp is 0 (or
    only the ZeRO point, by AMSP's enumeration, when zero.preset is 'auto'), else the fixed
    layout (dp may be 0 = the rest; its recompute policy is model.remat's, the planner chooses
    one only when it searches). Raises PlanError for a layout that breaks the placement
    rules unless parallel.allow_straddle."""
    validate_layout(c, topology)
    ranks = usable_ranks(c, topology)
    shapes = stage_shapes_of(c, len(ranks))
    if searches_layout(c):
        return plan_for_config(c, topology).plan
    n = len(ranks)
    p = c.parallel
    pp = p.pp or len(shapes) or (len(c.pipeline.stage_layers) if c.pipeline.stage_layers else 1)
    tp = shapes[0][1] if shapes else p.tp or 1
    dp = shapes[0][0] if shapes else p.dp or n // (pp * tp)
    mb = resolve_microbatches(c)
    raise_first(layout_problems(pp=pp, dp=dp, tp=tp, devices=n, topology_name=topology.name,
                                microbatches=mb, global_batch=c.train.batch_size,
                                stage_shapes=shapes, ep=p.ep or 1), ConfigError)
    stage_layers = tuple(c.pipeline.stage_layers) or even_split(c.model.n_layers, pp)
    plan_ = Plan(pp=pp, dp=dp, tp=tp, stage_layers=stage_layers, microbatches=mb,
                 global_batch=c.train.batch_size, seq_len=c.train.seq_len,
                 schedule=c.pipeline.schedule, zero=ZeroFactors(), source="config",
                 placement=c.pipeline.placement if pp > 1 else "looped",
                 device_order=tuple(ranks), stage_shapes=shapes, ep=p.ep or 1)
    if not p.allow_straddle:  # the search keeps this rule; a fixed layout must too
        refuse_straddle(placement_problems(plan_, topology))
    # The ZeRO factors depend on dp and on where the plan puts each replica (node rules).
    plan_ = dataclasses.replace(plan_, zero=zr.factors_from_config(c.zero, plan_, topology))
    plan_ = _choose_executor(c, plan_, topology, None)
    if len(ranks) < topology.num_devices:  # why each device is idle (describe() shows it)
        plan_.predicted[UNUSED_KEY] = {str(r): "left out by parallel.exclude"
                                       for r in plan_.unused_ranks(topology)}
    return plan_

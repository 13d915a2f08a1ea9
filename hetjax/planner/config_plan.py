"""Config -> (model, Plan, runners-up): the one path every entry point takes.

`plan_job(config, topology)` is what `hetjax plan`, `hetjax train` (the Trainer), `hetjax
launch` and the notebooks call. It resolves the config's aliases (`resolve_microbatches`),
checks the fixed degrees against the topology once (`validate_layout`), builds the model the
Trainer builds (`model_from_config`: the configured tokenizer's vocabulary, the compute dtype
of the topology, the recompute policy the plan chose) and either searches (`hetjax.planner.
search.plan`, every executor the config allows; degrees at 0 or any SEARCHED field left to
the planner) or completes the layout the config fixes (dp = the rest, an even layer split, the
ZeRO point, the same placement and ZeRO rules the search keeps: hetjax/planner/placement.py,
hetjax/planner/zero_factors.py) and prices it. So every command accepts and refuses the same
layouts with the same messages, and prices the model it trains.

Searched defaults: when the layout is searched (parallel.pp or parallel.tp at 0) the config
loader leaves every SEARCHED field the user did not set to the planner (`free_unset`); a field
the user set stays fixed, and `plan_job(..., explain=True)` says what freeing it would give.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetjax.errors import ConfigError, HetjaxError
from hetjax.core.plan import (UNUSED_KEY, Plan, ZeroFactors, even_split, layout_problems,
                              raise_first, stage_shape_problem, vocab_shards)
from hetjax.core.schedules import SCHEDULES
from hetjax.planner import zero_factors as zr
from hetjax.planner.cost import PLAN_EXECUTORS, CostModel, CostOptions, runs_schedule
from hetjax.planner.placement import placement_problems, refuse_straddle
from hetjax.planner.search import TIE, BelowNothing, PlanResult, layout_key, plan
from hetjax.core.topology import Topology
from hetjax.units import seconds

if TYPE_CHECKING:
    from hetjax.core.model_config import ModelConfig

# The fields the planner chooses when they are left to it, and the value that leaves them:
# when the layout is searched, the config loader sets each one the user did not set to it.
SEARCHED = {"pipeline.executor": "auto", "pipeline.schedule": "auto",
            "pipeline.placement": "auto", "train.microbatches": 0, "model.remat": "auto",
            "zero.preset": "auto"}


def _get(c, field: str):
    section, name = field.split(".")
    return c[section][name]


def _set(c, field: str, value) -> None:
    section, name = field.split(".")
    c[section][name] = value


def layout_searched(c) -> bool:
    """Whether the planner chooses the degrees (parallel.pp or parallel.tp at 0, and no
    per-stage degrees: parallel.stage_dp / stage_tp fix them)."""
    p = c.parallel
    if p.get("stage_dp", ()) or p.get("stage_tp", ()):
        return False
    return not p.pp or not p.tp


def free_unset(c, user_set) -> None:
    """When the layout is searched, leave every SEARCHED field the user did not set (a dotted
    name in `user_set`) to the planner, so nothing is inherited from a
    default the user did not choose (the default job's micro-batch count fits its own
    topology only). A fixed layout keeps every value: the default job stays as it is."""
    if not layout_searched(c):
        return
    for field, auto in SEARCHED.items():  # an alias set alone gives the value (resolved later)
        if field not in user_set:
            _set(c, field, auto)


def resolve_microbatches(c) -> int:
    """train.microbatches, or pipeline.microbatches if the user set that alias instead
    (0: the planner chooses). The one place the alias is read."""
    pm, tm = c.pipeline.microbatches, c.train.microbatches
    if pm and tm not in (0, 1, pm):
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


def model_from_config(c, topology: Topology | None = None, plan_: Plan | None = None,
                      shards: int = 0) -> "ModelConfig":
    """The ModelConfig a config trains, as the Trainer builds it: model.vocab_size, or when it
    is 0 the configured tokenizer's vocabulary (data.tokenizer) padded to a multiple of 128;
    the embedding and head padded for `shards`-way tensor parallelism (default: `plan_`'s,
    `vocab_shards`); model.dtype 'auto' resolved on `topology` (Topology.
    default_compute_dtype; without one, float32); the recompute policy `plan_` chose, when it
    chose one."""
    from hetjax.core.model_config import ModelConfig
    from hetjax.tokenizer import load_tokenizer, padded_vocab

    vocab = c.model.vocab_size or padded_vocab(load_tokenizer(c.data.tokenizer,
                                                              c.data.add_bos).vocab_size)
    shards = shards or (vocab_shards(plan_) if plan_ is not None else 1)
    model = ModelConfig.from_config(c.model, vocab, shards)
    if c.model.dtype == "auto" and topology is not None:
        model = dataclasses.replace(model, dtype=topology.default_compute_dtype)
    if plan_ is not None and plan_.remat:
        model = dataclasses.replace(model, remat=plan_.remat)
    return model


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
    return CostModel(topology, model_from_config(c, topology), options).predict(plan_)


# Below this predicted gain `hetjax plan` does not propose int8 pipeline boundaries.
CODEC_PROPOSAL_GAIN = 0.02


def boundary_codec_lines(c, plan_: Plan, topology: Topology) -> list[str]:
    """What `hetjax plan` adds for an MPMD pipeline whose stage boundaries cross clusters with
    uncompressed activations: the step priced with int8 boundaries
    (`pipeline.boundary_codec=int8`, which compresses only boundaries between clusters), when
    that is at least CODEC_PROPOSAL_GAIN faster -- slow inter-cluster links."""
    if (plan_.executor != "mpmd" or plan_.pp < 2 or c.pipeline.boundary_codec != "none"
            or "step_time_s" not in plan_.predicted):  # a plan the cost model did not price
        return []
    plain = predict_for_config(c, plan_, topology).step_time
    packed = predict_for_config(c, plan_, topology, boundary_codec="int8").step_time
    if packed > plain * (1 - CODEC_PROPOSAL_GAIN):
        return []
    return [f"int8 pipeline boundaries (--config.pipeline.boundary_codec=int8): predicted step "
            f"{seconds(packed)} instead of {seconds(plain)} ({1 - packed / plain:.0%} faster); "
            f"activations and their gradients cross clusters as int8 with a scale per row "
            f"(loss over 300 steps: docs/diloco.md)"]


@dataclass(frozen=True)
class JobPlan:
    """What a config trains on a topology: the model (as the Trainer builds it), the Plan (with
    its prediction), the runners-up (distinct layouts, when the planner searched), and with
    `explain` what freeing each field the user fixed would give (`fixed_lines`)."""

    model: "ModelConfig"
    plan: Plan
    runners_up: tuple[Plan, ...] = ()
    search: PlanResult | None = None  # what the search did, when it ran
    fixed_lines: tuple[str, ...] = ()
    # with `explain`: the step's parts (hetjax/planner/breakdown.py) and one line per what-if
    breakdown: dict = dataclasses.field(default_factory=dict)
    what_if_lines: tuple[str, ...] = ()

    def describe(self, topology: Topology) -> str:
        return self.search.describe(topology) if self.search else self.plan.describe(topology)


def searches_layout(c) -> bool:
    """Whether the config leaves anything to the planner's search: degrees at 0, or a SEARCHED
    field left to it (an executor alone is priced per layout; model.remat 'auto' on a fixed
    layout is the model's policy, `effective_remat`). Per-stage degrees (parallel.stage_dp /
    stage_tp) fix the layout."""
    p = c.parallel
    if p.get("stage_dp", ()) or p.get("stage_tp", ()):
        return False
    return (layout_searched(c) or not resolve_microbatches(c)
            or any(_get(c, f) == "auto"
                   for f in ("pipeline.schedule", "pipeline.placement", "zero.preset"))
            or (p.get("ep", 1) == 0 and c.model.n_experts > 0))


def plan_job(c, topology: Topology, *, explain: bool = False, top: int = 5,
             options: CostOptions | None = None) -> JobPlan:
    """The model, Plan and runners-up for config `c` on `topology` (see the module doc).
    `explain`: also price what freeing each field the user fixed would give (`fixed_lines`,
    one search each)."""
    validate_layout(c, topology)
    model = model_from_config(c, topology)
    options = options or options_from_config(c, topology)
    if searches_layout(c) and len(usable_ranks(c, topology)) < topology.num_devices:
        raise ConfigError("parallel.exclude", "leaves devices out of a layout the planner "
                          "searches", "fix the layout too (parallel.pp and parallel.tp, or "
                          "parallel.stage_dp / stage_tp), or leave parallel.exclude empty "
                          "(the planner leaves devices out itself when that is faster)")
    result = _search(c, topology, model, options, top) if searches_layout(c) else None
    best = result.plan if result else _fixed(c, topology, model, options)
    job = JobPlan(model_from_config(c, topology, best), best,
                  result.runners_up if result else (), result)
    if not explain or "step_time_s" not in best.predicted:  # (an unpriced fixed layout)
        return job
    from hetjax.planner.breakdown import step_breakdown, what_ifs

    cm = CostModel(topology, model, dataclasses.replace(
        options, executor=PLAN_EXECUTORS[best.executor]))
    step = best.predicted["step_time_s"]
    what_if = []
    # the config's own planner on each changed topology, keeping the chosen plan's schedule,
    # placement and recompute policy (a search over every layout, executor, micro-batch count
    # and ZeRO point; a fraction of the full one's time)
    kept = copy.deepcopy(c)
    kept.pipeline.schedule, kept.pipeline.placement = best.schedule, best.placement
    kept.model.remat = best.remat or c.model.remat
    for w in what_ifs(topology):
        try:
            other = _plan_on(kept, w.topology, options, top=1)
        except HetjaxError as e:
            what_if.append(f"{w.label}: {e}")
            continue
        t = other.predicted["step_time_s"]
        what_if.append(f"{w.label}: step {seconds(t)} ({_layout(other)}; now {seconds(step)})")
    parts = step_breakdown(cm, best)
    best.predicted["breakdown_s"] = parts  # in the JSON too
    return dataclasses.replace(job, fixed_lines=tuple(_fixed_lines(c, topology, best, options)),
                               breakdown=parts, what_if_lines=tuple(what_if))


def _plan_on(c, topology: Topology, options: CostOptions, top: int) -> Plan:
    """The plan the config gets on `topology` (searched or fixed), with `options`' measured
    rates and memory margin."""
    model = model_from_config(c, topology)
    if searches_layout(c):
        return _search(c, topology, model, options, top, what_if=True).plan
    return _fixed(c, topology, model, options)


def plan_from_config(c, topology: Topology) -> Plan:
    """The Plan for a config (`plan_job(c, topology).plan`). Raises PlanError for a layout
    that breaks the placement rules unless parallel.allow_straddle."""
    return plan_job(c, topology).plan


def _executors(c) -> tuple[str, ...]:
    """The pipeline executors to consider: the configured one, or for 'auto' every one that
    can run the configured schedule (every one when the schedule is searched too)."""
    if c.pipeline.executor != "auto":
        return (c.pipeline.executor,)
    return tuple(e for e in PLAN_EXECUTORS if c.pipeline.schedule == "auto"
                 or runs_schedule(e, c.pipeline.schedule))


def _zero(c):
    z = c.zero
    return ZeroFactors(z.s_p, z.s_g, z.s_os, "custom") if z.preset == "custom" else z.preset


def _search(c, topology: Topology, model, options: CostOptions, top: int,
            what_if: bool = False) -> PlanResult:
    """The planner's search under every executor the config allows; the best plan and the
    best distinct layouts after it (`layout_key`: degrees, executor, devices). `what_if`: a
    search asked beside the plan (a changed topology, a field left free), without DT-FM's
    assignment, which costs seconds per layout on topologies of many sites."""
    results, ceiling, skipped = [], math.inf, {}
    schedule = SCHEDULES if c.pipeline.schedule == "auto" else c.pipeline.schedule
    # the MPMD executor first: its asynchronous stages mostly price faster, and each search
    # skips what cannot beat the top found so far
    for executor in sorted(_executors(c), key=lambda e: e != "mpmd"):
        opts = dataclasses.replace(options, executor=PLAN_EXECUTORS[executor])
        try:
            r = plan(topology, model, c.train.batch_size, c.train.seq_len,
                     pp=c.parallel.pp, dp=c.parallel.dp, tp=c.parallel.tp,
                     microbatches=resolve_microbatches(c), schedule=schedule, zero=_zero(c),
                     stage_layers=tuple(c.pipeline.stage_layers), options=opts, top=top,
                     allow_straddle=c.parallel.allow_straddle,
                     placement=c.pipeline.placement, distinct=True, subsets=True,
                     stage_degrees=True, ceiling=ceiling, ep=c.parallel.ep,
                     network_aware=False if what_if else None)
        except BelowNothing:
            skipped[executor] = ceiling
            continue
        results.append(_with_executor(r, executor))
        steps = sorted(p.predicted["step_time_s"] for q in results
                       for p in (q.plan, *q.runners_up))
        if len(steps) >= top:
            ceiling = steps[top - 1]
    return merge_results(results, top, skipped)


def merge_results(results: list[PlanResult], top: int,
                  skipped: dict[str, float] | None = None) -> PlanResult:
    """One result from searches over different executors: the fastest plan (a simpler one
    first within TIE, as the search ranks), then the fastest plan of each other distinct
    layout, `top` in all; their counts summed. `skipped`: executors whose search found nothing
    faster than the given step."""
    plans = sorted((p for r in results for p in (r.plan, *r.runners_up)),
                   key=lambda p: p.predicted["step_time_s"])
    fastest = plans[0].predicted["step_time_s"]
    firsts = [r.plan for r in results]
    best = min(firsts, key=lambda p: (p.predicted["step_time_s"] > fastest * (1 + TIE),
                                      p.predicted["step_time_s"]))
    if len(results) + len(skipped or {}) > 1:
        _note_executor_choice(best, firsts, skipped or {})
    seen, ranked = {layout_key(best)}, [best]
    for p in plans:
        if layout_key(p) not in seen and len(ranked) < top:
            seen.add(layout_key(p))
            ranked.append(p)
    main = next(r for r in results if r.plan is best)
    return dataclasses.replace(
        main, plan=best, runners_up=tuple(ranked[1:]),
        candidates=sum(r.candidates for r in results),
        simulated=sum(r.simulated for r in results), seconds=sum(r.seconds for r in results),
        pruned=sum(r.pruned for r in results))


def _with_executor(result: PlanResult, executor: str) -> PlanResult:
    """A planner result whose plans name the executor they were priced for."""
    def named(p: Plan) -> Plan:
        return dataclasses.replace(p, executor=executor, predicted=p.predicted)

    return dataclasses.replace(result, plan=named(result.plan),
                               runners_up=tuple(named(p) for p in result.runners_up))


def _note_executor_choice(best: Plan, priced: list[Plan],
                          skipped: dict[str, float] | None = None) -> None:
    """Record in the chosen plan's predictions why its executor won."""
    times = ", ".join([f"{p.executor} {p.predicted['step_time_s']:.4g} s" for p in priced]
                      + [f"{e} none under {t:.4g} s" for e, t in (skipped or {}).items()])
    best.predicted["executor_choice"] = f"{best.executor} (predicted step: {times})"


def _fixed(c, topology: Topology, model, options: CostOptions) -> Plan:
    """The layout the config fixes, completed (dp = the rest, an even split, the ZeRO point;
    the devices less parallel.exclude; each stage's (dp, tp) when parallel.stage_dp / stage_tp
    give them) and checked by the rules the search keeps; its recompute policy is
    model.remat's. Its executor is the configured one, or for 'auto' the one the cost model
    predicts faster for this layout (a single-stage plan needs no pipeline executor; stages
    of different shapes only the executors that run them). Priced, when its stages share one
    (dp, tp) shape (the cost model prices no other)."""
    ranks = usable_ranks(c, topology)
    shapes = stage_shapes_of(c, len(ranks))
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
    if len(ranks) < topology.num_devices:  # why each device is idle (describe() shows it)
        plan_.predicted[UNUSED_KEY] = {str(r): "left out by parallel.exclude"
                                       for r in plan_.unused_ranks(topology)}
    executors = _executors(c) if plan_.pp > 1 else (c.pipeline.executor,)
    if not plan_.uniform:  # per-stage shapes: only the executors that run them, unpriced
        runnable = [e for e in executors
                    if e == "auto" or stage_shape_problem(e, plan_.pp, plan_.pp) is None]
        return dataclasses.replace(plan_, executor=(runnable or executors)[0])
    priced = []
    for executor in executors:
        named = executor if executor != "auto" else plan_.executor
        p_ = dataclasses.replace(plan_, executor=named, predicted=dict(plan_.predicted))
        cm = CostModel(topology, model, dataclasses.replace(
            options, executor=PLAN_EXECUTORS[named]))
        p_.predicted.update(cm.predict(p_).as_dict())
        priced.append(p_)
    best = min(priced, key=lambda p: p.predicted["step_time_s"])
    if len(priced) > 1:
        _note_executor_choice(best, priced)
    return best


def _fixed_lines(c, topology: Topology, best: Plan, options: CostOptions) -> list[str]:
    """When the layout is searched: for each SEARCHED field the user fixed, the plan the
    search finds with it left free, when that is predicted faster (beyond TIE): "executor=spmd
    is fixed; auto would pick mpmd: 15.6 s instead of 67.2 s (--config.pipeline.executor=auto)"."""
    if not layout_searched(c):
        return []
    step = best.predicted["step_time_s"]
    lines = []
    for field, auto in SEARCHED.items():
        value = resolve_microbatches(c) if field == "train.microbatches" else _get(c, field)
        if value == auto:
            continue
        free = copy.deepcopy(c)
        _set(free, field, auto)
        if field == "train.microbatches":
            free.pipeline.microbatches = 0
        try:
            other = _search(free, topology, model_from_config(free, topology), options, 1,
                            what_if=True).plan
        except HetjaxError:  # nothing fits even with it free: say nothing
            continue
        t = other.predicted["step_time_s"]
        if t >= step * (1 - TIE):
            continue
        name = field.split(".")[1]
        chosen = {"executor": other.executor, "schedule": other.schedule,
                  "placement": other.placement, "microbatches": other.microbatches,
                  "remat": other.remat or "the model's", "preset": other.zero.name}[name]
        lines.append(f"{name}={value} is fixed; auto would pick {name}={chosen} "
                     f"({_layout(other)}): step {seconds(t)} instead of {seconds(step)} "
                     f"(--config.{field}={auto})")
    return lines


def _layout(p: Plan) -> str:
    return (f"pp={p.pp} dp={p.dp} tp={p.tp}" + (f" {p.executor}" if p.pp > 1 else "")
            + f" M={p.microbatches}")

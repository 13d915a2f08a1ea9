"""The outer search, its errors, and how the rest of hetjax uses it (config, CLI, display)."""

import dataclasses
import itertools
import json
import os
import subprocess
import sys

import pytest

from hetjax.config import base_config, build_topology
from hetjax.errors import PlanError
from hetjax.core.plan import Plan
from hetjax.planner import (CostModel, CostOptions, model_from_config, placement_problems,
                            plan, plan_from_config, predict)
from hetjax.core.topology import ClusterLink, Link, Topology, make_cluster, preset
from hetjax.core.model_config import ModelConfig
from hetjax.parallel.mesh import mesh_shape

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpt(**kw) -> ModelConfig:
    base = dict(vocab_size=50304, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=16,
                d_ff=5632, max_seq_len=2048, remat="full", dtype="bfloat16",
                param_dtype="bfloat16")
    return ModelConfig(**{**base, **kw})


def cpu_config(**fields):
    c = base_config()
    for key, value in fields.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


def assert_runnable(p: Plan, c, topology: Topology) -> None:
    """What the trainer needs from a plan on the CPU default."""
    m = c.model
    assert p.pp * p.dp * p.tp == topology.num_devices
    assert sorted(p.device_order) == list(range(topology.num_devices))
    for v in (m.n_heads, m.n_kv_heads, m.d_ff, topology.clusters[0].devices_per_node):
        assert v % p.tp == 0
    assert c.train.batch_size % p.microbatches == 0 and p.microbatch_size % p.dp == 0
    assert min(p.stage_layers) >= 1 and sum(p.stage_layers) == m.n_layers
    assert placement_problems(p, topology) == []
    mesh_shape(p)
    assert Plan.from_json(p.to_json()) == p


# --- the planner on the CPU default ---------------------------------------------------------------
def test_config_with_pp_zero_gets_a_runnable_planned_layout():
    c = cpu_config(**{"parallel.pp": 0})
    topology = build_topology(c)
    p = plan_from_config(c, topology)
    assert p.source == "planner"
    assert_runnable(p, c, topology)
    for key in ("step_time_s", "tokens_per_s", "mfu", "bubble", "stage_memory_gib"):
        assert key in p.predicted
    assert json.loads(p.to_json())["predicted"]["step_time_s"] > 0


@pytest.mark.parametrize("fields", [{"parallel.tp": 0}, {"parallel.pp": 0, "parallel.tp": 0},
                                    {"parallel.pp": 0, "train.batch_size": 24},
                                    {"parallel.pp": 0, "pipeline.schedule": "gpipe",
                                     "zero.preset": "auto"}])
def test_other_automatic_configs_are_runnable(fields):
    c = cpu_config(**fields)
    topology = build_topology(c)
    p = plan_from_config(c, topology)
    assert_runnable(p, c, topology)
    assert p.schedule == c.pipeline.schedule


def test_fixed_degrees_keep_todays_layout():
    c = cpu_config(**{"parallel.pp": 2, "parallel.tp": 1})
    p = plan_from_config(c, build_topology(c))
    assert (p.source, p.pp, p.dp, p.stage_layers) == ("config", 2, 4, (2, 2))
    assert p.device_order == tuple(range(8)) and p.predicted["step_time_s"] > 0  # priced


def test_fixed_choices_are_honoured():
    c = cpu_config(**{"parallel.pp": 0, "pipeline.microbatches": 4, "zero.preset": "zero1",
                      "pipeline.stage_layers": (3, 1)})
    p = plan_from_config(c, build_topology(c))
    assert (p.pp, p.microbatches, p.zero.name, p.stage_layers) == (2, 4, "zero1", (3, 1))


def test_runners_up_are_ranked_by_predicted_step_time():
    c = cpu_config()
    result = plan(build_topology(c), model_from_config(c), 32, 128, top=6)
    times = [p.predicted["step_time_s"] for p in (result.plan, *result.runners_up)]
    assert times == sorted(times) and len(times) == 6
    assert result.simulated <= result.candidates


# --- choices the papers motivate ------------------------------------------------------------------
def test_pipelined_hybrid_keeps_data_parallelism_inside_each_cluster():
    t = preset("holmes_hybrid")
    p = plan(t, gpt(), 512, 2048, pp=2, tp=1).plan
    for s in range(2):
        assert len({t.devices[r].cluster for r in p.stage_ranks(s)}) == 1
    assert "ethernet" not in p.predicted["dp_links"]
    assert p.predicted["pp_links"] == ["ethernet"]


def test_faster_accelerators_get_more_layers():
    t = Topology("mix", (make_cluster("v", 1, 8, "v100", "roce"),
                         make_cluster("a", 1, 8, "a100", "infiniband")),
                 Link("ethernet", 100.0, 50.0))
    p = plan(t, gpt(), 256, 2048, pp=2, tp=1, schedule="1f1b").plan
    on_a100 = [s for s in range(2) if t.devices[p.stage_ranks(s)[0]].cluster == 1][0]
    assert p.stage_layers[on_a100] > 12


def test_slow_uneven_network_uses_the_dtfm_assignment():
    t = preset("dtfm_datacenter_ondemand")
    m = gpt()
    # Stages across instances (DP over the slow links, PP inside the fast ones) break the
    # placement rule, so they are only considered when straddling is allowed.
    kw = dict(pp=8, tp=1, microbatches=64, schedule="1f1b", zero="ddp")
    assert plan(t, m, 512, 2048, **kw).plan.predicted["layout"] == "rank order"
    result = plan(t, m, 512, 2048, allow_straddle=True, **kw)
    assert result.plan.predicted["layout"] == "DT-FM assignment"
    rank_order = Plan(pp=8, dp=8, tp=1, stage_layers=(3,) * 8, microbatches=64,
                      global_batch=512, seq_len=2048)
    assert result.plan.predicted["step_time_s"] < 0.5 * predict(rank_order, t, m).step_time


# --- infeasible requests --------------------------------------------------------------------------
def test_disconnected_cluster_is_refused():
    t = Topology("islands", (make_cluster("a", 1, 4, "a100", "infiniband"),
                             make_cluster("b", 1, 4, "a100", "infiniband"),
                             make_cluster("c", 1, 4, "a100", "infiniband")),
                 inter_cluster=None,
                 cluster_links=(ClusterLink("a", "b", Link("ethernet", 10.0, 100.0)),))
    with pytest.raises(PlanError, match=r"not connected: cluster\(s\) \['c'\].*ClusterLink"):
        plan(t, gpt(), 64, 2048)


def test_model_too_large_names_memory_and_the_nearest_change():
    with pytest.raises(PlanError) as err:
        plan(preset("cpu_hybrid"), gpt(n_layers=48, d_model=4096, n_heads=32, n_kv_heads=32,
                                       d_ff=11008), 32, 2048)
    msg = str(err.value)
    assert "binding constraint: device memory" in msg
    assert "GiB" in msg and "Nearest feasible change" in msg and "devices" in msg


def test_more_stages_than_devices_is_refused():
    with pytest.raises(PlanError, match="pp = 16 pipeline stages need at least 16 devices"):
        plan(preset("cpu_hybrid"), gpt(), 32, 128, pp=16)


def test_tensor_parallel_degree_must_fit_heads_and_nodes():
    with pytest.raises(PlanError, match=r"tp = 4 must divide.*nearest feasible: tp in \[1, 2\]"):
        plan(preset("cpu_hybrid"), gpt(), 32, 128, tp=4)


def test_batch_that_cannot_split_over_data_parallel_devices_is_refused():
    small = gpt(n_layers=4, d_model=256, n_heads=4, n_kv_heads=4, d_ff=512)
    with pytest.raises(PlanError, match="global batch 3 does not split into micro-batches"):
        plan(preset("cpu_single"), small, 3, 128, pp=1)


# --- display, CLI, imports ------------------------------------------------------------------------
def test_plan_renders_as_a_table():
    c = cpu_config(**{"parallel.pp": 0})
    topology = build_topology(c)
    p = dataclasses.replace(plan_from_config(c, topology), stage_layers=(4,))
    html = p._repr_html_()
    assert "<table>" in html and "time/micro-batch" in html and "tokens/s" in html
    text = p.describe(topology)
    assert "dp groups" in text and "predicted (rank order): step" in text


def run_cli(monkeypatch, *args: str) -> int:
    from hetjax.cli import main

    argv = ["hetjax", *args]
    monkeypatch.setattr(sys, "argv", argv)  # ml_collections reads overrides from sys.argv
    return main(argv)


def test_cli_plan_prints_writes_json_and_plots(tmp_path, capsys, monkeypatch):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = run_cli(monkeypatch, "plan", "--config.parallel.pp=0", "--json", str(out_json),
                 f"--plot={out_png}")
    assert rc == 0
    printed = capsys.readouterr().out
    assert "plan (planner)" in printed and "predicted (rank order): step" in printed
    assert Plan.from_json(out_json.read_text()).source == "planner"
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_plan_prices_a_fixed_layout_and_reports_bad_flags(capsys, monkeypatch):
    # (without --config the layout is searched: a fixed one names both degrees)
    assert run_cli(monkeypatch, "plan", "--config.parallel.pp=2", "--config.parallel.tp=2") == 0
    assert "plan (config)" in capsys.readouterr().out
    assert run_cli(monkeypatch, "plan", "--json") == 2
    assert "--json needs a value" in capsys.readouterr().err


def test_planner_does_not_import_jax():
    code = ("import sys, hetjax.planner, hetjax.planner.search, hetjax.planner.assign; "
            "assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": REPO})


def test_missing_link_is_routed_around():
    """a - b - c in a line (no a - c link): a Megatron pipeline puts b in the middle; hetjax's
    executor sums shared gradients around the ring of stages, which needs c - a too."""
    link = Link("ethernet", 10.0, 100.0)
    t = Topology("line", tuple(make_cluster(n, 1, 4, "a100", "infiniband") for n in "abc"),
                 inter_cluster=None,
                 cluster_links=(ClusterLink("a", "b", link), ClusterLink("b", "c", link)))
    m = gpt(n_layers=6, tie_embeddings=False)
    megatron = CostOptions(executor="megatron")
    p = plan(t, m, 48, 2048, pp=3, options=megatron).plan
    middle = {t.devices[r].cluster for r in p.stage_ranks(1)}
    assert middle == {1}
    wrong_order = Plan(pp=3, dp=4, tp=1, stage_layers=(2, 2, 2), microbatches=4,
                       global_batch=48, seq_len=2048,
                       device_order=(*range(4), *range(8, 12), *range(4, 8)))
    with pytest.raises(PlanError, match="no link between clusters 'a' and 'c'"):
        predict(wrong_order, t, m, megatron)
    with pytest.raises(PlanError, match=r"pp=3 .*no link between clusters 'a' and 'c'"):
        plan(t, m, 48, 2048, pp=3)


def test_a_fixed_layout_that_does_not_fit_is_flagged():
    t = preset("cpu_single")
    p = Plan(pp=1, dp=8, tp=1, stage_layers=(24,), microbatches=1, global_batch=8,
             seq_len=2048)
    pred = predict(p, t, gpt())
    assert not pred.fits and pred.as_dict()["fits"] is False
    shown = dataclasses.replace(p, predicted=pred.as_dict()).describe(t)
    assert "DOES NOT FIT" in shown


# --- ranking by predicted step time, the memory margin, what bound each choice ----------------
def _holmes_pp2(fraction):
    from hetjax.planner.reference_runs import holmes_model

    from hetjax.planner.memory import RuntimeReserve

    # no runtime reserve: the margin alone decides what is usable
    return plan(preset("holmes_infiniband"), holmes_model(), 768, 2048, pp=2, tp=1,
                schedule="gpipe", options=CostOptions(memory_fraction=fraction,
                                                      reserve={"a100": RuntimeReserve()}))


def test_zero_point_is_the_fastest_predicted_step_not_the_least_traffic():
    from hetjax.planner.reference_runs import holmes_model

    best = _holmes_pp2(0.9).plan
    assert best.predicted["bound"]["zero"].startswith("time:")
    # Every other ZeRO point, fixed, is predicted no faster at the same M.
    for name in ("ddp", "zero1", "zero2", "zero3", "mics"):
        other = plan(preset("holmes_infiniband"), holmes_model(), 768, 2048, pp=2, tp=1,
                     schedule="gpipe", zero=name, microbatches=best.microbatches).plan
        assert other.predicted["step_time_s"] >= best.predicted["step_time_s"] * (1 - 1e-9)


def test_memory_margin_binds_the_zero_choice_and_says_so():
    roomy, tight = _holmes_pp2(0.9).plan, _holmes_pp2(0.2).plan
    assert tight.zero != roomy.zero
    why = tight.predicted["bound"]["zero"]
    assert why.startswith(f"memory: {roomy.zero.name} would be") and "usable" in why
    assert max(tight.predicted["stage_memory_gib"]) <= 0.2 * 80
    assert tight.predicted["step_time_s"] > roomy.predicted["step_time_s"]


def test_memory_margin_from_the_config_reaches_the_cost_options():
    from hetjax.planner import options_from_config

    c = base_config()
    assert options_from_config(c).memory_fraction == pytest.approx(0.9)
    c.planner.memory_margin = 0.25
    assert options_from_config(c).memory_fraction == pytest.approx(0.75)


def test_amsp_setting_llama13b_on_1024_a800_chooses_a_zero_point_and_says_why():
    """scripts/bench/planner.py amsp, the 13B row: ZeRO-only data parallelism over 1,024
    devices; plain DDP cannot hold 16 bytes per parameter, so it is among the points that do
    not fit, and the chosen one fits with the runtime's reserve and the margin kept aside."""
    from hetjax.planner.reference_runs import amsp_plan

    best = amsp_plan("13B", 200.0)
    assert best.dp == 1024 and best.zero.name != "ddp"
    pr = best.predicted
    assert max(pr["stage_memory_gib"]) <= max(pr["stage_capacity_gib"])
    # with the runtime's reserve the device holds no more than 90% of its memory
    holds = max(pr["stage_memory_gib"]) + max(pr["stage_reserve_gib"])
    assert holds <= 0.9 * 80
    assert pr["bound"]["zero"].startswith("time: the fastest predicted")
    assert "more do not" in pr["bound"]["zero"]  # ddp among them


def test_layout_bound_names_the_faster_layout_memory_refused():
    """With 19% of an A100's memory usable, a faster layout (fewer micro-batches) exists but
    does not fit: the plan says memory bound its layout; with 90%, time did."""
    from hetjax.planner.reference_runs import holmes_model

    def bound(fraction):
        return plan(preset("holmes_infiniband"), holmes_model(), 768, 2048, tp=1,
                    schedule="1f1b", options=CostOptions(memory_fraction=fraction)
                    ).plan.predicted["bound"]

    assert bound(0.9)["layout"].startswith("time: the fastest predicted")
    tight = bound(0.19)["layout"]
    assert tight.startswith("memory: pp=") and "usable" in tight


# --- the recompute policy as a choice (model.remat = 'auto') ----------------------------------
def _remat_choice(batch, microbatches, fraction, executor="mpmd"):
    from hetjax.planner.reference_runs import holmes_model

    from hetjax.planner.memory import RuntimeReserve

    model = dataclasses.replace(holmes_model(), remat="auto")
    # no runtime reserve: the margin alone decides what is usable
    return plan(preset("holmes_infiniband"), model, batch, 2048, pp=2, tp=1,
                microbatches=microbatches, zero="ddp", schedule="1f1b",
                options=CostOptions(memory_fraction=fraction, executor=executor,
                                    reserve={"a100": RuntimeReserve()})).plan


def test_remat_auto_keeps_every_residual_when_memory_is_ample():
    p = _remat_choice(256, 16, 0.9)
    assert p.remat == "none" and p.executor == "mpmd"  # the plan names what it was priced for
    assert p.predicted["bound"]["remat"].startswith("time: the fastest predicted")
    assert "remat=none" in p.header()


def test_remat_auto_offers_the_spmd_pipeline_full_recompute_alone():
    # Where MPMD keeps every residual (above), the SPMD pipeline, whose stash copies under
    # none / dots the model does not price, recomputes every layer, and says why.
    p = _remat_choice(256, 16, 0.9, executor="spmd")
    assert p.remat == "full"
    assert p.predicted["bound"]["remat"].startswith("executor: the SPMD pipeline")
    from hetjax.planner.reference_runs import holmes_model

    cm = CostModel(preset("holmes_infiniband"), holmes_model(), CostOptions(executor="spmd"))
    assert cm.remat_choices(2) == ("full",)
    assert cm.remat_choices(1) == ("none", "dots", "full")  # no pipeline: nothing stashed


def test_remat_auto_recomputes_every_layer_when_memory_forces_it():
    p = _remat_choice(768, 8, 0.5)
    assert p.remat == "full"
    why = p.predicted["bound"]["remat"]
    assert why.startswith("memory: remat=none would be") and "usable" in why
    assert max(p.predicted["stage_memory_gib"]) <= 0.5 * 80
    # a fixed model.remat is not a choice
    from hetjax.planner.reference_runs import holmes_model

    fixed = plan(preset("holmes_infiniband"), holmes_model(), 256, 2048, pp=2, tp=1,
                 microbatches=16, zero="ddp", schedule="1f1b").plan
    assert fixed.remat == "" and "remat" not in fixed.predicted["bound"]


def test_explain_weighs_only_runnable_schedule_alternatives():
    """The interleaved schedule needs M to be a multiple of pp: explain's alternatives skip
    the others (a 70B plan on 4,096 A100s priced by kind chose pp = 32 interleaved, and its
    M = 1 alternative stopped the search)."""
    from hetjax.planner.search import _schedule_runs

    assert not _schedule_runs("interleaved", 32, 1)
    assert _schedule_runs("interleaved", 4, 8) and _schedule_runs("1f1b", 32, 1)


# --- the search's speed-ups keep its answers -----------------------------------------------------
def _signature(result):
    return [(p.pp, p.dp, p.tp, p.microbatches, p.schedule, p.placement, p.remat, p.zero,
             p.stage_layers, p.device_order, p.predicted["step_time_s"])
            for p in (result.plan, *result.runners_up)]


@pytest.mark.parametrize("executor", ["spmd", pytest.param("mpmd", marks=pytest.mark.slow)])
def test_pruned_search_finds_the_exhaustive_plan_and_runners_up(executor):
    t = preset("holmes_hybrid", nodes=4, devices_per_node=8)
    model = gpt(remat="auto")
    options = CostOptions(executor=executor)
    pruned = plan(t, model, 128, 2048, options=options)
    full = plan(t, model, 128, 2048, options=options, prune=False)
    assert _signature(pruned) == _signature(full)
    assert full.pruned == 0 and pruned.pruned > 0  # the floor skipped some layouts


ANSWERS = os.path.join(os.path.dirname(__file__), "fixtures", "planner_answers.json")


def test_the_search_gives_the_answers_recorded_before_its_speed_ups():
    """Plans, runners-up, predictions and what bound each choice on the small presets under
    every executor (and placement / remat 'auto'), as the search gave them before closed-form
    tick grids, lazily priced ZeRO points and the faster split and assignment."""
    small = ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                        d_ff=128, max_seq_len=64, remat="full")
    with open(ANSWERS) as f:
        cases = json.load(f)["cases"]
    for name, want in cases.items():
        topo, executor, *auto = name.split("/")
        model = dataclasses.replace(small, remat="auto") if auto and executor == "mpmd" \
            else small
        result = plan(preset(topo), model, 16, 64, options=CostOptions(executor=executor),
                      **({"placement": "auto"} if auto else {}))
        got = [dict(pp=p.pp, dp=p.dp, tp=p.tp, M=p.microbatches, schedule=p.schedule,
                    zero=[p.zero.s_p, p.zero.s_g, p.zero.s_os, p.zero.name],
                    layers=list(p.stage_layers), placement=p.placement, remat=p.remat)
               for p in (result.plan, *result.runners_up)]
        assert got == [{k: v for k, v in p.items() if k not in ("step", "mfu")}
                       for p in want["plans"]], name
        for p, w in zip((result.plan, *result.runners_up), want["plans"]):
            assert p.predicted["step_time_s"] == pytest.approx(w["step"], rel=1e-9), name
            assert p.predicted["mfu"] == pytest.approx(w["mfu"], rel=1e-9), name
        assert result.plan.predicted["bound"] == want["bound"], name


@pytest.mark.parametrize("executor,schedules", [
    ("mpmd", ("1f1b", "interleaved", "zb-h1")), ("spmd", ("gpipe", "1f1b"))])
def test_the_floors_are_below_every_candidates_lower_bound(executor, schedules):
    """The search skips a layout whose floor (`CostModel.step_floor`, `_Search.sync_floor`)
    reaches the ceiling: each must be at most the lower bound of the candidate of every ZeRO
    point the search may price for the layout, in the stage order the partition picks. Two
    clusters joined by a slow link, where the SPMD pipeline's shared-gradient ring and the
    boundaries cross between them."""
    from hetjax.planner import search as search_mod
    from hetjax.planner.layout import Layout

    t = preset("holmes_hybrid", nodes=4, devices_per_node=8)
    s = search_mod._Search(t, gpt(remat="auto"), 256, 2048, CostOptions(executor=executor),
                           False, None, 1.0)
    checked, raised = {}, 0
    for p, d, tp in s.degrees(0, 0, 0, ()):
        for order, orders, tag in s.layouts(p, d, tp):
            for M, schedule in itertools.product(s.microbatch_counts(d, 0)[:4], (
                    schedules if p > 1 else ("gpipe",))):
                if schedule == "interleaved" and M % p:
                    continue
                lay = Layout(pp=p, dp=d, tp=tp, device_order=order, microbatches=M,
                             global_batch=256, seq_len=2048, schedule=schedule,
                             remat=s.cm.remat_choices(p)[-1])
                floor = max(s.cm.step_floor(lay), s.sync_floor(lay, "auto"))
                for f in s.zero_points(lay, "auto"):
                    c = s._fitted(dataclasses.replace(lay, zero=f), orders, tag, ())
                    if c is not None:
                        assert floor <= c.bound * (1 + 1e-12), (lay, f)
                        checked[schedule] = checked.get(schedule, 0) + 1
                        # (the floor is not vacuous: the sync or the ring weighs)
                        raised += floor > 1.5 * s.cm.layer_floor(lay)[0].fwd * M
    assert min(checked.values()) >= 5 and set(checked) == {"gpipe", *schedules}, checked
    assert raised, "no floor above the compute alone"


def test_spread_is_the_least_slowest_stage_over_whole_layer_splits():
    from hetjax.planner.search import _spread

    for per_layer, layers in [([(1.0, 2)], 5), ([(0.3, 1), (0.7, 2)], 9),
                              ([(0.1, 2), (0.25, 1), (1.0, 1)], 12), ([(2.0, 4)], 4)]:
        stages = [a for a, n in per_layer for _ in range(n)]
        best = min(max(n * a for n, a in zip(split, stages))
                   for split in itertools.product(range(1, layers + 1), repeat=len(stages))
                   if sum(split) == layers)
        assert _spread(per_layer, layers) == pytest.approx(best, rel=1e-12)

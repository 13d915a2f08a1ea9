"""The one path from config to (model, Plan, runners-up) (`hetjax.planner.plan_job`): searched
defaults, fields the user fixed, the model the Trainer builds, the step's breakdown and its
what-ifs, distinct runners-up, devices left out. Pure Python: no JAX."""

import dataclasses
import json

import pytest

from hetjax.argv import default_job_path
from hetjax.config import build_topology, load_config
from hetjax.core.hardware import Link, Topology
from hetjax.core.catalogue import make_cluster
from hetjax.core.model_config import ModelConfig
from hetjax.core.plan import Plan
from hetjax.core.topology import preset
from hetjax.planner import CostModel, CostOptions, model_from_config, plan, plan_job
from hetjax.planner import breakdown as bd
from hetjax.planner.config_plan import SEARCHED, options_from_config
from hetjax.planner.search import device_subsets, layout_key, sub_topology
from hetjax.units import seconds


def default_job(*overrides: str, given: bool = False):
    """The config `hetjax plan` reads: the default job (as --config when `given`)."""
    return load_config(default_job_path(), list(overrides), default_job=not given)


def two_kinds(inter_gbps: float = 10.0) -> Topology:
    """Two A100 nodes on InfiniBand and a node of L40S on PCIe, joined by slow Ethernet (the
    user's cluster of docs/planner.md, smaller)."""
    return Topology("mixed", (make_cluster("a100ib", 1, 4, "a100_80gb", "infiniband"),
                              make_cluster("l40s", 1, 2, "l40s", "ethernet", intra="pcie")),
                    Link("ethernet", inter_gbps, 50.0))


def gpu_model(**kw) -> ModelConfig:
    base = dict(vocab_size=32000, d_model=1024, n_layers=4, n_heads=8, n_kv_heads=8,
                d_ff=2816, max_seq_len=1024, remat="auto", dtype="bfloat16")
    return ModelConfig(**{**base, **kw})


# --- searched defaults and fields the user fixed -------------------------------------------------
def test_the_default_job_keeps_its_fixed_layout_and_values():
    c = default_job()
    assert (c.pipeline.executor, c.pipeline.schedule, c.train.microbatches) == ("spmd", "1f1b", 4)
    p = plan_job(c, build_topology(c)).plan
    assert (p.source, p.pp, p.dp, p.tp, p.microbatches, p.executor, p.schedule) == (
        "config", 2, 2, 2, 4, "spmd", "1f1b")


def test_a_searched_layout_leaves_what_the_user_did_not_set_to_the_planner():
    c = default_job("--config.parallel.pp=0", "--config.parallel.tp=0")
    assert {f: c[f.split(".")[0]][f.split(".")[1]] for f in SEARCHED} == SEARCHED
    # what the user set stays: on the command line, or in the config file they gave
    c = default_job("--config.parallel.pp=0", "--config.pipeline.executor=spmd",
                    "--config.pipeline.microbatches=8")
    assert (c.pipeline.executor, c.pipeline.schedule, c.train.microbatches) == ("spmd", "auto", 0)
    assert plan_job(c, build_topology(c)).plan.microbatches == 8
    c = default_job("--config.parallel.pp=0", given=True)
    assert (c.train.microbatches, c.pipeline.executor) == (4, "auto")


def test_a_field_the_user_fixed_says_what_leaving_it_to_the_planner_gives():
    c = load_config(None, ["--config.parallel.pp=0", "--config.parallel.tp=0",
                           "--config.pipeline.executor=spmd", "--config.model.preset=llama3_2_1b",
                           "--config.topology.preset=holmes_hybrid", "--config.topology.nodes=1",
                           "--config.topology.devices_per_node=2",
                           "--config.train.batch_size=32", "--config.train.seq_len=2048"])
    job = plan_job(c, build_topology(c), explain=True)
    assert job.plan.executor == "spmd"
    line, = [x for x in job.fixed_lines if x.startswith("executor=spmd is fixed")]
    assert "auto would pick executor=mpmd" in line and "--config.pipeline.executor=auto" in line
    assert f"instead of {seconds(job.plan.predicted['step_time_s'])}" in line


@pytest.mark.parametrize("name", ["llama3_8b", pytest.param("tinyllama_1b", marks=pytest.mark.slow),
                                  pytest.param("qwen2_0_5b", marks=pytest.mark.slow),
                                  pytest.param("mistral_7b", marks=pytest.mark.slow)])
def test_hetjax_plan_just_works_for_a_model_preset_on_gpus(name):
    """The default job's 4 micro-batches made llama3_8b at batch 256 x 4096 fit nowhere."""
    c = default_job("--config.parallel.pp=0", "--config.parallel.tp=0",
                    f"--config.model.preset={name}", "--config.topology.preset=holmes_hybrid",
                    "--config.topology.nodes=1", "--config.topology.devices_per_node=2",
                    "--config.train.batch_size=256", "--config.train.seq_len=4096")
    job = plan_job(c, build_topology(c))
    assert job.plan.predicted["fits"] and job.plan.source == "planner"
    assert job.runners_up


# --- the model the Trainer builds ----------------------------------------------------------------
def write_word_tokenizer(path, size: int):
    """A HuggingFace tokenizer.json with `size` whole-word tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_a_32k_tokenizer_gives_the_plan_its_vocabulary_memory_and_flops(tmp_path):
    tok = write_word_tokenizer(tmp_path / "tokenizer.json", 32000)
    c = load_config(None, [f"--config.data.tokenizer={tok}", "--config.model.d_model=256",
                           "--config.model.d_ff=768"])  # (a fixed layout: priced, not searched)
    assert c.model.vocab_size == 0
    t = build_topology(c)
    job = plan_job(c, t)
    assert job.model.vocab_size == 32000  # (a multiple of 128 already)
    assert job.model == model_from_config(c, t, job.plan)  # what the Trainer builds
    byte = dataclasses.replace(job.model, vocab_size=384)  # the byte tokenizer's, padded
    options = dataclasses.replace(options_from_config(c, t), executor="spmd")
    priced = CostModel(t, job.model, options).predict(job.plan)
    assert job.plan.predicted["stage_memory_gib"] == pytest.approx(
        [m / 2**30 for m in priced.stage_memory])
    as_bytes = CostModel(t, byte, options).predict(job.plan)
    assert max(priced.stage_memory) > max(as_bytes.stage_memory) * 1.5
    assert job.model.flops_per_token(128) > byte.flops_per_token(128) * 1.5
    assert job.plan.predicted["mfu"] == pytest.approx(priced.mfu)


# --- what the step is made of ---------------------------------------------------------------------
@pytest.mark.parametrize("executor,placement,pp,topology", [
    ("spmd", "looped", 3, "mixed"), ("mpmd", "looped", 3, "mixed"),
    ("spmd", "folded", 2, "holmes"), ("mpmd", "looped", 1, "holmes")])
def test_the_breakdown_sums_to_the_step(executor, placement, pp, topology):
    t = two_kinds() if topology == "mixed" else preset("holmes_hybrid", nodes=1,
                                                        devices_per_node=2)
    r = plan(t, gpu_model(remat="full"), 24, 512, pp=pp, placement=placement,
             options=CostOptions(executor=executor), schedule="1f1b")
    cm = CostModel(t, gpu_model(remat="full"), CostOptions(executor=executor))
    parts = bd.step_breakdown(cm, r.plan)
    assert set(parts) == set(bd.PARTS)
    assert sum(parts.values()) == pytest.approx(r.plan.predicted["step_time_s"], rel=1e-9)
    assert all(v >= -1e-9 * r.plan.predicted["step_time_s"] for v in parts.values())
    assert parts["recompute"] > 0  # remat 'full' repeats every forward
    lines = bd.breakdown_lines(parts)
    largest = max(parts, key=parts.get)
    assert any(line.strip().startswith(largest) and "<- largest" in line for line in lines)
    for shown in bd.SHOWN:
        assert any(line.strip().startswith(shown) for line in lines)


def test_what_ifs_name_the_slow_links_and_the_weaker_kinds():
    t = Topology("mixed", (make_cluster("a100ib", 2, 4, "a100_80gb", "infiniband"),
                           make_cluster("l40s", 2, 2, "l40s", "ethernet", intra="pcie")),
                 Link("ethernet", 10.0, 50.0))
    labels = [w.label for w in bd.what_ifs(t)]
    assert labels == [
        "the 10 Gb/s ethernet link between a100ib and l40s at 100 Gb/s",
        "the 25 Gb/s ethernet NIC of l40s at 100 Gb/s",
        "the 8 a100_80gb devices at 362 TFLOP/s",
        "the 4 l40s devices with 80 GiB"]
    changed = bd.what_ifs(t)[0].topology
    assert changed.cluster_link(0, 1).bandwidth_gbps == 100
    assert t.cluster_link(0, 1).bandwidth_gbps == 10
    assert [bd.faster_rate(x) for x in (1, 10, 25, 100, 800)] == [10, 100, 100, 400, 1600]


# --- distinct runners-up --------------------------------------------------------------------------
def test_runners_up_are_distinct_layouts_and_pruning_finds_the_exhaustive_ones():
    t, m = preset("holmes_hybrid", nodes=1, devices_per_node=2), gpu_model()
    kw = dict(options=CostOptions(executor="mpmd"), distinct=True, placement="auto")
    pruned, full = plan(t, m, 16, 512, **kw), plan(t, m, 16, 512, prune=False, **kw)
    plans = [pruned.plan, *pruned.runners_up]
    assert len({layout_key(p) for p in plans}) == len(plans) >= 3
    assert [(layout_key(p), p.microbatches, p.schedule, p.stage_layers,
             p.predicted["step_time_s"]) for p in plans] == [
        (layout_key(p), p.microbatches, p.schedule, p.stage_layers, p.predicted["step_time_s"])
        for p in (full.plan, *full.runners_up)]


# --- devices left out -----------------------------------------------------------------------------
def three_plus_one() -> Topology:
    """Three nodes of A100 on InfiniBand and a fourth behind a 1 Gb/s link."""
    return Topology("three_plus_one", (make_cluster("fast", 3, 4, "a100_80gb", "infiniband"),
                                       make_cluster("far", 1, 4, "a100_80gb", "infiniband")),
                    Link("ethernet", 1.0, 50.0))


def test_the_planner_leaves_a_node_behind_a_slow_link_idle_and_says_why():
    t = three_plus_one()
    m = gpu_model(d_model=2048, n_heads=16, d_ff=5632)
    r = plan(t, m, 24, 1024, options=CostOptions(executor="mpmd"), subsets=True, distinct=True)
    p = r.plan
    assert sorted(p.device_order) == list(range(12))  # the far node is idle
    assert p.unused_ranks(t) == list(range(12, 16))
    why = p.unused_reasons()[12]
    assert why.startswith("behind a 1 Gb/s ethernet link")
    with_all = float(why.split("predicted ")[1].split(" s")[0])
    assert with_all > p.predicted["step_time_s"]
    assert any("unused: ranks 12-15 (far): behind a 1 Gb/s" in x for x in p.unused_lines(t))
    # priced on the whole topology as on the three nodes alone
    sub, ranks = sub_topology(t, (0,))
    alone = dataclasses.replace(p, device_order=tuple(ranks.index(r) for r in p.device_order))
    step = CostModel(sub, m, CostOptions(executor="mpmd")).predict(alone).step_time
    assert step == pytest.approx(p.predicted["step_time_s"], rel=1e-12)
    assert json.loads(p.to_json())["predicted"]["unused"]["12"] == why


def test_a_calibration_prices_the_plans_of_a_smaller_device_set_too():
    """plan(calibration=...) with device subsets: the plans of a subset, re-priced on the whole
    topology, are priced with the calibration's measurements as the whole set's are (they
    were priced with the nominal links)."""
    from hetjax.planner.calibrate import Calibration, LinkRow

    t = three_plus_one()
    m = gpu_model(d_model=2048, n_heads=16, d_ff=5632)
    # the InfiniBand between the three fast nodes measured at 4 Gb/s with 0.2 ms a hop
    groups = ((0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7, 11))
    rows = tuple(LinkRow(op, int(n), groups, steps * 2e-4 + 4 * steps / 3 * n / (4e9 / 8))
                 for n in (1e4, 1e6, 4e6) for op, steps in (("all_reduce", 4), ("all_gather", 2)))
    cal = Calibration(t, m, (), rows)
    options = CostOptions(executor="mpmd")
    by_file = plan(t, m, 24, 1024, options=options, calibration=cal, subsets=True, distinct=True)
    by_options = plan(t, m, 24, 1024, options=cal.options(options), subsets=True, distinct=True)
    got = [(p.device_order, p.predicted["step_time_s"]) for p in (by_file.plan,
                                                                  *by_file.runners_up)]
    assert got == [(p.device_order, p.predicted["step_time_s"])
                   for p in (by_options.plan, *by_options.runners_up)]
    assert any(len(order) < t.num_devices for order, _ in got)  # a subset's plan is among them


def test_device_subsets_are_connected_sets_of_clusters_all_first():
    assert device_subsets(two_kinds()) == [(0, 1), (0,), (1,)]
    line = Topology("line", tuple(make_cluster(n, 1, 2, "a100", "infiniband") for n in "abc"),
                    None, cluster_links=())
    assert device_subsets(line) == [(0,), (1,), (2,)]  # no links: only single clusters
    assert device_subsets(preset("cpu_single")) == [(0,)]


def test_with_subsets_the_search_keeps_todays_answers_where_every_device_wins():
    """The recorded answers (tests/fixtures/planner_answers.json) whose plan uses every device
    stay the plan when the search may leave clusters out."""
    from test_planner import ANSWERS

    small = ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                        d_ff=128, max_seq_len=64, remat="full")
    with open(ANSWERS) as f:
        cases = json.load(f)["cases"]
    checked = 0
    for name, want in cases.items():
        topo, executor, *auto = name.split("/")
        if auto or executor == "megatron":
            continue
        r = plan(preset(topo), small, 16, 64, options=CostOptions(executor=executor),
                 subsets=True)
        w = want["plans"][0]
        if len(r.plan.device_order) < preset(topo).num_devices:
            continue  # a new freedom won
        got = r.plan
        assert (got.pp, got.dp, got.tp, got.microbatches, got.schedule,
                list(got.stage_layers)) == (w["pp"], w["dp"], w["tp"], w["M"], w["schedule"],
                                            w["layers"]), name
        assert got.predicted["step_time_s"] == pytest.approx(w["step"], rel=1e-9), name
        checked += 1
    assert checked >= 4


# --- the plan against the best the cost model can price ------------------------------------------
@pytest.mark.parametrize("inter_gbps,devices", [(100.0, 6), (25.0, 4)])
def test_the_plan_is_within_one_percent_of_the_best_priced_without_the_search(inter_gbps,
                                                                             devices):
    """Every device subset, executor, layout, stage order, micro-batch count, schedule,
    placement, recompute policy, ZeRO point and layer split of a small mixed cluster, priced
    (scripts/bench/planner.py `exhaustive_best`); at 100 Gb/s the L40S help, at 25 they do not."""
    from scripts.bench import planner as bench_planner

    t = two_kinds(inter_gbps)
    c = load_config(None, ["--config.parallel.pp=0", "--config.parallel.tp=0",
                           "--config.model.vocab_size=32000", "--config.model.d_model=2048",
                           "--config.model.n_layers=4", "--config.model.n_heads=16",
                           "--config.model.n_kv_heads=8", "--config.model.d_ff=5632",
                           "--config.model.max_seq_len=1024", "--config.train.batch_size=8",
                           "--config.train.seq_len=1024"])
    job = plan_job(c, t)
    best, candidates, _ = bench_planner.exhaustive_best(t, job.model, 8, 1024)
    assert candidates > 5000
    assert job.plan.predicted["step_time_s"] <= best.predicted["step_time_s"] * 1.01
    assert len(job.plan.device_order) == len(best.device_order) == devices


def test_the_memory_message_counts_the_activations_the_spmd_pipeline_stashes():
    """They were in 'model states' and 'buffers', and 'activations 0.00 GiB' was printed."""
    import re

    from hetjax.errors import PlanError

    t = two_kinds()
    with pytest.raises(PlanError, match="does not fit in memory") as e:
        plan(t, gpu_model(n_layers=6, d_model=4096, n_heads=32, d_ff=11008, max_seq_len=8192),
             256, 8192, microbatches=2, schedule="1f1b", zero="ddp",
             options=CostOptions(executor="spmd"))
    acts = float(re.search(r"activations ([\d.]+)", str(e.value)).group(1))
    assert acts > 1.0


# --- each stage its own degrees ------------------------------------------------------------------
def nvlink_and_pcie(nv_devices: int = 8, pc_devices: int = 4) -> Topology:
    """A node of A100 on NVLink and a node of (four) L40S on PCIe, on InfiniBand."""
    return Topology("nv_pcie", (make_cluster("nv", 1, nv_devices, "a100_80gb", "infiniband",
                                             intra="nvlink3"),
                                make_cluster("pc", 1, pc_devices, "l40s", "infiniband",
                                             intra="pcie4")),
                    Link("infiniband", 100.0, 5.0))


STAGE_DEGREES = dict(options=CostOptions(executor="mpmd"), distinct=True, subsets=True,
                     stage_degrees=True, placement="auto")


def big_layers() -> ModelConfig:
    return gpu_model(d_model=8192, n_heads=64, d_ff=28672, max_seq_len=2048)


@pytest.mark.slow  # (two searches of a 14-device mixed cluster)
def test_stages_on_different_nodes_get_their_own_degrees_when_that_prices_faster():
    """8 A100 and 6 L40S: stages of one shape must straddle the nodes or leave devices out
    (the best uniform plan, dp=8 on the A100 alone, prices 1.28 s); a stage of 8 and one of 6
    devices, each shaped for its node, prices about 10% faster."""
    t, m = nvlink_and_pcie(pc_devices=6), big_layers()
    p = plan(t, m, 48, 2048, **STAGE_DEGREES).plan
    assert not p.uniform and p.executor == "mpmd"
    nv = {tuple(p.stage_shape(s)) for s in range(p.pp) if p.stage_ranks(s)[0] < 8}
    pc = {tuple(p.stage_shape(s)) for s in range(p.pp) if p.stage_ranks(s)[0] >= 8}
    assert nv and pc and nv != pc  # each node's stages their own (dp, tp)
    assert "dp,tp per stage" in p.header() and p.predicted["layout"] == "per-stage degrees"
    uniform = plan(t, m, 48, 2048, **{**STAGE_DEGREES, "stage_degrees": False}).plan
    assert p.predicted["step_time_s"] < uniform.predicted["step_time_s"] * (1 - 0.01)
    again = CostModel(t, m, CostOptions(executor="mpmd")).predict(
        dataclasses.replace(p, predicted={}))
    assert again.step_time == pytest.approx(p.predicted["step_time_s"], rel=1e-12)
    assert Plan.from_json(p.to_json()).stage_shapes == p.stage_shapes


@pytest.mark.slow
def test_with_stage_degrees_the_pruned_search_finds_the_exhaustive_plans():
    t, m = nvlink_and_pcie(), big_layers()
    r, full = (plan(t, m, 32, 2048, prune=prune, **STAGE_DEGREES) for prune in (True, False))
    assert [(q.shapes(), q.microbatches, q.predicted["step_time_s"])
            for q in (r.plan, *r.runners_up)] == [
        (q.shapes(), q.microbatches, q.predicted["step_time_s"])
        for q in (full.plan, *full.runners_up)]


def test_a_stage_of_another_shape_is_priced_as_a_stage_of_that_shape():
    """Stages of different (dp, tp) cost what uniform stages of their shape cost on their
    devices; boundaries carry one micro-batch's activations, however they are cut."""
    t = nvlink_and_pcie(4)
    m = gpu_model(d_model=4096, n_heads=32, d_ff=11008, remat="none")
    cm = CostModel(t, m, CostOptions(executor="mpmd"))
    mixed = Plan(pp=2, dp=0, tp=0, stage_layers=(2, 2), microbatches=8, global_batch=32,
                 seq_len=1024, executor="mpmd", stage_shapes=((1, 4), (4, 1)))
    tp4 = Plan(pp=2, dp=1, tp=4, stage_layers=(2, 2), microbatches=8, global_batch=32,
               seq_len=1024, executor="mpmd")
    dp4 = dataclasses.replace(tp4, dp=4, tp=1)
    a, b, c = (cm.predict(p) for p in (mixed, tp4, dp4))
    assert a.stage_time == pytest.approx((b.stage_time[0], c.stage_time[1]), rel=1e-12)
    assert a.stage_memory[0] == pytest.approx(b.stage_memory[0], rel=1e-12)
    assert a.dp_links == ("-", "pcie") and a.pp_links == ("infiniband",)

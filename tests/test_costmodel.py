"""The cost model, the step simulator and AMSP's ZeRO algebra, against the papers' numbers and
against hand-computed alpha-beta times."""

import dataclasses
import random

import numpy as np
import pytest

from hetjax.errors import PlanError
from hetjax.core.plan import Plan, ZeroFactors
from hetjax.planner import formulas, zero_factors as zr
from hetjax.planner.cost import CostModel, CostOptions, LayerProfile, SharedPrices
from hetjax.planner.layout import Layout
from hetjax.planner.network import ring_time
from hetjax.planner.simulate import closed_form, in_flight, lower_bound, simulate
from hetjax.core.topology import LINKS, Link, Topology, make_cluster, preset
from hetjax.core.model_config import ModelConfig
from hetjax.core.schedules import make_schedule

# Holmes Table 1: GPT 3.6B (hidden 3072, 30 layers, 32 heads, vocab 50257), seq 2048, 32 A100.
HOLMES_ROWS = {"infiniband": (99.23, 197), "roce": (80.54, 160), "ethernet": (61.32, 122)}


def holmes_model(**kw) -> ModelConfig:
    """Holmes' GPT 3.6B with a SwiGLU MLP of the same size (d_ff = 8/3 h) and recompute."""
    base = dict(vocab_size=50257, d_model=3072, n_layers=30, n_heads=32, n_kv_heads=32,
                d_ff=8192, max_seq_len=2048, remat="full", dtype="bfloat16",
                param_dtype="bfloat16")
    return ModelConfig(**{**base, **kw})


def tiny_model(**kw) -> ModelConfig:
    base = dict(vocab_size=384, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=384,
                max_seq_len=512)
    return ModelConfig(**{**base, **kw})


# --- the papers' numbers ---------------------------------------------------------------------------
@pytest.mark.parametrize("nic", list(HOLMES_ROWS))
def test_holmes_tflops_formula_reproduces_table_1(nic):
    samples_per_s, tflops = HOLMES_ROWS[nic]
    got = formulas.holmes_tflops(samples_per_s, gpus=32, seq_len=2048, layers=30, hidden=3072,
                                 vocab=50257)
    assert got == pytest.approx(tflops, abs=1.0)


def test_our_flops_with_recompute_equal_megatrons_count():
    m = holmes_model()
    cm = CostModel(preset("holmes_infiniband"), m)
    ours = cm.train_flops_per_token(2048) * 768 * 2048
    assert ours == pytest.approx(formulas.megatron_flops_per_step(768, 2048, 30, 3072, 50257),
                                 rel=1e-12)


def test_amsp_memory_formula_for_zero_1_2_3():
    """ZeRO's 7.5B-parameter example on 64 devices: 120, 31.4, 16.6 and 1.9 GB per device."""
    phi, dp = 7.5e9, 64
    got = {name: zr.model_state_bytes(phi, zr.named(name, dp, 8)) / 1e9
           for name in ("ddp", "zero1", "zero2", "zero3")}
    assert got == pytest.approx({"ddp": 120.0, "zero1": 31.41, "zero2": 16.64, "zero3": 1.875},
                                abs=0.01)


def test_hethub_throughput_upper_bound_and_efficiency():
    t = formulas.hethub_throughput(seq_len=1024, global_batch=1024, devices=16, iter_time=32.0)
    assert t == pytest.approx(2048.0)
    ub = formulas.hethub_upper_bound(3000.0, 8, 1800.0, 8)
    assert ub == pytest.approx(2400.0)
    # A uniform split runs at the slow kind's pace: min(T_A, T_B) / T_UB.
    assert formulas.hethub_efficiency(1800.0, ub) == pytest.approx(0.75)


def test_hethub_efficiency_of_uniform_and_planned_splits_on_the_cost_model():
    """HetHub's arithmetic applied to the cost model of its own system (asynchronous 1F1B):
    homogeneous throughputs give T_UB; an even split of a two-kind pipeline reaches about
    min(T_A, T_B) / T_UB, the planner's uneven split at least 90%."""
    from hetjax.planner import plan

    m = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                    d_ff=11008, remat="full", dtype="bfloat16", param_dtype="bfloat16")
    kw = dict(global_batch=256, seq_len=1024, pp=2, tp=2, microbatches=64, schedule="1f1b",
              zero="zero1", options=CostOptions(executor="megatron"))

    def two_clusters(a: str, b: str) -> Topology:
        return Topology("mix", (make_cluster("a", 1, 8, a, "infiniband"),
                                make_cluster("b", 1, 8, b, "roce")), LINKS["ethernet"])

    def tokens_per_device(result):
        return result.plan.predicted["tokens_per_s"] / 16

    t_a = tokens_per_device(plan(two_clusters("a100", "a100"), m, **kw))
    t_b = tokens_per_device(plan(two_clusters("v100", "v100"), m, **kw))
    het = two_clusters("a100", "v100")
    ub = formulas.hethub_upper_bound(t_a, 8, t_b, 8)
    uniform = tokens_per_device(plan(het, m, stage_layers=(16, 16), **kw))
    planned = tokens_per_device(plan(het, m, **kw))
    assert formulas.hethub_efficiency(uniform, ub) == pytest.approx(min(t_a, t_b) / ub, rel=0.1)
    assert formulas.hethub_efficiency(planned, ub) >= 0.9
    assert planned > 1.2 * uniform


# --- communication ---------------------------------------------------------------------------------
def test_ring_and_point_to_point_formulas():
    lk = Link("ethernet", 8.0, 100.0)  # 1 GB/s, 100 us
    assert ring_time("all_reduce", 4e9, 4, lk) == pytest.approx(2 * 3 * (1e-4 + 1.0))
    assert ring_time("reduce_scatter", 4e9, 4, lk) == pytest.approx(3 * (1e-4 + 1.0))
    assert ring_time("all_gather", 4e9, 1, lk) == 0.0
    assert lk.latency_s + 1e9 / lk.bytes_per_s == pytest.approx(1e-4 + 1.0)


def test_collective_is_priced_on_the_slowest_link_it_crosses():
    t = preset("holmes_hybrid")  # 2 clusters x 2 nodes x 8 A100, Ethernet between clusters
    cm = CostModel(t, tiny_model(), CostOptions(share_nics=False, collectives="ring"))
    nbytes = 1e9
    inside_node = cm.collective("all_reduce", nbytes, np.array([[0, 1]]))
    across_nodes = cm.collective("all_reduce", nbytes, np.array([[0, 8]]))
    across_clusters = cm.collective("all_reduce", nbytes, np.array([[0, 1, 16]]))
    assert inside_node == pytest.approx(ring_time("all_reduce", nbytes, 2, t.link(0, 1)))
    assert across_nodes == pytest.approx(ring_time("all_reduce", nbytes, 2, t.link(0, 8)))
    assert across_clusters == pytest.approx(ring_time("all_reduce", nbytes, 3,
                                                      t.inter_cluster))
    assert inside_node < across_nodes < across_clusters


def test_groups_leaving_one_node_share_its_nic():
    t = preset("holmes_hybrid")
    shared = CostModel(t, tiny_model())
    alone = CostModel(t, tiny_model(), CostOptions(share_nics=False))
    pairs = np.stack([np.arange(8), np.arange(16, 24)], axis=1)  # node 0 -> node 2, 8 flows
    one = alone.transfer(1e8, pairs)[0]
    assert shared.transfer(1e8, pairs)[0] == pytest.approx(
        t.inter_cluster.latency_s + 8 * 1e8 / t.inter_cluster.bytes_per_s)
    assert one == pytest.approx(t.inter_cluster.latency_s + 1e8 / t.inter_cluster.bytes_per_s)
    # Inside a node (NVLink) nothing is shared.
    intra = np.array([[0, 1], [2, 3]])
    assert shared.transfer(1e8, intra)[0] == alone.transfer(1e8, intra)[0]


def test_group_links_agree_with_topology_group_link():
    rng = np.random.default_rng(0)
    for name in ("holmes_hybrid", "dtfm_regional", "dtfm_datacenter_spot", "cpu_hybrid"):
        t = preset(name)
        cm = CostModel(t, tiny_model())
        for size in (2, 3, 8):
            groups = np.array([rng.choice(t.num_devices, size, replace=False)
                               for _ in range(100)])
            assert cm.group_links(groups) == [t.group_link(g.tolist()) for g in groups]


# --- compute and memory ----------------------------------------------------------------------------
def _layout(pp, dp, tp=1, M=4, B=32, seq=128, schedule="1f1b", zero=ZeroFactors(), order=None):
    n = pp * dp * tp
    return Layout(pp=pp, dp=dp, tp=tp, device_order=order or tuple(range(n)), microbatches=M,
                  global_batch=B, seq_len=seq, schedule=schedule, zero=zero)


def test_compute_time_is_flops_over_peak_times_efficiency():
    m = tiny_model()
    t = preset("cpu_single")
    cm = CostModel(t, m, CostOptions(efficiency=0.5))
    stage = cm.stage_costs(_layout(1, 8, M=1, B=8))[0]
    tok = 8 / 8 * 128  # tokens per device per micro-batch
    rate = t.clusters[0].accelerator.peak_tflops * 1e12 * 0.5
    assert stage.fwd_layer == pytest.approx(tok * m.layer_flops(128) / rate)
    assert stage.bwd_layer == pytest.approx(2 * tok * m.layer_flops(128) / rate)
    assert stage.fwd_fixed == pytest.approx(tok * m.head_flops() / rate)


def test_measured_profile_replaces_flops():
    t = preset("cpu_single")
    prof = LayerProfile(fwd_s=1e-3, bwd_s=3e-3, head_fwd_s=2e-3, head_bwd_s=4e-3)
    cm = CostModel(t, tiny_model(), CostOptions(profiles={"cpu": prof}))
    stage = cm.stage_costs(_layout(1, 8, M=1, B=8))[0]
    assert (stage.fwd_layer, stage.bwd_layer) == pytest.approx((128e-3, 384e-3))
    assert (stage.fwd_fixed, stage.bwd_fixed) == pytest.approx((256e-3, 512e-3))


def test_activation_memory_follows_the_schedule():
    cm = CostModel(preset("cpu_single"), tiny_model(), CostOptions(executor="megatron"))
    gpipe = cm.stage_costs(_layout(4, 2, M=8, schedule="gpipe"))
    ofob = cm.stage_costs(_layout(4, 2, M=8, schedule="1f1b"))
    per_mb = gpipe[0].mem_layer / 8
    assert [c.mem_layer / per_mb for c in gpipe] == pytest.approx([8, 8, 8, 8])
    assert [c.mem_layer / per_mb for c in ofob] == pytest.approx([4, 3, 2, 1])


def test_hetjax_executor_stashes_layer_inputs_and_replicates_shared_parameters():
    """parallel/pipeline.py with model.remat 'auto': every layer recomputed (Megatron: none),
    max_layers + 1 stashed activations per micro-batch in flight, embedding and head on every
    stage."""
    m = tiny_model(n_layers=8, remat="auto")
    t = preset("cpu_single")
    hj, mg = (CostModel(t, m, CostOptions(executor=e)) for e in ("spmd", "megatron"))
    layout = _layout(4, 2, M=8, schedule="1f1b")
    ours, theirs = hj.stage_costs(layout), mg.stage_costs(layout)
    tok = 32 / 8 / 2 * 128
    stash = tok * m.d_model * 4
    slot = zr.model_state_bytes(m.layer_params, ZeroFactors(), zr.FP32)
    assert [c.mem_slot - slot for c in ours] == pytest.approx([4 * stash, 3 * stash,
                                                               2 * stash, stash])
    assert all(c.mem_layer == 0 for c in ours)
    assert ours[0].bwd_layer == pytest.approx(1.5 * theirs[0].bwd_layer)  # 3 forwards, not 2
    embed = zr.model_state_bytes(m.embed_params, ZeroFactors(), zr.FP32)
    # Megatron's middle stage holds no embedding or head, only one layer's backward buffers
    assert ours[1].mem_fixed > embed and theirs[1].mem_fixed == pytest.approx(
        mg.temporary_bytes(layout, "none"))
    # One stage: no pipeline, the model's own remat and layout.
    single = hj.stage_costs(_layout(1, 8, M=2))[0]
    assert single.mem_layer > 0 and single.bwd_layer == pytest.approx(
        mg.stage_costs(_layout(1, 8, M=2))[0].bwd_layer)


@pytest.mark.parametrize("remat", ["none", "dots"])
def test_hetjax_executor_prices_the_recompute_policy_it_is_given(remat):
    """model.remat none / dots in the SPMD pipeline: the backward recomputes what Megatron's
    does, and every padded layer slot stashes the residuals the policy keeps."""
    m = tiny_model(n_layers=8, remat=remat)
    t = preset("cpu_single")
    hj, mg = (CostModel(t, m, CostOptions(executor=e)) for e in ("spmd", "megatron"))
    full = CostModel(t, dataclasses.replace(m, remat="full"), CostOptions(executor="spmd"))
    layout = _layout(4, 2, M=8, schedule="1f1b")
    ours, theirs, recomputed = (c.stage_costs(layout) for c in (hj, mg, full))
    assert ours[0].bwd_layer == pytest.approx(theirs[0].bwd_layer)
    assert ours[0].bwd_layer < recomputed[0].bwd_layer
    tok = 32 / 8 / 2 * 128
    slot = zr.model_state_bytes(m.layer_params, ZeroFactors(), zr.FP32)
    kept = hj.activation_bytes_per_token(1, 128, remat, cpu=True) * tok  # cpu_single
    assert kept > tok * m.d_model * 4
    assert [c.mem_slot - slot for c in ours] == pytest.approx([4 * kept, 3 * kept, 2 * kept,
                                                               kept])
    assert all(a.mem_slot > b.mem_slot for a, b in zip(ours, recomputed))


def test_hetjax_executor_runs_ticks_in_lockstep():
    """In lockstep 1F1B's steady state pairs an F with a B, so it is slower than GPipe;
    asynchronously the two take the same time (spec of parallel/pipeline.py)."""
    m = tiny_model(n_layers=8)
    t = preset("cpu_single")
    plans = {name: Plan(pp=4, dp=2, tp=1, stage_layers=(2,) * 4, microbatches=16,
                        global_batch=32, seq_len=128, schedule=name)
             for name in ("gpipe", "1f1b")}
    hj = {n: CostModel(t, m).predict(p).step_time for n, p in plans.items()}
    mg = {n: CostModel(t, m, CostOptions(executor="megatron")).predict(p).step_time
          for n, p in plans.items()}
    assert 1.15 < hj["1f1b"] / hj["gpipe"] < 1.6
    assert mg["1f1b"] == pytest.approx(mg["gpipe"], rel=0.01)
    # Lockstep 1F1B on the executor's worked example: ticks of 1 1 3 3 3 3 = 14.
    assert simulate("1f1b", 2, [1, 1], [3, 3], lockstep=True).step_time == 14


def test_hetjax_executor_across_processes_is_priced_asynchronously():
    """CostOptions(lockstep=False): the same executor (same stage costs and memory), its
    stages played on the asynchronous timeline, as one process per stage runs them."""
    m = tiny_model(n_layers=8)
    t = preset("cpu_single")
    p = Plan(pp=4, dp=2, tp=1, stage_layers=(3, 2, 2, 1), microbatches=16, global_batch=32,
             seq_len=128, schedule="1f1b")
    lock, free = (CostModel(t, m, CostOptions(lockstep=flag)) for flag in (True, False))
    layout = Layout.of(p)
    assert lock.runs_in_lockstep(layout) and not free.runs_in_lockstep(layout)
    assert free.stage_costs(layout) == lock.stage_costs(layout)
    stages = free.stage_costs(layout)
    send, _ = free.boundary_times(layout)
    fwd = [c.fwd(n) for c, n in zip(stages, p.stage_layers)]
    bwd = [c.bwd(n) for c, n in zip(stages, p.stage_layers)]
    # on CPU nothing overlaps: the sync and the refresh follow each stage's last backward
    sync = [c.sync(n) + c.refresh(n) for c, n in zip(stages, p.stage_layers)]
    assert free.exposed_sync(layout, stages, p.stage_layers, fwd, bwd) == sync
    asynchronous = simulate("1f1b", 16, fwd, bwd, send, send, sync, 0.0)
    assert free.predict(p).step_time == pytest.approx(asynchronous.step_time)
    assert free.predict(p).step_time < lock.predict(p).step_time
    assert free.predict(p).stage_memory == lock.predict(p).stage_memory
    # Without a pipeline there is nothing to run in lockstep.
    one = Layout.of(Plan(pp=1, dp=8, tp=1, stage_layers=(8,), microbatches=4,
                         global_batch=32, seq_len=128))
    assert not lock.runs_in_lockstep(one)


def test_in_flight_matches_the_schedule_tables():
    for name in ("gpipe", "1f1b"):
        for S in range(1, 7):
            for M in range(1, 17):
                table = make_schedule(name, S, M)
                assert in_flight(name, S, M) == tuple(table.max_in_flight(s) for s in range(S))


def test_memory_pads_every_stage_to_the_longest_and_zero_shards_states():
    m = tiny_model(n_layers=8)
    cm = CostModel(preset("cpu_single"), m, CostOptions(executor="megatron"))
    plan = Plan(pp=2, dp=4, tp=1, stage_layers=(6, 2), microbatches=4, global_batch=32,
                seq_len=128)
    pred = cm.predict(plan)
    slot = zr.model_state_bytes(m.layer_params, ZeroFactors(), zr.FP32)
    assert pred.padding_bytes == pytest.approx(4 * slot)
    sharded = cm.predict(dataclasses.replace(plan, zero=zr.named("zero3", 4, 4)))
    # 6 padded slots sharded 4 ways save 4.5 slots; the prefetched layer costs 0.5 back.
    assert sharded.stage_memory[1] < pred.stage_memory[1] - 4 * slot


def test_fp32_and_mixed_precision_state_bytes():
    assert zr.state_bytes_for("float32") == zr.FP32
    assert zr.state_bytes_for("bfloat16") == zr.MIXED_PRECISION
    assert sum(dataclasses.astuple(zr.FP32)) == sum(dataclasses.astuple(zr.MIXED_PRECISION)) == 16


def test_cost_options_are_checked():
    with pytest.raises(PlanError, match="efficiency"):
        CostOptions(efficiency=1.5)


# --- simulator -------------------------------------------------------------------------------------
def test_equal_stages_match_the_closed_form_and_bubble():
    for name in ("gpipe", "1f1b"):
        for S, M in ((1, 1), (2, 4), (4, 8), (8, 3)):
            sim = simulate(name, M, [1.0] * S, [2.0] * S)
            assert sim.step_time == pytest.approx(closed_form([1.0] * S, [2.0] * S, M))
            assert sim.bubble == pytest.approx((S - 1) / (M + S - 1))


def test_lower_bound_never_exceeds_the_simulation():
    # every schedule and placement, played either way where it can be: the search skips
    # simulating candidates by this bound (its fill and drain only where `chain` allows them).
    from hetjax.core.schedules import SCHEDULES
    from hetjax.planner.simulate import chain

    rng = random.Random(0)
    played = {}
    for _ in range(600):
        S, M = rng.randint(1, 6), rng.randint(1, 10)
        name = rng.choice(sorted(SCHEDULES))
        grid = SCHEDULES[name].spmd_compatible  # the tick grid: lockstep and folded
        placement = "folded" if grid and S > 1 and rng.random() < 0.3 else "looped"
        try:
            SCHEDULES[name].check(S * (2 if placement == "folded" else 1), M)
        except ValueError:  # the schedule's own rule on M and S (e.g. interleaved's)
            continue
        fwd = [rng.uniform(0.1, 2) for _ in range(S)]
        bwd = [rng.uniform(0.1, 4) for _ in range(S)]
        send = [rng.uniform(0, 0.5) for _ in range(S - 1)]
        sync = [rng.uniform(0, 3) for _ in range(S)]
        sim = simulate(name, M, fwd, bwd, send, send, sync, rng.uniform(0, 1),
                       lockstep=grid and rng.random() < 0.5, placement=placement)
        fill, drain = chain(name, placement == "folded")
        bound = lower_bound(fwd, bwd, M, send, send, sim.sync_exposed, fill=fill, drain=drain)
        assert bound <= sim.step_time + 1e-9, (name, placement, S, M)
        played[name, placement] = played.get((name, placement), 0) + 1
    assert {n for n, _ in played} == set(SCHEDULES) and any(p == "folded" for _, p in played)


def test_gradient_sync_hides_behind_the_last_backward():
    base = simulate("1f1b", 4, [1.0, 1.0], [2.0, 2.0])
    hidden = simulate("1f1b", 4, [1.0, 1.0], [2.0, 2.0], sync=[1.0, 1.0], overlap=1.0)
    exposed = simulate("1f1b", 4, [1.0, 1.0], [2.0, 2.0], sync=[1.0, 1.0], overlap=0.0)
    assert hidden.step_time == pytest.approx(base.step_time)
    assert exposed.step_time == pytest.approx(base.step_time + 1.0)
    assert exposed.stage_idle[0] == pytest.approx(exposed.step_time - 4 * 3.0)


def test_prediction_of_a_plan_without_communication_is_the_closed_form():
    m = tiny_model(n_layers=8)
    t = preset("cpu_single")
    cm = CostModel(t, m, CostOptions(overlap=1.0, executor="megatron"))
    plan = Plan(pp=8, dp=1, tp=1, stage_layers=(1,) * 8, microbatches=16, global_batch=16,
                seq_len=128)
    pred, sim = cm.predict(plan, with_events=True)
    stages = cm.stage_costs(Layout.of(plan))
    send, _ = cm.boundary_times(Layout.of(plan))
    fwd = [c.fwd(1) for c in stages]
    bwd = [c.bwd(1) for c in stages]
    assert pred.step_time >= closed_form(fwd, bwd, 16, send) - 1e-12
    assert pred.step_time == pytest.approx(closed_form(fwd, bwd, 16, send), rel=0.02)
    assert len(sim.events) == 2 * 8 * 16


# --- ZeRO factors ---------------------------------------------------------------------------------
def test_named_points():
    assert zr.named("ddp", 16, 8) == ZeroFactors(1, 1, 1, "ddp")
    assert zr.named("zero1", 16, 8) == ZeroFactors(1, 1, 16, "zero1")
    assert zr.named("zero2", 16, 8) == ZeroFactors(1, 16, 16, "zero2")
    assert zr.named("zero3", 16, 8) == ZeroFactors(16, 16, 16, "zero3")
    assert zr.named("mics", 16, 8) == ZeroFactors(8, 8, 8, "mics")
    with pytest.raises(PlanError, match="unknown ZeRO preset"):
        zr.named("zero4", 16, 8)


def test_space_keeps_amsps_constraints_and_contains_the_named_points():
    nodes = np.repeat(np.arange(4), 8)[None, :]  # a DP group of 32 on 4 nodes of 8
    space = zr.space(nodes)
    for f in space:
        assert 32 % f.s_os == 0 and f.s_os % f.s_p == 0 and f.s_g in (f.s_p, f.s_os)
        for s in (f.s_p, f.s_g, f.s_os):  # fill a node before spanning nodes
            assert 8 % s == 0 or s % 8 == 0
    triples = {(f.s_p, f.s_g, f.s_os) for f in space}
    assert zr.node_local_factor(nodes) == 8
    for name in zr.NAMED:
        f = zr.named(name, 32, 8)
        assert (f.s_p, f.s_g, f.s_os) in triples
    assert {f.name for f in space} >= set(zr.NAMED)
    with pytest.raises(PlanError, match="s_p | s_os | dp"):
        zr.check(ZeroFactors(2, 2, 3), 12)


def test_node_rule_is_checked_on_the_real_placement():
    # Members alternate between two nodes: only blocks holding whole nodes are allowed.
    alternating = np.array([[0, 1, 0, 1, 0, 1, 0, 1]])
    assert zr.valid_factors(alternating) == [1, 8]
    assert zr.node_local_factor(alternating) == 1
    assert [f.name for f in zr.space(alternating)][0] == "ddp"  # not mics, the same point
    # 6 members on nodes of 4 and 2: blocks of 2 stay inside a node, blocks of 3 do not.
    uneven = np.array([[0, 0, 0, 0, 1, 1]])
    assert zr.valid_factors(uneven) == [1, 2, 6]


def test_subgroups_follow_the_mesh_factoring():
    dp_groups = np.arange(8)[None, :]  # one DP group of 8, laid out (dp/s_os, s_os/s_p, s_p)
    g = zr.subgroups(dp_groups, ZeroFactors(2, 4, 4))
    assert g["p"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["replicas"].tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["os"].tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["shard"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["os_replicas"].tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_amsp_terms_vanish_for_plain_data_parallelism_but_its_sync():
    cm = CostModel(preset("holmes_infiniband"), tiny_model(), CostOptions(executor="megatron"))
    groups = np.arange(32)[None, :]
    ddp = cm.zero_times(ZeroFactors(), 1e6, groups)
    z3 = cm.zero_times(zr.named("zero3", 32, 8), 1e6, groups)
    assert ddp.gather == ddp.scatter == ddp.accumulate == ddp.refresh == 0.0
    assert ddp.sync > 0
    assert z3.gather > 0 and z3.scatter > 0
    assert z3.per_step(10, 4) > ddp.per_step(10, 4)


def test_hetjax_zero_gathers_once_per_step_and_keeps_the_gathered_parameters():
    """parallel/zero_sharding.py: P all-gathered once per step (and held), G reduce-scattered every
    micro-batch, reduce-scatter to OS and all-reduce across replicas after the loop."""
    t = preset("holmes_infiniband")
    hj = CostModel(t, tiny_model(), CostOptions(collectives="ring"))
    lk = t.clusters[0].nic
    groups = np.arange(32)[None, :]
    z1 = hj.zero_times(zr.named("zero1", 32, 8), 1e6, groups)
    # ZeRO-1: no per-micro-batch traffic; once per step a reduce-scatter over 32 (the OS
    # shard), no replicas left to all-reduce, and the refresh all-gather over 32.
    assert z1.scatter == 0.0
    assert z1.sync == pytest.approx(ring_time("reduce_scatter", 4e6, 32, lk))
    assert z1.refresh == pytest.approx(ring_time("all_gather", 4e6, 32, lk))
    z3 = hj.zero_times(zr.named("zero3", 32, 8), 1e6, groups)
    assert z3.gather == 0.0 and z3.scatter == pytest.approx(ring_time("reduce_scatter", 4e6,
                                                                      32, lk))
    assert z3.sync == pytest.approx(ring_time("all_gather", 4e6, 32, lk))
    sb = zr.FP32
    assert zr.step_state_bytes(1e6, zr.named("zero3", 32, 8), sb, "hetjax") == pytest.approx(
        1e6 * (16 / 32 + 4))
    assert zr.step_state_bytes(1e6, zr.named("zero3", 32, 8), sb, "megatron") == pytest.approx(
        1e6 * 16 / 32)


def test_cost_models_sharing_prices_price_a_subsets_stage_as_it_alone_would():
    """ZeRO's terms depend on the DP groups' clusters and node pattern, not on their ranks or
    the clusters' indices: the cost models of a topology and of a subset of it (the search's
    device subsets) share them (SharedPrices), each pricing as it would alone."""
    t = preset("holmes_hybrid")  # ib: ranks 0-15, roce: 16-31, two nodes of 8 each
    sub = t.without_nodes([0, 1])  # roce alone, as ranks 0-15 and cluster 0
    m, o = tiny_model(), CostOptions()
    shared = SharedPrices()
    whole, part = CostModel(t, m, o, shared), CostModel(sub, m, o, shared)
    alone = CostModel(sub, m, o)
    f = zr.named("zero3", 2, 1)
    groups = np.arange(16).reshape(2, 8).T  # 8 DP groups of one device on each of 2 nodes
    assert whole.network.shape_id(groups + 16) == part.network.shape_id(groups)
    assert whole.network.shape_id(groups) != part.network.shape_id(groups)  # ib, roce
    roce = whole.zero_times(f, 1e6, groups + 16)
    assert roce == alone.zero_times(f, 1e6, groups)
    assert part.zero_times(f, 1e6, groups) is roce  # priced once
    assert whole.zero_times(f, 1e6, groups).per_step(1, 1) < roce.per_step(1, 1)  # ib
    with pytest.raises(PlanError, match="one set of options"):
        CostModel(sub, m, CostOptions(collectives="ring"), shared)
    slower = dataclasses.replace(t, inter_cluster=dataclasses.replace(t.inter_cluster,
                                                                      bandwidth_gbps=1.0))
    with pytest.raises(PlanError, match="otherwise than"):
        CostModel(slower, m, o, shared)


# --- calibration on Holmes Table 1 ----------------------------------------------------------------
def test_calibrated_on_infiniband_the_model_predicts_ethernet():
    from hetjax.planner.reference_runs import (fit_efficiency, fit_nic_bandwidth, holmes_table1,
                                               predicted_samples_per_s)

    ib, roce, eth = holmes_table1(nominal=True)  # every link at its nominal rate
    eff = fit_efficiency(ib)
    options = CostOptions(efficiency=eff)
    assert predicted_samples_per_s(ib, options) == pytest.approx(99.23, rel=1e-4)
    assert eff == pytest.approx(0.70, abs=0.02)  # the default efficiency comes from this fit
    assert predicted_samples_per_s(eth, options) == pytest.approx(61.32, rel=0.05)
    # The nominal specs do not separate RoCE from InfiniBand (both 200 Gb/s); RoCE's row
    # implies a much lower effective bandwidth, Ethernet's its nominal 25 Gb/s.
    assert predicted_samples_per_s(roce, options) > 1.15 * 80.54
    assert fit_nic_bandwidth(roce, options) < 100
    assert fit_nic_bandwidth(eth, options) == pytest.approx(25, rel=0.1)


@pytest.mark.parametrize("row", ["infiniband", "roce", "ethernet"])
def test_catalogue_fabric_efficiencies_reproduce_each_holmes_table1_row(row):
    """The catalogue's per-fabric efficiencies and the default compute efficiency (fitted
    together on Table 1, see reference_runs.fit_fabrics) predict each row's samples/s."""
    from hetjax.planner.reference_runs import (HOLMES_TABLE1, holmes_table1,
                                               predicted_samples_per_s)

    m = {m.name: m for m in holmes_table1()}[row]
    assert m.topology.clusters[0].nic.efficiency == LINKS[row].efficiency
    assert predicted_samples_per_s(m, CostOptions()) == pytest.approx(HOLMES_TABLE1[row],
                                                                      rel=0.01)


def test_fit_fabrics_anchors_the_best_fabric_and_matches_the_catalogue():
    from hetjax.planner.reference_runs import fit_fabrics
    from hetjax.planner.cost import DEFAULT_EFFICIENCY

    fit = fit_fabrics()
    assert fit.anchor == "ethernet" and fit.fabric_efficiency["ethernet"] == 1.0
    assert fit.compute_efficiency == pytest.approx(DEFAULT_EFFICIENCY, abs=0.005)
    for fabric, eff in fit.fabric_efficiency.items():
        assert eff == pytest.approx(LINKS[fabric].efficiency, abs=0.005)
    # RoCE's row: about 53 Gb/s achieved of its nominal 200.
    assert 40 < fit.fabric_efficiency["roce"] * 200 < 60


# --- compute efficiency that depends on the kernel's size ------------------------------------------
def test_compute_curve_interpolates_efficiency_in_log_kernel_flops():
    from hetjax.planner.cost import ComputeCurve

    m = tiny_model()
    t = preset("cpu_single")
    tok = 8 / 8 * 128  # tokens per device per micro-batch (B = 8, dp = 8, M = 1)
    x = m.layer_flops(128) * tok
    # Measured at x / 10 (30% / 20% of peak) and x * 10 (60% / 40%): x sits midway in log.
    curve = ComputeCurve(flops=(x * 10, x / 10), fwd=(0.6, 0.3), bwd=(0.4, 0.2))
    assert curve.efficiency(x) == pytest.approx((0.45, 0.3))
    assert curve.efficiency(x * 1e6) == pytest.approx((0.6, 0.4))  # held beyond the range
    cm = CostModel(t, m, CostOptions(curves={"cpu": curve}))
    stage = cm.stage_costs(_layout(1, 8, M=1, B=8))[0]
    peak = t.clusters[0].accelerator.peak_tflops * 1e12
    assert stage.fwd_layer == pytest.approx(tok * m.layer_flops(128) / (peak * 0.45))
    assert stage.bwd_layer == pytest.approx(tok * 2 * m.layer_flops(128) / (peak * 0.3))
    # Bigger micro-batches run closer to peak: twice the tokens, less than twice the time.
    big = cm.stage_costs(_layout(1, 8, M=1, B=16))[0]
    assert big.fwd_layer < 2 * stage.fwd_layer
    # Another kind without a curve falls back to peak x efficiency.
    flat = CostModel(t, m, CostOptions(efficiency=0.5, curves={"a100": curve}))
    assert flat.stage_costs(_layout(1, 8, M=1, B=8))[0].fwd_layer == pytest.approx(
        tok * m.layer_flops(128) / (peak * 0.5))


def test_int8_boundaries_shrink_only_the_stage_boundaries_between_clusters():
    """pipeline.boundary_codec = int8: a boundary between two clusters carries 1 byte a value
    plus a 4-byte scale per row of d_model / tp values (fp32: 4 bytes a value); a boundary
    inside a cluster is unchanged. Priced with the transfer the cost model uses anyway."""
    t = preset("cpu_hybrid")  # two clusters of 4 devices
    m = tiny_model(n_layers=4)
    layout = _layout(4, 2, M=4, B=32)  # stages 0-1 on the first cluster, 2-3 on the second
    plain, packed = (CostModel(t, m, CostOptions(boundary_codec=c)) for c in ("none", "int8"))
    (t32, k32), (t8, k8) = plain.boundary_times(layout), packed.boundary_times(layout)
    assert k32 == k8 and t32[0] == t8[0] and t32[2] == t8[2]  # inside a cluster
    mesh = layout.mesh()
    pairs = np.stack([mesh[1].ravel(), mesh[2].ravel()], axis=1)
    tok, row = layout.tokens_per_device(), m.d_model
    assert t32[1] == pytest.approx(plain.transfer(tok * row * 4, pairs)[0])
    assert t8[1] == pytest.approx(plain.transfer(tok * (row + 4), pairs)[0])
    assert t8[1] < t32[1]


def test_unique_rows_is_numpys_unique_over_rows():
    from hetjax.planner.network import unique_rows

    rng = np.random.default_rng(0)
    for trial in range(50):
        rows = rng.integers(0, 1 + trial, size=(1 + trial * 3, 1 + trial % 5))
        if trial % 3 == 0:
            rows = rows % 2 == 0
        want = np.unique(rows, axis=0, return_index=True, return_inverse=True)
        got = unique_rows(rows, return_index=True, return_inverse=True)
        assert (got[0] == want[0]).all() and (got[1] == want[1]).all()
        assert (got[2] == want[2].ravel()).all()
        assert (unique_rows(rows) == np.unique(rows, axis=0)).all()


# --- overlap as scheduled, TP on the node's link ----------------------------------------------------
def _a100s(nodes=2, per_node=8, intra="nvlink", nic="infiniband"):
    return Topology("a100s", (make_cluster("a", nodes, per_node, "a100", nic, intra=intra),),
                    None)


def test_zero_traffic_overlaps_layer_by_layer_on_gpus_and_not_on_cpus():
    """Megatron / AMSP under ZeRO-3: each layer's gather is prefetched during the layer before
    and its reduce-scatter runs during the next layer's backward, so a layer costs the longer
    of its compute and its traffic, and a pass's first gather / last reduce-scatter stay
    exposed once. XLA:CPU overlaps nothing: there a layer costs compute + traffic."""
    m = holmes_model()
    for topo, overlaps in ((_a100s(), True), (preset("cpu_single"), False)):
        cm = CostModel(topo, m, CostOptions(executor="megatron"))
        dp = topo.num_devices
        lay = Layout(pp=1, dp=dp, tp=1, microbatches=1, global_batch=dp, seq_len=2048,
                     zero=zr.named("zero3", dp, topo.clusters[0].devices_per_node))
        (c,) = cm.stage_costs(lay)
        z = cm.zero_times(lay.zero, m.layer_params, lay.mesh()[0].T)
        compute_f, _, _ = cm.layer_times(topo.clusters[0].accelerator, lay, "full", False)
        assert z.gather > 0
        if overlaps:
            assert c.fwd_layer == pytest.approx(max(compute_f, z.gather))
            head_f, _, _ = cm.piece_times(topo.clusters[0].accelerator, lay, "head")
            assert c.fwd_fixed == pytest.approx(head_f + min(z.gather, compute_f))
        else:
            assert c.fwd_layer == pytest.approx(compute_f + z.gather)


def test_gradient_buckets_hide_behind_the_last_backward_all_but_the_last():
    """Asynchronous executors synchronise a layer's gradients as soon as the last backward
    has produced them: of a stage of n layers, n / (n + 1) of the sync may hide behind that
    backward (one bucket per layer and one for embedding and head); the SPMD executor in
    lockstep reduces after its loop, hiding nothing."""
    m = holmes_model()
    topo = _a100s()
    p = Plan(pp=2, dp=8, tp=1, stage_layers=(15, 15), microbatches=4, global_batch=32,
             seq_len=2048, schedule="1f1b")
    lay = Layout.of(p)
    for executor in ("mpmd", "megatron"):
        cm = CostModel(topo, m, CostOptions(executor=executor))
        stages = cm.stage_costs(lay)
        fwd = [c.fwd(15) for c in stages]
        bwd = [c.bwd(15) for c in stages]
        got = cm.exposed_sync(lay, stages, [15, 15], fwd, bwd)
        for c, f, b, e in zip(stages, fwd, bwd, got):
            sync, refresh = c.sync(15), c.refresh(15)
            hidden = min(15 / 16 * sync, b)
            # Megatron / AMSP also prefetch the refresh during the next step's forward
            ref = refresh - min(refresh, f) if executor == "megatron" else refresh
            assert e == pytest.approx(sync - hidden + ref)
    lock = CostModel(topo, m, CostOptions(executor="spmd"))
    stages = lock.stage_costs(lay)
    assert lock.exposed_sync(lay, stages, [15, 15], [0, 0], [1, 1]) == pytest.approx(
        [c.sync(15) + c.refresh(15) for c in stages])


def test_tensor_parallelism_on_pcie_shares_the_link_with_the_boundary():
    """TP all-reduces are priced on the node's own link; on PCIe the stage boundary's
    activations to and from the NIC cross the same lanes (through host memory without P2P,
    at half the rate), so TP waits for them once per micro-batch; on NVLink it does not."""
    m = tiny_model(n_layers=4)
    p = Plan(pp=2, dp=1, tp=4, stage_layers=(2, 2), microbatches=2, global_batch=8,
             seq_len=128, schedule="1f1b")
    lay = Layout.of(p)
    tok = lay.tokens_per_device()
    boundary = 2 * tok * m.d_model * 4 / 4  # in and out, f32, split over tp = 4
    shared = {}
    for intra in ("nvlink", "pcie4", "pcie4_no_p2p"):
        cm = CostModel(_a100s(2, 4, intra=intra), m)
        shared[intra] = cm.pcie_shared(lay, lay.mesh()[0].ravel())
        tp_link = cm.group_links(lay.mesh()[0])[0]
        assert tp_link == LINKS[intra]  # TP priced on the node's link
    assert shared["nvlink"] == 0.0
    assert shared["pcie4"] == pytest.approx(boundary / LINKS["pcie4"].bytes_per_s)
    assert shared["pcie4_no_p2p"] == pytest.approx(2 * shared["pcie4"])
    # two stages on one node: the boundary stays inside, nothing shares the NIC's path
    one = CostModel(_a100s(1, 8, intra="pcie4"), m)
    assert one.pcie_shared(lay, lay.mesh()[0].ravel()) == 0.0


def test_zero_points_with_equal_axis_patterns_have_the_same_groups():
    """The cost model prices a ZeRO collective's links once per axis pattern: every pair of
    (s_os, s_p, axes) with equal `axis_pattern` must give the same rank groups, each listed in
    the same order (a group's first and last member choose its intra-node link), and patterns
    that differ must give different groups."""
    import itertools

    rng = np.random.default_rng(0)
    for dp in (1, 2, 6, 8, 12, 32):
        dp_groups = rng.permutation(3 * dp).reshape(3, dp)
        groups_of: dict[tuple, list] = {}
        for s_os in [d for d in range(1, dp + 1) if dp % d == 0]:
            for s_p in [d for d in range(1, s_os + 1) if s_os % d == 0]:
                f = ZeroFactors(s_p, s_p, s_os)
                for r in range(4):
                    for axes in itertools.combinations(("dp", "dp_os", "dp_p"), r):
                        rows = sorted(map(tuple, zr.axis_groups(dp_groups, f, axes).tolist()))
                        got = groups_of.setdefault(zr.axis_pattern(dp, s_os, s_p, axes), rows)
                        assert got == rows, (dp, s_os, s_p, axes)
        distinct = list(groups_of.values())
        assert len({tuple(g) for g in distinct}) == len(distinct)

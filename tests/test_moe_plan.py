"""Planning an MoE model: the all-to-all priced per link (against the compiled program's), the
expert-parallel placement rule, the EP degree searched, the experts' memory, and a job across
two clusters with EP inside each and the pipeline across."""

import dataclasses

import numpy as np
import pytest
from conftest import tiny_config

from hetjax.core import hlo
from hetjax.core import topology as topo
from hetjax.core.model_config import ModelConfig
from hetjax.core.plan import Plan
from hetjax.planner import placement
from hetjax.planner.cost import CostModel, CostOptions
from hetjax.planner.layout import Layout
from hetjax.planner.network import Network
from hetjax.planner.search import plan as search

MOE = ModelConfig(vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=128,
                  n_experts=8, experts_per_token=2, moe_d_ff=64)
MOE_FIELDS = {"model.n_experts": 8, "model.experts_per_token": 2, "model.moe_d_ff": 64,
              "model.moe_z_loss_coef": 0.001, "model.moe_aux_loss_coef": 0.05}


def test_all_to_all_is_priced_on_each_link_it_crosses():
    """cpu_hybrid's InfiniBand cluster: an EP group of 4 is two nodes of two. A member sends
    V / 4 to its node peer over NVLink and V / 4 to each of the two off-node peers through its
    node's NIC, which carries both members' off-node payload: max(V/4 / nvlink, V / IB) + the
    slower latency."""
    t = topo.preset("cpu_hybrid")
    net = Network(t)
    V = 8e6
    time, kinds = net.all_to_all(V, np.array([[0, 1, 2, 3]]))
    ib, nv = t.clusters[0].nic, t.clusters[0].intra_node
    expected = max(V / 4 / nv.bytes_per_s, V / ib.bytes_per_s) + max(ib.latency_s,
                                                                     nv.latency_s)
    assert time == pytest.approx(expected) and kinds == {"nvlink": 1, "infiniband": 2}
    # across the clusters: the Ethernet link between them carries every cross flow
    time, kinds = net.all_to_all(V, np.array([[2, 4]]))
    eth = t.cluster_link(0, 1)
    assert kinds == {"ethernet": 1}
    assert time >= V / 2 / eth.bytes_per_s
    assert net.all_to_all(V, np.array([[0]]))[0] == 0.0


def test_expert_parallel_groups_stay_inside_an_island():
    """pp = 2 on cpu_hybrid puts a stage on each cluster: EP over 4 devices crosses the RoCE
    cluster's NIC (refused), EP over 2 stays inside its nodes (NVLink); the InfiniBand
    cluster takes EP over its two nodes."""
    t = topo.preset("cpu_hybrid")
    base = Plan(pp=2, dp=4, tp=1, stage_layers=(2, 2), microbatches=2, global_batch=8,
                seq_len=16)
    ep4 = dataclasses.replace(base, ep=4)
    problems = placement.placement_problems(ep4, t)
    assert len(problems) == 1 and "expert-parallel group [4, 5, 6, 7] crosses roce" in problems[0]
    assert placement.placement_problems(dataclasses.replace(base, ep=2), t) == []
    one = dataclasses.replace(base, pp=1, dp=4, stage_layers=(4,), device_order=(0, 1, 2, 3,
                                                                                4, 5, 6, 7)[:4])
    assert placement.placement_problems(dataclasses.replace(one, ep=4), t) == []
    with pytest.raises(Exception, match="ep so each expert-parallel group fits"):
        placement.refuse_straddle(problems)
    lines = "\n".join(dataclasses.replace(base, ep=2).group_lines(t))
    assert "ep groups: 4 of 2, e.g. 0-1; links: nvlink" in lines


def test_planner_searches_the_ep_degree_and_counts_the_experts_memory():
    """holmes_hybrid (an InfiniBand and a RoCE cluster of 2 x 8 A100s 80 GB): 64 experts of
    width 4096 per layer do not fit one device's memory without EP (26 GB of states per layer
    at 16 bytes a parameter); the search prices every EP degree whose groups stay inside the
    RoCE cluster's nodes (ep <= 8) and picks one that fits."""
    t = topo.preset("holmes_hybrid")
    model = dataclasses.replace(MOE, d_model=2048, n_heads=16, n_kv_heads=8, d_ff=8192,
                                moe_d_ff=4096, n_layers=8, n_experts=64, experts_per_token=4,
                                vocab_size=32000, dtype="bfloat16")
    r = search(t, model, 64, 2048, pp=2, tp=1, schedule="1f1b", zero="ddp", ep=0,
               options=CostOptions(), prune=False)
    best = r.plan
    assert best.ep in (2, 4, 8) and not placement.placement_problems(best, t)
    # the other degrees were priced beside it, ep = 1 among those that do not fit
    assert "do not" in best.predicted["bound"]["ep"]
    described = best.describe(t)
    assert f"ep={best.ep}" in described and "ep groups:" in described
    # every degree priced: more EP, fewer experts per device, less memory
    cm = CostModel(t, model)
    lay = Layout.of(best)
    mem = {e: max(s.memory(2, 4) for s in cm.stage_costs(dataclasses.replace(lay, ep=e)))
           for e in (1, 2, 4, 8)}
    assert mem[1] > mem[2] > mem[4] > mem[8]
    per_device = {e: cm.layer_params_per_device(dataclasses.replace(lay, ep=e))
                  for e in (1, 8)}
    assert per_device[1] - per_device[8] == pytest.approx(model.expert_params * 7 / 8)


@pytest.mark.parametrize("dispatch", ["capacity",
                                      pytest.param("dropless", marks=pytest.mark.slow)])
def test_compiled_all_to_alls_equal_the_cost_models(dispatch):
    """The all-to-alls of the compiled step (bytes, replica groups over 'expert', executions)
    are the ones the cost model prices."""
    from hetjax.train import Trainer

    config = tiny_config(**{**MOE_FIELDS, "topology.preset": "cpu_single",
                            "topology.devices_per_node": 4, "parallel.dp": 4, "parallel.ep": 4,
                            "train.microbatches": 2, "model.remat": "none",
                            "model.moe_dispatch": dispatch, "model.moe_capacity_factor": 1.0})
    trainer = Trainer(config, quiet=True)
    compiled = trainer.executor.compiled_step(trainer.state)
    got = {}  # (bytes, group size) -> executions per step, over the program's all-to-alls
    for c in hlo.collectives(compiled.as_text(), dict(trainer.executor.mesh.shape)):
        if c.kind == "all-to-all":
            assert c.axes == ("expert",) and not c.conditional
            got[c.nbytes, c.group_size] = got.get((c.nbytes, c.group_size), 0) + c.count
    cm = CostModel(trainer.topology, trainer.executor.model_cfg)
    want = {(v, p): n for v, p, n in cm.expert_all_to_alls(Layout.of(trainer.plan))}
    assert got == want and len(want) == (1 if dispatch == "capacity" else 2)


@pytest.mark.slow
def test_moe_across_two_clusters_ep_inside_each_pipeline_across():
    """cpu_hybrid: a stage on each cluster (pp = 2, the MPMD executor), EP over each node's two
    devices: the single device's losses and parameters (its micro-batches split like the
    EP groups' rows, which the balance loss is computed over). The planner's plan for the
    same job keeps EP inside the islands and prices the alternatives."""
    from test_moe_parallel import assert_same_run, run

    from hetjax.planner import plan_from_config
    from hetjax.planner.config_plan import plan_job

    layout = {"parallel.pp": 2, "parallel.dp": 4, "parallel.ep": 2, "train.microbatches": 2,
              "pipeline.executor": "mpmd"}
    got = run(2, **{**layout, "topology.preset": "cpu_hybrid"})  # 2 devices a node
    assert got[0].plan.ep == 2
    ref = run(1, **{"parallel.dp": 1, "train.microbatches": 4})
    assert_same_run(got, ref)
    c = tiny_config(**{**MOE_FIELDS, "topology.preset": "cpu_hybrid", "parallel.pp": 2,
                       "parallel.tp": 1, "parallel.ep": 0, "pipeline.executor": "mpmd"})
    result = plan_job(c, topo.preset("cpu_hybrid")).search
    assert result.plan.ep in (1, 2) and "ep" in result.plan.predicted["bound"]
    assert plan_from_config(c, topo.preset("cpu_hybrid")).ep == result.plan.ep

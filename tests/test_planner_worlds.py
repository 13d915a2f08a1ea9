"""Worlds: stages sharing one fabric and accelerator kind form one JAX world, each world's
processes get their own cluster's stock NCCL settings (no socket fallback for data
parallelism), and `hetjax plan` prints which world runs which stages."""

import pytest

from hetjax.distributed import process_slots
from hetjax.errors import PlanError
from hetjax.core.plan import Plan
from hetjax.planner.worlds import plan_worlds, world_lines
from hetjax.core.topology import preset
from hetjax.parallel import nic


def mpmd(pp, dp, tp, executor="mpmd"):
    return Plan(pp=pp, dp=dp, tp=tp, stage_layers=(1,) * pp, microbatches=1,
                global_batch=dp, seq_len=8, executor=executor)


def env_of(topo, plan, worlds):
    return lambda w, slot: nic.world_environment(topo, plan, w, slot, num_worlds=len(worlds))


def test_holmes_hybrid_has_one_world_per_cluster_with_its_own_rdma_settings():
    topo = preset("holmes_hybrid")  # 2 clusters x 2 nodes x 8 A100
    plan = mpmd(4, 8, 1)  # stages 0, 1 on the IB cluster, 2, 3 on RoCE
    worlds = plan_worlds(plan, topo)
    assert [w.stages for w in worlds] == [(0, 1), (2, 3)]
    assert [w.processes for w in worlds] == [(0, 1), (2, 3)]
    slots = process_slots(topo, topo.num_nodes)
    for w in worlds:
        for p in w.processes:
            env = nic.world_environment(topo, plan, w, slots[p], num_worlds=2)
            assert env["NCCL_NET"] == "IB" and env["HETJAX_WORLD"] == str(w.index)
            assert ("NCCL_IB_GID_INDEX" in env) == (w.index == 1)  # RoCE only
    # every data-parallel group stays inside one world, so it runs on its cluster's RDMA NIC
    owner = {r: w.index for w in worlds for r in w.ranks}
    for g in plan.dp_groups():
        assert len({owner[r] for r in g}) == 1
    lines = world_lines(plan, topo, env_of(topo, plan, worlds))
    assert lines[0].startswith("worlds: 2")
    assert "world 0: stages 0-1 on ib (a100), 2 process(es), NCCL_NET=IB" in lines[1]
    assert "NCCL_IB_GID_INDEX=3" in lines[2]
    assert lines[3].strip() == "bridge: stage 1 (world 0) <-> stage 2 (world 1) over ethernet"


def test_accelerator_kinds_split_worlds_and_spmd_plans_are_one_world():
    topo = preset("hethub_mixed")  # one cluster of a100, one of ascend910b
    worlds = plan_worlds(mpmd(2, 8, 1), topo)
    assert [w.accelerator for w in worlds] == ["a100", "ascend910b"]
    assert len(plan_worlds(mpmd(2, 8, 1, executor="spmd"), topo)) == 1
    lines = world_lines(mpmd(2, 8, 1, executor="spmd"), topo, lambda w, s: {})
    assert lines == ["worlds: one (all 2 stages in one jax.distributed job)"]


def test_a_process_in_two_worlds_is_an_error():
    topo = preset("holmes_hybrid", nodes=1)  # 2 nodes, one per cluster, 8 devices each
    slots = process_slots(topo, 1)  # one process for both clusters
    with pytest.raises(PlanError, match="process 0 .* runs devices of world 0 and world 1"):
        plan_worlds(mpmd(2, 8, 1), topo, slots)
    with pytest.raises(PlanError, match="process 0 is not in world 1"):
        w = plan_worlds(mpmd(2, 8, 1), topo)[1]
        nic.world_environment(topo, mpmd(2, 8, 1), w, process_slots(topo, 2)[0])


def test_hetjax_plan_proposes_int8_boundaries_for_mpmd_stages_on_a_slow_link(capsys):
    """Two university sites (DT-FM's preset) with a pipeline stage each: the MPMD plan gets the
    int8 proposal, priced by the cost model with and without the codec; with the codec
    already on, or on the SPMD executor (which has no codec), it does not."""
    from hetjax.cli import main
    from hetjax.cli import default_job_path
    from hetjax.config import build_topology, load_config
    from hetjax.planner import plan_from_config
    from hetjax.planner.config_plan import predict_for_config
    from hetjax.units import seconds

    flags = ["--config.topology.preset=dtfm_multi_university", "--config.topology.nodes=2",
             "--config.train.batch_size=64", "--config.parallel.pp=2", "--config.parallel.dp=0",
             "--config.parallel.tp=1"]
    proposal = "int8 pipeline boundaries (--config.pipeline.boundary_codec=int8)"
    assert main(["hetjax", "plan", *flags, "--config.pipeline.executor=mpmd"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith(proposal)]
    c = load_config(default_job_path(), [*flags, "--config.pipeline.executor=mpmd"])
    top = build_topology(c)
    p = plan_from_config(c, top)
    plain = predict_for_config(c, p, top).step_time
    packed = predict_for_config(c, p, top, boundary_codec="int8").step_time
    assert packed < 0.98 * plain
    assert line == [f"{proposal}: predicted step {seconds(packed)} instead of {seconds(plain)} "
                    f"({1 - packed / plain:.0%} faster); activations and their gradients cross "
                    "clusters as int8 with a scale per row (loss over 300 steps: docs/diloco.md)"]
    base = ["hetjax", "plan", *flags]
    for extra in ("--config.pipeline.boundary_codec=int8", "--config.pipeline.executor=spmd"):
        extra = [extra] if "spmd" in extra else ["--config.pipeline.executor=mpmd", extra]
        assert main([*base, *extra]) == 0
        assert proposal not in capsys.readouterr().out

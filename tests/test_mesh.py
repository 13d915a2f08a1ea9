"""Mesh placement: Holmes' group formulas, TP inside nodes, DP inside clusters."""

import dataclasses

import numpy as np
import pytest

from conftest import holmes_dp_group, holmes_pp_group, holmes_tp_group
from hetjax.core import topology as topo
from hetjax.errors import PlanError
from hetjax.core.plan import Plan, ZeroFactors
from hetjax.planner import placement
from hetjax.parallel import mesh as pmesh


def test_holmes_group_formulas_match_the_worked_example():
    # 2 clusters x 2 nodes x 4 GPUs, t=2, d=4, p=2 (1-indexed ranks, as in the paper)
    t, d, p = 2, 4, 2
    assert [holmes_tp_group(i, t, d, p) for i in (1, 2)] == [[1, 2], [3, 4]]
    assert [holmes_pp_group(i, t, d, p) for i in (1, 2)] == [[1, 9], [2, 10]]
    assert [holmes_dp_group(i, t, d, p) for i in range(1, 5)] == [
        [1, 3, 5, 7], [2, 4, 6, 8], [9, 11, 13, 15], [10, 12, 14, 16]]


def test_plan_groups_equal_holmes_formulas():
    t, d, p = 2, 4, 2
    plan = Plan(pp=p, dp=d, tp=t, stage_layers=(15, 15), microbatches=4, global_batch=16,
                seq_len=8)
    one = lambda groups: sorted(sorted(r + 1 for r in g) for g in groups)  # noqa: E731
    assert one(plan.tp_groups()) == sorted(holmes_tp_group(i, t, d, p)
                                           for i in range(1, p * d + 1))
    assert one(plan.pp_groups()) == sorted(holmes_pp_group(i, t, d, p)
                                           for i in range(1, t * d + 1))
    assert one(plan.dp_groups()) == sorted(holmes_dp_group(i, t, d, p)
                                           for i in range(1, p * t + 1))


def test_mesh_places_tp_in_nodes_and_dp_in_clusters_for_holmes_preset():
    t = topo.preset("holmes_hybrid", nodes=2, devices_per_node=2)  # 8 devices
    plan = Plan(pp=2, dp=2, tp=2, stage_layers=(1, 1), microbatches=2, global_batch=4,
                seq_len=8)
    mesh = pmesh.build_mesh(plan, t)
    ids = np.vectorize(lambda dv: dv.id)(mesh.devices).reshape(2, 2, 2)  # (pp, dp, tp)
    node_of = {dv.id: t.devices[r].global_node for r, dv in enumerate(t.jax_devices())}
    cluster_of = {dv.id: t.devices[r].cluster for r, dv in enumerate(t.jax_devices())}
    for s in range(2):
        for d in range(2):
            assert len({node_of[i] for i in ids[s, d, :]}) == 1  # a TP group is one node
        for k in range(2):
            assert len({cluster_of[i] for i in ids[s, :, k]}) == 1  # a DP group one cluster
        assert {cluster_of[i] for i in ids[s].ravel()} == {s}  # stage s is cluster s
    assert ids[:, 0, 0].tolist() == [0, 4]  # pipeline pairs cross clusters
    assert placement.check_placement(plan, t) == []


def test_zero_sub_axes_factor_dp_with_p_innermost():
    t = topo.preset("cpu_single")
    plan = Plan(pp=1, dp=8, tp=1, stage_layers=(2,), microbatches=1, global_batch=8,
                seq_len=8, zero=ZeroFactors(2, 2, 4, "custom"))
    mesh = pmesh.build_mesh(plan, t)
    assert dict(mesh.shape) == {"pp": 1, "dp": 2, "dp_os": 2, "dp_p": 2, "expert": 1, "tp": 1}
    ids = np.vectorize(lambda dv: dv.id)(mesh.devices)
    assert ids[0, 0, 0, :, 0, 0].tolist() == [0, 1]  # a P group is adjacent ranks
    # expert parallelism: the innermost data axis, an EP group adjacent ranks, ZeRO beside it
    ep = dataclasses.replace(plan, ep=2, zero=ZeroFactors(2, 2, 2, "custom"))
    mesh = pmesh.build_mesh(ep, t)
    assert dict(mesh.shape) == {"pp": 1, "dp": 2, "dp_os": 1, "dp_p": 2, "expert": 2, "tp": 1}
    ids = np.vectorize(lambda dv: dv.id)(mesh.devices)
    assert ids[0, 0, 0, 0, :, 0].tolist() == [0, 1] and ep.ep_groups()[1] == [2, 3]
    assert ids[0, 0, 0, :, 0, 0].tolist() == [0, 2]  # a P group: one device of each EP group
    with pytest.raises(PlanError, match="s_os x ep | dp"):
        pmesh.mesh_shape(dataclasses.replace(plan, ep=4))
    with pytest.raises(PlanError, match="s_p | s_os | dp"):
        pmesh.mesh_shape(Plan(pp=1, dp=8, tp=1, stage_layers=(2,), microbatches=1,
                              global_batch=8, seq_len=8, zero=ZeroFactors(3, 3, 3)))


def test_tp_across_nodes_is_refused_unless_allowed():
    t = topo.preset("cpu_hybrid")  # 2 devices per node
    plan = Plan(pp=1, dp=2, tp=4, stage_layers=(2,), microbatches=1, global_batch=4,
                seq_len=8)
    with pytest.raises(PlanError) as e:
        placement.check_placement(plan, t)
    assert "TP group [0, 1, 2, 3] spans 2 nodes" in str(e.value)
    assert "allow_straddle" in str(e.value)
    with pytest.warns(UserWarning, match="crosses infiniband"):
        notes = placement.check_placement(plan, t, allow_straddle=True)
    assert any("spans 2 nodes" in n for n in notes)


def test_stage_across_clusters_is_refused():
    t = topo.preset("cpu_hybrid")
    # device order that puts ranks of both clusters into stage 0
    order = (0, 4, 1, 5, 2, 6, 3, 7)
    plan = Plan(pp=2, dp=2, tp=2, stage_layers=(1, 1), microbatches=2, global_batch=4,
                seq_len=8, device_order=order)
    with pytest.raises(PlanError, match="stage 0 spans clusters"):
        placement.check_placement(plan, t)


def test_single_stage_on_two_clusters_notes_dp_crossing():
    t = topo.preset("cpu_hybrid")
    plan = Plan(pp=1, dp=4, tp=2, stage_layers=(2,), microbatches=1, global_batch=8,
                seq_len=8)
    notes = placement.check_placement(plan, t)
    assert notes and "DP groups span clusters" in notes[0] and "ethernet" in notes[0]


def test_stage_across_unequal_clusters_is_refused_or_warned_with_its_link():
    # clusters of 6 and 2 devices: with stages of 4, stage 1 takes 2 devices from each
    t = topo.Topology(name="uneven", clusters=(
        topo.make_cluster("a", 3, 2, "cpu", "infiniband"),
        topo.make_cluster("b", 1, 2, "cpu", "roce")), inter_cluster=topo.LINKS["ethernet"])
    plan = Plan(pp=2, dp=2, tp=2, stage_layers=(1, 1), microbatches=2, global_batch=4,
                seq_len=8)
    with pytest.raises(PlanError, match=r"stage 1 spans clusters \['a', 'b'\]"):
        placement.check_placement(plan, t)
    with pytest.warns(UserWarning, match="DP reduction crosses ethernet"):
        notes = placement.check_placement(plan, t, allow_straddle=True)
    assert any("stage 1 spans clusters" in n for n in notes)


def test_plan_and_train_refuse_a_tp_group_across_nodes_with_the_same_message(capsys):
    from hetjax import cli

    straddle = ["--config.parallel.pp=1", "--config.parallel.tp=4",
                "--config.model.n_kv_heads=4"]  # cpu_hybrid: nodes of 2 devices
    errors = {}
    for command in ("plan", "train"):
        assert cli.main(["hetjax", command, *straddle]) == 2
        errors[command] = capsys.readouterr().err
    assert "TP group [0, 1, 2, 3] spans 2 nodes" in errors["plan"]
    assert errors["plan"] == errors["train"]
    assert cli.main(["hetjax", "plan", *straddle, "--config.parallel.allow_straddle=True"]) == 0
    assert "tp=4" in capsys.readouterr().out

"""NIC environment: each process gets its cluster's NCCL settings, every group's link class
matches Holmes' worked example, and the XLA GPU flags exist in this jaxlib."""

import os
import subprocess
import sys

import pytest

from conftest import holmes_dp_group, holmes_pp_group, holmes_tp_group
from hetjax.distributed import DistributedError, ProcessSlot, process_slots
from hetjax.errors import HetjaxError, PlanError
from hetjax.core.hardware import CPU_COLLECTIVE_PATIENCE, merge_xla_flags, simulated_cpu_flags
from hetjax.core.plan import Plan
from hetjax.core.topology import NicSettings, Topology, LINKS, make_cluster, preset
from hetjax.parallel import nic


def plan(pp, dp, tp):
    return Plan(pp=pp, dp=dp, tp=tp, stage_layers=(1,) * pp, microbatches=1,
                global_batch=dp, seq_len=8)


IB_HCAS = "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1"
ROCE_HCAS = "mlx5_bond_0:1,mlx5_bond_1:1"


def test_each_holmes_process_gets_its_clusters_hca_and_gid():
    topo = preset("holmes_hybrid")  # 2 clusters x 2 nodes x 8 A100
    slots = process_slots(topo, topo.num_nodes)
    envs = [nic.process_environment(topo, plan(2, 8, 2), s) for s in slots]
    for env in envs[:2]:  # InfiniBand cluster
        assert env["NCCL_IB_HCA"] == IB_HCAS
        assert "NCCL_IB_GID_INDEX" not in env
    for env in envs[2:]:  # RoCE cluster
        assert env["NCCL_IB_HCA"] == ROCE_HCAS
        assert env["NCCL_IB_GID_INDEX"] == "3"
    for env in envs:
        assert (env["NCCL_NET"], env["NCCL_IB_DISABLE"]) == ("IB", "0")
        assert env["NCCL_NET_GDR_LEVEL"] == "PHB"
        assert env["NCCL_SOCKET_IFNAME"] == "eth0"
        flags = env["XLA_FLAGS"].split()
        assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
        assert "--xla_gpu_enable_pipelined_p2p=true" in flags  # pp = 2
        assert "JAX_PLATFORMS" not in env  # real GPUs: no simulated devices


def test_settings_come_from_the_topology_config():
    custom = NicSettings(hcas=("mlx5_4:1",), gid_index=1, socket_ifname="ens1f0",
                         gdr_level="SYS")
    topo = Topology(name="t", clusters=(
        make_cluster("a", 1, 8, "h100", "roce", settings=custom),
        make_cluster("b", 1, 8, "h100", "ethernet")), inter_cluster=LINKS["ethernet"])
    a, b = (nic.process_environment(topo, plan(2, 8, 1), s) for s in process_slots(topo, 2))
    assert a == {**a, "NCCL_NET": "IB", "NCCL_IB_HCA": "mlx5_4:1", "NCCL_IB_GID_INDEX": "1",
                 "NCCL_SOCKET_IFNAME": "ens1f0", "NCCL_NET_GDR_LEVEL": "SYS"}
    assert b["NCCL_NET"] == "Socket" and b["NCCL_IB_DISABLE"] == "1"
    assert (b["NCCL_SOCKET_NTHREADS"], b["NCCL_NSOCKS_PERTHREAD"]) == ("4", "4")
    assert not any(k.startswith("NCCL_IB_") and k != "NCCL_IB_DISABLE" for k in b)


def test_socket_policy_and_processes_spanning_clusters_use_sockets():
    topo = preset("holmes_hybrid", devices_per_node=4)
    slots = process_slots(topo, 4)
    for s in slots:
        env = nic.process_environment(topo, plan(2, 4, 2), s, policy="socket")
        assert env["NCCL_NET"] == "Socket" and "NCCL_IB_HCA" not in env
    # One process over both clusters (a one-process simulation): no single RDMA fabric.
    (whole,) = process_slots(topo, 1)
    assert nic.nccl_env(topo, whole)["NCCL_NET"] == "Socket"
    with pytest.raises(HetjaxError, match="policy 'fast' is unknown"):
        nic.nccl_env(topo, whole, policy="fast")


def test_group_links_match_the_holmes_worked_example():
    """2 clusters x 2 nodes x 4 GPUs, t=2, d=4, p=2 (spec/holmes.md, 1-indexed there)."""
    topo = preset("holmes_hybrid", devices_per_node=4)
    links = nic.group_links(plan(2, 4, 2), topo)
    t, d, p = 2, 4, 2

    def by_axis(axis):
        return {g.ranks: g for g in links if g.axis == axis}

    tp, dp, pp = by_axis("tp"), by_axis("dp"), by_axis("pp")
    assert set(tp) == {tuple(r - 1 for r in holmes_tp_group(i, t, d, p))
                       for i in range(1, p * d + 1)}
    assert set(pp) == {tuple(r - 1 for r in holmes_pp_group(i, t, d, p))
                       for i in range(1, t * d + 1)}
    assert set(dp) == {tuple(r - 1 for r in holmes_dp_group(i, t, d, p))
                       for i in range(1, p * t + 1)}
    assert all(g.link == "nvlink" and g.nccl_net == "in-process" for g in tp.values())
    assert pp[(0, 8)].link == "ethernet" and pp[(0, 8)].processes == (0, 2)
    assert all(g.link == "ethernet" for g in pp.values())
    assert dp[(0, 2, 4, 6)].link == dp[(1, 3, 5, 7)].link == "infiniband"
    assert dp[(8, 10, 12, 14)].link == dp[(9, 11, 13, 15)].link == "roce"
    assert all(g.nccl_net == "IB" for g in dp.values())
    report = nic.link_report(plan(2, 4, 2), topo)
    assert "dp    2       infiniband  IB          [0, 2, 4, 6] [1, 3, 5, 7]" in report
    assert "dp    2       roce        IB          [8, 10, 12, 14] [9, 11, 13, 15]" in report
    assert "pp    8       ethernet    IB          [0, 8] [1, 9] ..." in report


def test_stock_nccl_notes_name_groups_that_leave_their_fabric():
    hybrid = preset("holmes_hybrid", devices_per_node=4)
    (note,) = nic.stock_nccl_notes(plan(2, 4, 2), hybrid)
    assert note.startswith("8 pp group(s), e.g. [0, 8] across clusters ib/roce")
    assert "--nic-policy=socket" in note
    assert nic.stock_nccl_notes(plan(2, 4, 2), hybrid, policy="socket") == []
    (note,) = nic.stock_nccl_notes(plan(1, 8, 2), hybrid)  # pp = 1: DP spans both clusters
    assert note.startswith("2 dp group(s)")
    assert nic.stock_nccl_notes(plan(1, 4, 2), preset("holmes_infiniband", nodes=2,
                                                      devices_per_node=4)) == []
    with pytest.raises(PlanError, match="plan uses ranks up to 31 but .* has 16 devices"):
        nic.group_links(plan(1, 16, 2), hybrid)


def test_cpu_processes_get_their_share_of_simulated_devices():
    topo = preset("cpu_hybrid")
    envs = [nic.process_environment(topo, plan(1, 8, 1), s) for s in process_slots(topo, 2)]
    assert [e["XLA_FLAGS"].split()[0] for e in envs] == \
        ["--xla_force_host_platform_device_count=4"] * 2
    assert all(set(CPU_COLLECTIVE_PATIENCE) <= set(e["XLA_FLAGS"].split()) for e in envs)
    assert all(e["JAX_PLATFORMS"] == "cpu" for e in envs)
    assert [e["NCCL_IB_HCA"] for e in envs] == [IB_HCAS, ROCE_HCAS]


def test_process_slots_own_whole_consecutive_nodes():
    topo = preset("cpu_hybrid")  # 4 nodes x 2 devices
    assert process_slots(topo, 2) == (
        ProcessSlot(0, (0, 1), (0, 1, 2, 3), (0,)), ProcessSlot(1, (2, 3), (4, 5, 6, 7), (1,)))
    assert [s.ranks for s in process_slots(topo, 4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    with pytest.raises(DistributedError, match=r"must divide the node count. Use one of "
                                               r"\[1, 2, 4\]"):
        process_slots(topo, 8)


def test_merge_environment_merges_xla_flags_by_name():
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d",
            "NCCL_NET": "Socket"}
    ours = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "NCCL_NET": "IB",
            "NCCL_IB_HCA": "mlx5_0"}
    merged = nic.merge_environment(base, ours, override=True)
    assert merged["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=4",
                                           "--xla_dump_to=/tmp/d"]
    assert (merged["NCCL_NET"], merged["NCCL_IB_HCA"]) == ("IB", "mlx5_0")
    kept = nic.merge_environment(base, ours, override=False)
    assert "--xla_force_host_platform_device_count=8" in kept["XLA_FLAGS"].split()
    assert (kept["NCCL_NET"], kept["NCCL_IB_HCA"]) == ("Socket", "mlx5_0")


def _jax_accepts(flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          capture_output=True, text=True, timeout=120)


def test_xla_gpu_flags_exist_in_this_jaxlib():
    """XLA aborts on an unknown flag in XLA_FLAGS, so every flag hetjax sets must parse."""
    flags = nic.XLA_GPU_FLAGS_ALWAYS + nic.XLA_GPU_FLAGS_ZERO + nic.XLA_GPU_FLAGS_PIPELINE
    ok = _jax_accepts(" ".join(flags))
    assert ok.returncode == 0, ok.stderr[-2000:]
    bad = _jax_accepts("--xla_gpu_enable_latency_hiding_scheduler_typo=true")
    assert bad.returncode != 0 and "Unknown flag" in bad.stderr


# Device 1 reaches the psum `late` seconds after device 0 (a host callback sleeps first).
LATE_PEER = """
import sys, time
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import io_callback
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jax.make_mesh((2,), ("x",))
late = float(sys.argv[1])

def wait(i):
    if int(i) == 1:
        time.sleep(late)
    return np.float32(1.0)

def body(x):
    y = io_callback(wait, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.axis_index("x"))
    return jax.lax.psum(x * y, "x")

f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P()))
print("sum", float(f(jax.device_put(jnp.ones(2), NamedSharding(mesh, P("x"))))[0]))
"""


def _late_peer(late_s: float, warn_s: int, end_s: int) -> subprocess.CompletedProcess:
    flags = merge_xla_flags(simulated_cpu_flags(2), (
        f"--xla_cpu_collective_call_warn_stuck_timeout_seconds={warn_s} "
        f"--xla_cpu_collective_call_terminate_timeout_seconds={end_s}"), override=True)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    return subprocess.run([sys.executable, "-c", LATE_PEER, str(late_s)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_simulated_devices_wait_for_a_late_peer_as_long_as_the_flags_say():
    """The patience flags hetjax gives simulated devices are the ones this jaxlib reads: a peer
    10 s late ends the process when warning + end allow 2 s (XLA's defaults would wait 60 s),
    and a peer 3 s late is waited for when they allow 31 s. The margins are wide because the
    suite runs on a busy machine (the process ends 2 s after the early peer arrives)."""
    assert set(CPU_COLLECTIVE_PATIENCE) <= set(simulated_cpu_flags(8).split())
    ended = _late_peer(10, warn_s=1, end_s=1)
    assert ended.returncode != 0 and "Termination timeout" in ended.stderr, ended.stderr[-2000:]
    waited = _late_peer(3, warn_s=1, end_s=30)
    assert waited.returncode == 0 and "sum 2.0" in waited.stdout, waited.stderr[-2000:]


def test_the_cli_asks_for_patience_but_keeps_what_the_user_set(monkeypatch):
    from hetjax.cli import ensure_cpu_devices

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_call_terminate_timeout_seconds=9 "
                                    "--xla_dump_to=/tmp/d")
    ensure_cpu_devices(4)
    flags = os.environ["XLA_FLAGS"].split()
    assert "--xla_force_host_platform_device_count=4" in flags
    assert "--xla_cpu_collective_call_terminate_timeout_seconds=9" in flags
    assert "--xla_cpu_collective_call_warn_stuck_timeout_seconds=60" in flags
    assert "--xla_dump_to=/tmp/d" in flags


def test_a_fresh_process_asking_a_topology_for_devices_gets_them_with_patience():
    """The notebook path: no XLA_FLAGS, jax imported, then `Topology.jax_devices()` (what a
    Trainer calls) before any backend started: 8 devices, and the patience flags set."""
    code = ("import os, jax\n"
            "from hetjax.core.topology import preset\n"
            "print(len(preset('cpu_hybrid').jax_devices()), os.environ['XLA_FLAGS'])\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], env={**env, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    count, *flags = out.stdout.split()
    assert count == "8" and set(CPU_COLLECTIVE_PATIENCE) <= set(flags)


def test_groups_of_a_plan_with_per_stage_shapes_on_some_of_the_devices():
    """Stage 0 a TP pair on an ib node, stage 1 two replicas on a roce node, the other four
    devices left out: they are in no group, and the PP group is the boundary's two stages."""
    p = Plan(pp=2, dp=0, tp=0, stage_layers=(1, 1), microbatches=1, global_batch=2, seq_len=8,
             executor="mpmd", stage_shapes=((1, 2), (2, 1)), device_order=(0, 1, 4, 5))
    links = {(g.axis, g.ranks): g.link for g in nic.group_links(p, preset("cpu_hybrid"))
             if len(g.ranks) > 1}
    assert links == {("tp", (0, 1)): "nvlink", ("dp", (4, 5)): "nvlink",
                     ("pp", (0, 1, 4, 5)): "ethernet"}

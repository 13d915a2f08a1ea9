"""Topology: presets, link classes between devices, JSON round trip, device mapping."""

import pytest

from hetjax.core import topology as topo
from hetjax.errors import TopologyError


def test_holmes_hybrid_links_follow_nodes_and_clusters():
    t = topo.preset("holmes_hybrid")  # 2 clusters x 2 nodes x 8 GPUs
    assert t.num_devices == 32 and t.num_nodes == 4
    assert t.link(0, 7).kind == "nvlink"  # same node
    assert t.link(0, 8).kind == "infiniband"  # same cluster, other node
    assert t.link(16, 24).kind == "roce"
    assert t.link(3, 20).kind == "ethernet"  # across clusters
    assert t.group_link([0, 8, 16]).kind == "ethernet"
    assert t.group_link([0, 1, 2]).kind == "nvlink"
    assert t.group_link([5]).kind == "loopback"


def test_rank_order_is_cluster_node_device():
    t = topo.preset("cpu_hybrid", nodes=2, devices_per_node=2)
    assert [(d.cluster, d.node, d.local) for d in t.devices[:5]] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0)]
    assert [d.global_node for d in t.devices] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert list(t.cluster_ranks(1)) == [4, 5, 6, 7]


def test_cluster_pair_override_for_geo_sites():
    a = topo.make_cluster("a", 1, 2, "a100", "infiniband")
    b = topo.make_cluster("b", 1, 2, "a100", "infiniband")
    c = topo.make_cluster("c", 1, 2, "a100", "infiniband")
    slow = topo.Link("ethernet", 1.0, 60_000.0)
    t = topo.Topology("geo", (a, b, c), topo.LINKS["ethernet"],
                      (topo.ClusterLink("a", "c", slow),))
    assert t.link(0, 4) == slow and t.link(4, 0) == slow
    assert t.link(0, 2) == topo.LINKS["ethernet"]
    bw, lat = t.bandwidth_matrix()
    assert bw[0, 4] == slow.bytes_per_s and lat[1, 5] == pytest.approx(0.06)
    assert bw[0, 1] == topo.LINKS["nvlink"].bytes_per_s and lat[2, 2] == 0.0


def test_json_round_trip():
    t = topo.preset("hethub_mixed")
    assert topo.Topology.from_json(t.to_json()) == t
    assert t.clusters[1].accelerator.name == "ascend910b"
    assert t.clusters[0].accelerator != t.clusters[1].accelerator


def test_alpha_beta_transfer_time():
    lk = topo.Link("ethernet", 8.0, 100.0)  # 1 GB/s, 100 us
    assert lk.latency_s + 1e9 / lk.bytes_per_s == pytest.approx(1.0001)


@pytest.mark.parametrize("build, message", [
    (lambda: topo.preset("nope"), "unknown topology preset 'nope'"),
    (lambda: topo.preset("cpu_hybrid", gpus=3), "takes (nodes, devices_per_node)"),
    (lambda: topo.Link("carrier-pigeon", 1, 1), "link kind: 'carrier-pigeon' is unknown"),
    (lambda: topo.Link("ethernet", 0, 1), "ethernet link bandwidth_gbps: must be > 0 Gbit/s"),
    (lambda: topo.Link("nvlink", 1, 1, p2p=False), "false applies to PCIe links only"),
    (lambda: topo.make_cluster("x", 0, 8, "a100", "roce"), "nodes: must be a whole number >= 1"),
    (lambda: topo.accelerator("tpu9"), "accelerator 'tpu9' is unknown"),
    (lambda: topo.Topology.from_dict({"clusters": []}), "is malformed"),
])
def test_bad_topologies_are_refused_clearly(build, message):
    with pytest.raises(TopologyError, match=None) as e:
        build()
    assert message in str(e.value)


def test_topology_larger_than_machine_is_refused():
    t = topo.preset("holmes_hybrid")  # 32 devices; the tests have 8
    with pytest.raises(TopologyError) as e:
        t.jax_devices()
    assert "needs 32 devices but JAX sees 8" in str(e.value)
    assert "xla_force_host_platform_device_count=32" in str(e.value)


def test_topology_maps_onto_devices_in_rank_order():
    import jax

    devs = topo.preset("cpu_hybrid").jax_devices()
    assert [d.id for d in devs] == [d.id for d in sorted(jax.devices(), key=lambda d: d.id)]


def test_catalogue_links_name_generations_and_keep_the_first_names():
    links = topo.LINKS
    # per GPU and direction: NVLink 2 / 3 / 4 at 300 / 600 / 900 GB/s bidirectional
    assert [links[n].bandwidth_gbps for n in ("nvlink2", "nvlink3", "nvlink4")] == \
        [1200.0, 2400.0, 3600.0]
    assert [links[n].bandwidth_gbps for n in ("pcie3", "pcie4", "pcie5")] == [128.0, 256.0, 512.0]
    # the first names are aliases of today's figures (the planner's recorded answers use them)
    assert links["nvlink"] == links["nvlink3"] == topo.Link("nvlink", 2400.0, 2.0, 0.78)
    assert links["pcie"] == links["pcie4"] == topo.Link("pcie", 256.0, 5.0)
    assert links["infiniband"] == links["ib_hdr_200g"] and links["roce"] == links["roce_200g"]
    assert links["ethernet"] == links["eth_25g"]
    assert topo.link_name(links["nvlink"]) == "nvlink3"
    assert topo.link_name(topo.Link("ethernet", 7.0, 50.0)) is None
    assert len({topo.link_name(lk) for lk in links.values()}) == \
        len(links) - len(topo.LINK_ALIASES)  # every entry has its own figures


def test_a_pcie_link_without_p2p_pays_the_trip_through_host_memory():
    p2p, staged = topo.LINKS["pcie4"], topo.LINKS["pcie4_no_p2p"]
    assert not staged.p2p and staged.bandwidth_gbps == p2p.bandwidth_gbps
    assert staged.bytes_per_s == p2p.bytes_per_s * topo.HOST_STAGED_BANDWIDTH == 16e9
    assert staged.latency_s == pytest.approx(2 * p2p.latency_s)
    node = topo.Topology("box", (topo.make_cluster("box", 1, 4, "rtx_4090", "eth_25g",
                                                   intra="pcie4_no_p2p"),), None)
    bw, lat = node.bandwidth_matrix()
    assert bw[0, 1] == 16e9 and lat[0, 1] == pytest.approx(10e-6)
    assert "pcie no P2P 256 Gb/s" in node.describe()

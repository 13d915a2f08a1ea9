"""Topology: presets, link classes between devices, the catalogue, the topology file (short
names, defaults, every validation message, writing back), device mapping."""

import copy
import json

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
    assert topo.topology_from_json(t.to_json()) == t  # every field spelled out
    assert topo.topology_from_json(topo.topology_to_json(t)) == t  # catalogue names
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
    (lambda: topo.make_cluster("x", 1, 8, "a100", "ib_hdr_300g"),
     "link 'ib_hdr_300g' is unknown; known links: nvlink2, nvlink3"),
    (lambda: topo.Topology("x", (), None), "clusters: the topology has no clusters"),
    (lambda: topo.topology_from_dict({"clusters": []}), "clusters: must be a list of at least"),
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


# --- the topology file ------------------------------------------------------------------------
def test_a_file_names_catalogue_hardware():
    d = {"name": "lab", "clusters": [
        {"name": "a100ib", "nodes": 2, "devices_per_node": 8, "accelerator": "a100_80gb",
         "nic": "ib_hdr_200g", "intra_node": "nvlink3"},
        {"name": "l40s", "nodes": 1, "devices_per_node": 4, "accelerator": "L40S",
         "nic": "roce_200g", "intra_node": "pcie4-no-p2p"}],  # names ignore case and - vs _
        "inter_cluster": "eth_10g"}
    t = topo.topology_from_dict(d)
    a, b = t.clusters
    assert a.accelerator == topo.ACCELERATORS["a100_80gb"] and a.nic == topo.LINKS["infiniband"]
    assert a.intra_node == topo.LINKS["nvlink"] and b.accelerator.name == "l40s"
    assert b.intra_node == topo.LINKS["pcie4_no_p2p"] and not b.intra_node.p2p
    assert t.inter_cluster == topo.Link("ethernet", 10.0, 50.0)
    assert a.nic_settings == topo.NicSettings()  # none given: NCCL's own choices
    # the first names still work in a file
    d["clusters"][0].update(nic="infiniband", intra_node="nvlink")
    assert topo.topology_from_dict(d) == t


def test_a_file_gives_custom_hardware_as_objects_with_defaults():
    t = topo.topology_from_dict({"clusters": [{
        "name": "box", "nodes": 1, "devices_per_node": 2,
        "accelerator": {"name": "acme_x1", "peak_tflops": 100, "memory_gib": 32},
        "intra_node": {"kind": "pcie", "bandwidth_gbps": 128, "latency_us": 4, "p2p": False}}]})
    c = t.clusters[0]
    assert t.name == "custom" and t.inter_cluster is None and t.cluster_links == ()
    assert c.accelerator == topo.Accelerator("acme_x1", 100, 32, "nvidia", 0.0)
    assert c.intra_node == topo.Link("pcie", 128, 4, 1.0, p2p=False)
    assert c.nic == topo.LINKS["eth_25g"]  # one node: its NIC carries nothing


def _base():
    return {"name": "lab", "clusters": [
        {"name": "a", "nodes": 2, "devices_per_node": 8, "accelerator": "a100_80gb",
         "nic": "ib_hdr_200g", "intra_node": "nvlink3"},
        {"name": "b", "nodes": 1, "devices_per_node": 4, "accelerator": "rtx_4090",
         "nic": {"kind": "ethernet", "bandwidth_gbps": 25, "latency_us": 50},
         "intra_node": "pcie4_no_p2p",
         "nic_settings": {"hcas": [], "socket_ifname": "eth0"}}],
        "inter_cluster": "eth_10g",
        "cluster_links": [{"a": "a", "b": "b", "link": "eth_1g"}]}


def _set(path: str, value):
    """_base() with the value at `path` (a.b[0].c; value DELETE removes it)."""
    d = _base()
    parts = [p for p in path.replace("[", ".").replace("]", "").split(".")]
    node = d
    for p in parts[:-1]:
        node = node[int(p)] if p.isdigit() else node[p]
    last = int(parts[-1]) if parts[-1].isdigit() else parts[-1]
    if value is DELETE:
        del node[last]
    elif isinstance(node, list) and last == len(node):
        node.append(value)
    else:
        node[last] = value
    return d


DELETE = object()
KNOWN_ACCELERATORS = ", ".join(sorted(topo.ACCELERATORS))
KNOWN_LINKS = ", ".join(n for n in topo.LINKS if n not in topo.LINK_ALIASES)

# (what is wrong, JSON path, new value, the whole message)
BAD_FILES = [
    ("unknown accelerator", "clusters[1].accelerator", "a100-80",
     "clusters[1].accelerator: unknown accelerator 'a100-80' (did you mean 'a100_80gb'?); fix: "
     f"use a catalogue name ({KNOWN_ACCELERATORS}) or an object "
     '{"name", "peak_tflops", "memory_gib"}'),
    ("unknown link", "clusters[0].intra_node", "nvlink5",
     "clusters[0].intra_node: unknown link 'nvlink5' (did you mean 'nvlink4'?); fix: use a "
     f"catalogue name ({KNOWN_LINKS}) or an object " '{"kind", "bandwidth_gbps", "latency_us"}'),
    ("unknown field in a cluster", "clusters[0].devices", 8,
     "clusters[0].devices: is not a field here; fix: did you mean 'devices_per_node'? the fields "
     "are name, nodes, devices_per_node, accelerator, nic, intra_node, nic_settings"),
    ("unknown field at the top", "inter_clusters", "eth_10g",
     "inter_clusters: is not a field here; fix: did you mean 'inter_cluster'? the fields are "
     "name, clusters, inter_cluster, cluster_links"),
    ("unknown field in a link", "clusters[1].nic.bandwidth", 25,
     "clusters[1].nic.bandwidth: is not a field here; fix: did you mean 'bandwidth_gbps'? the "
     "fields are kind, bandwidth_gbps, latency_us, efficiency, p2p"),
    ("text for a count", "clusters[0].nodes", "2",
     "clusters[0].nodes: must be a whole number, got text '2'; fix: write a number without "
     "quotes: the number of nodes, e.g. 2"),
    ("fraction for a count", "clusters[0].devices_per_node", 2.5,
     "clusters[0].devices_per_node: must be a whole number, got 2.5; fix: give the number of "
     "devices in a node, e.g. 8"),
    ("negative count", "clusters[0].nodes", -2,
     "clusters[0].nodes: must be a whole number >= 1, got -2; fix: give the number of nodes, "
     "e.g. 2"),
    ("too many nodes", "clusters[0].nodes", 10**9,
     "clusters[0].nodes: must be at most 65,536, got 1,000,000,000; fix: give the number of "
     "nodes, e.g. 2"),
    ("too many devices", "clusters[0].nodes", 60000,
     "clusters[0]: brings the topology to 480,000 devices, more than 65,536; fix: describe "
     "fewer devices"),
    ("text for a rate", "clusters[1].nic.bandwidth_gbps", "25",
     "clusters[1].nic.bandwidth_gbps: must be a number, got '25'; fix: write a number without "
     "quotes: the link's nominal rate per direction in Gbit/s, e.g. 25"),
    ("a rate too large for a float", "clusters[1].nic.bandwidth_gbps", 10**400,
     "clusters[1].nic.bandwidth_gbps: must be a finite number, got a number of 401 digits; fix: "
     "give the link's nominal rate per direction in Gbit/s, e.g. 25"),
    ("negative rate", "clusters[1].nic.bandwidth_gbps", -25,
     "clusters[1].nic.bandwidth_gbps: must be > 0 Gbit/s, got -25; fix: give the link's nominal "
     "rate per direction in Gbit/s, e.g. 25"),
    ("negative latency", "clusters[1].nic.latency_us", -1,
     "clusters[1].nic.latency_us: must be >= 0 µs, got -1; fix: give one message's latency in "
     "µs, e.g. 5"),
    ("NaN latency", "clusters[1].nic.latency_us", float("nan"),
     "clusters[1].nic.latency_us: must be a finite number, got nan; fix: give one message's "
     "latency in µs, e.g. 5"),
    ("efficiency above 1", "clusters[1].nic.efficiency", 1.5,
     "clusters[1].nic.efficiency: must lie in (0, 1], got 1.5; fix: give achieved / nominal "
     "bandwidth, in (0, 1] (1.0 for a measured rate)"),
    ("unknown link kind", "clusters[1].nic.kind", "wifi",
     "clusters[1].nic.kind: 'wifi' is unknown; fix: use one of loopback, nvlink, pcie, "
     "infiniband, roce, ethernet"),
    ("p2p off on a network link", "clusters[1].nic.p2p", False,
     "clusters[1].nic.p2p: false applies to PCIe links only (NVLink and networks carry "
     "GPU-to-GPU traffic themselves); fix: leave p2p out of this link"),
    ("p2p as text", "clusters[1].nic.p2p", "no",
     "clusters[1].nic.p2p: must be true or false, got 'no'; fix: write true or false without "
     "quotes"),
    ("negative memory", "clusters[1].accelerator",
     {"name": "x", "peak_tflops": 100, "memory_gib": -24},
     "clusters[1].accelerator.memory_gib: must be > 0, got -24; fix: give the device's memory in "
     "GiB, e.g. 80"),
    ("missing field", "clusters[0].nodes", DELETE,
     "clusters[0]: 'nodes' is missing; fix: add 'nodes': the number of nodes, e.g. 2"),
    ("missing NIC of a multi-node cluster", "clusters[0].nic", DELETE,
     "clusters[0]: 'nic' is missing; fix: add 'nic': the link between nodes: a catalogue name "
     "such as \"ib_hdr_200g\", or an object"),
    ("missing field of a link object", "clusters[1].nic.latency_us", DELETE,
     "clusters[1].nic: 'latency_us' is missing; fix: add 'latency_us': one message's latency "
     "in µs"),
    ("missing clusters", "clusters", DELETE,
     "(top level): 'clusters' is missing; fix: add 'clusters': a list of clusters"),
    ("missing inter_cluster", "inter_cluster", DELETE,
     "(top level): 'inter_cluster' is missing; fix: add 'inter_cluster': the link between "
     "clusters (e.g. \"eth_10g\"), or null when cluster_links lists every joined pair"),
    ("a cluster that is not an object", "clusters[1]", "b",
     "clusters[1]: must be an object {...}, got text; fix: write an object with name, nodes, "
     "devices_per_node, accelerator"),
    ("duplicate cluster names", "clusters[1].name", "a",
     "clusters[1].name: 'a' is already the name of clusters[0]; fix: give each cluster its own "
     "name"),
    ("a name with a space and a semicolon", "clusters[1].name", "b; rm -rf",
     "clusters[1].name: 'b; rm -rf' is not a name hetjax accepts; fix: use letters, digits, '_',"
     " '.' and '-' (at most 64, not starting with '.' or '-')"),
    ("cluster link to an unknown cluster", "cluster_links[0].b", "c",
     "cluster_links[0].b: no cluster is named 'c'; fix: name one of 'a', 'b'"),
    ("cluster link to itself", "cluster_links[0].b", "a",
     "cluster_links[0]: joins 'a' to itself; fix: name two different clusters in a and b"),
    ("the same pair twice", "cluster_links[1]", {"a": "b", "b": "a", "link": "eth_10g"},
     "cluster_links[1]: 'b' and 'a' are already joined by cluster_links[0]; fix: give each pair "
     "of clusters one link"),
    ("a bridge in a node of 4", "clusters[1].intra_node", "nvlink3_bridge",
     "clusters[1].intra_node: a two-card NVLink bridge joins 2 GPUs, but a node here has 4; fix:"
     " give the node's PCIe link (e.g. \"pcie4_no_p2p\"), or describe pairs of cards as nodes "
     "of 2"),
    ("an interface name with a shell character", "clusters[1].nic_settings.socket_ifname",
     "eth0 $(reboot)",
     "clusters[1].nic_settings.socket_ifname: 'eth0 $(reboot)' is not a network interface name;"
     " fix: write a name such as \"eth0\" or a list \"ens1,ens2\" (NCCL_SOCKET_IFNAME)"),
    ("an HCA list given as text", "clusters[1].nic_settings.hcas", "mlx5_0",
     "clusters[1].nic_settings.hcas: must be a list, got text; fix: write a list such as "
     "[\"mlx5_0:1\", \"mlx5_1:1\"] (or [] to let NCCL choose)"),
    ("an unknown GDR level", "clusters[1].nic_settings.gdr_level", "NEAR",
     "clusters[1].nic_settings.gdr_level: 'NEAR' is not an NCCL GDR level; fix: use one of LOC, "
     "PIX, PXB, PHB, SYS, or null"),
    ("a name that is not text", "clusters[0].name", 7,
     "clusters[0].name: must be text, got a number; fix: write the cluster's name in quotes"),
    ("a custom accelerator's name with a slash", "clusters[1].accelerator",
     {"name": "../x", "peak_tflops": 1, "memory_gib": 1},
     "clusters[1].accelerator.name: '../x' is not a name hetjax accepts; fix: use letters, "
     "digits, '_', '.' and '-' (at most 64, not starting with '.' or '-')"),
    ("a vendor with a space", "clusters[1].accelerator",
     {"name": "x", "peak_tflops": 1, "memory_gib": 1, "vendor": "big co"},
     "clusters[1].accelerator.vendor: 'big co' is not a name hetjax accepts; fix: use letters, "
     "digits, '_', '.' and '-' (at most 64, not starting with '.' or '-')"),
    ("an HCA with a space", "clusters[1].nic_settings.hcas", ["mlx5_0", "mlx5 1"],
     "clusters[1].nic_settings.hcas[1]: 'mlx5 1' is not an RDMA device name; fix: write a name "
     "such as \"mlx5_0\" or \"mlx5_0:1\""),
    ("a negative GID index", "clusters[1].nic_settings.gid_index", -1,
     "clusters[1].nic_settings.gid_index: must be >= 0, got -1; fix: give the RoCE v2 GID index,"
     " e.g. 3"),
    ("an infinite node count", "clusters[0].nodes", float("inf"),
     "clusters[0].nodes: must be a whole number, got inf; fix: give the number of nodes, e.g. 2"),
    ("cluster links given as an object", "cluster_links", {"a": "a", "b": "b"},
     "cluster_links: must be a list, got an object; fix: write [{\"a\": ..., \"b\": ..., "
     "\"link\": ...}] or leave it out"),
    ("a cluster link without its link", "cluster_links[0].link", DELETE,
     "cluster_links[0]: 'link' is missing; fix: add 'link': a catalogue link name or a link "
     "object"),
    ("too many clusters", "clusters", [{"name": f"c{i}"} for i in range(1025)],
     "clusters: lists 1,025 clusters, more than 1,024; fix: describe alike clusters as one with "
     "more nodes"),
    ("empty clusters", "clusters", [],
     "clusters: must be a list of at least one cluster, got an empty list; fix: write "
     '[{"name": ..., "nodes": ..., "devices_per_node": ..., "accelerator": ...}]'),
]


@pytest.mark.parametrize("what,path,value,message", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_a_bad_value_is_named_by_its_json_path_with_the_fix(what, path, value, message):
    topo.topology_from_dict(_base())  # the file is good before the change
    text = json.dumps(_set(path, value))  # through JSON, as a file is read
    with pytest.raises(topo.TopologyValueError) as e:
        topo.topology_from_json(text)
    assert str(e.value) == message
    assert "\n" not in str(e.value)


def test_a_file_that_is_not_an_object_is_refused():
    with pytest.raises(topo.TopologyValueError) as e:
        topo.topology_from_json("[1, 2]")
    assert str(e.value) == ("(top level): must be an object {...}, got a list; fix: write an "
                            "object with clusters")


def test_the_whole_file_is_checked_before_it_is_parsed(tmp_path, monkeypatch):
    from hetjax.core import topology_file

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(topo.TopologyValueError, match="nests lists or objects deeper"):
        topo.read_topology(str(deep))
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    with pytest.raises(topo.TopologyValueError, match=r"is not UTF-8 text \(byte 0\)"):
        topo.read_topology(str(binary))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_base()))
    assert topo.read_topology(str(good)) == topo.topology_from_dict(_base())
    monkeypatch.setattr(topology_file, "MAX_FILE_BYTES", 100)
    with pytest.raises(topo.TopologyValueError, match="is larger than"):
        topo.read_topology(str(good))
    with pytest.raises(topo.TopologyValueError, match=r"not valid JSON \(line 1, column 2"):
        topo.topology_from_json("{bad")


def test_writing_keeps_catalogue_names_and_spells_out_the_rest():
    t = topo.topology_from_dict(_base())
    d = json.loads(topo.topology_to_json(t))
    a, b = d["clusters"]
    assert (a["accelerator"], a["nic"], a["intra_node"]) == ("a100_80gb", "ib_hdr_200g", "nvlink3")
    assert (b["accelerator"], b["nic"], b["intra_node"]) == ("rtx_4090", "eth_25g", "pcie4_no_p2p")
    assert "nic_settings" not in a and d["cluster_links"][0]["link"] == "eth_1g"
    custom = copy.deepcopy(_base())
    custom["clusters"][1]["accelerator"] = {"name": "x1", "peak_tflops": 1, "memory_gib": 2}
    custom["clusters"][1]["nic_settings"] = {"hcas": ["mlx5_0:1"], "gdr_level": "PHB"}
    t = topo.topology_from_dict(custom)
    b = json.loads(topo.topology_to_json(t))["clusters"][1]
    assert b["accelerator"] == {"name": "x1", "peak_tflops": 1, "memory_gib": 2,
                                "vendor": "nvidia", "memory_bandwidth_gbs": 0.0}
    assert b["nic_settings"]["hcas"] == ["mlx5_0:1"]
    assert topo.topology_from_json(topo.topology_to_json(t)) == t
    # a link equal to a two-card bridge in a node of 4 (built in Python) is written as an object,
    # which reads back
    wide = topo.Topology("w", (topo.make_cluster("w", 1, 4, "rtx_3090", "eth_25g",
                                                 intra=topo.LINKS["nvlink3_bridge"]),), None)
    assert isinstance(json.loads(topo.topology_to_json(wide))["clusters"][0]["intra_node"], dict)
    assert topo.topology_from_json(topo.topology_to_json(wide)) == wide


def test_writing_a_topology_leaves_only_the_named_file(tmp_path):
    import os

    path = tmp_path / "out" / "t.json"
    path.parent.mkdir()
    t = topo.preset("holmes_hybrid")
    assert topo.write_topology(t, str(path)) == str(path)
    assert topo.write_topology(t, str(path)) == str(path)  # over an older one
    assert os.listdir(tmp_path) == ["out"] and os.listdir(path.parent) == ["t.json"]
    assert topo.read_topology(str(path)) == t


@pytest.mark.parametrize("name", sorted(topo.PRESETS))
def test_every_preset_round_trips_through_hetjax_topology_json(name, tmp_path, capsys):
    from hetjax import cli
    from hetjax.config import build_topology
    from conftest import tiny_config

    path = str(tmp_path / f"{name}.json")
    assert cli.main(["hetjax", "topology", f"--config.topology.preset={name}",
                     f"--json={path}"]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    written = topo.read_topology(path)
    assert written == topo.preset(name)
    # and the config reads it back as topology.file
    assert build_topology(tiny_config(**{"topology.file": path})) == written


def catalogue_rows() -> list[str]:
    """The start of each catalogue row of docs/topology.md, from the catalogue itself (the
    page adds a source or description column)."""
    rows = [f"| `{n}` | {a.vendor} | {a.peak_tflops:g} | {a.memory_gib:g} | "
            f"{a.memory_bandwidth_gbs:g} |" for n, a in topo.ACCELERATORS.items()]
    rows += [f"| `{n}` | {lk.kind} | {lk.bandwidth_gbps:g} | {lk.latency_us:g} | "
             f"{lk.efficiency:g} | {'yes' if lk.p2p else 'no'} | {lk.bytes_per_s / 1e9:.4g} |"
             for n, lk in topo.LINKS.items() if n not in topo.LINK_ALIASES]
    return rows


def test_the_catalogue_tables_in_the_docs_match_the_catalogue():
    import os

    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "topology.md")) as f:
        text = f.read()
    section = text.split("\n## The catalogue\n")[1].split("\n## ")[0]
    documented = [line for line in section.splitlines() if line.startswith("| `")]
    rows = catalogue_rows()
    assert [r for r in rows if not any(line.startswith(r) for line in documented)] == []
    assert len(documented) == len(rows)  # and no row of an entry that is gone

"""The topology file: the JSON a person writes to describe their clusters (docs/topology.md).

This module owns the format. Reading (`topology_from_dict`, `topology_from_json`,
`read_topology`) takes an accelerator or a link either by its catalogue name (`"a100_80gb"`,
`"pcie4_no_p2p"`) or as a full object, fills the documented defaults, and refuses a bad value
with one line naming its JSON path and the fix (`clusters[1].accelerator: unknown accelerator
'a100-80' ...; fix: ...`): unknown fields, wrong types, missing fields, sizes beyond the bounds
below (checked before anything is built, so a mistyped or hostile file cannot make hetjax
allocate without limit). The values' own rules (a bandwidth > 0, nodes >= 1, unique cluster
names, cluster links naming clusters) are the data classes' in hetjax.core.hardware; their
`TopologyValueError` names the field, and the reader puts the path in front of it.

Writing (`topology_to_dict`, `topology_to_json`, `write_topology`) names hardware that equals a
catalogue entry by its name and spells out everything else, so what it writes reads back to an
equal Topology. `Topology.to_dict()` (every field spelled out) is valid input too. No JAX.
"""

from __future__ import annotations

import difflib
import json
import numbers
import os
import re
from typing import Any

from hetjax.core.catalogue import ACCELERATORS, LINK_ALIASES, LINKS, link_name
from hetjax.core.hardware import Accelerator, Cluster, ClusterLink, Link, NicSettings, Topology
from hetjax.errors import TopologyValueError

# Bounds on what a file may describe, checked before anything is built (the planner is measured
# up to 4,096 devices; these leave room and stop a typo such as "nodes": 1e9 at the reader).
MAX_FILE_BYTES = 16 * 2**20
MAX_CLUSTERS = 1024
MAX_NODES = 65536  # per cluster
MAX_DEVICES_PER_NODE = 1024
MAX_DEVICES = 65536  # in the whole topology
# Names end up in process names, log lines and environment values: letters, digits and _ . -
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}\Z")
# NCCL's interface and HCA lists: names, ':port', a leading '^' (exclude) or '=' (exact), commas.
NCCL_LIST = re.compile(r"[A-Za-z0-9_.:,^=\-]{1,256}\Z")
GDR_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")  # NCCL_NET_GDR_LEVEL's names
# Two-card NVLink bridges join two GPUs; a node of more talks over PCIe (docs/topology.md).
BRIDGES = ("nvlink2_bridge", "nvlink3_bridge")

# Each object's fields: name -> what it is (the text a "missing" error shows).
TOPOLOGY_FIELDS = {
    "name": "the topology's name",
    "clusters": "a list of clusters",
    "inter_cluster": "the link between any two clusters, or null",
    "cluster_links": "a list of {a, b, link} for cluster pairs with their own link",
}
CLUSTER_FIELDS = {
    "name": "the cluster's name, e.g. \"a100ib\"",
    "nodes": "the number of nodes, e.g. 2",
    "devices_per_node": "the number of devices in a node, e.g. 8",
    "accelerator": "a catalogue name such as \"a100_80gb\", or an object",
    "nic": "the link between nodes: a catalogue name such as \"ib_hdr_200g\", or an object",
    "intra_node": "the link inside a node: a catalogue name such as \"nvlink3\", or an object",
    "nic_settings": "what NCCL needs to use the NIC",
}
ACCELERATOR_FIELDS = {
    "name": "the kind's name", "peak_tflops": "peak dense bf16 TFLOP/s",
    "memory_gib": "memory in GiB", "vendor": "nvidia, amd, google, huawei or cpu",
    "memory_bandwidth_gbs": "memory bandwidth in GB/s",
}
LINK_FIELDS = {
    "kind": "loopback, nvlink, pcie, infiniband, roce or ethernet",
    "bandwidth_gbps": "the nominal rate per direction in Gbit/s",
    "latency_us": "one message's latency in µs",
    "efficiency": "achieved / nominal bandwidth", "p2p": "PCIe peer-to-peer, true or false",
}
CLUSTER_LINK_FIELDS = {"a": "a cluster's name", "b": "another cluster's name",
                       "link": "a catalogue link name or a link object"}
NIC_SETTINGS_FIELDS = {
    "hcas": "RDMA devices, e.g. [\"mlx5_0:1\"]", "gid_index": "RoCE's GID index, or null",
    "socket_ifname": "the interface for socket traffic, e.g. \"eth0\"",
    "gdr_level": f"NCCL_NET_GDR_LEVEL ({', '.join(GDR_LEVELS)}), or null",
}
# A one-node cluster's NIC and a one-device node's link carry nothing; these fill them.
DEFAULT_NIC, DEFAULT_INTRA_NODE = "eth_25g", "pcie4"


def _fail(where: str, problem: str, fix: str):
    raise TopologyValueError(where, problem, fix)


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    return {str: "text", dict: "an object", list: "a list", tuple: "a list"}.get(
        type(value), "a number" if isinstance(value, numbers.Number) else type(value).__name__)


def _object(value, where: str, fields: dict[str, str], required: tuple[str, ...]) -> dict:
    """`value` as a JSON object with only `fields`, the `required` ones present."""
    if not isinstance(value, dict):
        _fail(where or "(top level)", f"must be an object {{...}}, got {_json_type(value)}",
              f"write an object with {', '.join(required or tuple(fields))}")
    for key in value:
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            _fail(f"{where}.{key}" if where else str(key), "is not a field here",
                  (f"did you mean {near[0]!r}? " if near else "") +
                  f"the fields are {', '.join(fields)}")
    for key in required:
        if key not in value:
            _fail(where or "(top level)", f"{key!r} is missing", f"add {key!r}: {fields[key]}")
    return value


def _name(value, where: str, what: str) -> str:
    if not isinstance(value, str):
        _fail(where, f"must be text, got {_json_type(value)}", f"write {what} in quotes")
    if not NAME.match(value):
        _fail(where, f"{value!r} is not a name hetjax accepts",
              "use letters, digits, '_', '.' and '-' (at most 64, not starting with '.' or '-')")
    return value


def _whole(value, where: str, high: int, what: str, low: int | None = None) -> int:
    """A whole JSON number up to `high` (2.0 is 2; "2", true and 2.5 are refused); the data
    classes check their own lower bounds (nodes >= 1), `low` is for the fields they lack."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(where, f"must be a whole number, got {_json_type(value)} {value!r}",
              f"write a number without quotes: {what}")
    if value != value or value in (float("inf"), float("-inf")) or value != int(value):
        _fail(where, f"must be a whole number, got {value}", f"give {what}")
    if value > high:
        _fail(where, f"must be at most {high:,}, got {int(value):,}", f"give {what}")
    if low is not None and value < low:
        _fail(where, f"must be >= {low}, got {int(value)}", f"give {what}")
    return int(value)


def _hardware(build, where: str):
    """Build a data class; its refusal of a field gets the field's JSON path."""
    try:
        return build()
    except TopologyValueError as e:
        if e.field:
            raise TopologyValueError(f"{where}.{e.field}", e.problem, e.fix) from None
        raise


def _catalogue_name(value: str, where: str, what: str, names: dict, known: list[str],
                    obj: str):
    key = value.strip().lower().replace("-", "_")
    if key in names:
        return names[key]
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.7)
    _fail(where, f"unknown {what} {value!r}" + (f" (did you mean {near[0]!r}?)" if near else ""),
          f"use a catalogue name ({', '.join(known)}) or an object {obj}")


def _accelerator(value, where: str) -> Accelerator:
    obj = '{"name", "peak_tflops", "memory_gib"}'
    if isinstance(value, str):
        return _catalogue_name(value, where, "accelerator", ACCELERATORS, sorted(ACCELERATORS),
                               obj)
    d = _object(value, where, ACCELERATOR_FIELDS, ("name", "peak_tflops", "memory_gib"))
    _name(d["name"], f"{where}.name", "the kind's name")
    if "vendor" in d:
        _name(d["vendor"], f"{where}.vendor", "the vendor")
    return _hardware(lambda: Accelerator(**d), where)


def _link(value, where: str) -> Link:
    obj = '{"kind", "bandwidth_gbps", "latency_us"}'
    if isinstance(value, str):
        known = [n for n in LINKS if n not in LINK_ALIASES]
        return _catalogue_name(value, where, "link", LINKS, known, obj)
    d = _object(value, where, LINK_FIELDS, ("kind", "bandwidth_gbps", "latency_us"))
    return _hardware(lambda: Link(**d), where)


def _nic_settings(value, where: str) -> NicSettings:
    d = _object(value, where, NIC_SETTINGS_FIELDS, ())
    hcas = d.get("hcas", [])
    if not isinstance(hcas, (list, tuple)):
        _fail(f"{where}.hcas", f"must be a list, got {_json_type(hcas)}",
              'write a list such as ["mlx5_0:1", "mlx5_1:1"] (or [] to let NCCL choose)')
    for i, h in enumerate(hcas):
        if not isinstance(h, str) or not NCCL_LIST.match(h) or "," in h:
            _fail(f"{where}.hcas[{i}]", f"{h!r} is not an RDMA device name",
                  'write a name such as "mlx5_0" or "mlx5_0:1"')
    gid = d.get("gid_index")
    if gid is not None:
        gid = _whole(gid, f"{where}.gid_index", 255, "the RoCE v2 GID index, e.g. 3", low=0)
    ifname = d.get("socket_ifname", NicSettings.socket_ifname)
    if not isinstance(ifname, str) or not NCCL_LIST.match(ifname):
        _fail(f"{where}.socket_ifname", f"{ifname!r} is not a network interface name",
              'write a name such as "eth0" or a list "ens1,ens2" (NCCL_SOCKET_IFNAME)')
    gdr = d.get("gdr_level")
    if gdr is not None and gdr not in GDR_LEVELS:
        _fail(f"{where}.gdr_level", f"{gdr!r} is not an NCCL GDR level",
              f"use one of {', '.join(GDR_LEVELS)}, or null")
    return NicSettings(hcas=tuple(hcas), gid_index=gid, socket_ifname=ifname, gdr_level=gdr)


def _cluster(value, where: str) -> Cluster:
    d = _object(value, where, CLUSTER_FIELDS,
                ("name", "nodes", "devices_per_node", "accelerator"))
    name = _name(d["name"], f"{where}.name", "the cluster's name")
    nodes = _whole(d["nodes"], f"{where}.nodes", MAX_NODES, CLUSTER_FIELDS["nodes"])
    per_node = _whole(d["devices_per_node"], f"{where}.devices_per_node", MAX_DEVICES_PER_NODE,
                      CLUSTER_FIELDS["devices_per_node"])
    for key, needed in (("nic", nodes > 1), ("intra_node", per_node > 1)):
        if needed and key not in d:
            _fail(where, f"{key!r} is missing", f"add {key!r}: {CLUSTER_FIELDS[key]}")
    intra = d.get("intra_node", DEFAULT_INTRA_NODE)
    if isinstance(intra, str) and intra.strip().lower().replace("-", "_") in BRIDGES \
            and per_node > 2:
        _fail(f"{where}.intra_node", f"a two-card NVLink bridge joins 2 GPUs, but a node here "
              f"has {per_node}", "give the node's PCIe link (e.g. \"pcie4_no_p2p\"), or "
              "describe pairs of cards as nodes of 2")
    return _hardware(lambda: Cluster(
        name=name, nodes=nodes, devices_per_node=per_node,
        accelerator=_accelerator(d["accelerator"], f"{where}.accelerator"),
        nic=_link(d.get("nic", DEFAULT_NIC), f"{where}.nic"),
        intra_node=_link(intra, f"{where}.intra_node"),
        nic_settings=_nic_settings(d.get("nic_settings", {}), f"{where}.nic_settings")), where)


def topology_from_dict(d: Any) -> Topology:
    """A Topology from a topology file's parsed JSON (module docstring; docs/topology.md)."""
    d = _object(d, "", TOPOLOGY_FIELDS, ("clusters",))
    name = _name(d.get("name", "custom"), "name", "the topology's name")
    clusters = d["clusters"]  # (a tuple in Topology.to_dict())
    if not isinstance(clusters, (list, tuple)) or not clusters:
        _fail("clusters", "must be a list of at least one cluster, got "
              + ("an empty list" if clusters in ([], ()) else _json_type(clusters)),
              'write [{"name": ..., "nodes": ..., "devices_per_node": ..., "accelerator": ...}]')
    if len(clusters) > MAX_CLUSTERS:
        _fail("clusters", f"lists {len(clusters):,} clusters, more than {MAX_CLUSTERS:,}",
              "describe alike clusters as one with more nodes")
    built, devices = [], 0
    for i, c in enumerate(clusters):
        built.append(_cluster(c, f"clusters[{i}]"))
        devices += built[-1].num_devices
        if devices > MAX_DEVICES:
            _fail(f"clusters[{i}]", f"brings the topology to {devices:,} devices, more than "
                  f"{MAX_DEVICES:,}", "describe fewer devices")
    if "inter_cluster" not in d and len(built) > 1:
        _fail("(top level)", "'inter_cluster' is missing",
              "add 'inter_cluster': the link between clusters (e.g. \"eth_10g\"), or null when "
              "cluster_links lists every joined pair")
    inter = d.get("inter_cluster")
    pairs = d.get("cluster_links", [])
    if not isinstance(pairs, (list, tuple)):
        _fail("cluster_links", f"must be a list, got {_json_type(pairs)}",
              'write [{"a": ..., "b": ..., "link": ...}] or leave it out')
    links = []
    for i, x in enumerate(pairs):
        where = f"cluster_links[{i}]"
        x = _object(x, where, CLUSTER_LINK_FIELDS, ("a", "b", "link"))
        links.append(ClusterLink(_name(x["a"], f"{where}.a", "a cluster's name"),
                                 _name(x["b"], f"{where}.b", "a cluster's name"),
                                 _link(x["link"], f"{where}.link")))
    return Topology(name=name, clusters=tuple(built),
                    inter_cluster=None if inter is None else _link(inter, "inter_cluster"),
                    cluster_links=tuple(links))


def topology_from_json(text: str) -> Topology:
    """A Topology from a topology file's text; invalid JSON is one TopologyValueError."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        _fail("", f"is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})",
              "fix the JSON; docs/topology.md shows the format")
    except RecursionError:
        _fail("", "nests lists or objects deeper than a topology ever does",
              "docs/topology.md shows the format")
    return topology_from_dict(d)


def read_topology(path: str) -> Topology:
    """A topology file. An OSError (no such file, a directory) is the caller's to name; a
    file larger than MAX_FILE_BYTES is refused before it is read."""
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        _fail("", f"is larger than {MAX_FILE_BYTES // 2**20} MiB, which no topology needs",
              "give the path of a topology file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        _fail("", f"is not UTF-8 text (byte {e.start})", "give the path of a topology file")
    return topology_from_json(text)


# --- writing --------------------------------------------------------------------------------
def _link_out(link: Link, bridge_ok: bool = True) -> str | dict:
    name = link_name(link)
    if name is not None and (bridge_ok or name not in BRIDGES):
        return name
    out = {"kind": link.kind, "bandwidth_gbps": link.bandwidth_gbps,
           "latency_us": link.latency_us, "efficiency": link.efficiency}
    if not link.p2p:
        out["p2p"] = False
    return out


def _accelerator_out(acc: Accelerator) -> str | dict:
    if ACCELERATORS.get(acc.name) == acc:
        return acc.name
    return {"name": acc.name, "peak_tflops": acc.peak_tflops, "memory_gib": acc.memory_gib,
            "vendor": acc.vendor, "memory_bandwidth_gbs": acc.memory_bandwidth_gbs}


def _cluster_out(c: Cluster) -> dict:
    out = {"name": c.name, "nodes": c.nodes, "devices_per_node": c.devices_per_node,
           "accelerator": _accelerator_out(c.accelerator), "nic": _link_out(c.nic),
           "intra_node": _link_out(c.intra_node, bridge_ok=c.devices_per_node <= 2)}
    if c.nic_settings != NicSettings():
        s = c.nic_settings
        out["nic_settings"] = {"hcas": list(s.hcas), "gid_index": s.gid_index,
                               "socket_ifname": s.socket_ifname, "gdr_level": s.gdr_level}
    return out


def topology_to_dict(t: Topology) -> dict[str, Any]:
    """A topology file's JSON object for `t`: catalogue names where the hardware equals a
    catalogue entry, full objects otherwise; it reads back to a Topology equal to `t`."""
    out: dict[str, Any] = {"name": t.name, "clusters": [_cluster_out(c) for c in t.clusters],
                           "inter_cluster": (None if t.inter_cluster is None
                                             else _link_out(t.inter_cluster))}
    if t.cluster_links:
        out["cluster_links"] = [{"a": x.a, "b": x.b, "link": _link_out(x.link)}
                                for x in t.cluster_links]
    return out


def _dumps(value, depth: int = 0) -> str:
    """JSON with the topology and its clusters one field a line, each field's value (a link, an
    accelerator, NIC settings) on its line, and a cluster link ({a, b, link}) on one line."""
    pad = "  " * (depth + 1)
    if isinstance(value, dict) and (depth < 2 or (depth == 2 and len(value) > 3)):
        items = [f"{pad}{json.dumps(k)}: {_dumps(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"
    if depth < 2 and isinstance(value, list) and any(isinstance(v, dict) for v in value):
        items = [pad + _dumps(v, depth + 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + "  " * depth + "]"
    return json.dumps(value, separators=(", ", ": "))


def topology_to_json(t: Topology) -> str:
    return _dumps(topology_to_dict(t)) + "\n"


def write_topology(t: Topology, path: str) -> str:
    """Write `t` as a topology file at `path` (the caller checked the path); returns it."""
    text = topology_to_json(t)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # a reader never sees half a file
    finally:
        if os.path.exists(tmp):  # a failed write (a full disk) leaves nothing behind
            os.remove(tmp)
    return path


__all__ = ["MAX_CLUSTERS", "MAX_DEVICES", "MAX_DEVICES_PER_NODE", "MAX_FILE_BYTES", "MAX_NODES",
           "read_topology", "topology_from_dict", "topology_from_json", "topology_to_dict",
           "topology_to_json", "write_topology"]

"""The hardware topology's data model: clusters of nodes of devices, and the links between any
two devices.

A `Topology` is plain data (frozen dataclasses) describing what hetjax trains
on: each cluster has a number of nodes, devices per node, one accelerator kind, an intra-node
link (NVLink/PCIe) and an inter-node NIC (InfiniBand, RoCE or Ethernet) with the settings NCCL
needs to use it. Clusters are joined by an inter-cluster link that can be overridden per
cluster pair (geo-distributed sites). Devices are numbered in rank order cluster -> node ->
device, the order the Holmes group formulas and the mesh assume.

Clusters with no link between them are expressed by leaving `inter_cluster` as None: then only
the pairs listed in `cluster_links` are connected, and `disconnected_pairs()` names the others
(the planner refuses a topology whose clusters do not form one connected network).

Nominal accelerators and links live in hetjax/core/catalogue.py, the JSON file a person writes
in hetjax/core/topology_file.py, named topologies in hetjax/core/paper_presets.py and
hetjax/core/testbed_presets.py; `hetjax.core.topology` gathers them. The data classes check their
own values and raise `TopologyValueError` naming the field. This module does not import jax, so
the CLI can size the simulated CPU device count from a topology before jax starts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any

from hetjax.errors import TopologyError, TopologyValueError
from hetjax.units import BYTES_PER_GBIT

LINK_KINDS = ("loopback", "nvlink", "pcie", "infiniband", "roce", "ethernet")


def _refuse(owner: str, field: str, problem: str, fix: str):
    """A hardware value's check failed: name the field (a file reader adds its JSON path)."""
    raise TopologyValueError(f"{owner} {field}", problem, fix, field=field)


def _number(value, owner: str, field: str, what: str) -> None:
    """A topology number must be a finite number, not a string, a bool or a NaN (Python's
    JSON reader takes `NaN` and `Infinity`; every later check would pass it). `what` says
    what the number is, for the fix."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _refuse(owner, field, f"must be a number, got {value!r}",
                f"write a number without quotes: {what}")
    try:  # an integer too large for a float (JSON allows any number of digits) is refused too
        finite = math.isfinite(value)
    except OverflowError:
        finite, value = False, f"a number of {len(str(value))} digits"
    if not finite:
        _refuse(owner, field, f"must be a finite number, got {value}", f"give {what}")


# Without PCIe peer-to-peer (NVIDIA's driver disables it on GeForce cards; an IOMMU or two CPU
# sockets also prevent it), NCCL stages GPU-to-GPU traffic through pinned host memory: each
# byte crosses PCIe twice (GPU -> host, host -> GPU) and host memory in between, and each
# message pays a second link latency for the staging copy. Nominal, like the PCIe figures
# themselves; `hetjax calibrate` measures the real link.
HOST_STAGED_BANDWIDTH = 0.5  # bytes_per_s of a link with p2p = False, as a share of p2p's
HOST_STAGED_LATENCY = 2.0  # latency_s of a link with p2p = False, as a multiple of p2p's


@dataclass(frozen=True)
class Link:
    """A point-to-point link class with an alpha-beta cost: latency plus bytes / bandwidth.

    `bytes_per_s` and `latency_s` are what a transfer pays (the cost model reads only these);
    the fields are the link's nominal figures and how it is used. docs/topology.md documents
    each field with its unit."""

    kind: str  # one of LINK_KINDS
    bandwidth_gbps: float  # gigabits per second per direction, as NICs are quoted (nominal)
    latency_us: float  # one message's latency in microseconds
    # Achieved / nominal bandwidth of this fabric under collective traffic (the catalogue's
    # values are fitted on Holmes Table 1, see hetjax/core/catalogue.py); 1.0 for a measured link.
    efficiency: float = 1.0
    # PCIe only: False when the GPUs cannot read each other's memory, so traffic is staged
    # through host memory (HOST_STAGED_BANDWIDTH, HOST_STAGED_LATENCY price it).
    p2p: bool = True

    def __post_init__(self):
        owner = f"{self.kind} link"
        if self.kind not in LINK_KINDS:
            _refuse("link", "kind", f"{self.kind!r} is unknown",
                    f"use one of {', '.join(LINK_KINDS)}")
        what = "the link's nominal rate per direction in Gbit/s, e.g. 25"
        _number(self.bandwidth_gbps, owner, "bandwidth_gbps", what)
        if not self.bandwidth_gbps > 0:
            _refuse(owner, "bandwidth_gbps", f"must be > 0 Gbit/s, got {self.bandwidth_gbps}",
                    f"give {what}")
        what = "one message's latency in µs, e.g. 5"
        _number(self.latency_us, owner, "latency_us", what)
        if self.latency_us < 0:
            _refuse(owner, "latency_us", f"must be >= 0 µs, got {self.latency_us}",
                    f"give {what}")
        what = "achieved / nominal bandwidth, in (0, 1] (1.0 for a measured rate)"
        _number(self.efficiency, owner, "efficiency", what)
        if not 0 < self.efficiency <= 1:
            _refuse(owner, "efficiency", f"must lie in (0, 1], got {self.efficiency}",
                    f"give {what}")
        if not isinstance(self.p2p, bool):
            _refuse(owner, "p2p", f"must be true or false, got {self.p2p!r}",
                    "write true or false without quotes")
        if not self.p2p and self.kind != "pcie":
            _refuse(owner, "p2p", "false applies to PCIe links only (NVLink and networks "
                    "carry GPU-to-GPU traffic themselves)", "leave p2p out of this link")

    @property
    def bytes_per_s(self) -> float:
        """Achieved bandwidth: nominal times the fabric's efficiency (halved without P2P)."""
        staged = 1.0 if self.p2p else HOST_STAGED_BANDWIDTH
        return self.bandwidth_gbps * BYTES_PER_GBIT * self.efficiency * staged

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6 * (1.0 if self.p2p else HOST_STAGED_LATENCY)


@dataclass(frozen=True)
class NicSettings:
    """What NCCL needs to use a cluster's NIC (see parallel/nic.py)."""

    hcas: tuple[str, ...] = ()  # RDMA devices, e.g. ("mlx5_0:1", "mlx5_1:1")
    gid_index: int | None = None  # RoCE only: the GID index of the RoCE v2 address
    socket_ifname: str = "eth0"  # interface for socket (Ethernet) traffic
    gdr_level: str | None = None  # NCCL_NET_GDR_LEVEL, e.g. "PHB"


@dataclass(frozen=True)
class Accelerator:
    """One accelerator kind: peak dense bf16 throughput and memory."""

    name: str
    peak_tflops: float
    memory_gib: float
    vendor: str = "nvidia"
    # Nominal memory (HBM) bandwidth in GB/s, which prices memory-bound work (norms, softmax,
    # the optimizer update; hetjax/planner/compute.py); 0: unknown, a ratio to the peak is used.
    memory_bandwidth_gbs: float = 0.0

    def __post_init__(self):
        owner = f"accelerator {self.name!r}"
        # The planner divides by both: a zero or negative value would crash or mislead it.
        for f, what in (("peak_tflops", "the device's peak dense bf16 TFLOP/s, e.g. 312"),
                        ("memory_gib", "the device's memory in GiB, e.g. 80")):
            v = getattr(self, f)
            _number(v, owner, f, what)
            if not v > 0:
                _refuse(owner, f, f"must be > 0, got {v}", f"give {what}")
        what = "the memory bandwidth in GB/s, e.g. 2039 (0: unknown)"
        _number(self.memory_bandwidth_gbs, owner, "memory_bandwidth_gbs", what)
        if self.memory_bandwidth_gbs < 0:
            _refuse(owner, "memory_bandwidth_gbs",
                    f"must be >= 0, got {self.memory_bandwidth_gbs}", f"give {what}")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30


@dataclass(frozen=True)
class Cluster:
    """`nodes` identical nodes of `devices_per_node` devices joined by one NIC kind."""

    name: str
    nodes: int
    devices_per_node: int
    accelerator: Accelerator
    nic: Link  # between nodes of this cluster
    intra_node: Link  # between devices of one node
    nic_settings: NicSettings = NicSettings()

    def __post_init__(self):
        for f in ("nodes", "devices_per_node"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                _refuse(f"cluster {self.name!r}", f, f"must be a whole number >= 1, got {v!r}",
                        f"give the number of {'nodes' if f == 'nodes' else 'devices in a node'}"
                        ", e.g. 2")

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class DeviceInfo:
    """Where one device sits. `rank` is its index in cluster -> node -> device order."""

    rank: int
    cluster: int  # index into Topology.clusters
    node: int  # node index inside its cluster
    local: int  # device index inside its node
    global_node: int  # node index over the whole topology (one process per node)


@dataclass(frozen=True)
class ClusterLink:
    """An override of the inter-cluster link for one (unordered) pair of clusters."""

    a: str
    b: str
    link: Link


@dataclass(frozen=True)
class Topology:
    name: str
    clusters: tuple[Cluster, ...]
    # The link between any two clusters, unless `cluster_links` overrides the pair. None: no
    # default link, so pairs without an override are disconnected.
    inter_cluster: Link | None
    cluster_links: tuple[ClusterLink, ...] = ()

    def __post_init__(self):
        if not self.clusters:
            raise TopologyValueError("clusters", "the topology has no clusters",
                                     "describe at least one cluster")
        first: dict[str, int] = {}
        for i, c in enumerate(self.clusters):
            if c.name in first:
                raise TopologyValueError(
                    f"clusters[{i}].name", f"{c.name!r} is already the name of "
                    f"clusters[{first[c.name]}]", "give each cluster its own name")
            first[c.name] = i
        pairs: dict[frozenset, int] = {}
        for i, cl in enumerate(self.cluster_links):
            for end in ("a", "b"):
                if getattr(cl, end) not in first:
                    raise TopologyValueError(
                        f"cluster_links[{i}].{end}", f"no cluster is named "
                        f"{getattr(cl, end)!r}", f"name one of {', '.join(map(repr, first))}")
            if cl.a == cl.b:
                raise TopologyValueError(f"cluster_links[{i}]", f"joins {cl.a!r} to itself",
                                         "name two different clusters in a and b")
            pair = frozenset((cl.a, cl.b))
            if pair in pairs:
                raise TopologyValueError(
                    f"cluster_links[{i}]", f"{cl.a!r} and {cl.b!r} are already joined by "
                    f"cluster_links[{pairs[pair]}]", "give each pair of clusters one link")
            pairs[pair] = i

    # --- devices --------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return sum(c.num_devices for c in self.clusters)

    @property
    def num_nodes(self) -> int:
        return sum(c.nodes for c in self.clusters)

    def without_nodes(self, nodes) -> "Topology":
        """This topology with the global node indices `nodes` removed (a cluster's nodes are
        alike, so it keeps fewer of them; a cluster left with none goes, with its links)."""
        gone, first = [0] * len(self.clusters), 0
        for i, c in enumerate(self.clusters):
            gone[i] = sum(first <= n < first + c.nodes for n in nodes)
            first += c.nodes
        kept = tuple(dataclasses.replace(c, nodes=c.nodes - g)
                     for c, g in zip(self.clusters, gone) if c.nodes > g)
        names = {c.name for c in kept}
        return dataclasses.replace(
            self, name=f"{self.name}-{len(set(nodes))}", clusters=kept,
            cluster_links=tuple(x for x in self.cluster_links if {x.a, x.b} <= names))

    @functools.cached_property
    def devices(self) -> tuple[DeviceInfo, ...]:
        out, rank, gnode = [], 0, 0
        for ci, c in enumerate(self.clusters):
            for n in range(c.nodes):
                for d in range(c.devices_per_node):
                    out.append(DeviceInfo(rank, ci, n, d, gnode))
                    rank += 1
                gnode += 1
        return tuple(out)

    def cluster_of(self, rank: int) -> Cluster:
        return self.clusters[self.devices[rank].cluster]

    def accelerator_of(self, rank: int) -> Accelerator:
        return self.cluster_of(rank).accelerator

    def cluster_ranks(self, cluster: int) -> range:
        start = sum(c.num_devices for c in self.clusters[:cluster])
        return range(start, start + self.clusters[cluster].num_devices)

    @property
    def default_compute_dtype(self) -> str:
        """What model.dtype 'auto' means here: float32 when every device is a CPU (the default
        job stays bit-identical), else bfloat16 (parameters stay in model.param_dtype)."""
        cpu = all(c.accelerator.vendor == "cpu" for c in self.clusters)
        return "float32" if cpu else "bfloat16"

    @property
    def peak_flops(self) -> float:
        """Sum of every device's peak FLOP/s (the MFU denominator)."""
        return sum(c.num_devices * c.accelerator.peak_tflops * 1e12 for c in self.clusters)

    # --- links ----------------------------------------------------------------------------
    def has_link(self, a: int, b: int) -> bool:
        """Whether clusters a and b (a != b) are joined by a link."""
        return self._cluster_link_or_none(a, b) is not None

    def _cluster_link_or_none(self, a: int, b: int) -> Link | None:
        na, nb = self.clusters[a].name, self.clusters[b].name
        for cl in self.cluster_links:
            if {cl.a, cl.b} == {na, nb}:
                return cl.link
        return self.inter_cluster

    def cluster_link(self, a: int, b: int) -> Link:
        """The link between clusters a and b (a != b), honouring per-pair overrides."""
        lk = self._cluster_link_or_none(a, b)
        if lk is None:
            na, nb = self.clusters[a].name, self.clusters[b].name
            raise TopologyError(
                f"topology {self.name!r} has no link between clusters {na!r} and {nb!r}; add "
                f"ClusterLink({na!r}, {nb!r}, link) to cluster_links or set inter_cluster")
        return lk

    def disconnected_pairs(self) -> list[tuple[str, str]]:
        """Cluster pairs (by name) with no link between them."""
        return [(a.name, b.name) for i, a in enumerate(self.clusters)
                for j, b in enumerate(self.clusters[i + 1:], i + 1) if not self.has_link(i, j)]

    def cluster_components(self) -> list[list[str]]:
        """Groups of cluster names that can reach each other over links (one group if the
        topology is connected)."""
        n = len(self.clusters)
        seen: set[int] = set()
        components = []
        for start in range(n):
            if start in seen:
                continue
            stack, comp = [start], []
            seen.add(start)
            while stack:
                a = stack.pop()
                comp.append(self.clusters[a].name)
                for b in range(n):
                    if b not in seen and self.has_link(a, b):
                        seen.add(b)
                        stack.append(b)
            components.append(comp)
        return components

    def link(self, r1: int, r2: int) -> Link:
        """The link class traffic between ranks r1 and r2 travels on."""
        d1, d2 = self.devices[r1], self.devices[r2]
        if d1.cluster != d2.cluster:
            return self.cluster_link(d1.cluster, d2.cluster)
        c = self.clusters[d1.cluster]
        if d1.node != d2.node:
            return c.nic
        if d1.local != d2.local:
            return c.intra_node
        return Link("loopback", 1e6, 0.0)

    def group_link(self, ranks) -> Link:
        """The slowest link any pair of `ranks` crosses: what a collective over them pays."""
        places = {(self.devices[r].cluster, self.devices[r].node, self.devices[r].local)
                  for r in ranks}
        clusters = sorted({c for c, _, _ in places})
        nodes = {(c, n) for c, n, _ in places}
        candidates = [self.cluster_link(a, b)
                      for i, a in enumerate(clusters) for b in clusters[i + 1:]]
        candidates += [self.clusters[c].nic for c in clusters
                       if len({n for cc, n in nodes if cc == c}) > 1]
        candidates += [self.clusters[c].intra_node for c, n in nodes
                       if sum(1 for p in places if p[:2] == (c, n)) > 1]
        if not candidates:
            return Link("loopback", 1e6, 0.0)
        return min(candidates, key=lambda lk: (lk.bandwidth_gbps, -lk.latency_us))

    def bandwidth_matrix(self):
        """(N, N) numpy arrays of bandwidth [bytes/s] and latency [s] between ranks.

        Disconnected pairs have bandwidth 0 and latency inf."""
        import numpy as np

        n = self.num_devices
        bw = np.empty((n, n))
        lat = np.empty((n, n))
        # Fill by blocks (cluster, node) so 4,096-device topologies stay fast.
        blocks = []
        for ci, c in enumerate(self.clusters):
            start = self.cluster_ranks(ci).start
            for node in range(c.nodes):
                s = start + node * c.devices_per_node
                blocks.append((ci, s, s + c.devices_per_node))
        for (ca, sa, ea) in blocks:
            for (cb, sb, eb) in blocks:
                if ca != cb:
                    lk = self._cluster_link_or_none(ca, cb)
                    if lk is None:
                        bw[sa:ea, sb:eb], lat[sa:ea, sb:eb] = 0.0, np.inf
                        continue
                elif sa != sb:
                    lk = self.clusters[ca].nic
                else:
                    lk = self.clusters[ca].intra_node
                bw[sa:ea, sb:eb] = lk.bytes_per_s
                lat[sa:ea, sb:eb] = lk.latency_s
        np.fill_diagonal(lat, 0.0)
        np.fill_diagonal(bw, np.inf)
        return bw, lat

    # --- display and serialisation --------------------------------------------------------
    # Above this many clusters (or listed cluster links) describe() groups alike rows.
    COMPACT_ROWS = 8

    def cluster_rows(self, full: bool = False) -> list[dict[str, str]]:
        """One row per cluster; with more than COMPACT_ROWS clusters (unless `full`),
        consecutive clusters of identical hardware share a row."""
        groups: list[list[int]] = []
        for ci, c in enumerate(self.clusters):
            same = groups and dataclasses.replace(self.clusters[groups[-1][0]], name="") == \
                dataclasses.replace(c, name="")
            if same and not full and len(self.clusters) > self.COMPACT_ROWS:
                groups[-1].append(ci)
            else:
                groups.append([ci])
        rows = []
        for g in groups:
            c = self.clusters[g[0]]
            first, last = self.cluster_ranks(g[0]), self.cluster_ranks(g[-1])
            ranks = (f"{first.start}-{last.stop - 1}" if last.stop - first.start > 1
                     else str(first.start))
            name = c.name if len(g) == 1 else \
                f"{c.name} .. {self.clusters[g[-1]].name} ({len(g)} clusters)"
            each = " each" if len(g) > 1 else ""
            acc = c.accelerator
            rows.append({"cluster": name, "nodes x dev": f"{c.nodes} x {c.devices_per_node}{each}",
                         "ranks": ranks,
                         "accelerator": f"{acc.name} {acc.peak_tflops:g}TF "
                                        f"{acc.memory_gib:g}GiB",
                         "NIC": _fmt_link(c.nic), "intra-node": _fmt_link(c.intra_node)})
        return rows

    def link_lines(self, full: bool = False) -> list[str]:
        """The links between clusters: each listed pair, or (more than COMPACT_ROWS pairs,
        unless `full`) one line per link kind with its range of rates and latencies and the
        slowest pair."""
        if len(self.clusters) == 1:
            return []
        lines = ["between clusters: " + (_fmt_link(self.inter_cluster)
                                         if self.inter_cluster is not None
                                         else "only the links listed")]
        if full or len(self.cluster_links) <= self.COMPACT_ROWS:
            lines += [f"  {cl.a} <-> {cl.b}: {_fmt_link(cl.link)}" for cl in self.cluster_links]
        else:
            from hetjax import units

            for kind in sorted({cl.link.kind for cl in self.cluster_links}):
                ls = [cl for cl in self.cluster_links if cl.link.kind == kind]
                bw = [cl.link.bandwidth_gbps * 1e9 for cl in ls]
                lat = [cl.link.latency_us * 1e-6 for cl in ls]
                slow = min(ls, key=lambda cl: cl.link.bytes_per_s)
                lines.append(f"  {len(ls)} {kind} links: {units.bits_per_s(min(bw))} to "
                             f"{units.bits_per_s(max(bw))}, latency {units.seconds(min(lat))} to "
                             f"{units.seconds(max(lat))};\n    slowest {slow.a} <-> {slow.b}: "
                             f"{_fmt_link(slow.link)}")
            lines.append("  (every pair: topology.describe(full=True))")
        lines += [f"  {a} <-> {b}: no link" for a, b in self.disconnected_pairs()]
        return lines

    def size_text(self) -> str:
        from hetjax.units import count

        return (f"{count(len(self.clusters), 'cluster')}, {count(self.num_nodes, 'node')}, "
                f"{count(self.num_devices, 'device')}")

    def describe(self, full: bool = False) -> str:
        """The clusters and links as a table; large topologies compactly (alike clusters on
        one row, cluster links by kind) unless `full`."""
        rows = self.cluster_rows(full)
        lines = [f"topology {self.name!r}: {self.size_text()}",
                 *("  " + line for line in _table(rows))]
        lines += ["  " + line for line in self.link_lines(full)]
        return "\n".join(lines)

    def _repr_html_(self) -> str:  # notebooks: the same table as HTML
        import html

        rows = self.cluster_rows()
        head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
        body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(v)}</td>"
                                        for v in r.values()) + "</tr>" for r in rows)
        links = "<br>".join(html.escape(line) for line in self.link_lines())
        return (f"<p><b>topology {html.escape(self.name)}</b>: {self.size_text()}</p>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                f"<p style='font-family:monospace'>{links}</p>")

    def to_dict(self) -> dict[str, Any]:
        """Every field spelled out: a valid topology file (hetjax.core.topology_file writes the
        shorter form that names catalogue hardware, and reads both)."""
        return dataclasses.asdict(self)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    # --- mapping onto JAX devices -----------------------------------------------------------
    def jax_devices(self):
        """The JAX devices standing for ranks 0..N-1, in rank order.

        Devices are ordered by (process, id): each process is a node in a multi-host run, and
        nodes are numbered in rank order too.
        """
        import jax

        _simulate_cpu_devices(jax, self.num_devices)
        avail = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        if self.num_devices > len(avail):
            raise TopologyError(
                f"topology {self.name!r} needs {self.num_devices} devices but JAX sees "
                f"{len(avail)} ({avail[0].platform}). On CPU, JAX had started before hetjax "
                "could ask for simulated devices: restart the Python process (or notebook "
                "kernel) and build the Trainer before any other JAX operation, or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={self.num_devices} before "
                "jax is imported (the hetjax CLI does this itself); or pick a smaller "
                "topology (--config.topology.nodes / devices_per_node).")
        return avail[: self.num_devices]


# --- simulated CPU devices --------------------------------------------------------------------
# Simulated devices run their programs on the threads of one shared pool, and a collective
# waits until every peer's thread reaches it. On a busy machine (two cores running two test
# workers, each job with 8 devices) a peer can arrive tens of seconds late, and XLA's default
# then ends the whole process (a warning after 20 s, the end 40 s later). Longer limits keep
# such a wait from killing a healthy run; a collective that truly hangs is still ended, after
# 5 minutes, with XLA's message naming it (tests/test_nic.py checks this jaxlib honours both).
CPU_COLLECTIVE_PATIENCE = (
    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=60",
    "--xla_cpu_collective_call_terminate_timeout_seconds=240",  # counted after the warning
)


def simulated_cpu_flags(num_devices: int) -> str:
    """XLA_FLAGS for `num_devices` simulated CPU devices that wait for late peers."""
    return " ".join((f"--xla_force_host_platform_device_count={num_devices}",
                     *CPU_COLLECTIVE_PATIENCE))


def merge_xla_flags(base: str, ours: str, override: bool) -> str:
    """Two XLA_FLAGS values merged flag by flag (by name); on a clash `ours` wins if
    `override`, else `base` does."""
    def by_name(text: str) -> dict[str, str]:
        return {f.split("=", 1)[0]: f for f in text.split()}

    mine, theirs = by_name(ours), by_name(base)
    return " ".join(({**theirs, **mine} if override else {**mine, **theirs}).values())


def _simulate_cpu_devices(jax, n: int) -> None:
    """Before JAX starts its backends (a fresh notebook kernel that only imported jax), give
    its CPU backend `n` devices, unless the user already chose a count (XLA_FLAGS or
    jax_num_cpu_devices), and `CPU_COLLECTIVE_PATIENCE` (XLA reads XLA_FLAGS when a backend
    starts). Accelerator backends are not affected; once JAX has started, the caller's error
    message says how to restart with the right count."""
    import os

    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a JAX without this (private) probe: leave it
        return
    if started:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = merge_xla_flags(flags, " ".join(CPU_COLLECTIVE_PATIENCE), False)
    if jax.config.jax_num_cpu_devices == -1 and "xla_force_host_platform_device_count" not in flags:
        jax.config.update("jax_num_cpu_devices", n)


def _fmt_link(lk: Link) -> str:
    from hetjax import units

    eff = f" x{lk.efficiency:.2f}" if lk.efficiency != 1 else ""
    p2p = "" if lk.p2p else " no P2P"
    return f"{lk.kind}{p2p} {units.bits_per_s(lk.bandwidth_gbps * 1e9)}{eff} " \
        f"{units.seconds(lk.latency_us * 1e-6)}"


def _table(rows: list[dict[str, str]]) -> list[str]:
    """Rows of equal keys as text columns, each as wide as its widest cell."""
    cols = list(rows[0])
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    return ["  ".join(f"{r[c]:<{width[c]}}" for c in cols).rstrip()
            for r in [dict(zip(cols, cols)), *rows]]

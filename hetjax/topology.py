"""Hardware topology: clusters of nodes of devices, and the links between any two devices.

A `Topology` is plain data (frozen dataclasses, JSON round-trip) describing what hetjax trains
on: each cluster has a number of nodes, devices per node, one accelerator kind, an intra-node
link (NVLink/PCIe) and an inter-node NIC (InfiniBand, RoCE or Ethernet) with the settings NCCL
needs to use it. Clusters are joined by an inter-cluster link that can be overridden per
cluster pair (geo-distributed sites). Devices are numbered in rank order cluster -> node ->
device, the order the Holmes group formulas and the mesh assume.

Clusters with no link between them are expressed by leaving `inter_cluster` as None: then only
the pairs listed in `cluster_links` are connected, and `disconnected_pairs()` names the others
(the planner refuses a topology whose clusters do not form one connected network).

This module does not import jax, so the CLI can size the simulated CPU device count from a
topology before jax starts.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from hetjax.errors import TopologyError

LINK_KINDS = ("loopback", "nvlink", "pcie", "infiniband", "roce", "ethernet")


@dataclass(frozen=True)
class Link:
    """A point-to-point link class with an alpha-beta cost: latency plus bytes / bandwidth."""

    kind: str
    bandwidth_gbps: float  # gigabits per second, as NICs are quoted (nominal)
    latency_us: float
    # Achieved / nominal bandwidth of this fabric under collective traffic (the catalogue's
    # values are fitted on Holmes Table 1, see LINKS); 1.0 for a link given by measurement.
    efficiency: float = 1.0

    def __post_init__(self):
        if self.kind not in LINK_KINDS:
            raise TopologyError(
                f"link kind {self.kind!r} is unknown; use one of {', '.join(LINK_KINDS)}")
        if not self.bandwidth_gbps > 0:
            raise TopologyError(
                f"{self.kind} link bandwidth must be > 0 Gbit/s, got {self.bandwidth_gbps}")
        if self.latency_us < 0:
            raise TopologyError(f"{self.kind} link latency must be >= 0 us, got {self.latency_us}")
        if not 0 < self.efficiency <= 1:
            raise TopologyError(f"{self.kind} link efficiency (achieved / nominal bandwidth) "
                                f"must lie in (0, 1], got {self.efficiency}")

    @property
    def bytes_per_s(self) -> float:
        """Achieved bandwidth: nominal times the fabric's efficiency."""
        return self.bandwidth_gbps * 1e9 / 8 * self.efficiency

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move `nbytes` once over this link (alpha + bytes / beta)."""
        return self.latency_s + nbytes / self.bytes_per_s


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
        if self.nodes < 1 or self.devices_per_node < 1:
            raise TopologyError(
                f"cluster {self.name!r} needs nodes >= 1 and devices_per_node >= 1, got "
                f"{self.nodes} x {self.devices_per_node}")

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
            raise TopologyError(f"topology {self.name!r} has no clusters")
        names = [c.name for c in self.clusters]
        if len(set(names)) != len(names):
            raise TopologyError(f"topology {self.name!r} repeats a cluster name: {names}")
        for cl in self.cluster_links:
            for end in (cl.a, cl.b):
                if end not in names:
                    raise TopologyError(
                        f"topology {self.name!r}: a cluster link names {end!r}, which is not "
                        f"one of its clusters {names}")

    # --- devices --------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        return sum(c.num_devices for c in self.clusters)

    @property
    def num_nodes(self) -> int:
        return sum(c.nodes for c in self.clusters)

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
    def is_homogeneous_accelerator(self) -> bool:
        return len({c.accelerator for c in self.clusters}) == 1

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
    def describe(self) -> str:
        lines = [f"topology {self.name!r}: {len(self.clusters)} clusters, "
                 f"{self.num_nodes} nodes, {self.num_devices} devices"]
        lines.append(f"  {'cluster':<12}{'nodes x dev':<13}{'ranks':<12}{'accelerator':<24}"
                     f"{'NIC':<30}{'intra-node':<20}")
        for ci, c in enumerate(self.clusters):
            r = self.cluster_ranks(ci)
            acc = f"{c.accelerator.name} {c.accelerator.peak_tflops:g}TF {c.accelerator.memory_gib:g}GiB"
            lines.append(
                f"  {c.name:<12}{f'{c.nodes} x {c.devices_per_node}':<13}"
                f"{f'{r.start}-{r.stop - 1}':<12}{acc:<24}{_fmt_link(c.nic):<30}"
                f"{_fmt_link(c.intra_node):<20}")
        lines.append("  between clusters: " + (_fmt_link(self.inter_cluster)
                                                if self.inter_cluster is not None
                                                else "only the links listed"))
        for cl in self.cluster_links:
            lines.append(f"    {cl.a} <-> {cl.b}: {_fmt_link(cl.link)}")
        for a, b in self.disconnected_pairs():
            lines.append(f"    {a} <-> {b}: no link")
        return "\n".join(lines)

    def _repr_html_(self) -> str:  # notebooks
        return "<pre>" + self.describe() + "</pre>"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Topology":
        try:
            def link(x):
                return Link(**x)

            clusters = tuple(
                Cluster(
                    name=c["name"], nodes=int(c["nodes"]),
                    devices_per_node=int(c["devices_per_node"]),
                    accelerator=Accelerator(**c["accelerator"]),
                    nic=link(c["nic"]), intra_node=link(c["intra_node"]),
                    nic_settings=NicSettings(**{
                        **c.get("nic_settings", {}),
                        "hcas": tuple(c.get("nic_settings", {}).get("hcas", ())),
                    }),
                ) for c in d["clusters"])
            return Topology(
                name=d.get("name", "custom"), clusters=clusters,
                inter_cluster=(link(d["inter_cluster"]) if d["inter_cluster"] is not None
                               else None),
                cluster_links=tuple(ClusterLink(x["a"], x["b"], link(x["link"]))
                                    for x in d.get("cluster_links", ())))
        except (KeyError, TypeError) as e:
            raise TopologyError(
                f"topology description is malformed ({type(e).__name__}: {e}); it needs "
                "'clusters' (each with name, nodes, devices_per_node, accelerator, nic, "
                "intra_node) and 'inter_cluster' (a link, or null for none); write one with Topology.to_json() to see "
                "the format") from None

    @staticmethod
    def from_json(text: str) -> "Topology":
        return Topology.from_dict(json.loads(text))

    # --- mapping onto JAX devices -----------------------------------------------------------
    def jax_devices(self):
        """The JAX devices standing for ranks 0..N-1, in rank order.

        Devices are ordered by (process, id): each process is a node in a multi-host run, and
        nodes are numbered in rank order too.
        """
        import jax

        avail = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        if self.num_devices > len(avail):
            raise TopologyError(
                f"topology {self.name!r} needs {self.num_devices} devices but JAX sees "
                f"{len(avail)} ({avail[0].platform}). On CPU, set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={self.num_devices} before "
                "jax is imported (the hetjax CLI does this itself), or pick a smaller "
                "topology (--config.topology.nodes / devices_per_node).")
        return avail[: self.num_devices]


def _fmt_link(lk: Link) -> str:
    eff = f" x{lk.efficiency:.2f}" if lk.efficiency != 1 else ""
    return f"{lk.kind} {lk.bandwidth_gbps:g}Gb/s{eff} {lk.latency_us:g}us"


# --- link and accelerator catalogue -----------------------------------------------------------
# Nominal figures for planning; a real deployment overrides them from measurements
# (`hetjax calibrate`). Efficiency = achieved / nominal bandwidth under NCCL collectives:
# InfiniBand, RoCE and Ethernet fitted on Holmes Table 1 (`hetjax.planner.calibrate.
# fit_fabrics`, `python scripts/bench_planner.py calibrate`); NVLink from NCCL's own tuning
# model, which caps an A100's NVLink bus bandwidth at 235 of its 300 GB/s; PCIe unmeasured.
LINKS = {
    "nvlink": Link("nvlink", 2400.0, 2.0, efficiency=0.78),  # A100 NVLink3: 300 GB/s per direction
    "pcie": Link("pcie", 256.0, 5.0),  # PCIe 4.0 x16
    "infiniband": Link("infiniband", 200.0, 5.0, efficiency=0.79),  # HDR 200 Gb/s
    "roce": Link("roce", 200.0, 8.0, efficiency=0.26),  # RoCE v2, 200 Gb/s
    "ethernet": Link("ethernet", 25.0, 50.0),  # 25 GbE via TCP sockets; Table 1's anchor (1.0)
}

ACCELERATORS = {
    "a100": Accelerator("a100", 312.0, 80.0),
    "a800": Accelerator("a800", 312.0, 80.0),
    "h100": Accelerator("h100", 989.0, 80.0),
    "v100": Accelerator("v100", 125.0, 32.0),
    "mi250x": Accelerator("mi250x", 383.0, 128.0, vendor="amd"),
    "ascend910b": Accelerator("ascend910b", 320.0, 64.0, vendor="huawei"),
    # A simulated CPU device: 2 cores shared by 8 of them; a nominal fp32 peak so MFU on the
    # CPU default reads as a fraction of what these cores can do (about 200 GFLOP/s in all).
    "cpu": Accelerator("cpu", 0.025, 2.0, vendor="cpu"),
}


def accelerator(name: str) -> Accelerator:
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise TopologyError(f"accelerator {name!r} is unknown; known kinds: "
                            f"{', '.join(sorted(ACCELERATORS))}") from None


def link(name: str, bandwidth_gbps: float | None = None, latency_us: float | None = None) -> Link:
    base = LINKS[name]
    return dataclasses.replace(
        base, bandwidth_gbps=bandwidth_gbps if bandwidth_gbps is not None else base.bandwidth_gbps,
        latency_us=latency_us if latency_us is not None else base.latency_us)


IB_SETTINGS = NicSettings(hcas=("mlx5_0:1", "mlx5_1:1", "mlx5_2:1", "mlx5_3:1"),
                          socket_ifname="eth0", gdr_level="PHB")
ROCE_SETTINGS = NicSettings(hcas=("mlx5_bond_0:1", "mlx5_bond_1:1"), gid_index=3,
                            socket_ifname="eth0", gdr_level="PHB")
ETH_SETTINGS = NicSettings(socket_ifname="eth0")


def nic_settings_for(kind: str) -> NicSettings:
    return {"infiniband": IB_SETTINGS, "roce": ROCE_SETTINGS}.get(kind, ETH_SETTINGS)


def make_cluster(name: str, nodes: int, devices_per_node: int, accel: str | Accelerator,
                 nic: str | Link, intra: str | Link = "nvlink",
                 settings: NicSettings | None = None) -> Cluster:
    nic_link = LINKS[nic] if isinstance(nic, str) else nic
    return Cluster(
        name=name, nodes=nodes, devices_per_node=devices_per_node,
        accelerator=accelerator(accel) if isinstance(accel, str) else accel,
        nic=nic_link, intra_node=LINKS[intra] if isinstance(intra, str) else intra,
        nic_settings=settings if settings is not None else nic_settings_for(nic_link.kind))


# --- presets ----------------------------------------------------------------------------------
PRESETS: dict[str, Callable[..., Topology]] = {}


def register_preset(fn: Callable[..., Topology]) -> Callable[..., Topology]:
    PRESETS[fn.__name__] = fn
    return fn


@register_preset
def cpu_hybrid(nodes: int = 2, devices_per_node: int = 2) -> Topology:
    """The default: two clusters (InfiniBand and RoCE) joined by Ethernet, on CPU devices.

    Same shape as Holmes' hybrid setting, shrunk to 2 x nodes x devices_per_node simulated
    CPU devices (8 by default).
    """
    return Topology(
        name="cpu_hybrid",
        clusters=(make_cluster("ib", nodes, devices_per_node, "cpu", "infiniband"),
                  make_cluster("roce", nodes, devices_per_node, "cpu", "roce")),
        inter_cluster=LINKS["ethernet"])


@register_preset
def holmes_hybrid(nodes: int = 2, devices_per_node: int = 8, accel: str = "a100") -> Topology:
    """Holmes' hybrid setting: an InfiniBand cluster and a RoCE cluster joined by Ethernet."""
    return Topology(
        name="holmes_hybrid",
        clusters=(make_cluster("ib", nodes, devices_per_node, accel, "infiniband"),
                  make_cluster("roce", nodes, devices_per_node, accel, "roce")),
        inter_cluster=LINKS["ethernet"])


def _holmes_homogeneous(nic: str, nodes: int, devices_per_node: int, accel: str) -> Topology:
    return Topology(
        name=f"holmes_{nic}",
        clusters=(make_cluster(nic, nodes, devices_per_node, accel, nic),),
        inter_cluster=LINKS["ethernet"])


@register_preset
def holmes_infiniband(nodes: int = 4, devices_per_node: int = 8, accel: str = "a100") -> Topology:
    """Holmes Table 1, first row: 4 nodes x 8 A100 on InfiniBand."""
    return _holmes_homogeneous("infiniband", nodes, devices_per_node, accel)


@register_preset
def holmes_roce(nodes: int = 4, devices_per_node: int = 8, accel: str = "a100") -> Topology:
    """Holmes Table 1, second row: 4 nodes x 8 A100 on RoCE."""
    return _holmes_homogeneous("roce", nodes, devices_per_node, accel)


@register_preset
def holmes_ethernet(nodes: int = 4, devices_per_node: int = 8, accel: str = "a100") -> Topology:
    """Holmes Table 1, third row: 4 nodes x 8 A100 on 25 Gb/s Ethernet."""
    return _holmes_homogeneous("ethernet", nodes, devices_per_node, accel)


@register_preset
def hethub_mixed(nodes: int = 1, devices_per_node: int = 8, fast: str = "a100",
                 slow: str = "ascend910b") -> Topology:
    """HetHub's setting: two clusters of different accelerator kinds joined by Ethernet."""
    return Topology(
        name="hethub_mixed",
        clusters=(make_cluster(fast, nodes, devices_per_node, fast, "infiniband"),
                  make_cluster(slow, nodes, devices_per_node, slow, "roce", intra="pcie")),
        inter_cluster=LINKS["ethernet"])


@register_preset
def cpu_single(nodes: int = 1, devices_per_node: int = 8) -> Topology:
    """One cluster of simulated CPU devices: the homogeneous baseline (and the 1-device
    reference the tests compare against)."""
    return Topology(name="cpu_single",
                    clusters=(make_cluster("cpu", nodes, devices_per_node, "cpu", "infiniband"),),
                    inter_cluster=LINKS["ethernet"])


def preset(name: str, **kwargs) -> Topology:
    """Build a registered topology preset, e.g. preset("holmes_hybrid", devices_per_node=2)."""
    if name not in PRESETS:
        raise TopologyError(f"unknown topology preset {name!r}; choose one of: "
                            f"{', '.join(sorted(PRESETS))}")
    try:
        return PRESETS[name](**kwargs)
    except TypeError as e:
        import inspect

        params = ", ".join(inspect.signature(PRESETS[name]).parameters)
        raise TopologyError(f"topology preset {name!r} takes ({params}); {e}") from None


# --- DT-FM's five scenarios (spec/dtfm.md): 64 V100s on slow and uneven networks ---------------
# Sites are clusters of single-device nodes (their NIC is the site's network); geo links are
# per-pair ClusterLink overrides, with no default link between sites (inter_cluster=None).
def _wan(gbps: float, ms: float) -> Link:
    return Link("ethernet", gbps, ms * 1e3)


def _sites(name: str, sites: tuple[str, ...], nodes: int, inside: Link,
           between: dict[tuple[str, str], Link], accel: str) -> Topology:
    return Topology(
        name=name,
        clusters=tuple(make_cluster(s, nodes, 1, accel, inside, intra=inside) for s in sites),
        inter_cluster=None,
        cluster_links=tuple(ClusterLink(a, b, lk) for (a, b), lk in between.items()))


@register_preset
def dtfm_datacenter_ondemand(instances: int = 8, devices_per_node: int = 8,
                             accel: str = "v100") -> Topology:
    """DT-FM scenario 0: instances of 8 GPUs, 100 Gb/s inside, 3.125 Gb/s between, no delay."""
    inside = Link("nvlink", 100.0, 0.0)
    return Topology(
        name="dtfm_datacenter_ondemand",
        clusters=tuple(make_cluster(f"inst{i}", 1, devices_per_node, accel, _wan(3.125, 0),
                                    intra=inside) for i in range(instances)),
        inter_cluster=_wan(3.125, 0))


@register_preset
def dtfm_datacenter_spot(accel: str = "v100") -> Topology:
    """DT-FM scenario 1: 8 instances of 4 GPUs (100 Gb/s inside) and 32 standalone GPUs
    (1-node, 1-device clusters); 1.25 Gb/s between everything else, no delay."""
    inside = Link("nvlink", 100.0, 0.0)
    slow = _wan(1.25, 0)
    clusters = [make_cluster(f"inst{i}", 1, 4, accel, slow, intra=inside) for i in range(8)]
    clusters += [make_cluster(f"gpu{i}", 1, 1, accel, slow, intra=inside) for i in range(32)]
    return Topology(name="dtfm_datacenter_spot", clusters=tuple(clusters), inter_cluster=slow)


@register_preset
def dtfm_multi_university(nodes: int = 32, accel: str = "v100") -> Topology:
    """DT-FM scenario 2: two campuses (Ohio, Virginia) of `nodes` GPUs, 5 Gb/s / 1 ms inside,
    1.12 Gb/s / 11 ms between."""
    return _sites("dtfm_multi_university", ("ohio", "virginia"), nodes, _wan(5.0, 1.0),
                  {("ohio", "virginia"): _wan(1.12, 11)}, accel)


@register_preset
def dtfm_regional(nodes: int = 16, accel: str = "v100") -> Topology:
    """DT-FM scenario 3: four US regions of `nodes` GPUs, 2 Gb/s / 5 ms inside, measured
    inter-region links."""
    between = {("virginia", "oregon"): _wan(1.15, 67), ("virginia", "california"): _wan(1.05, 59),
               ("virginia", "ohio"): _wan(1.12, 11), ("oregon", "california"): _wan(1.25, 12),
               ("oregon", "ohio"): _wan(1.10, 49), ("california", "ohio"): _wan(1.02, 52)}
    return _sites("dtfm_regional", ("virginia", "oregon", "california", "ohio"), nodes,
                  _wan(2.0, 5.0), between, accel)


# (delay ms, Gb/s) between DT-FM's eight cities, as in the paper.
_WORLD_LINKS = {
    ("oregon", "virginia"): (67, 0.79), ("oregon", "ohio"): (49, 1.10),
    ("oregon", "tokyo"): (96, 0.523), ("oregon", "seoul"): (124, 0.46),
    ("oregon", "london"): (136, 0.42), ("oregon", "frankfurt"): (143, 0.404),
    ("oregon", "ireland"): (124, 0.482), ("virginia", "ohio"): (11, 1.12),
    ("virginia", "tokyo"): (143, 0.524), ("virginia", "seoul"): (172, 0.500),
    ("virginia", "london"): (76, 1.16), ("virginia", "frankfurt"): (90, 1.02),
    ("virginia", "ireland"): (67, 1.05), ("ohio", "tokyo"): (130, 0.694),
    ("ohio", "seoul"): (159, 0.529), ("ohio", "london"): (86, 1.05),
    ("ohio", "frankfurt"): (99, 0.799), ("ohio", "ireland"): (77, 1.14),
    ("tokyo", "seoul"): (34, 1.10), ("tokyo", "london"): (210, 0.366),
    ("tokyo", "frankfurt"): (223, 0.36), ("tokyo", "ireland"): (199, 0.465),
    ("seoul", "london"): (238, 0.342), ("seoul", "frankfurt"): (235, 0.358),
    ("seoul", "ireland"): (228, 0.335), ("london", "frankfurt"): (14, 1.14),
    ("london", "ireland"): (12, 1.09), ("frankfurt", "ireland"): (24, 1.08),
}


@register_preset
def dtfm_worldwide(nodes: int = 8, accel: str = "v100") -> Topology:
    """DT-FM scenario 4: eight cities of `nodes` GPUs, 2 Gb/s / 5 ms inside, measured
    world-wide links."""
    cities = ("oregon", "virginia", "ohio", "tokyo", "seoul", "london", "frankfurt", "ireland")
    between = {pair: _wan(gbps, ms) for pair, (ms, gbps) in _WORLD_LINKS.items()}
    return _sites("dtfm_worldwide", cities, nodes, _wan(2.0, 5.0), between, accel)


DTFM_SCENARIOS = ("dtfm_datacenter_ondemand", "dtfm_datacenter_spot", "dtfm_multi_university",
                  "dtfm_regional", "dtfm_worldwide")


# --- the testbed's miniatures (docs/testbed.md; README, Results) -------------------------------
# 2 clusters x 2 single-device hosts: on the 2-core testbed machine one process per emulated
# host, 4 in all, is what fits. Link rates are nominal; the testbed scales them all by one
# factor. A slower accelerator is a CPU device with half the nominal peak: the testbed's
# `cpus=N` gives its hosts half the CPU quota of a `cpu` host.
CPU_HALF = Accelerator("cpu_half", ACCELERATORS["cpu"].peak_tflops / 2, 2.0, vendor="cpu")
TESTBED_ACCELERATORS = {"cpu": ACCELERATORS["cpu"], "cpu_half": CPU_HALF}


def _uniform_pair(name: str, cluster: str, nic: str, nodes: int, devices_per_node: int
                  ) -> Topology:
    """Two `cpu` clusters (`cluster`, `cluster`2) whose every link, between them too, is `nic`."""
    return Topology(
        name=name,
        clusters=tuple(make_cluster(c, nodes, devices_per_node, "cpu", nic)
                       for c in (cluster, cluster + "2")),
        inter_cluster=LINKS[nic])


@register_preset
def testbed_all_fast(nodes: int = 2, devices_per_node: int = 1) -> Topology:
    """Holmes' all-RDMA baseline in miniature: two InfiniBand clusters joined by a link as fast
    as InfiniBand."""
    return _uniform_pair("testbed_all_fast", "ib", "infiniband", nodes, devices_per_node)


@register_preset
def testbed_all_ethernet(nodes: int = 2, devices_per_node: int = 1) -> Topology:
    """Every link 25 Gb/s Ethernet, inside and between the two clusters."""
    return _uniform_pair("testbed_all_ethernet", "eth", "ethernet", nodes, devices_per_node)


@register_preset
def testbed_hybrid(nodes: int = 2, devices_per_node: int = 1) -> Topology:
    """Holmes' hybrid setting in miniature: an InfiniBand and a RoCE cluster joined by
    Ethernet (cpu_hybrid with one device per host)."""
    return dataclasses.replace(cpu_hybrid(nodes, devices_per_node), name="testbed_hybrid")


@register_preset
def testbed_hetaccel(nodes: int = 2, devices_per_node: int = 1, kind_a: str = "cpu",
                     kind_b: str = "cpu_half") -> Topology:
    """HetHub's setting in miniature: cluster `a` of accelerator kind_a (InfiniBand inside),
    cluster `b` of kind_b (RoCE inside), joined by Ethernet. Kinds: cpu, cpu_half (equal kinds
    give the homogeneous runs HetHub's upper bound needs)."""
    kinds = []
    for k in (kind_a, kind_b):
        if k not in TESTBED_ACCELERATORS:
            raise TopologyError(f"testbed accelerator kind {k!r} is unknown; choose from "
                                f"{', '.join(TESTBED_ACCELERATORS)}")
        kinds.append(TESTBED_ACCELERATORS[k])
    return Topology(
        name="testbed_hetaccel",
        clusters=(make_cluster("a", nodes, devices_per_node, kinds[0], "infiniband"),
                  make_cluster("b", nodes, devices_per_node, kinds[1], "roce")),
        inter_cluster=LINKS["ethernet"])


__all__ = [
    "Accelerator", "Cluster", "ClusterLink", "DeviceInfo", "Link", "NicSettings", "Topology",
    "ACCELERATORS", "LINKS", "PRESETS", "preset", "register_preset", "make_cluster", "link",
    "accelerator", "DTFM_SCENARIOS",
]


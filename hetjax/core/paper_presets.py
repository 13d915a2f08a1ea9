"""Named topologies of the papers hetjax reproduces (spec/), and the CPU defaults shaped like
them: Holmes' hybrid and homogeneous clusters, HetHub's mixed accelerators, DT-FM's five
geo-distributed scenarios. `PAPER_PRESETS` maps each name to its builder; `hetjax.core.topology`
registers them for `preset(name)` and the config's topology.preset.
"""

from __future__ import annotations

from hetjax.core.catalogue import LINKS, make_cluster
from hetjax.core.hardware import ClusterLink, Link, Topology


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


def holmes_infiniband(nodes: int = 4, devices_per_node: int = 8, accel: str = "a100") -> Topology:
    """Holmes Table 1, first row: 4 nodes x 8 A100 on InfiniBand."""
    return _holmes_homogeneous("infiniband", nodes, devices_per_node, accel)


def holmes_roce(nodes: int = 4, devices_per_node: int = 8, accel: str = "a100") -> Topology:
    """Holmes Table 1, second row: 4 nodes x 8 A100 on RoCE."""
    return _holmes_homogeneous("roce", nodes, devices_per_node, accel)


def holmes_ethernet(nodes: int = 4, devices_per_node: int = 8, accel: str = "a100") -> Topology:
    """Holmes Table 1, third row: 4 nodes x 8 A100 on 25 Gb/s Ethernet."""
    return _holmes_homogeneous("ethernet", nodes, devices_per_node, accel)


def hethub_mixed(nodes: int = 1, devices_per_node: int = 8, fast: str = "a100",
                 slow: str = "ascend910b") -> Topology:
    """HetHub's setting: two clusters of different accelerator kinds joined by Ethernet."""
    return Topology(
        name="hethub_mixed",
        clusters=(make_cluster(fast, nodes, devices_per_node, fast, "infiniband"),
                  make_cluster(slow, nodes, devices_per_node, slow, "roce", intra="pcie")),
        inter_cluster=LINKS["ethernet"])


def cpu_single(nodes: int = 1, devices_per_node: int = 8) -> Topology:
    """One cluster of simulated CPU devices: the homogeneous baseline (and the 1-device
    reference the tests compare against)."""
    return Topology(name="cpu_single",
                    clusters=(make_cluster("cpu", nodes, devices_per_node, "cpu", "infiniband"),),
                    inter_cluster=LINKS["ethernet"])



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


def dtfm_datacenter_ondemand(instances: int = 8, devices_per_node: int = 8,
                             accel: str = "v100") -> Topology:
    """DT-FM scenario 0: instances of 8 GPUs, 100 Gb/s inside, 3.125 Gb/s between, no delay."""
    inside = Link("nvlink", 100.0, 0.0)
    return Topology(
        name="dtfm_datacenter_ondemand",
        clusters=tuple(make_cluster(f"inst{i}", 1, devices_per_node, accel, _wan(3.125, 0),
                                    intra=inside) for i in range(instances)),
        inter_cluster=_wan(3.125, 0))


def dtfm_datacenter_spot(accel: str = "v100") -> Topology:
    """DT-FM scenario 1: 8 instances of 4 GPUs (100 Gb/s inside) and 32 standalone GPUs
    (1-node, 1-device clusters); 1.25 Gb/s between everything else, no delay."""
    inside = Link("nvlink", 100.0, 0.0)
    slow = _wan(1.25, 0)
    clusters = [make_cluster(f"inst{i}", 1, 4, accel, slow, intra=inside) for i in range(8)]
    clusters += [make_cluster(f"gpu{i}", 1, 1, accel, slow, intra=inside) for i in range(32)]
    return Topology(name="dtfm_datacenter_spot", clusters=tuple(clusters), inter_cluster=slow)


def dtfm_multi_university(nodes: int = 32, accel: str = "v100") -> Topology:
    """DT-FM scenario 2: two campuses (Ohio, Virginia) of `nodes` GPUs, 5 Gb/s / 1 ms inside,
    1.12 Gb/s / 11 ms between."""
    return _sites("dtfm_multi_university", ("ohio", "virginia"), nodes, _wan(5.0, 1.0),
                  {("ohio", "virginia"): _wan(1.12, 11)}, accel)


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


def dtfm_worldwide(nodes: int = 8, accel: str = "v100") -> Topology:
    """DT-FM scenario 4: eight cities of `nodes` GPUs, 2 Gb/s / 5 ms inside, measured
    world-wide links."""
    cities = ("oregon", "virginia", "ohio", "tokyo", "seoul", "london", "frankfurt", "ireland")
    between = {pair: _wan(gbps, ms) for pair, (ms, gbps) in _WORLD_LINKS.items()}
    return _sites("dtfm_worldwide", cities, nodes, _wan(2.0, 5.0), between, accel)


DTFM_SCENARIOS = ("dtfm_datacenter_ondemand", "dtfm_datacenter_spot", "dtfm_multi_university",
                  "dtfm_regional", "dtfm_worldwide")

PAPER_PRESETS = {fn.__name__: fn for fn in (
    cpu_hybrid, holmes_hybrid, holmes_infiniband, holmes_roce, holmes_ethernet, hethub_mixed,
    cpu_single, dtfm_datacenter_ondemand, dtfm_datacenter_spot, dtfm_multi_university,
    dtfm_regional, dtfm_worldwide)}

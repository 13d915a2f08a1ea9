"""The testbed's miniature topologies (docs/testbed.md; README, Results): the papers' settings
shrunk to what hetjax/testbed.py can emulate on one small machine. `TESTBED_PRESETS` maps
each name to its builder; `hetjax.core.topology` registers them for `preset(name)` and the
config's topology.preset.
"""

from __future__ import annotations

import dataclasses

from hetjax.core.catalogue import ACCELERATORS, LINKS, make_cluster
from hetjax.errors import TopologyError
from hetjax.core.hardware import Accelerator, Topology
from hetjax.core.paper_presets import cpu_hybrid

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


def testbed_all_fast(nodes: int = 2, devices_per_node: int = 1) -> Topology:
    """Holmes' all-RDMA baseline in miniature: two InfiniBand clusters joined by a link as fast
    as InfiniBand."""
    return _uniform_pair("testbed_all_fast", "ib", "infiniband", nodes, devices_per_node)


def testbed_all_ethernet(nodes: int = 2, devices_per_node: int = 1) -> Topology:
    """Every link 25 Gb/s Ethernet, inside and between the two clusters."""
    return _uniform_pair("testbed_all_ethernet", "eth", "ethernet", nodes, devices_per_node)


def testbed_hybrid(nodes: int = 2, devices_per_node: int = 1) -> Topology:
    """Holmes' hybrid setting in miniature: an InfiniBand and a RoCE cluster joined by
    Ethernet (cpu_hybrid with one device per host)."""
    return dataclasses.replace(cpu_hybrid(nodes, devices_per_node), name="testbed_hybrid")


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


TESTBED_PRESETS = {fn.__name__: fn for fn in (
    testbed_all_fast, testbed_all_ethernet, testbed_hybrid, testbed_hetaccel)}

"""Collective algorithms: how long an all-reduce, reduce-scatter or all-gather takes over a group
of devices laid out on nodes, the way NCCL chooses and prices its algorithms.

NCCL's tuning model (src/graph/tuning.cc, `ncclTopoTuneModel` / `ncclTopoGetAlgoTime`) prices
each algorithm as `time = latency + bytes / algbw` and runs the cheapest. With p ranks on n
nodes (k = p / n per node), bus bandwidth B of the group's slowest link (a node's NIC once the
group leaves a node) and per-hop latencies a_intra (inside a node) and a_inter (between nodes):

- ring: nsteps = 2(p-1) for all-reduce, p-1 for reduce-scatter / all-gather, of which
  2(n-1) (resp. n-1) cross nodes; algbw = B p / nsteps, so
  t = nsteps / p * S / B + (nsteps - inter) a_intra + inter a_inter.
  nccl-tests' PERFORMANCE.md states the same relation from the other side: busbw = algbw x
  2(p-1)/p (all-reduce), x (p-1)/p (reduce-scatter, all-gather).
- tree (all-reduce only): a chain inside each node and a double binary tree across nodes;
  algbw = 0.5 x 0.9 B (NCCL's tree bus bandwidth is 0.9 of the ring's), so
  t = S / (0.45 B) + 2((k-1) a_intra + ceil(log2 n) a_inter).

Both are hierarchical when a group spans nodes: the tree runs intra-node then inter-node, and
the ring pays the inter-node latency only on its 2(n-1) hops between nodes. An explicit
reduce-scatter / all-reduce / all-gather split (SHARP-style, or Horovod's hierarchical
all-reduce), which would move only 2(n-1)/n S over each NIC, is not modelled: stock NCCL
does not run it, and Holmes Table 1 (NCCL) would be mispriced by it.

`collective_time` returns the cheapest algorithm's time (and its name); the plain alpha-beta
ring of earlier versions, 2(p-1)(a + S/(p B)) with the slowest link's latency on every hop,
is `flat_ring_time` (the `CostOptions(collectives="ring")` model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetjax.core.hlo import ring_steps  # the ring's steps: one definition with the HLO audit's bytes

OPS = ("all_reduce", "reduce_scatter", "all_gather")
ALGORITHMS = ("ring", "tree")
TREE_BUS_FRACTION = 0.9  # NCCL: tree busBw = 0.9 x the ring's (tuning.cc)



@dataclass(frozen=True)
class Group:
    """A collective's group as the model sees it: p members on `nodes` nodes (at most
    `per_node` on one), the bandwidth `bw` [bytes/s] of its slowest link (a shared NIC
    divided among the groups using it) and that link's latency `lat_inter` [s], and the link
    inside a node (`bw_intra`, `lat_intra`). For a group inside one node the slowest link is
    the intra-node one, in `bw` / `lat_inter`."""

    p: int
    nodes: int
    per_node: int
    bw: float
    lat_inter: float
    bw_intra: float
    lat_intra: float

    @property
    def one_node(self) -> bool:
        return self.nodes <= 1


def flat_ring_time(op: str, nbytes: float, p: int, bw: float, lat: float) -> float:
    """The alpha-beta ring on one link class: steps(p) (a + S / (p b))."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return ring_steps(op, p) * (lat + nbytes / (p * bw))


def ring_time(op: str, nbytes: float, g: Group) -> float:
    """NCCL's ring: nsteps/p x S/B, hops inside a node at a_intra, across nodes at a_inter
    (a group inside one node: every hop on its own link, `bw` and `lat_inter`)."""
    if g.p <= 1 or nbytes <= 0:
        return 0.0
    steps = ring_steps(op, g.p)
    if g.one_node:
        return steps * (g.lat_inter + nbytes / (g.p * g.bw))
    inter = _inter_steps(op, g.nodes)
    return steps * nbytes / (g.p * g.bw) + (steps - inter) * g.lat_intra + inter * g.lat_inter


def _inter_steps(op: str, nodes: int) -> int:
    return 2 * (nodes - 1) if op == "all_reduce" else nodes - 1


def tree_time(op: str, nbytes: float, g: Group) -> float:
    """NCCL's tree all-reduce (math.inf for the other operations, which have no tree)."""
    if g.p <= 1 or nbytes <= 0:
        return 0.0
    if op != "all_reduce":
        return math.inf
    if g.one_node:  # a chain through the node
        return nbytes / (0.5 * TREE_BUS_FRACTION * g.bw) + 2 * (g.p - 1) * g.lat_inter
    depth = math.ceil(math.log2(g.nodes))
    return (nbytes / (0.5 * TREE_BUS_FRACTION * g.bw)
            + 2 * ((g.per_node - 1) * g.lat_intra + depth * g.lat_inter))


_TIMES = {"ring": ring_time, "tree": tree_time}


def collective_time(op: str, nbytes: float, g: Group) -> tuple[float, str]:
    """The cheapest algorithm's time and name (NCCL's choice by size and group)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; one of {', '.join(OPS)}")
    if g.p <= 1 or nbytes <= 0:
        return 0.0, "none"
    best = min(ALGORITHMS, key=lambda a: _TIMES[a](op, nbytes, g))
    return _TIMES[best](op, nbytes, g), best


__all__ = ["OPS", "ALGORITHMS", "Group", "collective_time", "flat_ring_time", "ring_time",
           "tree_time", "TREE_BUS_FRACTION"]

"""Network pricing: what moving bytes between a topology's ranks costs.

`Network` interns the topology's links and prices collectives (all-reduce, reduce-scatter,
all-gather; NCCL's algorithm choice of hetjax/planner/collectives.py, or the flat alpha-beta
ring) and point-to-point transfers over concurrent rank groups: each group on the slowest link
it crosses, a node's NIC bandwidth shared by the concurrent groups that leave that node, and a
calibrated `LinkFit` per link class and operation used instead of the topology's links when
`hetjax calibrate` measured one. The cost model (hetjax/planner/cost.py) holds one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hetjax.core.topology import Link, Topology
from hetjax.errors import PlanError, TopologyError
from hetjax.planner import collectives as coll
from hetjax.units import BYTES_PER_GBIT

_ON_NODE = ("loopback", "nvlink", "pcie")  # links that do not go through a node's NIC
COLLECTIVE_MODELS = ("nccl", "ring")


@dataclass(frozen=True)
class LinkFit:
    """Achieved bus bandwidth and per-hop latency of one operation on one link class, as
    measured by `hetjax calibrate` (hetjax/planner/calibrate.py)."""

    bandwidth_gbps: float
    latency_us: float

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * BYTES_PER_GBIT

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


class MissingLinkError(PlanError):
    """A layout puts traffic between two clusters that no link joins."""


def ring_time(op: str, nbytes: float, group: int, link: Link) -> float:
    """Alpha-beta ring collective of `nbytes` over `group` devices on `link`: all_reduce
    2(p-1)(a + v/(p b)), reduce_scatter / all_gather (p-1)(a + v/(p b))."""
    return coll.flat_ring_time(op, nbytes, group, link.bytes_per_s, link.latency_s)


@dataclass(frozen=True)
class _Net:
    """Concurrent groups' links (see Network.net), one entry per distinct kind of group."""

    ids: np.ndarray  # slowest link id of each group
    kinds: np.ndarray  # [distinct, 5]: slowest link id, NIC flows, nodes, max per node,
    # intra-node link id (groups alike in these are priced alike)
    rows: tuple[tuple[int, ...], ...] = ()  # `kinds` as Python ints (the pricing's memo key)


class Structures:
    """What describes groups of ranks independently of one topology's numbering, for one
    network or shared by the networks of sub-topologies of one topology
    (`Topology.without_nodes`: the device subsets' searches) with the same options: the links
    (a `_Net`'s link ids), the ids of `Network.shape_id`, and the collectives' prices per
    kind of group. A cluster is known by its name and hardware rather than its index, so a
    subset's cluster 0 is the whole topology's cluster 1 when it is the same cluster, and one
    id names groups priced alike on each of these networks (pricing reads a cluster's links
    and the links between clusters, which such topologies share; a network joining its
    clusters otherwise than the ones before, or priced with other options, is refused)."""

    def __init__(self):
        self._clusters: dict[tuple, int] = {}  # (name, cluster less its node count) -> code
        self._joins: dict[tuple[int, int], Link | None] = {}  # codes -> the link between
        self._options: tuple | None = None  # (share_nics, collectives, link_fits)
        self.links: list[Link] = []  # by id
        self.ids: dict[tuple, int] = {}  # (shape, cluster codes, node pattern) -> id
        # (op, bytes, p, a row of _Net.kinds) -> (time, algorithm): a collective's price
        # depends on nothing else (the links, their fits and the model are the networks'),
        # and the search prices the same kind of group with the same bytes many times over
        # groups of different ranks (stages, layouts, ZeRO points, subsets)
        self.kind_times: dict[tuple, tuple[float, str]] = {}

    def codes(self, topology: Topology, options: tuple) -> np.ndarray:
        """The code of each of `topology`'s clusters (on a network priced with `options`)."""
        if self._options is None:
            self._options = options
        elif self._options != options:
            raise PlanError("networks that share prices must price with one set of options; "
                            "build this one on its own")
        codes = [self._clusters.setdefault((c.name, dataclasses.replace(c, nodes=1)),
                                           len(self._clusters)) for c in topology.clusters]
        for i, a in enumerate(codes):
            for j, b in enumerate(codes[:i]):
                link = topology.cluster_link(i, j) if topology.has_link(i, j) else None
                if self._joins.setdefault((min(a, b), max(a, b)), link) != link:
                    raise PlanError(f"topology {topology.name!r} joins clusters "
                                    f"{topology.clusters[i].name!r} and "
                                    f"{topology.clusters[j].name!r} otherwise than the topology "
                                    "whose prices it would share; price it on its own")
        return np.asarray(codes, dtype=np.int64)


class Network:
    """Prices traffic between the ranks of `topology`. share_nics: concurrent groups leaving a
    node split its NIC bandwidth; collectives: "nccl" (NCCL's cheapest algorithm) or "ring"
    (the flat alpha-beta ring); link_fits: measured bandwidth and latency per link kind and
    operation ("all_reduce", "reduce_scatter", "all_gather", "p2p"); structures: the ids of
    `shape_id`, shared with the networks of other subsets of one topology (`Structures`)."""

    def __init__(self, topology: Topology, share_nics: bool = True, collectives: str = "nccl",
                 link_fits: dict[str, dict[str, LinkFit]] | None = None,
                 structures: Structures | None = None):
        self.topology = topology
        self.share_nics = share_nics
        self.collectives = collectives
        self.link_fits = link_fits or {}
        devs = topology.devices
        self.cluster = np.array([d.cluster for d in devs])  # of each rank
        self.node = np.array([d.global_node for d in devs])  # of each rank
        self._node_cluster = np.array([c for c, cl in enumerate(topology.clusters)
                                       for _ in range(cl.nodes)])
        self._structures = structures or Structures()
        self._code = self._structures.codes(  # of each cluster (Structures)
            topology, (share_nics, collectives, self.link_fits))
        # Links interned by id (Structures.links), so a group's link is an index into these
        # arrays.
        self.links = self._structures.links
        self._intra_id = np.array([self.link_id(c.intra_node) for c in topology.clusters])
        self._nic_id = np.array([self.link_id(c.nic) for c in topology.clusters])
        self._nets: dict[tuple, _Net] = {}
        self._shapes: dict[tuple, int] = {}  # rank arrays (shape, bytes) -> `shape_id`
        self._kind_times = self._structures.kind_times

    def link_id(self, link: Link) -> int:
        if link not in self.links:
            self.links.append(link)
        return self.links.index(link)

    def shape_id(self, ranks: np.ndarray) -> int:
        """A small int equal for two arrays of ranks of one shape exactly when each position
        has the same cluster and the positions share nodes in the same pattern (nodes
        numbered in increasing order), also between the networks sharing `Structures`. Every
        price these networks give for groups cut from such arrays at the same positions is
        the same: `net` reads a group's nodes only by equality and order (sorting, runs,
        counts per node), its clusters for their links, and Topology.group_link a cluster's
        nodes only by equality; the nodes of one cluster are alike. (Cached: the search asks
        for the same arrays many times.)"""
        key = (ranks.shape, ranks.tobytes())
        got = self._shapes.get(key)
        if got is None:
            nodes = np.unique(self.node[ranks], return_inverse=True)[1].reshape(ranks.shape)
            pattern = (ranks.shape, self._code[self.cluster[ranks]].tobytes(), nodes.tobytes())
            ids = self._structures.ids
            got = self._shapes[key] = ids.setdefault(pattern, len(ids))
        return got

    def net(self, groups: np.ndarray) -> "_Net":
        """The links of concurrent rank groups `groups` [instances, size]: each row's slowest
        link, and the distinct (bandwidth, latency) the rows see once the groups that leave
        one node share its NIC (cached: the search prices the same groups many times)."""
        key = (groups.shape, groups.tobytes())
        if key in self._nets:
            return self._nets[key]
        snodes = np.sort(self.node[groups], axis=1)
        new_node = np.ones_like(snodes, dtype=bool)
        new_node[:, 1:] = snodes[:, 1:] != snodes[:, :-1]
        one_node = ~new_node[:, 1:].any(axis=1)
        c = self.cluster[groups.min()]
        if c == self.cluster[groups.max()]:
            # all in one cluster (ranks are numbered cluster by cluster), the common case:
            # what follows for any groups, with every cluster lookup that one's
            ids = np.where(one_node, self._intra_id[c], self._nic_id[c])
            mixed = np.flatnonzero(~(one_node | new_node.all(axis=1)))
            intra = np.full(len(groups), self._intra_id[c])
        else:
            clusters = self.cluster[groups]
            one_cluster = (clusters == clusters[:, :1]).all(axis=1) & new_node.all(axis=1)
            ids = np.where(one_node, self._intra_id[clusters[:, 0]],
                           self._nic_id[clusters[:, 0]])
            mixed = np.flatnonzero(~(one_node | one_cluster))
            # The slower intra-node link of the first and last member's cluster.
            ends = self._intra_id[clusters[:, [0, -1]]]
            intra_bw = np.array([lk.bytes_per_s for lk in self.links])[ends]
            intra = ends[np.arange(len(groups)), np.argmin(intra_bw, axis=1)]
        if len(mixed):
            ids[mixed] = self._mixed_link_ids(groups[mixed], snodes[mixed], new_node[mixed])
        off = np.array([lk.kind not in _ON_NODE for lk in self.links])[ids] & ~one_node
        flows = np.ones(len(groups), dtype=int)
        if self.share_nics and off.any():
            counts = np.bincount(snodes[off][new_node[off]], minlength=self.node.max() + 1)
            flows = np.where(off, counts[snodes].max(axis=1), 1)
        # Members per node: the longest run of one node in the sorted row.
        pos = np.arange(groups.shape[1])
        run_start = np.maximum.accumulate(np.where(new_node, pos, 0), axis=1)
        per_node = (pos - run_start + 1).max(axis=1)
        kinds = unique_rows(np.stack([ids, flows, new_node.sum(axis=1), per_node, intra],
                                     axis=1))
        net = _Net(ids, kinds, tuple(map(tuple, kinds.tolist())))
        self._nets[key] = net
        return net

    def _mixed_link_ids(self, groups: np.ndarray, snodes: np.ndarray,
                        new_node: np.ndarray) -> np.ndarray:
        """Link ids of groups spanning clusters (or nodes, with some node holding two
        members). Topology.group_link decides from three facts per cluster: present, spanning
        nodes, holding two members on one node; groups alike in those share the answer."""
        node_cluster = self._node_cluster[snodes]
        same_cluster = node_cluster[:, 1:] == node_cluster[:, :-1]
        shape = np.concatenate([
            np.eye(len(self.topology.clusters), dtype=bool)[node_cluster].any(axis=1),
            _flag(node_cluster[:, 1:], new_node[:, 1:] & same_cluster, self.topology),
            _flag(node_cluster[:, 1:], ~new_node[:, 1:], self.topology)], axis=1)
        first, inverse = unique_rows(shape, return_index=True, return_inverse=True)[1:]
        try:
            ids = [self.link_id(self.topology.group_link(self._witness(groups[i])))
                   for i in first]
        except TopologyError as e:
            raise MissingLinkError(f"the layout needs a link that does not exist: {e}") from None
        return np.asarray(ids)[inverse.ravel()]

    def _witness(self, ranks: np.ndarray) -> list[int]:
        """A few of `ranks` with the same three facts per cluster (at most two nodes of a
        cluster, two members of a node), so group_link stays cheap on large groups: in node
        order, the first member of each of a cluster's first two nodes, and the first other
        member on those two nodes."""
        r = ranks[np.argsort(self.node[ranks], kind="stable")]
        node, cluster = self.node[r], self.cluster[r]
        new = np.ones(len(r), dtype=bool)  # the first member of its node
        new[1:] = node[1:] != node[:-1]
        start = np.ones(len(r), dtype=bool)  # of its cluster (a cluster's nodes are numbered
        start[1:] = cluster[1:] != cluster[:-1]  # together, so its members are together)
        count = np.cumsum(new)
        early = count - np.maximum.accumulate(np.where(start, count, 0)) < 2
        keep = new & early
        doubled = np.flatnonzero(~new & early)
        if len(doubled):
            keep[doubled[np.unique(cluster[doubled], return_index=True)[1]]] = True
        return r[keep].tolist()

    def node_of(self, ranks: np.ndarray) -> np.ndarray:
        """The (global) node of each rank."""
        return self.node[np.asarray(ranks)]

    def nic_flows(self, groups: np.ndarray) -> int:
        """The most concurrent groups of `groups` sharing one node's NIC (1: none shared)."""
        return int(self.net(np.asarray(groups)).kinds[:, 1].max())

    def group_links(self, groups: np.ndarray) -> list[Link]:
        """Slowest link of each row of `groups`."""
        return [self.links[i] for i in self.net(np.asarray(groups)).ids]

    def _group(self, op: str, kind: Sequence[int], p: int) -> coll.Group:
        """The collectives model's view of one kind of group (see _Net.kinds), with the
        calibrated bandwidth and latency of `op` on its links when a calibration has them."""
        link_id, flows, nodes, per_node, intra_id = (int(x) for x in kind)
        bw, lat = self._achieved(self.links[link_id], op)
        bw_intra, lat_intra = self._achieved(self.links[intra_id], op)
        return coll.Group(p, nodes, per_node, bw / flows, lat, bw_intra, lat_intra)

    def _achieved(self, lk: Link, op: str) -> tuple[float, float]:
        """Bandwidth [bytes/s] and latency [s] of `op` on link `lk`: the calibration's fit for
        the link's class, else the link's achieved bandwidth (nominal x efficiency)."""
        fit = self.link_fits.get(lk.kind, {}).get(op)
        if fit is not None:
            return fit.bytes_per_s, fit.latency_s
        return lk.bytes_per_s, lk.latency_s

    def collective(self, op: str, nbytes: float, groups: np.ndarray) -> float:
        """Time of collective `op` run concurrently by every row of `groups`: the slowest
        row's, each priced with NCCL's algorithm choice (hetjax/planner/collectives.py), or
        the flat alpha-beta ring with CostOptions(collectives="ring")."""
        return self.collective_choice(op, nbytes, groups)[0]

    def collective_choice(self, op: str, nbytes: float, groups: np.ndarray
                          ) -> tuple[float, str]:
        """(time, algorithm) of the slowest row of `groups` (see `collective`)."""
        groups = np.asarray(groups)
        p = groups.shape[1]
        if p <= 1 or nbytes <= 0:
            return 0.0, "none"
        return self.choice_on(self.net(groups), op, nbytes, p)

    def choice_on(self, net: "_Net", op: str, nbytes: float, p: int) -> tuple[float, str]:
        """`collective_choice` on groups of p members whose links `net` describes."""
        worst = (0.0, "none")
        for kind in net.rows:
            key = (op, nbytes, p, kind)
            t = self._kind_times.get(key)
            if t is None:
                g = self._group(op, kind, p)
                if self.collectives == "ring":
                    t = (coll.flat_ring_time(op, nbytes, p, g.bw, g.lat_inter), "flat ring")
                else:
                    t = coll.collective_time(op, nbytes, g)
                self._kind_times[key] = t
            worst = max(worst, t)
        return worst


    def transfer(self, nbytes: float, pairs: np.ndarray) -> tuple[float, Link]:
        """Concurrent point-to-point transfers between each row's two ranks: the slowest, and
        its link."""
        return self.transfer_on(self.net(np.asarray(pairs)), nbytes)

    def transfer_on(self, net: "_Net", nbytes: float) -> tuple[float, Link]:
        """`transfer` over pairs whose links `net` describes."""
        best = (-1.0, None)
        for kind in net.kinds:
            lk = self.links[int(kind[0])]
            bw, lat = self._achieved(lk, "p2p")
            t = lat + nbytes * kind[1] / bw
            if t > best[0]:
                best = (float(t), lk)
        return best


    def all_to_all(self, nbytes: float, groups: np.ndarray) -> tuple[float, dict[str, int]]:
        """Time of an all-to-all run concurrently by every row of `groups`: each member sends
        nbytes / p to each of its p - 1 peers, all sends in flight at once (NCCL's all-to-all,
        one point-to-point send per peer). Priced on every link it crosses: a member's payload
        to peers on its node over the intra-node link; to peers on other nodes through its
        node's NIC, which carries the off-node payload of every member on that node (of all
        groups, when `share_nics`); to peers in other clusters, in addition, over the link
        between the clusters, shared by every such flow between them. A member takes the
        longest of these plus the latency of the slowest link it crosses; the all-to-all
        takes its slowest member. Also returns one member's peers per link kind (display)."""
        groups = np.asarray(groups)
        p = groups.shape[1]
        if p <= 1 or nbytes <= 0:
            return 0.0, {}
        topo, per_peer = self.topology, nbytes / p
        node, cluster = self.node[groups], self.cluster[groups]  # [G, p]
        same_node = node[:, :, None] == node[:, None, :]
        same_cluster = cluster[:, :, None] == cluster[:, None, :]
        on_node = same_node.sum(-1) - 1  # peers of each member, by where they are
        off_node = (~same_node).sum(-1)
        # the load on each NIC and each cluster pair's link, summed over concurrent members
        nic_load: dict[int, float] = {}
        pair_load: dict[tuple[int, int], float] = {}
        for g, i in zip(*np.nonzero(off_node)):
            n = int(node[g, i])
            nic_load[n] = nic_load.get(n, 0.0) + off_node[g, i] * per_peer
            for j in np.nonzero(~same_cluster[g, i])[0]:
                key = tuple(sorted((int(cluster[g, i]), int(cluster[g, j]))))
                pair_load[key] = pair_load.get(key, 0.0) + per_peer
        worst, kinds = 0.0, {}
        for g in range(groups.shape[0]):
            for i in range(p):
                c, n = int(cluster[g, i]), int(node[g, i])
                links = []  # (link, bytes it carries for this member's share of the time)
                if on_node[g, i]:
                    links.append((topo.clusters[c].intra_node, on_node[g, i] * per_peer))
                if off_node[g, i]:
                    share = nic_load[n] if self.share_nics else off_node[g, i] * per_peer
                    links.append((topo.clusters[c].nic, share))
                for j in np.nonzero(~same_cluster[g, i])[0]:
                    key = tuple(sorted((c, int(cluster[g, j]))))
                    load = pair_load[key] if self.share_nics else per_peer
                    links.append((topo.cluster_link(*key), load))
                times = [(b / self._achieved(lk, "p2p")[0], self._achieved(lk, "p2p")[1])
                         for lk, b in links]
                t = max(x for x, _ in times) + max(lat for _, lat in times)
                if t > worst:
                    worst = t
                    kinds = {}
                    for j in range(p):
                        if j != i:
                            lk = (topo.clusters[c].intra_node if same_node[g, i, j] else
                                  topo.clusters[c].nic if same_cluster[g, i, j] else
                                  topo.cluster_link(c, int(cluster[g, j])))
                            kinds[lk.kind] = kinds.get(lk.kind, 0) + 1
        return worst, kinds


def unique_rows(rows: np.ndarray, return_index: bool = False, return_inverse: bool = False):
    """`np.unique(rows, axis=0, ...)` for small non-negative integer (or bool) rows, sorted
    alike: each row is read as one mixed-radix integer (first column most significant), which
    np.unique sorts many times faster than rows (the search calls this for every distinct
    group of ranks it prices). Falls back to np.unique(axis=0) if the code would overflow."""
    rows = np.asarray(rows)
    if rows.ndim == 2 and len(rows) and (rows == rows[0]).all():
        # one kind of row (concurrent groups are mostly alike): np.unique's answer, directly
        out = rows[:1]
        if not (return_index or return_inverse):
            return out
        return (out,) + ((np.zeros(1, dtype=np.intp),) if return_index else ()) + \
            ((np.zeros(len(rows), dtype=np.intp),) if return_inverse else ())
    if rows.ndim != 2 or rows.size == 0 or (rows.dtype != bool and rows.min() < 0):
        return np.unique(rows, axis=0, return_index=return_index,
                         return_inverse=return_inverse)
    radix = rows.max(axis=0).astype(np.int64) + 1
    if float(np.prod(radix.astype(float))) >= 2.0 ** 62:
        return np.unique(rows, axis=0, return_index=return_index,
                         return_inverse=return_inverse)
    place = np.concatenate([np.cumprod(radix[::-1])[::-1][1:], [1]]).astype(np.int64)
    code = rows.astype(np.int64) @ place
    _, index, inverse = np.unique(code, return_index=True, return_inverse=True)
    out = rows[index]
    if not (return_index or return_inverse):
        return out
    return (out,) + ((index,) if return_index else ()) + \
        ((inverse.reshape(-1),) if return_inverse else ())


def _flag(clusters: np.ndarray, where: np.ndarray, topology: Topology) -> np.ndarray:
    """[groups, n_clusters]: whether `where` holds at some position of that cluster."""
    out = np.zeros((len(clusters), len(topology.clusters)), dtype=bool)
    rows, cols = np.nonzero(where)
    out[rows, clusters[rows, cols]] = True
    return out


__all__ = ["Network", "Structures", "LinkFit", "MissingLinkError", "COLLECTIVE_MODELS", "ring_time",
           "unique_rows"]

"""Device assignment on slow, uneven networks: DT-FM's problem and cost model (spec/dtfm.md).

N devices are partitioned into D_pp groups of D_dp (a group is one pipeline stage and its
data-parallel all-reduce group), the groups are ordered into a pipeline, and the devices of
consecutive groups are matched into D_dp pipelines. DT-FM's cost:
- data parallel: a group's cost is its slowest member's sum over the other members of
  2 (alpha + c_dp / (D_dp beta)); the DP cost is the worst group's;
- pipeline: between two groups, the bottleneck of the best perfect matching of their members
  on alpha + c_pp / beta; the pipeline cost is twice the cheapest open path through the groups.

`search` solves it by local search from several network-aware starting partitions (device
swaps between groups, scored exactly: each group's DP cost updated in closed form for every
candidate swap at once, matchings re-solved only for the edges a swap touches) with
perturbation restarts. `genetic_search` is DT-FM's own approach (a genetic algorithm with
local search), kept as the baseline `search` must match or beat. `consecutive` is the
network-unaware assignment (consecutive ranks, stages in rank order).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_bipartite_matching

from hetjax.errors import PlanError
from hetjax.core.topology import Topology


@dataclass(frozen=True)
class Problem:
    """DT-FM's inputs: per-pair latency [s] and bandwidth [bytes/s], the shape, the bytes."""

    latency: np.ndarray
    bandwidth: np.ndarray
    stages: int  # D_pp
    dp: int  # D_dp
    dp_bytes: float  # c_dp: gradient bytes a stage all-reduces per step
    pp_bytes: float  # c_pp: activation bytes a pipeline sends across one boundary per step

    def __post_init__(self):
        n = len(self.latency)
        if self.stages * self.dp != n:
            raise PlanError(f"DT-FM assignment: D_pp x D_dp = {self.stages} x {self.dp} = "
                            f"{self.stages * self.dp}, but there are {n} devices; choose "
                            f"D_pp from the divisors of {n}")

    @staticmethod
    def from_topology(topology: Topology, stages: int, dp: int, dp_bytes: float,
                      pp_bytes: float) -> "Problem":
        bw, lat = topology.bandwidth_matrix()
        return Problem(lat, bw, stages, dp, dp_bytes, pp_bytes)

    @property
    def n(self) -> int:
        return len(self.latency)

    def dp_pair_cost(self) -> np.ndarray:
        with np.errstate(divide="ignore"):
            w = 2 * (self.latency + self.dp_bytes / (self.dp * self.bandwidth))
        np.fill_diagonal(w, 0.0)
        return w

    def pp_pair_cost(self) -> np.ndarray:
        with np.errstate(divide="ignore"):
            return self.latency + self.pp_bytes / self.bandwidth


@dataclass(frozen=True)
class Assignment:
    """groups[s] = the devices of pipeline stage s, position d of every group on pipeline d."""

    groups: tuple[tuple[int, ...], ...]
    cost: float
    dp_cost: float
    pp_cost: float

    def device_order(self) -> tuple[int, ...]:
        """Ranks in Plan mesh order (pp, dp) for tp = 1."""
        return tuple(r for g in self.groups for r in g)


# --- the two sub-problems ------------------------------------------------------------------------
def twin_classes(*mats: np.ndarray) -> np.ndarray:
    """Class label per device: twins (equal costs to every third device in every symmetric
    matrix, e.g. the devices of one site) share a class. They are interchangeable, so the
    search tries one swap per class and matchings work on class counts."""
    n = len(mats[0])
    labels = np.arange(n)
    if not all(np.array_equal(m, m.T) for m in mats):
        return labels
    # Twins have equal sorted rows: bucket by them (hashing the rows' bytes: np.unique over
    # rows of thousands of columns took seconds), then compare each device with its bucket's
    # representatives all at once, the first twin found giving its class.
    keys = np.ascontiguousarray(np.concatenate([np.sort(m, axis=1) for m in mats], axis=1))
    bucket: dict[bytes, list[int]] = {}
    for d in range(n):
        reps = bucket.setdefault(keys[d].tobytes(), [])
        twin = _first_twin(mats, d, reps) if reps else -1
        if twin >= 0:
            labels[d] = labels[twin]
        else:
            reps.append(d)
    return labels


def _first_twin(mats: tuple[np.ndarray, ...], d: int, reps: list[int]) -> int:
    """The first of `reps` whose rows equal d's in every matrix except at d and at itself
    (their costs to each other), or -1."""
    r = np.asarray(reps)
    ok = np.ones(len(r), dtype=bool)
    for m in mats:
        same = m[r] == m[d][None, :]
        same[:, d] = True
        same[np.arange(len(r)), r] = True
        ok &= same.all(axis=1)
    hit = np.flatnonzero(ok)
    return int(r[hit[0]]) if len(hit) else -1


def _perfect_matching(adj: np.ndarray, start: list[int] | None = None) -> list[int] | None:
    """A perfect matching of the bipartite graph `adj` [n, n] (row i -> column match[i]),
    grown from the partial matching `start` (valid in `adj`), or None if there is none."""
    n = len(adj)
    if not adj.any(axis=1).all() or not adj.any(axis=0).all():
        return None
    rows, cols = np.nonzero(adj)
    nbrs = [c.tolist() for c in np.split(cols, np.cumsum(np.bincount(rows, minlength=n))[:-1])]
    match_l = list(start) if start is not None else [-1] * n
    match_r = [-1] * n
    for i, j in enumerate(match_l):
        if j >= 0:
            match_r[j] = i
    for i in sorted(range(n), key=lambda i: len(nbrs[i])):  # greedy, scarce rows first
        if match_l[i] < 0:
            for j in nbrs[i]:
                if match_r[j] < 0:
                    match_l[i], match_r[j] = j, i
                    break

    def augment(i: int, seen: list[bool]) -> bool:
        for j in nbrs[i]:
            if not seen[j]:
                seen[j] = True
                if match_r[j] < 0 or augment(match_r[j], seen):
                    match_l[i], match_r[j] = j, i
                    return True
        return False

    for i in range(n):
        if match_l[i] < 0 and not augment(i, [False] * n):
            return None
    return match_l


def _transport(allowed: np.ndarray, supply: np.ndarray, demand: np.ndarray) -> np.ndarray | None:
    """Flows [R, C] on allowed edges moving every row class's supply into the column classes'
    demands (a perfect matching between class counts), or None. Greedy fill, then augmenting
    paths found by BFS (row -> column on allowed edges, column -> row where flow can be
    taken back). Plain Python: the class graphs are tiny."""
    R, C = allowed.shape
    nbrs = [np.flatnonzero(row).tolist() for row in allowed]
    flow = [[0] * C for _ in range(R)]
    left, need = [int(x) for x in supply], [int(x) for x in demand]
    for i in range(R):
        for j in nbrs[i]:
            amount = min(left[i], need[j])
            if amount:
                flow[i][j] += amount
                left[i] -= amount
                need[j] -= amount
    while any(left):
        prev_col = [-1] * C  # the row class each column class was reached from
        prev_row = [-2] * R  # the column class each row class was reached from (-1: source)
        queue = [i for i in range(R) if left[i]]
        for i in queue:
            prev_row[i] = -1
        end = -1
        while queue and end < 0:
            nxt = []
            for i in queue:
                for j in nbrs[i]:
                    if prev_col[j] >= 0:
                        continue
                    prev_col[j] = i
                    if need[j]:
                        end = j
                        break
                    for i2 in range(R):
                        if flow[i2][j] and prev_row[i2] == -2:
                            prev_row[i2] = j
                            nxt.append(i2)
                if end >= 0:
                    break
            queue = nxt
        if end < 0:
            return None
        path, j = [], end  # forward edges (i, j); row i gives back flow on (i, prev_row[i])
        while True:
            i = prev_col[j]
            path.append((i, j))
            if prev_row[i] == -1:
                break
            j = prev_row[i]
        amount = min([left[path[-1][0]], need[end]] +
                     [flow[i][prev_row[i]] for i, _ in path[:-1]])
        for k, (i, j) in enumerate(path):
            flow[i][j] += amount
            if k + 1 < len(path):
                flow[i][prev_row[i]] -= amount
        left[path[-1][0]] -= amount
        need[end] -= amount
    return np.array(flow)


def matching_lower_bound(w: np.ndarray) -> float:
    """No perfect matching has a bottleneck below this: every row and column needs an edge."""
    return float(max(w.min(axis=1).max(), w.min(axis=0).max()))


def bottleneck_matching(w: np.ndarray, want_matching: bool = True
                        ) -> tuple[float, list[int] | None]:
    """The perfect matching minimising its largest cost w[i, match[i]], and that cost.

    Binary search over the distinct costs for the smallest threshold with a perfect matching;
    the returned matching achieves the returned bottleneck (a trap DT-FM's notes warn about).
    The thresholds are tested with scipy's Hopcroft-Karp (C); the matching returned is then
    grown by `_perfect_matching` at the threshold found, as before (so device orders do not
    change), and not at all without `want_matching` (the search's edge costs)."""
    values = np.unique(w[w >= matching_lower_bound(w)])
    value, _ = _smallest_feasible(values, lambda v: True if _has_perfect_matching(w <= v)
                                  else None)
    return value, _perfect_matching(w <= value) if want_matching else None


def _has_perfect_matching(adj: np.ndarray) -> bool:
    """Whether the bipartite graph `adj` [n, n] has a perfect matching."""
    if not adj.any(axis=1).all() or not adj.any(axis=0).all():
        return False
    match = maximum_bipartite_matching(csr_matrix(adj), perm_type="column")
    return bool((match >= 0).all())


def class_bottleneck(W: np.ndarray, a: np.ndarray, b: np.ndarray, cls: np.ndarray,
                     want_matching: bool = True) -> tuple[float, list[int] | None]:
    """bottleneck_matching(W[a][:, b]) using twin classes: devices of one class have equal
    rows, so feasibility is a transport problem between class counts, far smaller than the
    matching. Falls back to the plain matching when classes do not compress."""
    rk, ri, rc = np.unique(cls[a], return_index=True, return_counts=True)
    ck, ci, cc = np.unique(cls[b], return_index=True, return_counts=True)
    if len(rk) * len(ck) * 4 > len(a) * len(b):
        return bottleneck_matching(W[np.ix_(a, b)], want_matching)
    wc = W[np.ix_(a[ri], b[ci])]
    values = np.unique(wc[wc >= matching_lower_bound(wc)])
    value, flow = _smallest_feasible(values, lambda v: _transport(wc <= v, rc, cc))
    return value, _expand(flow, cls[a], cls[b], rk, ck) if want_matching else None


def _smallest_feasible(values: np.ndarray, feasible):
    """Binary search for the smallest value whose check succeeds (the largest always does:
    a complete bipartite graph has a perfect matching). The smallest is tried first: with a
    good partition the lower bound is usually the answer."""
    found = feasible(values[0])
    if found is not None:
        return float(values[0]), found
    lo, hi, found = 1, len(values) - 1, None
    while lo < hi:
        mid = (lo + hi) // 2
        got = feasible(values[mid])
        if got is None:
            lo = mid + 1
        else:
            hi, found = mid, got
    return float(values[hi]), found if found is not None else feasible(values[hi])


def _expand(flow: np.ndarray, row_class, col_class, rk, ck) -> list[int]:
    """A device-level matching from flows between classes."""
    rows = {k: list(np.flatnonzero(row_class == k)) for k in rk}
    cols = {k: list(np.flatnonzero(col_class == k)) for k in ck}
    match = [-1] * len(row_class)
    for a, b in zip(*np.nonzero(flow)):
        for _ in range(flow[a, b]):
            match[rows[rk[a]].pop()] = int(cols[ck[b]].pop())
    return match


def open_path(C: np.ndarray) -> tuple[float, list[int]]:
    """Cheapest path visiting every node once (any start and end): exact DP over subsets for
    up to 10 nodes, else nearest-neighbour starts improved by 2-opt."""
    n = len(C)
    if n == 1:
        return 0.0, [0]
    if n <= 10:
        return _held_karp(C)
    best = (np.inf, [])
    for start in range(n):
        path = [start]
        left = set(range(n)) - {start}
        while left:
            nxt = min(left, key=lambda j: C[path[-1], j])
            path.append(nxt)
            left.remove(nxt)
        path = _two_opt(C, path)
        cost = _path_cost(C, path)
        if cost < best[0]:
            best = (cost, path)
    return best


def _path_cost(C: np.ndarray, path) -> float:
    return float(sum(C[a, b] for a, b in zip(path, path[1:])))


def _held_karp(C: np.ndarray) -> tuple[float, list[int]]:
    """Exact open path: dp[mask, j] = cheapest path through `mask` ending at j."""
    n = len(C)
    full = 1 << n
    dp = np.full((full, n), np.inf)
    parent = np.full((full, n), -1, dtype=int)
    dp[1 << np.arange(n), np.arange(n)] = 0.0
    for mask in range(1, full):
        js = np.flatnonzero((mask >> np.arange(n)) & 1)
        if len(js) < 2:
            continue
        cand = dp[mask ^ (1 << js)] + C[:, js].T  # [j, i]: reach j from i
        best = np.argmin(cand, axis=1)
        dp[mask, js] = cand[np.arange(len(js)), best]
        parent[mask, js] = best
    j = int(np.argmin(dp[full - 1]))
    cost, mask, path = float(dp[full - 1, j]), full - 1, []
    while j >= 0:
        path.append(j)
        mask, j = mask ^ (1 << j), int(parent[mask, j])
    return cost, path[::-1]


def _two_opt(C: np.ndarray, path: list[int]) -> list[int]:
    improved = True
    while improved:
        improved = False
        for i in range(len(path) - 1):
            for j in range(i + 1, len(path)):
                # Reverse path[i..j]: edges (i-1, i) and (j, j+1) become (i-1, j) and (i, j+1).
                before = (C[path[i - 1], path[i]] if i else 0) + \
                    (C[path[j], path[j + 1]] if j + 1 < len(path) else 0)
                after = (C[path[i - 1], path[j]] if i else 0) + \
                    (C[path[i], path[j + 1]] if j + 1 < len(path) else 0)
                if after < before - 1e-12:
                    path[i:j + 1] = path[i:j + 1][::-1]
                    improved = True
    return path


# --- evaluation ----------------------------------------------------------------------------------
class _Tables:
    """A problem's pair costs and twin classes, computed once per search.

    Pairs with no link (infinite cost) get a finite penalty far above any real cost, so the
    search's incremental sums stay finite; a result that pays it is reported as infinite."""

    def __init__(self, problem: Problem):
        self.problem = problem
        raw = (problem.dp_pair_cost(), problem.pp_pair_cost())
        real = np.concatenate([w[np.isfinite(w)] for w in raw])
        self.penalty = 1e9 * max(float(real.max()) if real.size else 1.0, 1.0)
        self.Wdp, self.Wpp = (np.where(np.isfinite(w), w, self.penalty) for w in raw)
        self.cls = twin_classes(self.Wdp, self.Wpp)


class _State:
    """A partition with its DP costs, pairwise bottlenecks and best path, updated by swaps."""

    def __init__(self, tables: _Tables, labels: np.ndarray):
        self.t, self.p = tables, tables.problem
        self.Wdp, self.Wpp = tables.Wdp, tables.Wpp
        self.labels = labels.copy()
        G = self.p.stages
        self.members = [np.flatnonzero(labels == g) for g in range(G)]
        self.rows = [self.Wdp[np.ix_(m, m)].sum(axis=1) for m in self.members]
        self.dp = np.array([r.max() for r in self.rows])
        self.C = np.zeros((G, G))
        for i in range(G):
            for j in range(i + 1, G):
                self.C[i, j] = self.C[j, i] = self.edge(self.members[i], self.members[j])
        self.reorder()

    def matching(self, a: np.ndarray, b: np.ndarray) -> tuple[float, list[int]]:
        return class_bottleneck(self.Wpp, a, b, self.t.cls)

    def edge(self, a: np.ndarray, b: np.ndarray) -> float:
        return class_bottleneck(self.Wpp, a, b, self.t.cls, want_matching=False)[0]

    def reorder(self) -> None:
        cost, self.path = open_path(self.C)
        self.pp = 2 * cost

    @property
    def cost(self) -> float:
        return float(self.dp.max() + self.pp)

    def key(self) -> tuple[float, float]:
        # Ties on the worst group are common; the total over groups breaks them.
        return (self.cost, float(self.dp.sum()))

    def swap_candidates(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions in group g of one member per twin class, and one device per (group, twin
        class) outside g: swapping twins gives the same partition cost."""
        cls = self.t.cls
        _, first = np.unique(cls[self.members[g]], return_index=True)
        outside = np.flatnonzero(self.labels != g)
        _, reps = np.unique(self.labels[outside] * (cls.max() + 1) + cls[outside],
                            return_index=True)
        return np.sort(first), outside[reps]

    def swap_dp_costs(self, g: int, ks: np.ndarray, V: np.ndarray) -> tuple[np.ndarray, ...]:
        """For swaps of member A[k] (k in ks) of group g with device v in V (outside g): the
        new DP costs of g and of v's group, as arrays [len(ks), len(V)], in closed form from
        the members' row sums."""
        W, A, rsA = self.Wdp, self.members[g], self.rows[g]
        U = A[ks]
        # Members x that stay lose u and gain v: rsA[x] - W[x, u] + W[x, v] (x = u excluded);
        # v's own row is its cost to those who stay. Chunks over u bound the [u, x, v] array.
        joined = W[np.ix_(V, A)].sum(axis=1)[None, :] - W[np.ix_(V, U)].T
        lose = rsA[None, :] - W[np.ix_(A, U)].T  # [u, x]
        gain = W[np.ix_(A, V)]  # [x, v]
        newA = np.empty((len(ks), len(V)))
        step = max(1, 2_000_000 // max(1, len(A) * len(V)))
        for c in range(0, len(ks), step):
            t = lose[c:c + step, :, None] + gain[None]
            t[np.arange(len(t)), ks[c:c + step], :] = -np.inf
            newA[c:c + step] = t.max(axis=1)
        newA = np.maximum(newA, joined)
        newB = np.empty_like(newA)
        for h in np.unique(self.labels[V]):
            cols = np.flatnonzero(self.labels[V] == h)
            B, rsB = self.members[h], self.rows[h]
            pos = np.searchsorted(B, V[cols])
            # [v, y, u]: row of member y of h after v leaves and u joins (y = v excluded).
            stay = (rsB[None, :] - W[np.ix_(V[cols], B)])[:, :, None] + W[np.ix_(B, U)][None]
            stay[np.arange(len(cols)), pos, :] = -np.inf
            joined = W[np.ix_(U, B)].sum(axis=1)[None, :] - W[np.ix_(V[cols], U)]  # [v, u]
            newB[:, cols] = np.maximum(stay.max(axis=1), joined).T
        return newA, newB

    def path_cost_after(self, g: int, h: int, ma: np.ndarray, mb: np.ndarray,
                        give_up_above: float = np.inf) -> float:
        """Pipeline cost on the current path when groups g and h get members ma and mb; inf
        as soon as a lower bound shows it exceeds `give_up_above`."""
        touched, total = [], 0.0
        for a, b in zip(self.path, self.path[1:]):
            if g in (a, b) or h in (a, b):
                xa = ma if a == g else mb if a == h else self.members[a]
                xb = ma if b == g else mb if b == h else self.members[b]
                lb = self._edge_lower_bound(xa, xb)
                touched.append((xa, xb, lb))
                total += lb
            else:
                total += self.C[a, b]
        if 2 * total > give_up_above:
            return np.inf
        total += sum(self.edge(xa, xb) - lb for xa, xb, lb in touched)
        return 2 * total

    def path_cost_reordered(self, g: int, h: int, ma: np.ndarray, mb: np.ndarray,
                            give_up_above: float = np.inf) -> float:
        """Pipeline cost when groups g and h get members ma and mb and the path is re-solved;
        inf when the path re-solved on the changed edges' lower bounds already costs more
        than `give_up_above` (exact paths only: at most 10 groups, see `open_path`)."""
        new = {g: ma, h: mb}
        changed = [(grp, j, m, new.get(j, self.members[j])) for grp, m in new.items()
                   for j in range(self.p.stages) if j != grp]
        if np.isfinite(give_up_above) and self.p.stages <= 10:
            C = self.C.copy()
            for grp, j, a, b in changed:
                C[grp, j] = C[j, grp] = self._edge_lower_bound(a, b)
            if 2 * open_path(C)[0] > give_up_above:
                return np.inf
        C = self.C.copy()
        for grp, j, a, b in changed:
            C[grp, j] = C[j, grp] = self.edge(a, b)
        return 2 * open_path(C)[0]

    def _edge_lower_bound(self, a: np.ndarray, b: np.ndarray) -> float:
        _, ri = np.unique(self.t.cls[a], return_index=True)
        _, ci = np.unique(self.t.cls[b], return_index=True)
        return matching_lower_bound(self.Wpp[np.ix_(a[ri], b[ci])])

    def apply(self, u: int, v: int) -> None:
        g, h = self.labels[u], self.labels[v]
        self.labels[u], self.labels[v] = h, g
        for grp in (g, h):
            m = np.flatnonzero(self.labels == grp)
            self.members[grp] = m
            self.rows[grp] = self.Wdp[np.ix_(m, m)].sum(axis=1)
            self.dp[grp] = self.rows[grp].max()
            for j in range(self.p.stages):
                if j != grp:
                    self.C[grp, j] = self.C[j, grp] = self.edge(m, self.members[j])
        self.reorder()

    def assignment(self) -> Assignment:
        """Groups in path order, each ordered by the bottleneck matching with the previous."""
        groups = [self.members[self.path[0]]]
        for b in self.path[1:]:
            prev, nxt = groups[-1], self.members[b]
            _, match = self.matching(prev, nxt)
            groups.append(nxt[match])
        def real(x: float) -> float:
            return float(x) if x < self.t.penalty else np.inf

        return Assignment(tuple(tuple(int(r) for r in g) for g in groups), real(self.cost),
                          real(self.dp.max()), real(self.pp))


def evaluate(problem: Problem, groups) -> Assignment:
    """DT-FM's cost of a partition into groups (best path and matchings)."""
    labels = np.empty(problem.n, dtype=int)
    for g, members in enumerate(groups):
        labels[list(members)] = g
    return _State(_Tables(problem), labels).assignment()


def consecutive(problem: Problem) -> Assignment:
    """The network-unaware assignment: stage s = ranks s*D_dp .. (s+1)*D_dp - 1, stages in rank
    order, pipeline d = the d-th rank of every stage."""
    groups = [list(range(s * problem.dp, (s + 1) * problem.dp)) for s in range(problem.stages)]
    Wdp, Wpp = problem.dp_pair_cost(), problem.pp_pair_cost()
    dp = max(Wdp[np.ix_(g, g)].sum(axis=1).max() for g in groups)
    pp = 2 * sum(Wpp[a, b].max() for a, b in zip(np.array(groups[:-1]), np.array(groups[1:])))
    return Assignment(tuple(tuple(g) for g in groups), float(dp + pp), float(dp), float(pp))


# --- the search ----------------------------------------------------------------------------------
def _local_search(state: _State, deadline: float, tries: int = 64,
                  reorder_tries: int = 16) -> None:
    """Swap devices between groups while a swap lowers the cost (ties: the DP total).

    Groups are visited worst first (the worst DP group, the ends of the most expensive path
    edge, then the rest). For a group, every swap of one of its members with a device outside
    is scored for its DP costs in closed form; the `tries` most promising are priced exactly
    on the current path (matchings of the edges they touch) and the first that improves is
    made. When none does, the `reorder_tries` closest are priced again with the path re-solved,
    since a swap may pay off only in another stage order."""
    while time.perf_counter() < deadline:
        P = state.p
        edge_cost = [state.C[a, b] for a, b in zip(state.path, state.path[1:])]
        focus = [int(np.argmax(state.dp))]
        if edge_cost:
            k = int(np.argmax(edge_cost))
            focus += [state.path[k], state.path[k + 1]]
        base = state.key()
        near = []
        move = None
        for g in dict.fromkeys(focus + list(np.argsort(-state.dp))):
            ks, V = state.swap_candidates(int(g))
            if not len(V):
                continue
            newA, newB = state.swap_dp_costs(g, ks, V)
            hs = state.labels[V]
            # The largest DP cost among the groups a swap does not touch (g and v's group).
            rest_max = np.array([np.delete(state.dp, [g, h]).max() if P.stages > 2 else 0.0
                                 for h in range(P.stages)])
            new_max = np.maximum(np.maximum(newA, newB), rest_max[hs][None, :])
            A = state.members[g]
            cls = state.t.cls
            new_max[cls[A[ks]][:, None] == cls[V][None, :]] = np.inf  # twins: no change
            new_sum = state.dp.sum() - state.dp[g] - state.dp[hs][None, :] + newA + newB
            for flat in np.argsort(new_max + 1e-9 * new_sum, axis=None)[:tries]:
                row, col = divmod(int(flat), len(V))
                if not np.isfinite(new_max[row, col]):
                    break
                u, v, h = int(A[ks[row]]), int(V[col]), int(hs[col])
                ma = np.sort(np.append(np.delete(A, ks[row]), v))
                mb = np.sort(np.append(state.members[h][state.members[h] != v], u))
                dp_max, dp_sum = float(new_max[row, col]), float(new_sum[row, col])
                cost = dp_max + state.path_cost_after(g, h, ma, mb, base[0] - dp_max + 1e-9)
                if _better((cost, dp_sum), base):
                    move = (u, v)
                    break
                near.append((cost, dp_max, dp_sum, g, h, u, v, ma, mb))
            if move:
                break
        if move is None:
            near.sort(key=lambda c: (c[0], c[1]))
            # (a path whose lower bound exceeds the base by twice _better's tolerance cannot
            # be better: skip solving its matchings)
            slack = 2e-9 * max(1.0, abs(base[0]))
            for _, dp_max, dp_sum, g, h, u, v, ma, mb in near[:reorder_tries]:
                path = state.path_cost_reordered(g, h, ma, mb, base[0] + slack - dp_max)
                if _better((dp_max + path, dp_sum), base):
                    move = (u, v)
                    break
        if move is None:
            return
        state.apply(*move)


def _better(key: tuple[float, float], base: tuple[float, float], tol: float = 1e-9) -> bool:
    """Lexicographically smaller by more than rounding noise."""
    if key[0] < base[0] - tol * max(1.0, abs(base[0])):
        return True
    return abs(key[0] - base[0]) <= tol * max(1.0, abs(base[0])) and key[1] < base[1] - tol * max(1.0, abs(base[1]))


def _locality_order(problem: Problem, Wpp: np.ndarray) -> list[int]:
    """Devices chained so that each follows the one it talks to fastest (sites stay together)."""
    n = problem.n
    left = np.ones(n, dtype=bool)
    order = [0]
    left[0] = False
    for _ in range(n - 1):
        cost = np.where(left, Wpp[order[-1]], np.inf)
        nxt = int(np.argmin(cost))
        order.append(nxt)
        left[nxt] = False
    return order


def _seeds(problem: Problem, Wpp: np.ndarray) -> list[np.ndarray]:
    """Starting partitions: consecutive ranks, and for every run length r
    dividing D_pp, runs of r consecutive devices of the locality chain laid along pipelines
    (r = 1: each group is D_dp neighbours, data parallelism stays local; r = D_pp: each
    pipeline is D_pp neighbours, pipeline traffic stays local; in between, e.g. r = the size
    of a fast instance, both)."""
    G, D, n = problem.stages, problem.dp, problem.n
    order = np.array(_locality_order(problem, Wpp))
    seeds = [np.arange(n) // D]
    i = np.arange(n)
    for r in (r for r in range(1, G + 1) if G % r == 0):
        labels = np.empty(n, dtype=int)
        labels[order] = (i // r // D) * r + i % r
        seeds.append(labels)
    return seeds


def search(problem: Problem, seconds: float = 10.0, seed: int = 0,
           max_rounds_without_gain: int = 8, min_rounds_without_gain: int = 2) -> Assignment:
    """Best assignment found by local search from network-aware starts, then perturbation
    (a few random swaps of the best) and local search again until `seconds` pass or
    `max_rounds_without_gain` rounds bring nothing (or at least `min_rounds_without_gain`
    brought nothing for as long as finding the best took)."""
    rng = random.Random(seed)
    search_start = time.perf_counter()
    deadline = search_start + seconds
    tables = _Tables(problem)
    best: _State | None = None
    for labels in _seeds(problem, tables.Wpp):
        st = _State(tables, labels)
        _local_search(st, deadline)
        if best is None or _better(st.key(), best.key()):
            best = st
    stale = 0
    cls = tables.cls
    # Perturbation rounds stop after `max_rounds_without_gain` without a gain, or sooner,
    # after `min_rounds_without_gain`, once they have spent as long without one as the search
    # took to find its best: on DT-FM's scenarios and their scaled versions (64 to 1,024
    # devices, 2 to 16 stages) no kick ever improved on the seeds' local optima, and at 1,024
    # devices in 128 classes eight fruitless rounds took three quarters of the search.
    t_gain = time.perf_counter()  # when the best so far was found

    def patient() -> bool:
        now = time.perf_counter()
        return stale < min_rounds_without_gain or now - t_gain <= t_gain - search_start

    while (time.perf_counter() < deadline and stale < max_rounds_without_gain
           and problem.stages > 1 and patient()):
        labels = best.labels.copy()
        for _ in range(rng.randint(1, 3)):  # a kick: swap devices that are not twins
            u = rng.randrange(problem.n)
            others = np.flatnonzero((labels != labels[u]) & (cls != cls[u]))
            if len(others):
                v = int(others[rng.randrange(len(others))])
                labels[u], labels[v] = labels[v], labels[u]
        st = _State(tables, labels)
        # A kicked solution is a few swaps from a local optimum; repair it in a bounded time.
        _local_search(st, min(deadline, time.perf_counter() + seconds / 10))
        if _better(st.key(), best.key()):
            best, stale, t_gain = st, 0, time.perf_counter()
        else:
            stale += 1
    return best.assignment()


def genetic_search(problem: Problem, population: int = 100, trials: int = 4900,
                   seconds: float = 60.0, seed: int = 0) -> Assignment:
    """DT-FM's hybrid genetic algorithm: random partitions, crossover (copy a few positions of
    one parent into the other, repair the group sizes), local search on each child by
    improving swaps, and the child replaces the worst individual when better."""
    rng = random.Random(seed)
    deadline = time.perf_counter() + seconds
    G, D, n = problem.stages, problem.dp, problem.n
    tables = _Tables(problem)

    def random_labels() -> np.ndarray:
        labels = np.arange(n) // D
        rng.shuffle(labels)
        return labels

    def child_of(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        c = b.copy()
        for pos in rng.sample(range(n), min(5, n)):
            c[pos] = a[pos]
        sizes = np.bincount(c, minlength=G)
        for i in range(n):  # repair: move devices out of over-full groups
            if sizes[c[i]] > D:
                j = int(np.argmin(sizes))
                sizes[c[i]] -= 1
                sizes[j] += 1
                c[i] = j
        return c

    pop = []
    for _ in range(population):
        st = _State(tables, random_labels())
        _local_search(st, deadline, tries=4)
        pop.append(st)
        if time.perf_counter() > deadline:
            break
    for _ in range(trials):
        if time.perf_counter() > deadline:
            break
        a, b = rng.sample(pop, 2) if len(pop) > 1 else (pop[0], pop[0])
        st = _State(tables, child_of(a.labels, b.labels))
        _local_search(st, deadline, tries=4)
        worst = max(range(len(pop)), key=lambda i: pop[i].key())
        if _better(st.key(), pop[worst].key()):
            pop[worst] = st
    return min(pop, key=lambda s: s.key()).assignment()


def dtfm_problem(topology: Topology, stages: int, layers: int, layer_params: float,
                 seq_len: int, d_model: int, sequences_per_pipeline: float,
                 grad_bytes: float = 4, act_bytes: float = 2) -> Problem:
    """DT-FM's workload numbers for a model: c_dp = a stage's gradient bytes (its share of the
    layers), c_pp = the activations of a pipeline's sequences at one boundary."""
    dp = topology.num_devices // stages
    return Problem.from_topology(
        topology, stages, dp, dp_bytes=layer_params * layers / stages * grad_bytes,
        pp_bytes=seq_len * d_model * act_bytes * sequences_per_pipeline)


__all__ = ["Problem", "Assignment", "bottleneck_matching", "class_bottleneck", "twin_classes", "open_path", "evaluate",
           "consecutive", "search", "genetic_search", "dtfm_problem"]

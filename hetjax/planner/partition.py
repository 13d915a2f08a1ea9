"""Layer partition: how many layers each pipeline stage runs, and in which order stages sit.

Three methods, all on the cost model's `StageCost`s (times and memory linear in layers):
(a) `holmes_split`: Holmes' proportional split, N_i = floor(alpha * S_i / sum(S) * N) for all
    but the last stage, which takes the rest; alpha is moved away from its start value, nearest
    first, until every stage fits its memory.
(b) `hethub_split`: HetHub's search. Stages of one kind (same per-layer time and memory) get
    layer counts that differ by at most one, so the variables are the layers per kind; a DFS
    over them prunes by memory and by a bound on the objective, and each leaf places the
    stages slowest first.
(c) `optimal_split`: the exact optimum over contiguous splits for a given stage order, and
    `best_split` the best over a set of orders. It is never worse than (a) or (b) on the same
    objective when their orders are among those tried.

The objective is the pipeline time per step, sum_s t_s + (M - 1) * max_s t_s with t_s the
stage's forward + backward time per micro-batch, subject to every stage fitting its memory
(model states padded to the longest stage). Transfers between stages and the gradient sync
are added by the simulator afterwards (they do not depend on the split but on the devices).

A table `table[slot][position]` of StageCosts describes stages that can be reordered: slot
i placed at pipeline position p costs table[i][p] (first and last positions carry embedding
and head, earlier 1F1B positions keep more micro-batches in flight).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from hetjax.errors import PlanError
from hetjax.planner.cost import StageCost

Table = Sequence[Sequence[StageCost]]


@dataclass(frozen=True)
class Split:
    order: tuple[int, ...]  # order[p] = the slot at pipeline position p
    layers: tuple[int, ...]  # layers of the stage at each position
    objective: float


def pipeline_time(stages: Sequence[StageCost], layers: Sequence[int], microbatches: int) -> float:
    """sum_s t_s + (M - 1) max_s t_s: the pipeline's step time without transfers and sync."""
    t = [c.time(n) for c, n in zip(stages, layers)]
    return sum(t) + (microbatches - 1) * max(t)


def fits(stages: Sequence[StageCost], layers: Sequence[int]) -> bool:
    lmax = max(layers)
    return all(n >= 1 and c.memory(n, lmax) <= c.capacity for c, n in zip(stages, layers))


def placed(table: Table, order: Sequence[int]) -> list[StageCost]:
    return [table[slot][p] for p, slot in enumerate(order)]


def _evaluate(table: Table, order: Sequence[int], layers: Sequence[int], M: int) -> Split | None:
    stages = placed(table, order)
    if not fits(stages, layers):
        return None
    return Split(tuple(order), tuple(layers), pipeline_time(stages, layers, M))


# --- (a) Holmes ---------------------------------------------------------------------------------
def proportional(speeds: Sequence[float], n_layers: int, alpha: float) -> tuple[int, ...] | None:
    """Holmes' formula; None if some stage would get no layer."""
    total = sum(speeds)
    head = [math.floor(alpha * s / total * n_layers) for s in speeds[:-1]]
    layers = (*head, n_layers - sum(head))
    return layers if min(layers) >= 1 else None


def holmes_split(speeds: Sequence[float], n_layers: int, alpha: float = 1.05,
                 fits_memory: Callable[[tuple[int, ...]], bool] | None = None,
                 step: float = 0.01, span: float = 1.0) -> tuple[int, ...]:
    """Holmes' proportional split with `alpha`; if it does not fit memory, the alpha nearest
    to the given one (in steps of `step`, up to `span` away) whose split fits."""
    for k in range(int(round(span / step)) + 1):
        for a in ((alpha,) if k == 0 else (alpha - k * step, alpha + k * step)):
            layers = proportional(speeds, n_layers, a) if a > 0 else None
            if layers is not None and (fits_memory is None or fits_memory(layers)):
                return layers
    raise PlanError(f"Holmes' split of {n_layers} layers over speeds {list(speeds)} fits memory "
                    f"for no alpha within {alpha - span:g}..{alpha + span:g}; fewer layers per "
                    "stage (more stages) or more memory per device is needed")


def holmes_for(table: Table, n_layers: int, microbatches: int,
               alpha: float = 1.05) -> Split | None:
    """Holmes' split of stages in slot order, speeds = layers per second of each stage."""
    order = tuple(range(len(table)))
    stages = placed(table, order)
    speeds = [1.0 / max(c.time(1) - c.time(0), 1e-30) for c in stages]
    try:
        layers = holmes_split(speeds, n_layers, alpha, lambda ls: fits(stages, ls))
    except PlanError:
        return None
    return Split(order, layers, pipeline_time(stages, layers, microbatches))


# --- (b) HetHub ---------------------------------------------------------------------------------
def kinds(table: Table) -> list[list[int]]:
    """Slots grouped by kind: equal per-layer time and memory wherever they are placed."""
    groups: dict[tuple, list[int]] = {}
    for slot, row in enumerate(table):
        c = row[0]
        key = (round(c.fwd_layer + c.bwd_layer, 15), round(c.mem_slot), round(c.capacity))
        groups.setdefault(key, []).append(slot)
    return list(groups.values())


def _even(total: int, parts: int) -> list[int]:
    q, r = divmod(total, parts)
    return [q + 1] * r + [q] * (parts - r)


def hethub_split(table: Table, n_layers: int, microbatches: int) -> Split | None:
    """HetHub: DFS over layers per kind with pruning; each leaf orders stages slowest first."""
    S, M = len(table), microbatches
    groups = kinds(table)
    # Per-layer time of each kind (position-independent part), slowest kind first.
    groups.sort(key=lambda g: -(table[g[0]][0].fwd_layer + table[g[0]][0].bwd_layer))
    # Memory bound: the most layers a stage of the kind can hold anywhere in the pipeline
    # (without knowing the longest stage yet, its own layers set the padding).
    best: list[Split | None] = [None]

    def most_layers(slot: int) -> int:
        return max(max(n for n in range(0, n_layers + 1)
                       if n == 0 or table[slot][p].memory(n, n) <= table[slot][p].capacity)
                   for p in range(S))

    cap = [most_layers(g[0]) for g in groups]

    def leaf(alloc: list[int]) -> None:
        per_slot = {}
        for g, total in zip(groups, alloc):
            for slot, n in zip(g, _even(total, len(g))):
                per_slot[slot] = n
        # Slowest stage first (HetHub's empirical rule), judged where it would sit mid-pipe.
        order = sorted(per_slot, key=lambda sl: -table[sl][0].time(per_slot[sl]))
        split = _evaluate(table, order, [per_slot[sl] for sl in order], M)
        if split is not None and (best[0] is None or split.objective < best[0].objective):
            best[0] = split

    def bound(alloc: list[int]) -> float:
        t = [table[slot][0].time(n) for g, total in zip(groups, alloc)
             for slot, n in zip(g, _even(total, len(g)))]
        return sum(t) + (M - 1) * max(t) if t else 0.0

    def dfs(k: int, alloc: list[int], left: int) -> None:
        if k == len(groups) - 1:
            n = len(groups[k])
            if n <= left <= n * cap[k]:
                leaf(alloc + [left])
            return
        rest_min = sum(len(g) for g in groups[k + 1:])
        rest_max = sum(len(g) * c for g, c in zip(groups[k + 1:], cap[k + 1:]))
        n = len(groups[k])
        for total in range(max(n, left - rest_max), min(n * cap[k], left - rest_min) + 1):
            trial = alloc + [total]
            if best[0] is not None and bound(trial) >= best[0].objective:
                # Times grow with layers, so larger totals for this kind only get worse.
                break
            dfs(k + 1, trial, left - total)

    if S > n_layers:
        return None
    dfs(0, [], n_layers)
    return best[0]


# --- (c) exact ----------------------------------------------------------------------------------
def optimal_split(stages: Sequence[StageCost], n_layers: int, microbatches: int
                  ) -> tuple[tuple[int, ...], float] | None:
    """The contiguous split minimising the pipeline time subject to memory, exactly.

    For each longest-stage length Lmax and each candidate bottleneck B (every value a stage's
    time takes), stage p may hold up to min(Lmax, memory cap, layers with t_p <= B) layers;
    given those caps, giving every stage one layer and the rest to the stages with the
    smallest per-layer time first minimises the sum of times. The optimum's own (Lmax, B) is
    among those tried, so the best over all of them is optimal. None if nothing fits."""
    S, M = len(stages), microbatches
    if S > n_layers:
        return None
    # one pass over the stages (the search calls this tens of thousands of times); per and
    # fixed are c.time(1) - c.time(0) and c.time(0), in the same float operations
    fl, ff, bl, bf, slot, act, base, cap = np.array(
        [(c.fwd_layer, c.fwd_fixed, c.bwd_layer, c.bwd_fixed, c.mem_slot, c.mem_layer,
          c.mem_fixed, c.capacity) for c in stages], dtype=float).T
    fixed = (fl * 0 + ff) + (bl * 0 + bf)
    per = ((fl * 1 + ff) + (bl * 1 + bf)) - fixed
    cheapest = np.argsort(per, kind="stable")
    # Most layers each stage can hold when the longest stage (the padding) has lmax, for
    # every lmax at once: rows are lmax from the largest possible down to ceil(N / S).
    lmaxes = np.arange(n_layers - S + 1, -(-n_layers // S) - 1, -1)
    room = cap[None, :] - slot[None, :] * lmaxes[:, None] - base[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        caps_mem = np.where(act > 0, np.floor(room / np.where(act > 0, act, 1)), n_layers)
    caps_mem = np.where(room < 0, 0, np.minimum(caps_mem, lmaxes[:, None])).astype(int)
    feasible = (caps_mem.min(axis=1) >= 1) & (caps_mem.sum(axis=1) >= n_layers)
    unbound = (caps_mem == lmaxes[:, None]).all(axis=1)
    if unbound.any():
        # Memory does not bind at this lmax, so shorter longest stages cannot do better.
        feasible[np.argmax(unbound) + 1:] = False
    best: tuple[tuple[int, ...], float] | None = None
    if not feasible.any():
        return None
    # Candidate bottlenecks: the time of every stage at every feasible layer count. Every
    # lmax's candidates are among those of the largest feasible lmax, and the layers a stage
    # can run within a bottleneck (by_time) do not depend on lmax: both are computed once.
    top = int(lmaxes[feasible][0])
    counts = np.arange(1, top + 1)
    values = per[:, None] * counts[None, :] + fixed[:, None]  # [S, top]
    B_all, where = np.unique(values, return_inverse=True)
    where = where.reshape(values.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        time_all = np.floor((B_all[:, None] - fixed[None, :]) / per[None, :] * (1 + 1e-12)
                            + 1e-9)
    least = fixed.sum() + per.sum() + (n_layers - S) * per.min()  # one layer each, the rest
    # on the cheapest stage
    for lmax, mem_cap in zip(lmaxes[feasible], caps_mem[feasible]):
        pick = np.zeros(len(B_all), dtype=bool)
        pick[where[counts[None, :] <= np.minimum(mem_cap, lmax)[:, None]]] = True
        B = B_all[pick]
        by_time = np.where(per[None, :] > 0, time_all[pick], lmax)
        caps = np.minimum(mem_cap[None, :], by_time).astype(int)
        ok = (caps.min(axis=1) >= 1) & (caps.sum(axis=1) >= n_layers)
        if ok.any():
            # Every split of this lmax has its bottleneck among the feasible B and a sum of
            # times at least `least`: skip the fill when even that cannot beat the best.
            if best is not None and least + (M - 1) * B[np.argmax(ok)] > best[1] * (1 + 1e-9):
                continue
            caps = caps[ok]
            room = caps[:, cheapest] - 1  # room above the one layer each stage gets
            before = np.concatenate([np.zeros((len(room), 1), int),
                                     np.cumsum(room, axis=1)[:, :-1]], axis=1)
            give = np.clip(n_layers - S - before, 0, room)
            layers = np.empty_like(give)
            layers[:, cheapest] = give + 1
            t = layers * per[None, :] + fixed[None, :]
            obj = t.sum(axis=1) + (M - 1) * t.max(axis=1)
            i = int(np.argmin(obj))
            if best is None or obj[i] < best[1]:
                best = (_level(layers[i], caps[i], per, fixed), float(obj[i]))
    if best is not None:  # levelling never raises the objective; report its exact value
        best = (best[0], pipeline_time(stages, best[0], M))
    return best


def _level(layers: np.ndarray, caps: np.ndarray, per: np.ndarray, fixed: np.ndarray
           ) -> tuple[int, ...]:
    """Among stages with the same per-layer time the greedy fills the first ones up; moving
    layers to the least loaded of them (within the caps) keeps the sum of times and does
    not raise the maximum, so ties between splits go to the balanced one."""
    layers = layers.copy()
    f, p, c = fixed.tolist(), per.tolist(), caps.tolist()
    for speed in np.unique(per):
        group = np.flatnonzero(np.isclose(per, speed, rtol=1e-9, atol=0.0)).tolist()
        total = int(layers[group].sum())
        held = dict.fromkeys(group, 1)
        # each layer goes to the stage whose time after it is least (first stage on ties): a
        # heap of (that time, stage) is the same choice as an argmin over the open stages
        heap = [(f[j] + p[j] * 2, j) for j in group if 1 < c[j]]
        heapq.heapify(heap)
        for _ in range(total - len(group)):
            _, j = heapq.heappop(heap)
            held[j] += 1
            if held[j] < c[j]:
                heapq.heappush(heap, (f[j] + p[j] * (held[j] + 1), j))
        layers[group] = list(held.values())
    return tuple(int(n) for n in layers)


def candidate_orders(table: Table, limit: int = 120) -> list[tuple[int, ...]]:
    """Stage orders worth trying: slot order, slowest first, fastest first, and every
    distinct arrangement of kinds when there are at most `limit` of them."""
    S = len(table)
    groups = kinds(table)
    speed = [table[s][0].fwd_layer + table[s][0].bwd_layer for s in range(S)]
    orders = [tuple(range(S)), tuple(sorted(range(S), key=lambda s: -speed[s])),
              tuple(sorted(range(S), key=lambda s: speed[s]))]
    n_arrangements = math.factorial(S) // math.prod(math.factorial(len(g)) for g in groups)
    if 1 < len(groups) and n_arrangements <= limit:
        for perm in _arrangements([len(g) for g in groups]):
            pools = [list(g) for g in groups]
            orders.append(tuple(pools[k].pop(0) for k in perm))
    return list(dict.fromkeys(orders))


def _arrangements(counts: list[int]):
    """Every distinct sequence with counts[k] copies of label k."""
    if not any(counts):
        yield ()
        return
    for k, c in enumerate(counts):
        if c:
            counts[k] -= 1
            for rest in _arrangements(counts):
                yield (k, *rest)
            counts[k] += 1


def best_split(table: Table, n_layers: int, microbatches: int,
               orders: Sequence[Sequence[int]] | None = None) -> Split | None:
    """The exact split for each order in `orders` (default `candidate_orders`), best first."""
    best = None
    for order in orders if orders is not None else candidate_orders(table):
        res = optimal_split(placed(table, order), n_layers, microbatches)
        if res is not None and (best is None or res[1] < best.objective):
            best = Split(tuple(order), res[0], res[1])
    return best


__all__ = ["Split", "pipeline_time", "fits", "placed", "proportional", "holmes_split",
           "holmes_for", "kinds", "hethub_split", "optimal_split", "candidate_orders",
           "best_split"]

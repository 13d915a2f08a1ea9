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

import functools
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
    return _kinds_of([row[0] for row in table])


def _kinds_of(first: Sequence[StageCost]) -> list[list[int]]:
    """`kinds` from each slot's cost at the first position."""
    groups: dict[tuple, list[int]] = {}
    for slot, c in enumerate(first):
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
    among those tried, so the best over all of them is optimal. None if nothing fits.
    Ties go to the larger Lmax, then the smaller B (then `_level`). A floor per Lmax (least
    sum of times within its memory caps + (M - 1) x its least feasible B) skips the Lmax
    values and bottlenecks that cannot win, and the rest are filled in one batch.

    The search asks for the same split many times (ZeRO points and layouts whose stages price
    alike), so the answer is memoised on the stage numbers it depends on (`split_cache_clear`
    empties the memo)."""
    S = len(stages)
    if S > n_layers:
        return None
    if S == 1:
        layers = _one_stage(stages[0], n_layers)
        return None if layers is None else (layers, pipeline_time(stages, layers, microbatches))
    # one pass over the stages (the search calls this tens of thousands of times)
    columns = np.array([(c.fwd_layer, c.fwd_fixed, c.bwd_layer, c.bwd_fixed, c.mem_slot,
                         c.mem_layer, c.mem_fixed, c.capacity) for c in stages], dtype=float)
    layers = _exact_layers(columns.tobytes(), S, n_layers, microbatches)
    if layers is None:
        return None
    return layers, pipeline_time(stages, layers, microbatches)  # its exact value


def _one_stage(c: StageCost, n_layers: int) -> tuple[int, ...] | None:
    """`_exact_layers` of a single stage, in the same float operations without numpy (a
    third of the search's splits): all the layers if they fit its memory and its time at
    all of them is a bottleneck that holds them (`time_all`, always but for a per-layer time
    lost in rounding beside the fixed time), else None."""
    fixed = (c.fwd_layer * 0 + c.fwd_fixed) + (c.bwd_layer * 0 + c.bwd_fixed)
    per = ((c.fwd_layer * 1 + c.fwd_fixed) + (c.bwd_layer * 1 + c.bwd_fixed)) - fixed
    room = c.capacity - c.mem_slot * n_layers - c.mem_fixed
    held = 0 if room < 0 else math.floor(min(room / c.mem_layer if c.mem_layer > 0
                                             else n_layers, n_layers))
    if held < n_layers:
        return None
    if per > 0 and math.floor((per * n_layers + fixed - fixed) / per * (1 + 1e-12)
                              + 1e-9) < n_layers:
        return None
    return (n_layers,)


def split_cache_clear() -> None:
    """Forget the memoised exact splits (benchmarks time searches from a cold start)."""
    _exact_layers.cache_clear()


_BATCH = 1 << 20  # most caps (rows x bottlenecks x stages) the exact split fills at once


@functools.lru_cache(maxsize=8192)
def _exact_layers(columns: bytes, S: int, n_layers: int, M: int) -> tuple[int, ...] | None:
    """`optimal_split`'s layers for stages given as rows of (fwd_layer, fwd_fixed, bwd_layer,
    bwd_fixed, mem_slot, mem_layer, mem_fixed, capacity)."""
    fl, ff, bl, bf, slot, act, base, cap = np.frombuffer(columns).reshape(S, 8).T
    # per and fixed are c.time(1) - c.time(0) and c.time(0), in the same float operations
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
    if not feasible.any():
        return None
    # Candidate bottlenecks: the time of every stage at every feasible layer count. Every
    # lmax's candidates are among those of the largest feasible lmax, and the layers a stage
    # can run within a bottleneck (by_time) do not depend on lmax: both are computed once.
    top = int(lmaxes[feasible][0])
    counts = np.arange(1, top + 1)
    values = per[:, None] * counts[None, :] + fixed[:, None]  # [S, top]
    # np.unique(values, return_inverse=True) without its overhead (the values are finite):
    # the sorted distinct values, and where each value sits among them
    ranked = np.sort(values, axis=None)
    B_all = ranked[np.concatenate(([True], ranked[1:] != ranked[:-1]))]
    where = np.searchsorted(B_all, values)
    with np.errstate(divide="ignore", invalid="ignore"):
        time_all = np.floor((B_all[:, None] - fixed[None, :]) / per[None, :] * (1 + 1e-12)
                            + 1e-9)
    rows = np.flatnonzero(feasible)  # lmax values, largest first
    mem = caps_mem[rows]
    by_time = np.where(per[None, :] > 0, time_all, n_layers)  # mem caps never exceed it
    # kmin[p, b]: the fewest layers at which stage p takes time B_all[b] (top + 1: never);
    # a row's candidates are the times its stages take within their memory caps.
    kmin = np.full((S, len(B_all)), top + 1)
    np.minimum.at(kmin, (np.arange(S)[:, None], where), counts[None, :])

    def candidates(r: int, below: int) -> tuple[np.ndarray, np.ndarray]:
        """Row r's bottlenecks among the first `below` (those that fit) and their caps."""
        caps = np.minimum(mem[r][None, :], by_time[:below]).astype(int)
        ok = ((kmin[:, :below] <= mem[r][:, None]).any(axis=0) & (caps.min(axis=1) >= 1)
              & (caps.sum(axis=1) >= n_layers))
        return caps[ok], ok

    def objective(caps: np.ndarray, alone: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The objective of each row of caps' greedy fill, and the fill. `alone`: the rows
        that were their lmax's only candidate, whose sums the scan took pairwise."""
        layers = _fill(caps, cheapest, n_layers)
        t = layers * per[None, :] + fixed[None, :]
        return _sums(t, alone) + (M - 1) * t.max(axis=1), layers

    # The answer is the first (largest lmax, then smallest bottleneck) split of least
    # objective, compared exactly, as a scan over lmax and bottlenecks finds it.
    floor = (_row_floors(mem, per, fixed, cheapest, B_all, by_time, n_layers, M)
             if len(rows) > 1 else np.zeros(1))
    finite = np.flatnonzero(np.isfinite(floor))
    if not len(finite):
        return None
    def scan(rows_: Sequence[int]) -> tuple[int, ...] | None:
        """Row after row (largest lmax first), skipping rows whose floor cannot win."""
        best = None
        for r in rows_:
            if best is not None and floor[r] > best[0] * (1 + 1e-9):
                continue
            caps, _ = candidates(r, len(B_all))
            if len(caps):
                obj, layers = objective(caps, np.full(len(caps), len(caps) == 1))
                i = int(np.argmin(obj))
                if best is None or obj[i] < best[0]:
                    best = (obj[i], layers[i], caps[i])
        return None if best is None else _level(best[1], best[2], per, fixed)

    if M == 1 or len(finite) == 1:  # one lmax, or no bottleneck term to bound B with
        return scan(finite.tolist())
    # The row with the lowest floor bounds the answer. A split whose greedy fill peaks below
    # its bottleneck B repeats the split of the lower bottleneck it peaks at, so the first
    # split of least objective sits at a B it reaches: objective >= floor sum + (M-1) B,
    # which bounds the B worth filling in every row. Those are filled all at once.
    r0 = int(finite[np.argmin(floor[finite])])
    caps, _ = candidates(r0, len(B_all))
    bound = float(objective(caps, np.full(len(caps), len(caps) == 1))[0].min()) * (1 + 1e-9)
    live = finite[floor[finite] <= bound]
    cut = np.searchsorted(B_all, (bound - _row_sums(mem[live], per, fixed, cheapest, n_layers))
                          / (M - 1), side="right")
    below = int(cut.max())
    if len(live) * below * S > _BATCH:  # the batch would not fit in a small working set
        return scan(live.tolist())
    caps = np.minimum(mem[live][:, None, :], by_time[None, :below]).astype(int)  # [R, B, S]
    ok = ((kmin[None, :, :below] <= mem[live][:, :, None]).any(axis=1)
          & (caps.min(axis=2) >= 1) & (caps.sum(axis=2) >= n_layers)
          & (np.arange(below)[None, :] < cut[:, None]))
    # A row's only candidate: one below its cut, and no stage reaching a larger time.
    reach = where[np.arange(S)[None, :], mem[live] - 1].max(axis=1)
    alone = (ok.sum(axis=1) == 1) & (reach == np.argmax(ok, axis=1))
    caps = caps[ok]  # rows in lmax order, each row's bottlenecks ascending
    obj, layers = objective(caps, np.repeat(alone, ok.sum(axis=1)))
    i = int(np.argmin(obj))
    # levelling never raises the objective
    return _level(layers[i], caps[i], per, fixed)


def _sums(t: np.ndarray, alone: np.ndarray) -> np.ndarray:
    """Row sums of t as the scan over lmax computed them, to the last bit (ties between
    splits are decided on it): the scan summed each lmax's candidates as one Fortran-ordered
    block (numpy adds such rows stage after stage), and a lone candidate as a one-row array
    (pairwise). The same numpy calls are made here, so the sums agree on any numpy."""
    block = np.asfortranarray(np.concatenate([t, t[:1]]))  # two rows at least, as a block
    out = block.sum(axis=1)[:len(t)]
    for i in np.flatnonzero(alone).tolist():
        out[i] = np.ascontiguousarray(t[i:i + 1]).sum(axis=1)[0]
    return out


def _fill(caps: np.ndarray, cheapest: np.ndarray, n_layers: int) -> np.ndarray:
    """For each row of per-stage caps, one layer per stage and the rest to the stages in
    `cheapest` order, each up to its cap: the least sum of times within the caps."""
    room = caps[:, cheapest] - 1  # room above the one layer each stage gets
    before = np.concatenate([np.zeros((len(room), 1), int),
                             np.cumsum(room, axis=1)[:, :-1]], axis=1)
    give = np.clip(n_layers - caps.shape[1] - before, 0, room)
    layers = np.empty_like(give)
    layers[:, cheapest] = give + 1
    return layers


def _row_sums(mem: np.ndarray, per: np.ndarray, fixed: np.ndarray, cheapest: np.ndarray,
              n_layers: int) -> np.ndarray:
    """The least sum of stage times within each row of memory caps (the greedy fill)."""
    return (_fill(mem, cheapest, n_layers) * per[None, :] + fixed[None, :]).sum(axis=1)


def _row_floors(mem: np.ndarray, per: np.ndarray, fixed: np.ndarray, cheapest: np.ndarray,
                B_all: np.ndarray, by_time: np.ndarray, n_layers: int, M: int) -> np.ndarray:
    """A lower bound on the objective of every split of each row of memory caps, inf where
    no bottleneck fits: the least sum of times within the caps, plus (M - 1) times the
    smallest bottleneck B whose caps min(memory, layers within B) hold every layer. Each
    split's own bottleneck is such a B, so its objective is at least the floor. The smallest
    B is found for all rows at once by bisection (the caps only grow with B)."""
    n_B = len(B_all)
    lo, hi = np.zeros(len(mem), int), np.full(len(mem), n_B)
    while (lo < hi).any():
        mid = (lo + hi) // 2
        caps = np.minimum(mem, by_time[np.minimum(mid, n_B - 1)]).astype(int)
        ok = (caps.min(axis=1) >= 1) & (caps.sum(axis=1) >= n_layers)
        open_ = lo < hi
        hi = np.where(open_ & ok, mid, hi)
        lo = np.where(open_ & ~ok, mid + 1, lo)
    return np.where(lo < n_B, _row_sums(mem, per, fixed, cheapest, n_layers)
                    + (M - 1) * B_all[np.minimum(lo, n_B - 1)], np.inf)


def _level(layers: np.ndarray, caps: np.ndarray, per: np.ndarray, fixed: np.ndarray
           ) -> tuple[int, ...]:
    """Among stages with the same per-layer time the greedy fills the first ones up; moving
    layers to the least loaded of them (within the caps) keeps the sum of times and does
    not raise the maximum, so ties between splits go to the balanced one.

    Each group (the stages within 1e-9 of each distinct speed, in ascending order) keeps one
    layer per stage and hands out the rest one at a time, each to the stage whose time after
    it, fixed + per x (its layers + 1), is least (the lowest stage on equal times). A stage's
    times only grow with its layers, so those hand-outs are the group's smallest (time,
    stage) pairs among every stage's layers 2 .. cap: picked all at once by one sort."""
    layers = layers.copy()
    # np.isclose(per, speed, rtol=1e-9, atol=0) for every distinct speed at once, spelt out
    # (the same comparison, without isclose's checks of its arguments)
    speed = np.unique(per)[:, None]
    close = ((np.abs(per[None, :] - speed) <= 1e-9 * np.abs(speed)) & np.isfinite(speed)
             | (per[None, :] == speed))
    for row in close[close.sum(axis=1) > 1]:
        group = np.flatnonzero(row)
        extra = int(layers[group].sum()) - len(group)  # layers above one per stage
        room = np.maximum(caps[group] - 1, 0)
        stage = np.repeat(group, room)
        k = np.arange(len(stage)) - np.repeat(np.cumsum(room) - room, room) + 2
        time = fixed[stage] + per[stage] * k  # (as float as the one-at-a-time greedy's)
        picked = stage[np.lexsort((k, stage, time))[:extra]]
        layers[group] = 1 + np.bincount(picked, minlength=len(per))[group]
    return tuple(layers.tolist())


def candidate_orders(table: Table, limit: int = 120) -> list[tuple[int, ...]]:
    """Stage orders worth trying: slot order, slowest first, fastest first, and every
    distinct arrangement of kinds when there are at most `limit` of them."""
    S = len(table)
    first = [row[0] for row in table]  # read once: the search asks for orders per layout
    groups = _kinds_of(first)
    speed = [c.fwd_layer + c.bwd_layer for c in first]
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
           "best_split", "split_cache_clear"]

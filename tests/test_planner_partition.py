"""Layer partition: Holmes' proportional split, HetHub's DFS, and the exact contiguous split."""

import itertools
import random

import pytest

from hetjax.errors import PlanError
from hetjax.planner import partition as pt
from hetjax.planner.cost import CostModel, StageCost
from hetjax.planner.layout import Layout
from hetjax.core.topology import LINKS, Topology, make_cluster
from hetjax.core.model_config import ModelConfig


def stage(per_layer: float, *, head: float = 0.0, slot: float = 1.0, act: float = 0.5,
          fixed: float = 0.0, capacity: float = 1e9, label: str = "") -> StageCost:
    return StageCost(fwd_layer=per_layer / 3, bwd_layer=2 * per_layer / 3, fwd_fixed=head / 3,
                     bwd_fixed=2 * head / 3, sync_layer=0.0, sync_fixed=0.0, mem_slot=slot,
                     mem_layer=act, mem_fixed=fixed, capacity=capacity, label=label)


def random_table(rng: random.Random, S: int, kinds: int, tight: bool):
    """table[slot][position]: slots of a few kinds; the last position carries the head and
    earlier positions keep more activations (as under 1F1B)."""
    kind = [rng.randrange(kinds) for _ in range(S)]
    speed = [rng.uniform(0.5, 3.0) for _ in range(kinds)]
    cap = [rng.uniform(12, 30) if tight else 1e9 for _ in range(kinds)]
    head = rng.uniform(0, 2)
    return [[stage(speed[kind[i]], head=head if p == S - 1 else 0.0, act=0.2 * (S - p),
                   fixed=1.0 if p in (0, S - 1) else 0.0, capacity=cap[kind[i]])
             for p in range(S)] for i in range(S)]


def brute_force(stages, n_layers, M):
    best = None
    for cuts in itertools.combinations(range(1, n_layers), len(stages) - 1):
        bounds = (0, *cuts, n_layers)
        layers = [bounds[i + 1] - bounds[i] for i in range(len(stages))]
        if pt.fits(stages, layers):
            v = pt.pipeline_time(stages, layers, M)
            best = v if best is None else min(best, v)
    return best


# --- (a) Holmes -----------------------------------------------------------------------------------
def test_holmes_worked_example_17_13():
    assert pt.holmes_split([197, 160], 30, alpha=1.05) == (17, 13)
    assert pt.holmes_split([197, 160], 30, alpha=1.0) == (16, 14)
    assert pt.holmes_split([1, 1], 30, alpha=1.0) == (15, 15)


def test_holmes_many_clusters_last_takes_the_rest():
    assert pt.holmes_split([3, 2, 1], 60, alpha=1.0) == (30, 20, 10)
    assert sum(pt.holmes_split([5, 3, 2, 1], 41, alpha=1.05)) == 41


def test_holmes_moves_alpha_until_memory_holds():
    # The fast stage can hold at most 16 layers: alpha drops from 1.05 until it does.
    split = pt.holmes_split([197, 160], 30, alpha=1.05, fits_memory=lambda ls: ls[0] <= 16)
    assert split == (16, 14)
    with pytest.raises(PlanError, match="fits memory for no alpha"):
        pt.holmes_split([197, 160], 30, fits_memory=lambda ls: False)


# --- (c) exact ------------------------------------------------------------------------------------
def test_exact_split_matches_brute_force():
    rng = random.Random(1)
    for _ in range(150):
        S, M = rng.randint(1, 4), rng.randint(1, 8)
        n_layers = rng.randint(S, 12)
        stages = [stage(rng.uniform(0.5, 3), head=rng.uniform(0, 2) if p == S - 1 else 0.0,
                        slot=rng.uniform(1, 2), act=rng.uniform(0.1, 1) * (S - p),
                        fixed=rng.uniform(0, 3), capacity=rng.choice([1, 2, 5]) * rng.uniform(8, 20))
                  for p in range(S)]
        want = brute_force(stages, n_layers, M)
        got = pt.optimal_split(stages, n_layers, M)
        if want is None:
            assert got is None
        else:
            layers, value = got
            assert sum(layers) == n_layers and pt.fits(stages, layers)
            assert value == pytest.approx(want)
            assert pt.pipeline_time(stages, layers, M) == pytest.approx(value)


def test_exact_split_is_never_worse_than_holmes_or_hethub():
    rng = random.Random(2)
    compared = 0
    for trial in range(120):
        S = rng.randint(2, 6)
        n_layers = rng.randint(S, 40)
        M = rng.randint(1, 16)
        table = random_table(rng, S, kinds=rng.randint(1, 3), tight=trial % 2 == 0)
        holmes = pt.holmes_for(table, n_layers, M)
        hethub = pt.hethub_split(table, n_layers, M)
        others = [s for s in (holmes, hethub) if s is not None]
        # Default orders: slot order (Holmes'), slowest first, and every arrangement of kinds
        # (so HetHub's order up to interchangeable stages of one kind).
        best = pt.best_split(table, n_layers, M)
        if best is None:
            assert not others
            continue
        stages = pt.placed(table, best.order)
        assert pt.fits(stages, best.layers)
        for other in others:
            assert best.objective <= other.objective + 1e-9
            compared += 1
    assert compared > 100


def test_hethub_places_the_slowest_stages_first_and_balances_within_a_kind():
    fast, slow = stage(1.0), stage(2.0)
    table = [[fast] * 4, [fast] * 4, [slow] * 4, [slow] * 4]
    split = pt.hethub_split(table, 30, microbatches=8)
    assert set(split.order[:2]) == {2, 3}  # slow slots first
    assert abs(split.layers[0] - split.layers[1]) <= 1 and abs(split.layers[2] - split.layers[3]) <= 1
    assert sum(split.layers[2:]) > sum(split.layers[:2])  # the fast kind gets more layers


def test_the_faster_cluster_gets_more_layers_from_the_cost_model():
    """Two clusters of different accelerators: the exact split beats the even one and gives
    the fast stage more layers (HetHub's rule (a))."""
    m = ModelConfig(vocab_size=32000, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=16,
                    d_ff=5632, remat="full", dtype="bfloat16", param_dtype="bfloat16")
    topo = Topology("mix", (make_cluster("a", 1, 8, "a100", "infiniband"),
                            make_cluster("b", 1, 8, "v100", "roce")), LINKS["ethernet"])
    cm = CostModel(topo, m)
    layout = Layout(pp=2, dp=8, tp=1, microbatches=32, global_batch=256, seq_len=1024,
                    schedule="1f1b")
    table = cm.stage_table(layout)
    best = pt.best_split(table, 24, 32)
    stages = pt.placed(table, best.order)
    fast_position = [p for p, slot in enumerate(best.order) if slot == 0][0]
    assert best.layers[fast_position] > 12
    even = pt.pipeline_time(pt.placed(table, (0, 1)), (12, 12), 32)
    assert best.objective < 0.85 * even
    assert pt.fits(stages, best.layers)


def test_candidate_orders_cover_every_arrangement_of_kinds():
    a, b = stage(1.0), stage(2.0)
    table = [[a] * 4, [a] * 4, [b] * 4, [b] * 4]
    orders = pt.candidate_orders(table)
    kinds = {tuple("ab"[s >= 2] for s in order) for order in orders}
    assert len(kinds) == 6  # 4! / (2! 2!)
    assert (0, 1, 2, 3) in orders


def test_no_split_when_there_are_more_stages_than_layers_or_no_memory():
    assert pt.optimal_split([stage(1.0)] * 5, 4, 4) is None
    assert pt.optimal_split([stage(1.0, capacity=0.5)] * 2, 4, 4) is None


def test_equal_stages_get_a_level_split():
    split = pt.best_split([[stage(1.0)] * 8 for _ in range(8)], 22, microbatches=16)
    assert sorted(split.layers) == [2, 2, 3, 3, 3, 3, 3, 3]
    # A head on the last stage: it gets fewer layers, the others stay level.
    table = [[stage(1.0, head=1.8 if p == 7 else 0.0) for p in range(8)] for _ in range(8)]
    layers = pt.best_split(table, 24, 16, orders=[tuple(range(8))]).layers
    assert max(layers[:7]) - min(layers[:7]) <= 1 and layers[7] < max(layers)


def level_reference(layers, caps, per, fixed):
    """The levelling one layer at a time, as it was first written: for each distinct speed
    (ascending), the stages within 1e-9 of it keep one layer each and every other layer goes,
    in turn, to the stage whose time after it is least (the lowest stage on equal times)."""
    import heapq

    import numpy as np

    layers = layers.copy()
    f, p, c = fixed.tolist(), per.tolist(), caps.tolist()
    for speed in np.unique(per):
        group = np.flatnonzero(np.isclose(per, speed, rtol=1e-9, atol=0.0)).tolist()
        if len(group) == 1:
            continue
        held = dict.fromkeys(group, 1)
        heap = [(f[j] + p[j] * 2, j) for j in group if 1 < c[j]]
        heapq.heapify(heap)
        for _ in range(int(layers[group].sum()) - len(group)):
            _, j = heapq.heappop(heap)
            held[j] += 1
            if held[j] < c[j]:
                heapq.heappush(heap, (f[j] + p[j] * (held[j] + 1), j))
        layers[group] = list(held.values())
    return tuple(int(n) for n in layers)


def test_levelling_equals_handing_out_one_layer_at_a_time():
    """The levelling picks each group's layers with one sort: the same layers as the greedy
    that hands them out one at a time, on random stages with equal speeds, speeds apart by
    less than 1e-9 (overlapping groups) and equal times (ties to the lowest stage)."""
    import numpy as np

    rng = random.Random(7)
    for _ in range(300):
        S = rng.randint(2, 12)
        base = rng.uniform(0.1, 2.0)
        per = np.array([base * (1 + rng.choice([0.0, 0.0, 1e-16, 3e-10, 0.5])) for _ in range(S)])
        fixed = np.array([rng.choice([0.0, 0.0, rng.uniform(0, 3 * base)]) for _ in range(S)])
        caps = np.array([rng.randint(1, 12) for _ in range(S)])
        layers = np.array([rng.randint(1, int(c)) for c in caps])
        assert pt._level(layers, caps, per, fixed) == level_reference(layers, caps, per, fixed)


def scan_reference(stages, n_layers, M):
    """The exact split as it was computed before it was memoised and batched: every lmax
    row in turn, every bottleneck of the row filled (the reference for same answers, to the
    bit: ties between splits are decided on the last bit of float sums)."""
    import numpy as np

    S = len(stages)
    if S > n_layers:
        return None
    fl, ff, bl, bf, slot, act, base, cap = np.array(
        [(c.fwd_layer, c.fwd_fixed, c.bwd_layer, c.bwd_fixed, c.mem_slot, c.mem_layer,
          c.mem_fixed, c.capacity) for c in stages], dtype=float).T
    fixed = (fl * 0 + ff) + (bl * 0 + bf)
    per = ((fl * 1 + ff) + (bl * 1 + bf)) - fixed
    cheapest = np.argsort(per, kind="stable")
    lmaxes = np.arange(n_layers - S + 1, -(-n_layers // S) - 1, -1)
    room = cap[None, :] - slot[None, :] * lmaxes[:, None] - base[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        caps_mem = np.where(act > 0, np.floor(room / np.where(act > 0, act, 1)), n_layers)
    caps_mem = np.where(room < 0, 0, np.minimum(caps_mem, lmaxes[:, None])).astype(int)
    feasible = (caps_mem.min(axis=1) >= 1) & (caps_mem.sum(axis=1) >= n_layers)
    unbound = (caps_mem == lmaxes[:, None]).all(axis=1)
    if unbound.any():
        feasible[np.argmax(unbound) + 1:] = False
    if not feasible.any():
        return None
    top = int(lmaxes[feasible][0])
    counts = np.arange(1, top + 1)
    values = per[:, None] * counts[None, :] + fixed[:, None]
    B_all, where = np.unique(values, return_inverse=True)
    where = where.reshape(values.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        time_all = np.floor((B_all[:, None] - fixed[None, :]) / per[None, :] * (1 + 1e-12)
                            + 1e-9)
    best = None
    for lmax, mem_cap in zip(lmaxes[feasible], caps_mem[feasible]):
        pick = np.zeros(len(B_all), dtype=bool)
        pick[where[counts[None, :] <= np.minimum(mem_cap, lmax)[:, None]]] = True
        by_time = np.where(per[None, :] > 0, time_all[pick], lmax)
        caps = np.minimum(mem_cap[None, :], by_time).astype(int)
        ok = (caps.min(axis=1) >= 1) & (caps.sum(axis=1) >= n_layers)
        if ok.any():
            caps = caps[ok]
            room = caps[:, cheapest] - 1
            before = np.concatenate([np.zeros((len(room), 1), int),
                                     np.cumsum(room, axis=1)[:, :-1]], axis=1)
            give = np.clip(n_layers - S - before, 0, room)
            layers = np.empty_like(give)
            layers[:, cheapest] = give + 1
            t = layers * per[None, :] + fixed[None, :]
            obj = t.sum(axis=1) + (M - 1) * t.max(axis=1)
            i = int(np.argmin(obj))
            if best is None or obj[i] < best[1]:
                best = (pt._level(layers[i], caps[i], per, fixed), float(obj[i]))
    return None if best is None else (best[0], pt.pipeline_time(stages, best[0], M))


def random_stages(rng: random.Random, S: int, n_layers: int, deep: bool):
    """Stages of one or two kinds (ties between splits are common), embedding and head on
    the ends. `deep`: as the planner's deep pipelines, one speed, states padded to the
    longest stage so that memory binds above a random longest stage; else more activations
    early (1F1B) and memory tight or not."""
    if deep:
        per, slot, act, base = rng.uniform(0.05, 0.2), rng.uniform(1, 3), rng.uniform(2, 5), \
            rng.uniform(1, 3)
        level = -(-n_layers // S)
        cap = slot * rng.randint(level, n_layers - S + 1) + act * (level + rng.random()) + base
        return [stage(per, head=rng.uniform(0.5, 1) * per if p == S - 1 else 0.0, slot=slot,
                      act=act, fixed=base + (rng.uniform(1, 3) if p in (0, S - 1) else 0.0),
                      capacity=cap) for p in range(S)]
    speeds = [rng.uniform(0.5, 3.0)] * 2 if rng.random() < 0.5 else \
        [rng.uniform(0.5, 3.0) for _ in range(2)]
    cap = rng.uniform(15, 40) if rng.random() < 0.5 else 1e9
    return [stage(speeds[p * 2 // S] if S > 1 else speeds[0],
                  head=rng.choice([0.0, rng.uniform(0, 2)]) if p == S - 1 else 0.0,
                  slot=rng.uniform(0.5, 1.5), act=0.2 * (S - p) * rng.choice([1, 0.5]),
                  fixed=rng.choice([0.0, 1.0]) if p in (0, S - 1) else 0.0, capacity=cap)
            for p in range(S)]


@pytest.mark.parametrize("batch", ["batched", "scanned"])
def test_memoised_batched_split_equals_the_row_by_row_scan(batch, monkeypatch):
    """Same answers to the bit: the memoised, batched exact split against the scan it
    replaced, on random cost vectors (kinds, deep pipelines, tight and loose memory, M from
    1 to 128), asked twice (the second answer comes from the memo) and once afresh; also
    with no batch allowed (the fallback for very long rows)."""
    if batch == "scanned":
        monkeypatch.setattr(pt, "_BATCH", 0)
    pt.split_cache_clear()
    rng = random.Random(31)
    found, trials = 0, 300 if batch == "batched" else 100
    for trial in range(trials):
        S = rng.choice([1, 2, 3, 4, 8, 16, 32])
        n_layers = rng.randint(S, 3 * S + 8)
        M = rng.choice([1, 2, 4, 16, 32, 128])
        stages = random_stages(rng, S, n_layers, deep=trial % 2 == 0 and S >= 2)
        want = scan_reference(stages, n_layers, M)
        assert pt.optimal_split(stages, n_layers, M) == want
        assert pt.optimal_split(stages, n_layers, M) == want  # memoised
        pt.split_cache_clear()
        assert pt.optimal_split(stages, n_layers, M) == want  # computed afresh
        found += want is not None
    assert found > trials * 2 // 3

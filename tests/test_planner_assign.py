"""DT-FM's device assignment: its cost model, the matching and path sub-problems, and the
search against brute force, the genetic baseline and the network-unaware layout."""

import functools
import itertools

import numpy as np
import pytest

from hetjax.errors import PlanError
from hetjax.planner import assign as A
from hetjax.core.topology import DTFM_SCENARIOS, preset


def worked_example() -> A.Problem:
    """spec/dtfm.md: a, b at site X and c, d at site Y; 5 ms / 2 Gb/s inside a site,
    50 ms / 1 Gb/s across; c_dp = 0.5 GB, c_pp = 1 Gbit."""
    site = np.array([0, 0, 1, 1])
    same = site[:, None] == site[None, :]
    lat = np.where(same, 0.005, 0.05)
    bw = np.where(same, 2e9 / 8, 1e9 / 8)
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, np.inf)
    return A.Problem(lat, bw, stages=2, dp=2, dp_bytes=0.5e9, pp_bytes=1e9 / 8)


def site_problem(rng, n, stages, sites, jitter=0.1) -> A.Problem:
    """Random sites with fast links inside, slow uneven links across (slightly noisy)."""
    site = rng.integers(0, sites, n)
    same = site[:, None] == site[None, :]
    lat = np.where(same, 0.001, rng.uniform(0.01, 0.1, (sites, sites))[site][:, site])
    bw = np.where(same, 1e9, rng.uniform(5e7, 2e8, (sites, sites))[site][:, site])
    noise = rng.uniform(1 - jitter, 1 + jitter, (n, n))
    lat, bw = (lat + lat.T) / 2, (bw * noise + (bw * noise).T) / 2
    np.fill_diagonal(lat, 0.0)
    np.fill_diagonal(bw, np.inf)
    return A.Problem(lat, bw, stages, n // stages, dp_bytes=rng.uniform(1e7, 1e9),
                     pp_bytes=rng.uniform(1e7, 1e9))


def partitions(items, size):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        group = (first, *others)
        left = [x for x in rest if x not in others]
        for tail in partitions(left, size):
            yield [group, *tail]


def gpt13b_problem(name: str) -> A.Problem:
    return A.dtfm_problem(preset(name), stages=8, layers=24, layer_params=1.3e9 / 24,
                          seq_len=2048, d_model=2048, sequences_per_pipeline=64)


# --- the cost model -------------------------------------------------------------------------------
def test_worked_example_costs():
    p = worked_example()
    by_site = A.evaluate(p, [(0, 1), (2, 3)])
    across = A.evaluate(p, [(0, 2), (1, 3)])
    assert (by_site.dp_cost, by_site.pp_cost, by_site.cost) == pytest.approx((2.010, 2.100, 4.110))
    assert (across.dp_cost, across.pp_cost, across.cost) == pytest.approx((4.100, 1.010, 5.110))
    # The search picks the first layout; its pipelines run a -> c and b -> d.
    best = A.search(p, seconds=5)
    assert best.cost == pytest.approx(4.110)
    assert {frozenset(pair) for pair in zip(*best.groups)} == {frozenset({0, 2}),
                                                               frozenset({1, 3})}


def test_problem_shape_is_checked():
    p = worked_example()
    with pytest.raises(PlanError, match="D_pp x D_dp"):
        A.Problem(p.latency, p.bandwidth, stages=3, dp=2, dp_bytes=1.0, pp_bytes=1.0)


# --- matching and path ----------------------------------------------------------------------------
def test_bottleneck_matching_is_optimal_and_achieves_its_value():
    rng = np.random.default_rng(0)
    for _ in range(150):
        n = int(rng.integers(1, 6))
        w = rng.integers(0, 6, (n, n)).astype(float)  # many ties
        value, match = A.bottleneck_matching(w)
        assert sorted(match) == list(range(n))
        assert max(w[i, match[i]] for i in range(n)) == value
        best = min(max(w[i, p[i]] for i in range(n)) for p in itertools.permutations(range(n)))
        assert value == best


def test_class_matching_agrees_with_the_plain_matching():
    rng = np.random.default_rng(1)
    for _ in range(40):
        p = site_problem(rng, 24, 3, sites=int(rng.integers(2, 5)), jitter=0.0)
        cls = A.twin_classes(p.dp_pair_cost(), p.pp_pair_cost())
        W = p.pp_pair_cost()
        a, b = np.sort(rng.choice(24, 8, replace=False)), None
        b = np.sort(rng.choice(np.setdiff1d(np.arange(24), a), 8, replace=False))
        value, match = A.class_bottleneck(W, a, b, cls)
        assert value == A.bottleneck_matching(W[np.ix_(a, b)])[0]
        assert sorted(match) == list(range(8))
        assert max(W[a[i], b[match[i]]] for i in range(8)) == value


def test_twin_classes_are_the_sites():
    p = gpt13b_problem("dtfm_regional")
    cls = A.twin_classes(p.dp_pair_cost(), p.pp_pair_cost())
    assert len(set(cls.tolist())) == 4
    assert all(len(set(cls[16 * k:16 * (k + 1)].tolist())) == 1 for k in range(4))


def test_open_path_is_exact_for_small_graphs_and_valid_for_large():
    rng = np.random.default_rng(2)
    for n in range(1, 8):
        C = rng.uniform(0, 10, (n, n))
        C = (C + C.T) / 2
        cost, path = A.open_path(C)
        best = min(sum(C[a, b] for a, b in zip(p, p[1:]))
                   for p in itertools.permutations(range(n)))
        assert cost == pytest.approx(best) and sorted(path) == list(range(n))
    C = rng.uniform(0, 10, (14, 14))
    cost, path = A.open_path((C + C.T) / 2)
    assert sorted(path) == list(range(14))


# --- the search -----------------------------------------------------------------------------------
@pytest.mark.parametrize("stages,dp,seed", [(2, 4, 0), (4, 2, 1), (3, 3, 2), (2, 5, 3),
                                            (2, 6, 4)])
def test_search_finds_the_brute_force_optimum(stages, dp, seed):
    rng = np.random.default_rng(seed)
    p = site_problem(rng, stages * dp, stages, sites=int(rng.integers(2, 4)))
    best = min(A.evaluate(p, parts).cost for parts in partitions(list(range(stages * dp)), dp))
    assert A.search(p, seconds=10).cost == pytest.approx(best)


@functools.lru_cache(maxsize=None)
def searched(name: str) -> tuple[A.Problem, A.Assignment]:
    p = gpt13b_problem(name)
    return p, A.search(p, seconds=10)


# Two of the five scenarios run in the slow tier: the other three (two of them the most and the
# least uneven networks, also checked below) keep the property in the default tier.
SLOW_SCENARIOS = ("dtfm_datacenter_spot", "dtfm_regional")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SCENARIOS
                                  else n for n in DTFM_SCENARIOS])
def test_search_beats_the_network_unaware_layout(name):
    p, found = searched(name)
    assert found.cost <= A.consecutive(p).cost + 1e-9
    # The reported cost is the cost of the returned groups.
    assert A.evaluate(p, found.groups).cost == pytest.approx(found.cost)


def test_network_aware_assignment_wins_where_the_network_is_uneven():
    ratios = {name: A.consecutive(searched(name)[0]).cost / searched(name)[1].cost
              for name in ("dtfm_datacenter_ondemand", "dtfm_worldwide")}
    assert ratios["dtfm_datacenter_ondemand"] > 4
    assert ratios["dtfm_worldwide"] > 1.5


def test_search_matches_the_genetic_baseline_on_a_small_world():
    p = A.dtfm_problem(preset("dtfm_worldwide", nodes=2), stages=4, layers=24,
                       layer_params=1.3e9 / 24, seq_len=2048, d_model=2048,
                       sequences_per_pipeline=64)
    ga = A.genetic_search(p, population=8, trials=16, seconds=10)
    assert A.search(p, seconds=10).cost <= ga.cost + 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("name", DTFM_SCENARIOS)
def test_search_matches_the_genetic_baseline_on_dtfm_scenarios(name):
    p, found = searched(name)
    ga = A.genetic_search(p, population=20, trials=100, seconds=60)
    assert found.cost <= ga.cost + 1e-9


def test_device_order_lines_matched_devices_up_across_stages():
    p, a = searched("dtfm_datacenter_ondemand")
    order = np.asarray(a.device_order()).reshape(8, 8)
    assert sorted(order.ravel().tolist()) == list(range(64))
    W = p.pp_pair_cost()
    # Each consecutive pair of stages is joined by a matching that reaches its bottleneck.
    total = 0.0
    for s in range(7):
        edge = max(W[order[s, d], order[s + 1, d]] for d in range(8))
        assert edge == pytest.approx(A.bottleneck_matching(W[np.ix_(order[s], order[s + 1])])[0])
        total += edge
    assert 2 * total == pytest.approx(a.pp_cost)


@pytest.mark.slow
def test_search_on_1024_devices():
    p = A.dtfm_problem(preset("dtfm_datacenter_ondemand", instances=128), stages=8, layers=24,
                       layer_params=1.3e9 / 24, seq_len=2048, d_model=2048,
                       sequences_per_pipeline=4)
    found = A.search(p, seconds=60)
    assert found.cost < A.consecutive(p).cost
    assert sorted(found.device_order()) == list(range(1024))

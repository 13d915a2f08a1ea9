"""NCCL-like collective algorithms (hetjax/planner/collectives.py), each against a hand
computation, and how the cost model uses them."""

import math

import numpy as np
import pytest

from hetjax.planner import collectives as coll
from hetjax.planner.cost import CostModel, CostOptions
from hetjax.core.topology import preset

# 16 ranks on 2 nodes of 8: NIC 1 GB/s, 10 us; NVLink-like 10 GB/s, 1 us.
G16 = coll.Group(p=16, nodes=2, per_node=8, bw=1e9, lat_inter=1e-5, bw_intra=1e10,
                 lat_intra=1e-6)


def test_ring_inside_one_node_is_the_alpha_beta_ring():
    g = coll.Group(8, 1, 8, 1e10, 1e-6, 1e10, 1e-6)
    assert coll.ring_time("all_reduce", 8e9, g) == pytest.approx(14 * (1e-6 + 8e9 / (8 * 1e10)))
    assert coll.ring_time("all_gather", 8e9, g) == pytest.approx(7 * (1e-6 + 0.1))


def test_ring_across_nodes_pays_the_nic_latency_only_on_inter_node_hops():
    # all-reduce: 30 steps of S/16 at 1 GB/s; 2 of them cross nodes (10 us), 28 stay (1 us).
    assert coll.ring_time("all_reduce", 1.6e9, G16) == pytest.approx(
        30 * 1e8 / 1e9 + 28 * 1e-6 + 2 * 1e-5)
    # reduce-scatter: 15 steps, 1 across nodes.
    assert coll.ring_time("reduce_scatter", 1.6e9, G16) == pytest.approx(
        15 * 1e8 / 1e9 + 14 * 1e-6 + 1e-5)


def test_tree_all_reduce_is_chain_in_node_then_binary_tree_across_nodes():
    # S / (0.5 * 0.9 B) + 2 ((k - 1) a_intra + ceil(log2 n) a_inter)
    assert coll.tree_time("all_reduce", 1e6, G16) == pytest.approx(
        1e6 / (0.45 * 1e9) + 2 * (7 * 1e-6 + 1 * 1e-5))
    g = coll.Group(1024, 128, 8, 1e9, 1e-5, 1e10, 1e-6)
    assert coll.tree_time("all_reduce", 1e6, g) == pytest.approx(
        1e6 / 0.45e9 + 2 * (7e-6 + 7 * 1e-5))
    assert coll.tree_time("reduce_scatter", 1e6, G16) == math.inf  # NCCL has no tree for it


def test_algorithm_choice_follows_message_and_group_size():
    g = coll.Group(1024, 128, 8, 1e9, 1e-5, 1e10, 1e-6)
    assert coll.collective_time("all_reduce", 1e4, g)[1] == "tree"  # latency-bound
    assert coll.collective_time("all_reduce", 1e10, g)[1] == "ring"  # bandwidth-bound
    # Few ranks: the ring's few hops beat the tree's lower bandwidth even for small buffers.
    two = coll.Group(2, 2, 1, 1e9, 1e-5, 1e10, 1e-6)
    assert coll.collective_time("all_reduce", 1e6, two)[1] == "ring"
    t, algo = coll.collective_time("all_gather", 1e6, g)
    assert algo == "ring" and t == coll.ring_time("all_gather", 1e6, g)


def test_1024_rank_all_reduce_of_1gb_against_the_flat_ring():
    """128 nodes x 8 A100 on InfiniBand: NCCL's ring moves the same bus bytes as the flat ring
    (busbw = algbw x 2(p-1)/p) but pays the NIC latency on 254 hops, not 2046; at 1 MB the
    tree's 2 (7 + 7) hops win by far."""
    t = preset("holmes_infiniband", nodes=128)
    nic, nvl = t.clusters[0].nic, t.clusters[0].intra_node
    group = np.arange(1024)[None, :]
    nccl = CostModel(t, _model())
    flat = CostModel(t, _model(), CostOptions(collectives="ring"))
    B, a_o, a_i = nic.bytes_per_s, nic.latency_s, nvl.latency_s
    S = 1e9
    assert flat.collective("all_reduce", S, group) == pytest.approx(2046 * (a_o + S / (1024 * B)))
    got, algo = nccl.collective_choice("all_reduce", S, group)
    assert algo == "ring"
    assert got == pytest.approx(2046 / 1024 * S / B + 254 * a_o + 1792 * a_i)
    # The bandwidth term is the same: the difference is the latency, 2046 a_o - 254 a_o - ...
    assert flat.collective("all_reduce", S, group) - got == pytest.approx(
        1792 * (a_o - a_i))
    small, algo = nccl.collective_choice("all_reduce", 1e6, group)
    assert algo == "tree" and small == pytest.approx(1e6 / (0.45 * B) + 2 * (7 * a_i + 7 * a_o))
    assert flat.collective("all_reduce", 1e6, group) > 40 * small


def test_calibrated_link_fits_replace_the_links_per_operation():
    from hetjax.planner.network import LinkFit

    t = preset("holmes_infiniband")
    fit = LinkFit(bandwidth_gbps=8.0, latency_us=100.0)  # 1 GB/s, 100 us
    cm = CostModel(t, _model(), CostOptions(collectives="ring",
                                            link_fits={"infiniband": {"all_gather": fit}}))
    pair = np.array([[0, 8]])  # across nodes: the InfiniBand NIC
    assert cm.collective("all_gather", 1e9, pair) == pytest.approx(1e-4 + 0.5)
    nic = t.clusters[0].nic  # other operations keep the topology's link
    assert cm.collective("all_reduce", 1e9, pair) == pytest.approx(
        2 * (nic.latency_s + 0.5e9 / nic.bytes_per_s))


def _model():
    from hetjax.planner.reference_runs import holmes_model

    return holmes_model()

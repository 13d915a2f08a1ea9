"""Topology additions the planner needs: disconnected clusters and DT-FM's scenario presets."""

import numpy as np
import pytest

from hetjax.errors import TopologyError
from hetjax.core.topology import (DTFM_SCENARIOS, ClusterLink, Link, Topology, make_cluster, preset,
                                  topology_from_json, topology_to_json)


def _three_sites(links):
    return Topology(
        name="sites", inter_cluster=None,
        clusters=tuple(make_cluster(n, 1, 2, "a100", "ethernet") for n in ("a", "b", "c")),
        cluster_links=tuple(ClusterLink(a, b, Link("ethernet", 1.0, 10.0)) for a, b in links))


def test_missing_link_is_a_disconnected_pair():
    t = _three_sites([("a", "b")])
    assert t.disconnected_pairs() == [("a", "c"), ("b", "c")]
    assert t.cluster_components() == [["a", "b"], ["c"]]
    assert t.has_link(0, 1) and not t.has_link(0, 2)
    with pytest.raises(TopologyError, match="no link between clusters 'a' and 'c'"):
        t.link(0, 4)
    bw, lat = t.bandwidth_matrix()
    assert bw[0, 4] == 0 and np.isinf(lat[0, 4]) and bw[0, 2] == 1e9 / 8


def test_connected_through_a_third_site():
    t = _three_sites([("a", "b"), ("b", "c")])
    assert t.disconnected_pairs() == [("a", "c")]
    assert len(t.cluster_components()) == 1


def test_disconnected_topology_round_trips_and_describes():
    t = _three_sites([("a", "b")])
    assert topology_from_json(t.to_json()) == t
    assert topology_from_json(topology_to_json(t)) == t
    assert "a <-> c: no link" in t.describe()


@pytest.mark.parametrize("name", DTFM_SCENARIOS)
def test_dtfm_presets_have_64_connected_devices(name):
    t = preset(name)
    assert t.num_devices == 64
    assert t.disconnected_pairs() == []
    assert topology_from_json(t.to_json()) == t
    assert topology_from_json(topology_to_json(t)) == t


def test_dtfm_worldwide_links_follow_the_paper():
    t = preset("dtfm_worldwide")
    names = [c.name for c in t.clusters]
    tokyo_london = t.cluster_link(names.index("tokyo"), names.index("london"))
    assert (tokyo_london.bandwidth_gbps, tokyo_london.latency_us) == (0.366, 210e3)
    # Inside a city: 2 Gb/s, 5 ms between any two devices.
    assert t.link(0, 1).bandwidth_gbps == 2.0 and t.link(0, 1).latency_us == 5e3


def test_dtfm_spot_has_32_standalone_gpus():
    t = preset("dtfm_datacenter_spot")
    assert sum(c.num_devices == 1 for c in t.clusters) == 32
    assert t.link(0, 1).bandwidth_gbps == 100.0  # inside an instance of 4
    assert t.link(0, 4).bandwidth_gbps == 1.25  # across instances

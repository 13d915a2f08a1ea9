"""Hardware topologies: the data model, the catalogue and the named presets, in one namespace.

    from hetjax.core.topology import Topology, Link, make_cluster, preset
    t = preset("holmes_hybrid", devices_per_node=2)

The ideas live in their own modules: hetjax/core/hardware.py (the data model: Topology, Cluster,
Link, ...), hetjax/core/catalogue.py (nominal accelerators, links and NIC settings),
hetjax/core/topology_file.py (the JSON file a person writes: reading and writing), and the named
topologies in hetjax/core/paper_presets.py (the papers' settings) and hetjax/core/testbed_presets.py
(the testbed's miniatures). This module owns the preset registry (`PRESETS`, `preset`,
`register_preset`) and re-exports the rest. No jax.
"""

from __future__ import annotations

import inspect
from typing import Callable

from hetjax.core.catalogue import (ACCELERATORS, ETH_SETTINGS, IB_SETTINGS, LINK_ALIASES, LINKS,
                                   ROCE_SETTINGS, accelerator, accelerator_for_kind, link,
                                   link_name, make_cluster, nic_settings_for)
from hetjax.errors import TopologyError, TopologyValueError
from hetjax.core.local_preset import local
from hetjax.core.hardware import (HOST_STAGED_BANDWIDTH, HOST_STAGED_LATENCY, LINK_KINDS,
                                  Accelerator, Cluster, ClusterLink, DeviceInfo, Link,
                                  NicSettings, Topology)
from hetjax.core.paper_presets import (DTFM_SCENARIOS, PAPER_PRESETS, cpu_hybrid, cpu_single,
                                  hethub_mixed)
from hetjax.core.testbed_presets import TESTBED_PRESETS
from hetjax.core.topology_file import (read_topology, topology_from_dict, topology_from_json,
                                       topology_to_dict, topology_to_json, write_topology)

# `local`: the devices the running JAX sees (hetjax/core/local_preset.py; JAX imported only then).
PRESETS: dict[str, Callable[..., Topology]] = {**PAPER_PRESETS, **TESTBED_PRESETS, "local": local}


def register_preset(fn: Callable[..., Topology]) -> Callable[..., Topology]:
    """Make a topology builder available by its name to `preset` and topology.preset."""
    PRESETS[fn.__name__] = fn
    return fn


def preset(name: str, **kwargs) -> Topology:
    """Build a registered topology preset, e.g. preset("holmes_hybrid", devices_per_node=2)."""
    if name not in PRESETS:
        raise TopologyError(f"unknown topology preset {name!r}; choose one of: "
                            f"{', '.join(sorted(PRESETS))}")
    try:
        return PRESETS[name](**kwargs)
    except TypeError as e:
        params = ", ".join(inspect.signature(PRESETS[name]).parameters)
        raise TopologyError(f"topology preset {name!r} takes ({params}); {e}") from None


__all__ = [
    "Accelerator", "Cluster", "ClusterLink", "DeviceInfo", "Link", "NicSettings", "Topology",
    "TopologyError", "TopologyValueError",
    "LINK_KINDS", "HOST_STAGED_BANDWIDTH", "HOST_STAGED_LATENCY", "ACCELERATORS", "LINKS",
    "LINK_ALIASES", "link", "link_name", "IB_SETTINGS", "ROCE_SETTINGS", "ETH_SETTINGS",
    "PRESETS", "preset", "register_preset", "make_cluster", "accelerator", "nic_settings_for",
    "accelerator_for_kind", "local",
    "DTFM_SCENARIOS", "cpu_hybrid", "cpu_single", "hethub_mixed",
    "read_topology", "topology_from_dict", "topology_from_json", "topology_to_dict",
    "topology_to_json", "write_topology",
]

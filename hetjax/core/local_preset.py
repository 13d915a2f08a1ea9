"""The `local` topology preset: the devices the running JAX sees, as a Topology.

`topology_from_devices` is plain data in, Topology out (no JAX): each process is a node, its
devices the node's devices, the device kind looked up in the catalogue
(`hetjax.core.catalogue.DEVICE_KINDS`); a kind the catalogue lacks needs its peak and memory stated
(`topology.peak_tflops`, `topology.memory_gib`). `local()` reads `jax.devices()` -- the one
place the topology layer touches JAX, imported only when the preset is built.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from hetjax.core.catalogue import ACCELERATORS, LINKS, accelerator_for_kind, make_cluster
from hetjax.errors import TopologyError
from hetjax.core.hardware import Accelerator, Topology


@dataclass(frozen=True)
class LocalDevice:
    """What JAX reports about one device: its kind, its process and (GPUs) its memory."""

    kind: str
    process_index: int = 0
    platform: str = ""
    memory_bytes: int = 0  # the runtime's bytes_limit, 0 when it does not say


def describe_jax_devices(devices) -> list[LocalDevice]:
    """LocalDevice records of JAX device objects (memory from `memory_stats()` when the
    backend reports it; CPU and some TPU runtimes do not)."""
    out = []
    for d in devices:
        try:
            stats = d.memory_stats() or {}
        except Exception:  # backends without memory statistics raise rather than return None
            stats = {}
        out.append(LocalDevice(kind=d.device_kind, process_index=d.process_index,
                               platform=d.platform, memory_bytes=int(stats.get("bytes_limit", 0))))
    return out


def accelerator_of(devices: Sequence[LocalDevice], peak_tflops: float = 0.0,
                   memory_gib: float = 0.0) -> Accelerator:
    """The catalogue entry of the devices' (single) kind; `peak_tflops` / `memory_gib` > 0
    override it, and are required for a kind the catalogue lacks. Memory defaults to what the
    runtime reports, else the catalogue's figure."""
    kinds = sorted({d.kind for d in devices})
    if len(kinds) > 1:
        raise TopologyError(
            f"the local preset sees several device kinds ({', '.join(kinds)}); it builds one "
            "cluster of one kind: describe the mixed cluster in a JSON topology "
            "(--config.topology.file) instead")
    kind = kinds[0]
    name = accelerator_for_kind(kind)
    if name is None and not (peak_tflops > 0 and memory_gib > 0):
        raise TopologyError(
            f"device kind {kind!r} is not in the hardware catalogue; state its peak dense "
            "bf16 TFLOP/s and memory: --config.topology.peak_tflops=<TFLOP/s> "
            "--config.topology.memory_gib=<GiB> (known kinds: "
            f"{', '.join(sorted(ACCELERATORS))})")
    platform = devices[0].platform
    base = ACCELERATORS[name] if name else Accelerator(
        _slug(kind), peak_tflops, memory_gib, vendor=platform or "unknown")
    reported = min((d.memory_bytes for d in devices), default=0) / 2**30
    return dataclasses.replace(
        base, peak_tflops=peak_tflops or base.peak_tflops,
        memory_gib=memory_gib or reported or base.memory_gib)


def topology_from_devices(devices: Sequence[LocalDevice], peak_tflops: float = 0.0,
                          memory_gib: float = 0.0) -> Topology:
    """One cluster: a node per process, the devices of each process on it."""
    if not devices:
        raise TopologyError("the local preset found no devices")
    per_process = Counter(d.process_index for d in devices)
    counts = sorted(set(per_process.values()))
    if len(counts) > 1:
        raise TopologyError(
            f"the local preset sees processes with different device counts ({counts}); "
            "describe the cluster in a JSON topology (--config.topology.file) instead")
    acc = accelerator_of(devices, peak_tflops, memory_gib)
    cpu = acc.vendor == "cpu"
    # A CPU's "devices" share one process's memory; GPUs in one node talk over NVLink (or
    # PCIe), nodes over the NIC the catalogue assumes for a GPU cluster.
    nic = "ethernet" if cpu or len(per_process) == 1 else "infiniband"
    intra = "nvlink" if acc.vendor == "nvidia" or cpu else "pcie"
    cluster = make_cluster("local", len(per_process), counts[0], acc, nic, intra)
    return Topology(name="local", clusters=(cluster,), inter_cluster=LINKS["ethernet"])


def local(peak_tflops: float = 0.0, memory_gib: float = 0.0) -> Topology:
    """The devices the running JAX sees (all processes', after jax.distributed starts)."""
    import jax

    return topology_from_devices(describe_jax_devices(jax.devices()), peak_tflops, memory_gib)


def _slug(kind: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in kind.strip().lower()).strip("_")


def device_mismatch(topology: Topology, devices: Sequence[LocalDevice]) -> str | None:
    """Why MFU against `topology`'s peak does not describe `devices` (the devices JAX runs
    on): another device count or another kind. None when they agree."""
    seen = Counter(accelerator_for_kind(d.kind) or d.kind for d in devices)
    # catalogue aliases of one chip ('h100' and 'h100_sxm', 'a100' and 'a100_80gb') agree, and
    # so do the CPU kinds the testbed uses to emulate slower accelerators ('cpu_half')
    alias = {"h100": "h100_sxm", "a100": "a100_80gb", "v100_32gb": "v100"}
    planned = Counter()
    for c in topology.clusters:
        acc = c.accelerator
        planned["cpu" if acc.vendor == "cpu" else alias.get(acc.name, acc.name)] += c.num_devices
    if seen == planned:
        return None

    def show(counts):
        return " + ".join(f"{n} x {k}" for k, n in sorted(counts.items()))

    return (f"MFU is measured against the topology's peak ({topology.name}: "
            f"{show(planned)}) but JAX runs on {show(seen)}, so it does not describe these "
            "devices; use --config.topology.preset=local to measure against them")

"""Plan + Topology -> the environment of every process (NCCL NIC settings, XLA flags), and the
link class every parallel group's traffic travels on.

Holmes (spec/holmes.md) gives each parallel group its own NCCL communicator with its own NIC:
TP inside a node, DP on its cluster's RDMA NIC (InfiniBand or RoCE), PP over Ethernet
sockets. Its rule per set of ranks: all in one InfiniBand cluster -> IB settings, all in one
RoCE cluster -> RoCE settings (with the GID index), otherwise sockets.

Stock NCCL cannot do that per group: it reads NCCL_NET, NCCL_IB_HCA, NCCL_IB_GID_INDEX,
NCCL_IB_DISABLE and the socket settings from the environment once per process, when its
network plugin first initialises, and every communicator of the process then uses them.
(NCCL's `ncclConfig_t.netName` can pick the network per communicator, but XLA does not expose
it.) hetjax therefore applies the Holmes rule per *process*: a process runs the devices of one
node, so its ranks lie in one cluster and it gets that cluster's settings. Because hetjax's
placement keeps TP groups inside a node (NVLink, no NIC) and DP groups inside a cluster, the
bulk of the traffic -- TP and DP -- uses exactly the transport Holmes would pick. What cannot
be honoured is a group that leaves its cluster (the PP groups, or DP groups when pp = 1 on
several clusters): its processes talk through their own cluster's NCCL_NET, which works when
the two sides' networks reach each other (both sockets, or one routed RDMA fabric) and fails
between an InfiniBand and a RoCE fabric. `stock_nccl_notes` names such groups; the
"socket" policy (all processes on sockets) is the safe, slower fallback, and a NCCL with
per-communicator NIC selection (Holmes' patch) is the real fix.

On simulated CPU devices the NCCL variables are inert (gloo collectives read none of them);
they are still computed and passed, so an emulated host carries the environment its GPU
counterpart would.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetjax.distributed import ProcessSlot, process_slots
from hetjax.errors import HetjaxError, PlanError
from hetjax.core.hardware import merge_xla_flags, simulated_cpu_flags
from hetjax.core.plan import Plan
from hetjax.core.topology import Topology

RDMA_KINDS = ("infiniband", "roce")
POLICIES = ("cluster", "socket")
GPU_VENDORS = ("nvidia", "amd")  # RCCL reads the same NCCL_* variables
# Socket transport threads: NCCL multiplies them (at most 64 sockets per peer); 4 x 4 fills a
# 25-100 GbE link where the defaults (1 thread, 1 socket on most clouds) leave it idle.
SOCKET_NTHREADS = 4
NSOCKS_PERTHREAD = 4

# XLA flags for overlapping communication with compute on GPU. Each name was checked against
# this jaxlib: XLA rejects an unknown flag in XLA_FLAGS at startup (tests/test_nic.py).
XLA_GPU_FLAGS_ALWAYS = (
    # Schedule asynchronous collectives so they run under independent compute.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # Communication kernels get the highest-priority stream, so compute does not starve them.
    "--xla_gpu_enable_highest_priority_async_stream=true",
    # The layer stack is a scanned while loop: double-buffering lets XLA overlap one layer's
    # collectives with the next layer's compute, and pipelining moves them across iterations.
    "--xla_gpu_enable_while_loop_double_buffering=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    # A NCCL error (a dead peer, a broken link) ends the process instead of hanging it.
    "--xla_gpu_nccl_terminate_on_error=true",
)
XLA_GPU_FLAGS_ZERO = (  # parameters / gradients sharded: all-gather and reduce-scatter per layer
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
)
XLA_GPU_FLAGS_PIPELINE = (  # pp > 1: stage-to-stage sends and receives
    "--xla_gpu_enable_pipelined_p2p=true",
    "--xla_gpu_experimental_pipeline_parallelism_opt_level=PIPELINE_PARALLELISM_OPT_LEVEL_ENABLE",
)


def xla_gpu_flags(plan: Plan) -> tuple[str, ...]:
    """The GPU overlap flags this plan benefits from."""
    flags = XLA_GPU_FLAGS_ALWAYS
    if plan.zero.s_p > 1 or plan.zero.s_g > 1:
        flags += XLA_GPU_FLAGS_ZERO
    if plan.pp > 1:
        flags += XLA_GPU_FLAGS_PIPELINE
    return flags


def simulated_cpu_env(num_devices: int) -> dict[str, str]:
    """A process that stands in for `num_devices` devices with simulated CPU devices."""
    return {"XLA_FLAGS": simulated_cpu_flags(num_devices), "JAX_PLATFORMS": "cpu"}


# --- NCCL settings ---------------------------------------------------------------------------
def transport(topology: Topology, ranks, policy: str = "cluster") -> str:
    """The network Holmes' rule picks for a set of ranks: 'infiniband' or 'roce' when all lie
    in one cluster with that NIC (and the policy allows RDMA), else 'ethernet' (sockets)."""
    if policy not in POLICIES:
        raise HetjaxError(f"NIC policy {policy!r} is unknown; choose 'cluster' (each process "
                          "uses its cluster's NIC) or 'socket' (every process uses sockets)")
    clusters = {topology.devices[r].cluster for r in ranks}
    if policy == "cluster" and len(clusters) == 1:
        kind = topology.clusters[clusters.pop()].nic.kind
        if kind in RDMA_KINDS:
            return kind
    return "ethernet"


def nccl_env(topology: Topology, slot: ProcessSlot, policy: str = "cluster") -> dict[str, str]:
    """NCCL variables for one process: its cluster's RDMA settings, or sockets."""
    clusters = [topology.clusters[c] for c in slot.clusters]
    # NCCL_SOCKET_IFNAME takes a comma list; bootstrap and the socket transport both use it.
    env = {"NCCL_SOCKET_IFNAME": ",".join(dict.fromkeys(c.nic_settings.socket_ifname
                                                        for c in clusters))}
    kind = transport(topology, slot.ranks, policy)
    if kind == "ethernet":
        env.update(NCCL_NET="Socket", NCCL_IB_DISABLE="1",
                   NCCL_SOCKET_NTHREADS=str(SOCKET_NTHREADS),
                   NCCL_NSOCKS_PERTHREAD=str(NSOCKS_PERTHREAD))
        return env
    s = clusters[0].nic_settings
    env.update(NCCL_NET="IB", NCCL_IB_DISABLE="0")
    # Unset values are left to NCCL (it then uses every HCA it finds / its own GID choice).
    if s.hcas:
        env["NCCL_IB_HCA"] = ",".join(s.hcas)
    if kind == "roce" and s.gid_index is not None:
        env["NCCL_IB_GID_INDEX"] = str(s.gid_index)
    if s.gdr_level:
        env["NCCL_NET_GDR_LEVEL"] = s.gdr_level
    return env


def process_environment(topology: Topology, plan: Plan, slot: ProcessSlot,
                        policy: str = "cluster") -> dict[str, str]:
    """Everything hetjax sets for one process: NCCL NIC settings plus XLA flags for its
    accelerator (GPU overlap flags, or the simulated CPU device count)."""
    env = nccl_env(topology, slot, policy)
    vendors = {topology.clusters[c].accelerator.vendor for c in slot.clusters}
    if vendors & set(GPU_VENDORS):
        env["XLA_FLAGS"] = " ".join(xla_gpu_flags(plan))
    elif vendors == {"cpu"}:
        env.update(simulated_cpu_env(slot.num_devices))
    return env


ENV_WORLD = "HETJAX_WORLD"  # this process's world index (multi-world MPMD jobs)
ENV_WORLDS = "HETJAX_WORLDS"  # how many worlds the job has


def world_environment(topology: Topology, plan: Plan, world, slot: ProcessSlot,
                      policy: str = "cluster", num_worlds: int = 1) -> dict[str, str]:
    """`process_environment` for a process of `world` (a `hetjax.planner.worlds.World`): with
    one world per cluster a process's NCCL talks only to processes of its own cluster, so its
    cluster's RDMA settings serve every collective it runs (the stage boundaries between
    worlds go over the bridge, not NCCL)."""
    if slot.index not in world.processes:
        raise PlanError(f"process {slot.index} is not in world {world.index} (its processes "
                        f"are {list(world.processes)})")
    env = process_environment(topology, plan, slot, policy)
    env.update({ENV_WORLD: str(world.index), ENV_WORLDS: str(num_worlds)})
    return env


def merge_environment(base, env: dict[str, str], override: bool) -> dict[str, str]:
    """`base` (a mapping, e.g. os.environ) updated with `env`. XLA_FLAGS merge flag by flag
    (by name); on a clash `env` wins if `override`, else `base` does."""
    out = dict(base)
    for key, value in env.items():
        if key == "XLA_FLAGS":
            out[key] = merge_xla_flags(out.get(key, ""), value, override)
        elif override or key not in out:
            out[key] = value
    return out


# --- which link each group uses --------------------------------------------------------------
@dataclass(frozen=True)
class GroupLink:
    """One parallel group: its ranks, the slowest link class it crosses, and how stock NCCL
    will carry it given its processes' environments."""

    axis: str  # "tp", "dp" or "pp"
    index: int
    ranks: tuple[int, ...]
    link: str  # nvlink / pcie / infiniband / roce / ethernet / loopback
    processes: tuple[int, ...]
    nccl_net: str  # "in-process" (no NIC), or the NCCL_NET values of its processes, e.g. "IB"


def group_links(plan: Plan, topology: Topology, slots=None,
                policy: str = "cluster") -> list[GroupLink]:
    """Every TP, DP and PP group of the plan with its link class (one process per node unless
    `slots` says otherwise); devices the plan leaves out are in no group. With per-stage
    shapes a PP group is a stage boundary's two stages (`Plan.pp_groups`)."""
    if max(plan.device_order) >= topology.num_devices:
        raise PlanError(f"plan uses ranks up to {max(plan.device_order)} but topology "
                        f"{topology.name!r} has {topology.num_devices} devices")
    slots = slots or process_slots(topology, topology.num_nodes)
    owner = {r: s.index for s in slots for r in s.ranks}
    nets = {s.index: nccl_env(topology, s, policy)["NCCL_NET"] for s in slots}
    out = []
    for axis, groups in (("tp", plan.tp_groups()), ("dp", plan.dp_groups()),
                         ("pp", plan.pp_groups())):
        for i, g in enumerate(groups):
            procs = tuple(sorted({owner[r] for r in g}))
            net = "in-process" if len(procs) == 1 else "/".join(
                sorted({nets[p] for p in procs}))
            out.append(GroupLink(axis, i, tuple(g), topology.group_link(g).kind, procs, net))
    return out


def stock_nccl_notes(plan: Plan, topology: Topology, slots=None,
                     policy: str = "cluster") -> list[str]:
    """Groups whose traffic stock NCCL cannot put on the link Holmes would choose (none when
    no cluster has GPUs: CPU devices talk over gloo, never NCCL)."""
    if not any(c.accelerator.vendor in GPU_VENDORS for c in topology.clusters):
        return []
    slots = slots or process_slots(topology, topology.num_nodes)
    links = group_links(plan, topology, slots, policy)
    notes = []
    for axis in ("tp", "dp", "pp"):
        bad = [g for g in links if g.axis == axis and g.nccl_net != "in-process"
               and _expected_net(topology, g.ranks, policy) != g.nccl_net]
        if not bad:
            continue
        g = bad[0]
        clusters = sorted({topology.cluster_of(r).name for r in g.ranks})
        notes.append(
            f"{len(bad)} {axis} group(s), e.g. {list(g.ranks)} across clusters "
            f"{'/'.join(clusters)}, should use sockets over {g.link}, but stock NCCL reads "
            f"NCCL_NET once per process and their processes use {g.nccl_net}: this works only "
            "if those networks reach each other (not between an InfiniBand and a RoCE fabric); "
            "otherwise launch with --nic-policy=socket or use a NCCL with per-communicator NIC "
            "selection")
    return notes


def _expected_net(topology: Topology, ranks, policy: str) -> str:
    return "Socket" if transport(topology, ranks, policy) == "ethernet" else "IB"


def link_report(plan: Plan, topology: Topology, slots=None, policy: str = "cluster",
                full: bool = False) -> str:
    """Per mesh axis, the link classes its groups use (every group if `full`), and the NCCL
    transport their processes' environments select."""
    links = group_links(plan, topology, slots, policy)
    lines = [f"  {'axis':<6}{'groups':<8}{'link':<12}{'NCCL net':<12}ranks"]
    rows: dict[tuple[str, str, str], list[GroupLink]] = {}
    for g in links:
        if len(g.ranks) > 1:  # size-1 axes have no traffic
            rows.setdefault((g.axis, g.link, g.nccl_net), []).append(g)
    for (axis, link, net), gs in rows.items():
        shown = gs if full else gs[:2]
        ranks = " ".join(str(list(g.ranks)) for g in shown) + (" ..." if len(gs) > len(shown)
                                                                else "")
        lines.append(f"  {axis:<6}{len(gs):<8}{link:<12}{net:<12}{ranks}")
    return "links per group\n" + "\n".join(lines)


__all__ = ["process_environment", "world_environment", "ENV_WORLD", "ENV_WORLDS", "nccl_env", "xla_gpu_flags", "simulated_cpu_env",
           "merge_environment", "transport", "GroupLink", "group_links", "stock_nccl_notes",
           "link_report", "POLICIES"]

"""The worker side of a launched job: what a `hetjax train` process started by `hetjax launch`
does to take its place.

`prepare_worker` completes the process's environment (its cluster's NCCL settings; for one
world of a multi-world job, its world's), joins the job (a rendezvous naming absent processes,
then `jax.distributed.initialize`, with the job's `fingerprint` every process must share) and
checks its devices. A SLURM task of a multi-world job first derives its world's variables from
the allocation (`join_slurm_worlds`). `world_worker_env` is the environment the launcher gives
each process and a SLURM task derives for itself.

Each worker writes a heartbeat line (`HEARTBEAT`) to its stderr every second from a daemon
thread (`start_heartbeat`), and `HEARTBEAT_DONE` as it exits normally, so the supervisor
(`hetjax.supervise`) can tell a worker that stopped (SIGSTOP, a hang holding the interpreter, a
frozen host) from one waiting for a peer in a collective.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time

from hetjax import stopping
from hetjax.core.plan import Plan
from hetjax.core.topology import Topology
from hetjax.distributed import (BRIDGE_PORT_OFFSET, DEFAULT_HEARTBEAT_TIMEOUT,
                                DEFAULT_INIT_TIMEOUT, DEFAULT_PORT, ENV_CLUSTER,
                                ENV_HEARTBEAT_TIMEOUT, ENV_INIT_TIMEOUT, DistributedError,
                                ProcessSlot, WorkerSpec, check_host, initialize,
                                process_slots)
from hetjax.errors import HetjaxError
from hetjax.parallel import bridge, nic
from hetjax.planner import plan_from_config
from hetjax.planner.worlds import bridged, idle_processes, plan_worlds


ENV_NIC_POLICY = "HETJAX_NIC_POLICY"
ENV_HEARTBEAT = "HETJAX_HEARTBEAT"  # "1": beat on stderr for the launcher
# The line a worker writes every second, and once more as it exits normally (so a worker that
# finished early is not taken for a hung one). One write(2) each: never torn, though it may land
# between a line's text and its newline (`_pump` joins such a line again).
HEARTBEAT = "<hetjax heartbeat>"
HEARTBEAT_DONE = "<hetjax heartbeat: done>"
HEARTBEAT_INTERVAL_S = 1.0


def fingerprint(cfg, topology: Topology) -> str:
    """A short hash of the job (config + topology), which every process must share."""
    text = cfg.to_json_best_effort(sort_keys=True) + topology.to_json(sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def start_heartbeat(env=None) -> threading.Thread | None:
    """When `$HETJAX_HEARTBEAT` is 1 (the launcher sets it), write `HEARTBEAT` to stderr every
    second from a daemon thread, for as long as this process runs and is not stopped, and
    `HEARTBEAT_DONE` when it exits normally. Otherwise do nothing."""
    env = os.environ if env is None else env
    if env.get(ENV_HEARTBEAT) != "1":
        return None

    def write(line: str) -> None:
        try:
            os.write(2, (line + "\n").encode())
        except OSError:
            pass  # the launcher is gone: nobody is listening

    def beat():
        while True:
            write(HEARTBEAT)
            time.sleep(HEARTBEAT_INTERVAL_S)

    import atexit

    atexit.register(write, HEARTBEAT_DONE)
    thread = threading.Thread(target=beat, name="hetjax-heartbeat", daemon=True)
    thread.start()
    return thread


def prepare_worker(cfg, topology: Topology, spec: WorkerSpec) -> ProcessSlot:
    """Make this process worker `spec.process_id`: complete its environment (values the
    launcher or the user already set win), join the job, and check its devices."""
    if start_heartbeat():  # from now on the launcher can tell a hung worker from a waiting one
        stopping.listen()  # and its Ctrl-C reaches us as a line on stdin
    plan = plan_from_config(cfg, topology)
    policy = os.environ.get(ENV_NIC_POLICY, "cluster")
    if bridge.bridged():  # one world of a bridged job: global slots
        slots = process_slots(topology, len(os.environ[bridge.ENV_BRIDGE_HOSTS].split(",")))
        slot = slots[int(os.environ[bridge.ENV_BRIDGE_RANK])]
        worlds = plan_worlds(plan, topology, slots)
        env = nic.world_environment(topology, plan, worlds[int(os.environ[nic.ENV_WORLD])], slot,
                                    policy, len(worlds))
    else:
        slot = process_slots(topology, spec.num_processes)[spec.process_id]
        env = nic.process_environment(topology, plan, slot, policy)
    os.environ.update(nic.merge_environment(os.environ, env, override=False))
    initialize(spec, fingerprint(cfg, topology))
    import jax

    if jax.local_device_count() != slot.num_devices:
        raise DistributedError(
            f"process {spec.process_id} sees {jax.local_device_count()} local devices but runs "
            f"topology nodes {list(slot.nodes)} with {slot.num_devices} devices; make the "
            "topology's devices_per_node match the hosts (or the simulated device count)")
    return slot


def world_coordinators(worlds, hosts: list[str], port: int | None) -> list[str]:
    """Remote launches (--hostfile, --slurm): each world's coordinator on its first host, on
    consecutive ports from `port` (default DEFAULT_PORT)."""
    return [f"{hosts[w.processes[0]]}:{(port or DEFAULT_PORT) + w.index}" for w in worlds]


def world_worker_env(topology: Topology, plan: Plan, worlds, slot: ProcessSlot,
                     coordinators: list[str], hosts: list[str], bridge_port: int,
                     init_timeout: int, heartbeat_timeout: int, policy: str,
                     joined: bool | None = None) -> dict[str, str]:
    """What hetjax sets for the process of `slot`: its world's coordinator and process id,
    its world's NCCL environment, and (worlds joined by the bridge, `joined`; default: several
    worlds) the bridge's addresses."""
    w = next(w for w in worlds if slot.index in w.processes)
    spec = WorkerSpec(coordinators[w.index], len(w.processes), w.process_id(slot.index),
                      init_timeout, heartbeat_timeout)
    env = {**nic.world_environment(topology, plan, w, slot, policy, len(worlds)),
           **spec.environ(), ENV_NIC_POLICY: policy, ENV_HEARTBEAT: "1"}
    if len(worlds) > 1 if joined is None else joined:
        env.update(bridge.bridge_environ(slot.index, hosts, bridge_port))
        # a world that never comes up is named by its bridge peers after the init timeout
        env[bridge.ENV_BRIDGE_TIMEOUT] = str(init_timeout)
    return env


def expand_nodelist(nodelist: str) -> list[str]:
    """A SLURM node list ('gpu[007-009,012],login1') as host names, in order."""
    hosts, item, depth = [], "", 0
    for ch in nodelist + ",":
        if ch == "," and depth == 0:
            if item:
                hosts += [check_host(h, f"SLURM node list {nodelist!r}")
                          for h in _expand_host(item, nodelist)]
            item = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        item += ch
    return hosts


def _expand_host(item: str, nodelist: str) -> list[str]:
    m = re.fullmatch(r"([^\[\]]*)(?:\[([0-9,\-]+)\]([^\[\]]*))?", item)
    if not m:
        raise HetjaxError(f"SLURM node list {nodelist!r}: cannot read {item!r} (one bracketed "
                          "range per host name is supported)")
    prefix, ranges, suffix = m.groups()
    if ranges is None:
        return [item]
    out = []
    for r in ranges.split(","):
        lo, _, hi = r.partition("-")
        width = len(lo)
        out += [f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def slurm_worlds_environ(cfg, topology: Topology, env=None) -> dict[str, str]:
    """Inside a SLURM task of a multi-world job: the variables `plan_workers` gives the same
    process of a --hostfile launch on the allocation's hosts (its world's coordinator and
    process id, its world's NCCL settings, the bridge's addresses), derived from
    SLURM_PROCID, SLURM_NTASKS and SLURM_STEP_NODELIST -- srun gives every task one
    environment. Empty for a single-world job (JAX's own SLURM detection serves it)."""
    env = os.environ if env is None else env
    if env.get(ENV_CLUSTER) != "slurm":
        return {}
    plan = plan_from_config(cfg, topology)
    if plan.executor != "mpmd" or plan.pp == 1:
        return {}
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or \
        env.get("SLURM_NODELIST")
    try:
        ntasks, procid = int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"])
    except (KeyError, ValueError):
        raise HetjaxError(f"{ENV_CLUSTER}=slurm but SLURM_NTASKS / SLURM_PROCID are missing or "
                          "not integers: start the workers with 'hetjax launch --slurm'") from None
    if not nodelist:
        raise HetjaxError("SLURM_STEP_NODELIST is not set: start the workers with "
                          "'hetjax launch --slurm' inside an allocation")
    hosts = expand_nodelist(nodelist)
    if len(hosts) != ntasks:
        raise HetjaxError(f"SLURM gives {ntasks} tasks on {len(hosts)} nodes ({nodelist}); a "
                          "multi-world job runs one task per node (srun --ntasks-per-node=1)")
    slots = process_slots(topology, ntasks)
    worlds = plan_worlds(plan, topology, slots)
    if not bridged(plan, worlds, slots):
        return {}
    if slots[procid] in idle_processes(plan, slots):
        return {ENV_IDLE: "1"}
    port = int(env.get("JAX_COORDINATOR_PORT") or DEFAULT_PORT)
    return world_worker_env(
        topology, plan, worlds, slots[procid], world_coordinators(worlds, hosts, port), hosts,
        port + BRIDGE_PORT_OFFSET, int(env.get(ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT)),
        int(env.get(ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT)),
        env.get(ENV_NIC_POLICY, "cluster"), True)


# A SLURM task whose devices the plan leaves out, all of them (srun starts every task; the
# other launches do not start such a process): it says so and exits 0 without joining.
ENV_IDLE = "HETJAX_IDLE"


def join_slurm_worlds(cfg, topology: Topology) -> None:
    """A SLURM task of a multi-world job takes its world's place (`slurm_worlds_environ`):
    the variables are set here, and JAX's whole-job SLURM detection is turned off. A task
    whose devices the plan leaves out, all of them, exits here."""
    env = slurm_worlds_environ(cfg, topology)
    if env.get(ENV_IDLE):
        print(f"hetjax: task {os.environ.get('SLURM_PROCID')}: the plan uses none of its "
              "devices; nothing to run", flush=True)
        raise SystemExit(0)
    if env:
        os.environ.update(env)
        os.environ.pop(ENV_CLUSTER)

"""Joining a multi-process JAX job: which devices each process runs, how a worker learns its
place, and a rendezvous that names missing processes before `jax.distributed.initialize`.

One process per topology node is the natural mapping (`DeviceInfo.global_node`); more
generally `process_slots(topology, n)` gives each of n processes `num_nodes / n` consecutive
whole nodes, so a process never splits a node and processes follow rank order, which is also
the order `Topology.jax_devices()` sorts devices in (by process, then id).

A worker learns its place from environment variables the launcher sets (`WorkerSpec`), or
from a SLURM allocation through JAX's own cluster detection. `initialize` first runs a small
TCP rendezvous on the coordinator's port: process 0 waits for every other process to say
hello and, if some never arrive within the timeout, every waiting process fails with a message
naming the missing process ids. Only then is `jax.distributed.initialize` called (on the same
port, now free), because JAX, when a process is missing, aborts the whole interpreter after
its timeout with "DEADLINE_EXCEEDED ... RegisterTask" and no word on who is missing.

This module does not import jax at module level, so the CLI can use it before jax starts.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass

from hetjax.errors import HetjaxError
from hetjax.core.topology import Topology

ENV_COORDINATOR = "HETJAX_COORDINATOR"  # host:port of process 0
ENV_NUM_PROCESSES = "HETJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "HETJAX_PROCESS_ID"
ENV_CLUSTER = "HETJAX_CLUSTER"  # "slurm": take the three above from the SLURM allocation
ENV_INIT_TIMEOUT = "HETJAX_INIT_TIMEOUT"  # seconds to wait for every process to arrive
ENV_HEARTBEAT_TIMEOUT = "HETJAX_HEARTBEAT_TIMEOUT"  # seconds before a silent process is dead

DEFAULT_INIT_TIMEOUT = 300  # JAX's default
# JAX's default is 100 s; a dead host should stop the job sooner than that.
DEFAULT_HEARTBEAT_TIMEOUT = 60
DEFAULT_PORT = 8476  # the coordinator's port for remote launches (hostfile, testbed) when none is given
BRIDGE_PORT_OFFSET = 100  # a multi-world job's bridge control ports start this far above it


class DistributedError(HetjaxError):
    """A multi-process job could not start or lost a process."""


# A host as ssh and srun take it: [user@]name, an IPv4/IPv6 address or a DNS name. It never
# starts with '-' (ssh would read it as an option: `-oProxyCommand=...` runs a command) and
# holds no blank or shell character (a blank would split it into a host and a command).
_HOST_RE = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.+-]*@)?[A-Za-z0-9_\[][A-Za-z0-9_.:%\[\]-]*")


def check_host(host: str, where: str) -> str:
    """`host` if it is a host name (`_HOST_RE`); otherwise a HetjaxError naming `where`."""
    if not _HOST_RE.fullmatch(host):
        raise HetjaxError(f"{where}: {host!r} is not a host name (a host name has letters, "
                          "digits, '.', '-', '_', ':' and an optional user@, and does not start "
                          "with '-'); fix: write one host name per line")
    return host


# --- which process runs which devices ----------------------------------------------------------
@dataclass(frozen=True)
class ProcessSlot:
    """Process `index` of a job: the whole topology nodes it runs, and their ranks."""

    index: int
    nodes: tuple[int, ...]  # global node indices (DeviceInfo.global_node)
    ranks: tuple[int, ...]  # topology ranks of its devices, ascending
    clusters: tuple[int, ...]  # indices of the clusters its nodes belong to

    @property
    def num_devices(self) -> int:
        return len(self.ranks)


def process_slots(topology: Topology, num_processes: int) -> tuple[ProcessSlot, ...]:
    """Split the topology's nodes evenly and in order over `num_processes` processes."""
    nodes = topology.num_nodes
    if not isinstance(num_processes, int) or num_processes < 1 or nodes % num_processes:
        divisors = [d for d in range(1, nodes + 1) if nodes % d == 0]
        raise DistributedError(
            f"{num_processes} processes cannot share the {nodes} nodes of topology "
            f"{topology.name!r}: every process runs whole nodes (a node's devices share one "
            f"process), so the process count must divide the node count. Use one of "
            f"{divisors} ({nodes} = one process per node), or change the topology's "
            "nodes / devices_per_node.")
    per = nodes // num_processes
    slots = []
    for p in range(num_processes):
        mine = range(p * per, (p + 1) * per)
        devs = [d for d in topology.devices if d.global_node in mine]
        slots.append(ProcessSlot(index=p, nodes=tuple(mine), ranks=tuple(d.rank for d in devs),
                                 clusters=tuple(sorted({d.cluster for d in devs}))))
    return tuple(slots)


# --- a worker's place in the job ---------------------------------------------------------------
@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process needs to join the job."""

    coordinator: str  # host:port of process 0
    num_processes: int
    process_id: int
    init_timeout_s: int = DEFAULT_INIT_TIMEOUT
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT

    def __post_init__(self):
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise DistributedError(f"coordinator address {self.coordinator!r} is not HOST:PORT; "
                                   f"set {ENV_COORDINATOR}=host0:8476 (process 0's host)")
        if not 0 <= self.process_id < self.num_processes:
            raise DistributedError(
                f"process id {self.process_id} is outside 0..{self.num_processes - 1}; "
                f"{ENV_PROCESS_ID} must be below {ENV_NUM_PROCESSES}={self.num_processes}")
        if self.init_timeout_s <= 0 or self.heartbeat_timeout_s <= 0:
            raise DistributedError(f"timeouts must be positive seconds, got init "
                                   f"{self.init_timeout_s}, heartbeat {self.heartbeat_timeout_s}")

    @property
    def host(self) -> str:
        return self.coordinator.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.coordinator.rpartition(":")[2])

    def environ(self) -> dict[str, str]:
        """The environment variables that make `hetjax train` join as this process."""
        return {ENV_COORDINATOR: self.coordinator, ENV_NUM_PROCESSES: str(self.num_processes),
                ENV_PROCESS_ID: str(self.process_id),
                ENV_INIT_TIMEOUT: str(self.init_timeout_s),
                ENV_HEARTBEAT_TIMEOUT: str(self.heartbeat_timeout_s)}

    @staticmethod
    def from_environ(env=None) -> "WorkerSpec | None":
        """The spec in `env` (default os.environ); None when this is not a distributed worker."""
        env = os.environ if env is None else env
        timeouts = {"init_timeout_s": _int_env(env, ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT),
                    "heartbeat_timeout_s": _int_env(env, ENV_HEARTBEAT_TIMEOUT,
                                                    DEFAULT_HEARTBEAT_TIMEOUT)}
        if env.get(ENV_CLUSTER):
            return _from_cluster(env, timeouts)
        if ENV_COORDINATOR not in env:
            return None
        return WorkerSpec(coordinator=env[ENV_COORDINATOR],
                          num_processes=_int_env(env, ENV_NUM_PROCESSES, None),
                          process_id=_int_env(env, ENV_PROCESS_ID, None), **timeouts)


def _int_env(env, name: str, default: int | None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise DistributedError(f"{name} is not set; the launcher sets it for every worker "
                                   f"(with {ENV_COORDINATOR})")
        return default
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} is not an integer") from None


def _from_cluster(env, timeouts) -> WorkerSpec:
    """Process id, count and coordinator from a SLURM allocation, via JAX's cluster detection
    (the same parsing `jax.distributed.initialize()` does without arguments)."""
    kind = env[ENV_CLUSTER]
    if kind != "slurm":
        raise DistributedError(f"{ENV_CLUSTER}={kind!r} is unknown; the only cluster kind is "
                               "'slurm'")
    # jax._src.clusters is private, but it is what JAX itself uses to read the allocation;
    # importing it does not start a backend.
    from jax._src.clusters import SlurmCluster

    if not SlurmCluster.is_env_present():
        raise DistributedError(
            f"{ENV_CLUSTER}=slurm but this process is not a SLURM task (SLURM_JOB_ID, "
            "SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID are needed): start "
            "it with srun inside an allocation, e.g. 'hetjax launch --slurm ...'")
    port = env.get("JAX_COORDINATOR_PORT")
    return WorkerSpec(coordinator=env.get(ENV_COORDINATOR) or
                      SlurmCluster.get_coordinator_address(timeouts["init_timeout_s"], port),
                      num_processes=SlurmCluster.get_process_count(),
                      process_id=SlurmCluster.get_process_id(), **timeouts)


# --- rendezvous ------------------------------------------------------------------------------
def rendezvous(spec: WorkerSpec, fingerprint: str = "") -> None:
    """Wait until every process of the job is up, or fail naming the ones that are not.

    Process 0 listens on the coordinator port; the others connect (retrying until the
    deadline, since process 0 may start last) and send their id, host, pid and a fingerprint
    of their job (config + topology), which must agree. Process 0 answers "go" once all have
    arrived; on timeout it tells the ones that did arrive who is missing, so every waiting
    process fails with the same message.
    """
    deadline = time.monotonic() + spec.init_timeout_s
    if spec.process_id == 0:
        _coordinate(spec, fingerprint, deadline)
    else:
        _join(spec, fingerprint, deadline)


def _send(conn: socket.socket, msg: dict) -> None:
    conn.sendall((json.dumps(msg) + "\n").encode())


def _recv(conn: socket.socket, deadline: float) -> dict | None:
    """One JSON line from conn, or None on EOF / deadline."""
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(left)
        try:
            chunk = conn.recv(4096)
        except (socket.timeout, OSError):
            return None
        if not chunk:
            return None
        buf += chunk
    try:
        return json.loads(buf)
    except ValueError:
        return None


def _fmt_ids(ids) -> str:
    ids = sorted(ids)
    return ("process " if len(ids) == 1 else "processes ") + ", ".join(map(str, ids))


def _coordinate(spec: WorkerSpec, fingerprint: str, deadline: float) -> None:
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    try:
        server = socket.create_server(("", spec.port), family=family,
                                      dualstack_ipv6=family == socket.AF_INET6)
    except OSError as e:
        raise DistributedError(f"process 0 cannot listen on port {spec.port} ({e}); pick a free "
                               "port for the coordinator (hetjax launch --port)") from None
    peers: list[tuple[socket.socket, dict]] = []
    problem = None
    try:
        while len(peers) < spec.num_processes - 1 and problem is None:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except socket.timeout:
                break
            hello = _recv(conn, min(deadline, time.monotonic() + 10))
            if not hello or "process_id" not in hello:
                conn.close()  # not one of ours (a port scan, a stale client)
                continue
            problem = _hello_problem(spec, fingerprint, hello, {h["process_id"] for _, h in peers})
            peers.append((conn, hello))
        missing = sorted(set(range(1, spec.num_processes)) - {h["process_id"] for _, h in peers})
        if problem is None and missing:
            came = "".join(f", {h['process_id']} on {h['host']}"
                           for _, h in sorted(peers, key=lambda x: x[1]["process_id"]))
            problem = (f"{_fmt_ids(missing)} of {spec.num_processes} never arrived at the "
                       f"coordinator {spec.coordinator} within {spec.init_timeout_s} s "
                       f"(arrived: 0 on {socket.gethostname()}{came}). Check that they were "
                       "started and can reach this host and port, or allow more time "
                       "(hetjax launch --init-timeout)")
        for conn, _ in peers:
            try:
                _send(conn, {"error": problem} if problem else {"go": True})
            except OSError:
                pass
        # Let the peers close first, so this port is free for JAX's service right away.
        for conn, _ in peers:
            _recv(conn, time.monotonic() + 5)
            conn.close()
    finally:
        server.close()
    if problem:
        raise DistributedError(f"process 0: {problem}")


def _hello_problem(spec: WorkerSpec, fingerprint: str, hello: dict, seen: set[int]) -> str | None:
    """Why a peer's hello does not fit this job (None if it does)."""
    pid, host = hello["process_id"], hello.get("host")
    if hello.get("num_processes") != spec.num_processes:
        return (f"process {pid} on {host} expects {hello.get('num_processes')} processes, "
                f"process 0 expects {spec.num_processes}; start every process with the same count")
    if hello.get("fingerprint") != fingerprint:
        return (f"process {pid} on {host} runs a different job (its config or topology differs "
                "from process 0's); start every process with the same config")
    if pid in seen or pid == 0:
        return (f"two processes claim process id {pid} (one on {host}); every process needs "
                "its own id")
    return None


def _join(spec: WorkerSpec, fingerprint: str, deadline: float) -> None:
    hello = {"process_id": spec.process_id, "num_processes": spec.num_processes,
             "host": socket.gethostname(), "pid": os.getpid(), "fingerprint": fingerprint}
    conn = None
    while conn is None:
        try:
            conn = socket.create_connection((spec.host, spec.port),
                                            timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        except OSError:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"process {spec.process_id}: the coordinator (process 0 at "
                    f"{spec.coordinator}) never answered within {spec.init_timeout_s} s; "
                    "check that process 0 was started and that this host can reach it") from None
            time.sleep(0.5)
    with conn:
        _send(conn, hello)
        # Process 0 answers when everyone is there or its own deadline passed; allow a little
        # longer than ours because it may have started later.
        answer = _recv(conn, deadline + 30)
    if answer is None:
        raise DistributedError(f"process {spec.process_id}: the coordinator at "
                               f"{spec.coordinator} stopped answering during the rendezvous")
    if "error" in answer:
        raise DistributedError(f"process {spec.process_id}: {answer['error']}")


# --- joining --------------------------------------------------------------------------------
def initialize(spec: WorkerSpec, fingerprint: str = "") -> None:
    """Rendezvous, then `jax.distributed.initialize` with gloo CPU collectives and the spec's
    timeouts. Call before anything touches a JAX backend."""
    rendezvous(spec, fingerprint)
    import jax

    # gloo is this jax's default; set it anyway, a cross-process CPU run needs it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service catches SIGTERM and only records it for a training loop that
    # polls sync points; hetjax does not poll, so the process would ignore SIGTERM (a launcher
    # stopping the job, scancel). Without the service SIGTERM ends the process as usual.
    jax.config.update("jax_enable_preemption_service", False)
    # All four of coordinator, count, id given and detection off: on SLURM JAX would otherwise
    # restrict each process to one GPU (SLURM_LOCALID); hetjax runs one process per node.
    jax.distributed.initialize(
        spec.coordinator, spec.num_processes, spec.process_id,
        cluster_detection_method="deactivate",
        initialization_timeout=spec.init_timeout_s,
        heartbeat_timeout_seconds=spec.heartbeat_timeout_s,
        # A finishing process waits this long at the shutdown barrier for the others.
        shutdown_timeout_seconds=spec.heartbeat_timeout_s)


# --- free ports (launches on one machine pick them; the DiLoCo bridge too) ----------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def free_port_block(n: int) -> int:
    """A port p with p .. p + n - 1 free now (the bridge's control ports on one machine)."""
    for _ in range(100):
        base = free_port()
        if base + n > 65535:
            continue
        try:
            socks = []
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise HetjaxError(f"found no {n} consecutive free ports for the bridge")


__all__ = ["ProcessSlot", "process_slots", "WorkerSpec", "DistributedError", "rendezvous",
           "initialize", "free_port", "free_port_block", "DEFAULT_PORT", "BRIDGE_PORT_OFFSET"]

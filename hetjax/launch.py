"""`hetjax launch`: run one training job as several `jax.distributed` processes.

    hetjax launch --local 4 --config.train.steps=100       # 4 processes on this machine
    hetjax launch --hostfile hosts.txt --config=...         # one process per host, over ssh
    hetjax launch --slurm --config=...                      # inside an allocation, via srun
    hetjax launch ... --dry-run                             # print command lines, run nothing

Each process runs the topology nodes `process_slots` gives it (one node per process on a real
cluster) with the environment `hetjax.parallel.nic.process_environment` computes for it: its
cluster's NCCL NIC settings and XLA flags; with `--local`, also its share of simulated CPU
devices. Workers are plain `hetjax train` processes that find their place in HETJAX_*
variables and join through `prepare_worker` (a rendezvous naming absent processes, then
`jax.distributed.initialize`). Under SLURM, srun cannot give each task its own environment, so
every task computes its own from the allocation.

The launcher supervises what it starts: each line a process prints (stdout and stderr read
apart, so a library's C++ log line never lands inside a Python one) is prefixed with its id;
third-party noise (gloo's per-rank connection lines, `is_noise`) is hidden unless `--verbose`;
when one process fails, the others get SIGTERM and, after `--grace` seconds, SIGKILL (a peer
may sit in a collective with the dead one forever); the exit code is the first failure's.
`--max-restarts N` then starts the job again (it resumes from its checkpoint), and `--elastic`
does so without the failed process's host, re-planned on the topology left.

Which process failed is decided by progress, not by the first exit code: each worker writes a
heartbeat line (`HEARTBEAT`) to its stderr every second from a daemon thread, and the launcher
takes it out of the output it already reads -- through the pipe of a local worker, ssh's
stdout/stderr of a remote one, or srun's `--label`led stream (the label names the task). A
worker that stops (SIGSTOP, a hang holding the interpreter, a frozen host) stops beating; its
healthy peers keep beating while they wait for it in a collective, until JAX's own heartbeat
check aborts one of them. The launcher blames the worker whose heartbeat stopped -- also when a
peer's abort is the first exit -- and stops the job itself once a heartbeat is
`--heartbeat-timeout` seconds old, so `--elastic` drops the host that hung, not the coordinator
that noticed.

Ctrl-C (SIGINT) or SIGTERM to the launcher reaches every worker as a stop line on its stdin
(what ssh and srun forward); the workers agree on a step to stop at (`hetjax.stopping`), each
saves it, and the launcher waits for them (a second signal stops them at once). SIGTERM sent
to the workers themselves -- a scheduler preempting or cancelling the job signals every task --
does the same: the first worker to exit 75 (or 130) after saving tells the launcher that the
job is stopping, and it waits for the others to save the same step instead of stopping them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from hetjax import config as hconfig
from hetjax import stopping
from hetjax.argv import CALIBRATE_FLAGS, CALIBRATE_OPTIONS, default_job_path, take_options
from hetjax.corpus_size import check_corpus_size
from hetjax.distributed import (BRIDGE_PORT_OFFSET, DEFAULT_HEARTBEAT_TIMEOUT,
                                DEFAULT_INIT_TIMEOUT, DEFAULT_PORT, ENV_CLUSTER,
                                ENV_HEARTBEAT_TIMEOUT, ENV_INIT_TIMEOUT, DistributedError,
                                ProcessSlot, WorkerSpec, free_port, free_port_block, initialize,
                                process_slots)
from hetjax.errors import HetjaxError
from hetjax.core.plan import Plan
from hetjax.planner import plan_from_config
from hetjax.planner.worlds import plan_worlds, world_lines
from hetjax.core.topology import Topology
from hetjax.parallel import bridge, nic

ENV_NIC_POLICY = "HETJAX_NIC_POLICY"
ENV_HEARTBEAT = "HETJAX_HEARTBEAT"  # "1": beat on stderr for the launcher
# The line a worker writes every second, and once more as it exits normally (so a worker that
# finished early is not taken for a hung one). One write(2) each: never torn, though it may land
# between a line's text and its newline (`_pump` joins such a line again).
HEARTBEAT = "<hetjax heartbeat>"
HEARTBEAT_DONE = "<hetjax heartbeat: done>"
_HEARTBEAT_RE = re.compile(r"<hetjax heartbeat(: done)?>")
# srun --label puts the task number before each line of a task's output.
_SRUN_LABEL = re.compile(r"^\s*(\d+): ")
HEARTBEAT_INTERVAL_S = 1.0
# A heartbeat this old means the worker has stopped (a live one beats every second).
STALLED_AFTER_S = 4.0
DEFAULT_RSH = "ssh -o BatchMode=yes {host}"
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the worker side ---------------------------------------------------------------------------
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
    if int(os.environ.get(nic.ENV_WORLDS, "1")) > 1:  # one world of several: global slots
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


# --- what to start -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Worker:
    """One process to start: where, with which hetjax-set variables, and the command."""

    slot: ProcessSlot
    host: str
    env: dict[str, str]  # what hetjax sets for this process
    # The worker as one shell command line, environment included ("cd DIR && env K=V ...
    # python -m hetjax train ..."): what a remote shell (ssh, a testbed host) runs.
    shell: str
    argv: tuple[str, ...]  # what the launcher executes (locally, or the remote shell)
    local: bool  # True: argv runs here with env added to ours; False: argv is rsh + shell

    @property
    def index(self) -> int:
        return self.slot.index


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


def read_hostfile(path: str) -> list[str]:
    """Hosts in process order, one per line (# comments and blank lines ignored); a line that
    is not one host name is refused (`check_host`)."""
    try:
        with open(path) as f:
            lines = [line.split("#", 1)[0].strip() for line in f]
    except OSError as e:
        raise HetjaxError(f"cannot read the hostfile {path!r}: {e.strerror}") from None
    hosts = [check_host(h, f"hostfile {path!r} line {n}") for n, h in enumerate(lines, 1) if h]
    if not hosts:
        raise HetjaxError(f"the hostfile {path!r} lists no hosts; write one host per line, in "
                          "the topology's node order (process i runs node i)")
    return hosts


def worker_command(python: str, config_args, command: str = "train",
                   options: tuple[str, ...] = ()) -> list[str]:
    """A worker's command line; `options` are the command's own flags (calibrate's)."""
    return [python, "-u", "-m", "hetjax", command, *options, *config_args]


def plan_workers(cfg, topology: Topology, plan: Plan, args, config_args) -> list[Worker]:
    """The processes of a --local or --hostfile launch: one jax.distributed job, or, for an
    MPMD plan whose stages sit on several fabrics or accelerator kinds, one job per world
    (`hetjax.planner.worlds`), each with its own coordinator, plus the bridge's addresses."""
    if args.local is not None:
        hosts = ["127.0.0.1"] * args.local
    else:
        hosts = read_hostfile(args.hostfile)
    slots = process_slots(topology, len(hosts))
    worlds = plan_worlds(plan, topology, slots)
    if len(worlds) == 1:
        coordinators = [f"127.0.0.1:{args.port or free_port()}" if args.local is not None else
                        args.coordinator or f"{hosts[0]}:{args.port or DEFAULT_PORT}"]
    elif args.local is not None:
        coordinators = [f"127.0.0.1:{args.port + w.index if args.port else free_port()}"
                        for w in worlds]
    else:
        coordinators = world_coordinators(worlds, hosts, args.port)
    bridge_port = (args.port or DEFAULT_PORT) + BRIDGE_PORT_OFFSET if args.local is None else free_port_block(
        len(hosts))
    workers = []
    for slot, host in zip(slots, hosts):
        env = world_worker_env(topology, plan, worlds, slot, coordinators, hosts, bridge_port,
                               args.init_timeout, args.heartbeat_timeout, args.nic_policy)
        cmd = worker_command(args.python, config_args, getattr(args, "command", "train"),
                             getattr(args, "worker_options", ()))
        local = args.local is not None
        if local:
            env.update(nic.simulated_cpu_env(slot.num_devices))
            # The workers import the hetjax this launcher runs, wherever it was found.
            paths = [PACKAGE_ROOT, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
            env["PYTHONPATH"] = os.pathsep.join(p for p in dict.fromkeys(paths) if p)
        shell = f"cd {shlex.quote(args.chdir)} && env {_env_prefix(env)} {shlex.join(cmd)}"
        argv = cmd if local else rsh_argv(args.rsh, host) + [shell]
        workers.append(Worker(slot, host, env, shell, tuple(argv), local))
    return workers


def rsh_argv(template: str, host: str) -> list[str]:
    """The remote-shell command for `host`: the --rsh template split into words first, then
    {host} put into its word, so a host is only ever one word (and `check_host` one that is
    not an option)."""
    return [word.replace("{host}", host) for word in shlex.split(template)]


def world_coordinators(worlds, hosts: list[str], port: int | None) -> list[str]:
    """Remote launches (--hostfile, --slurm): each world's coordinator on its first host, on
    consecutive ports from `port` (default DEFAULT_PORT)."""
    return [f"{hosts[w.processes[0]]}:{(port or DEFAULT_PORT) + w.index}" for w in worlds]


def world_worker_env(topology: Topology, plan: Plan, worlds, slot: ProcessSlot,
                     coordinators: list[str], hosts: list[str], bridge_port: int,
                     init_timeout: int, heartbeat_timeout: int, policy: str) -> dict[str, str]:
    """What hetjax sets for the process of `slot`: its world's coordinator and process id,
    its world's NCCL environment, and (several worlds) the bridge's addresses."""
    w = next(w for w in worlds if slot.index in w.processes)
    spec = WorkerSpec(coordinators[w.index], len(w.processes), w.process_id(slot.index),
                      init_timeout, heartbeat_timeout)
    env = {**nic.world_environment(topology, plan, w, slot, policy, len(worlds)),
           **spec.environ(), ENV_NIC_POLICY: policy, ENV_HEARTBEAT: "1"}
    if len(worlds) > 1:
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
    if len(worlds) == 1:
        return {}
    port = int(env.get("JAX_COORDINATOR_PORT") or DEFAULT_PORT)
    return world_worker_env(
        topology, plan, worlds, slots[procid], world_coordinators(worlds, hosts, port), hosts,
        port + BRIDGE_PORT_OFFSET, int(env.get(ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT)),
        int(env.get(ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT)),
        env.get(ENV_NIC_POLICY, "cluster"))


def join_slurm_worlds(cfg, topology: Topology) -> None:
    """A SLURM task of a multi-world job takes its world's place (`slurm_worlds_environ`):
    the variables are set here, and JAX's whole-job SLURM detection is turned off."""
    env = slurm_worlds_environ(cfg, topology)
    if env:
        os.environ.update(env)
        os.environ.pop(ENV_CLUSTER)


def slurm_launch(topology: Topology, args, config_args) -> tuple[list[str], dict[str, str],
                                                                  tuple[ProcessSlot, ...]]:
    """The srun command for a launch inside a SLURM allocation, the variables it adds for all
    tasks, and the process slots (one task per allocated node)."""
    nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
    if not os.environ.get("SLURM_JOB_ID") or not nodes:
        raise HetjaxError("--slurm needs a SLURM allocation (SLURM_JOB_ID and "
                          "SLURM_JOB_NUM_NODES are not set): run it inside sbatch or salloc")
    slots = process_slots(topology, int(nodes))
    env = {ENV_HEARTBEAT: "1", ENV_CLUSTER: "slurm", ENV_INIT_TIMEOUT: str(args.init_timeout),
           ENV_HEARTBEAT_TIMEOUT: str(args.heartbeat_timeout), ENV_NIC_POLICY: args.nic_policy}
    if args.port:
        env["JAX_COORDINATOR_PORT"] = str(args.port)  # JAX's SLURM detection honours it
    n = len(slots)
    cmd = ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
           "--kill-on-bad-exit=1", "--label",
           *worker_command(args.python, config_args, getattr(args, "command", "train"),
                             getattr(args, "worker_options", ()))]
    return cmd, env, slots


# --- describing a launch -------------------------------------------------------------------------
def describe(topology: Topology, plan: Plan, slots, hosts, policy: str) -> str:
    """Which process runs what, with its NIC settings, and the link report."""
    lines = [f"{len(slots)} processes for topology {topology.name!r} "
             f"({topology.num_nodes} nodes, {topology.num_devices} devices), NIC policy "
             f"{policy!r}",
             f"  {'process':<9}{'host':<18}{'nodes':<8}{'ranks':<10}{'cluster':<10}NCCL settings"]
    for slot, host in zip(slots, hosts):
        env = nic.nccl_env(topology, slot, policy)
        shown = " ".join(f"{k}={v}" for k, v in env.items() if k != "NCCL_SOCKET_IFNAME")
        clusters = ",".join(topology.clusters[c].name for c in slot.clusters)
        lines.append(f"  {slot.index:<9}{host:<18}{_span(slot.nodes):<8}{_span(slot.ranks):<10}"
                     f"{clusters:<10}{shown} NCCL_SOCKET_IFNAME={env['NCCL_SOCKET_IFNAME']}")
    lines.append(nic.link_report(plan, topology, slots, policy))
    lines += [f"  note: {n}" for n in nic.stock_nccl_notes(plan, topology, slots, policy)]
    return "\n".join(lines)


def _span(xs) -> str:
    return f"{xs[0]}-{xs[-1]}" if len(xs) > 1 else str(xs[0])


def _env_prefix(env: dict[str, str]) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())


# --- running and supervising -------------------------------------------------------------------
# Children start through this small exec wrapper rather than a `preexec_fn`: a `preexec_fn`
# forces a real fork() of the launcher, which fails with ENOMEM when the launcher is a large
# JAX process (a notebook, a pytest worker) on a machine without much free memory; without it
# Python uses vfork(). The wrapper asks for SIGKILL when its parent dies (kept across exec),
# then checks the parent is still the launcher (it may have died before prctl ran).
_ORPHAN_GUARD = ("import ctypes, os, sys\n"
                 "ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
                 "if os.getppid() != int(sys.argv[1]): sys.exit(137)\n"
                 "try: os.execvp(sys.argv[2], sys.argv[2:])\n"
                 "except OSError as e: sys.exit(f'could not start {sys.argv[2]!r}: {e.strerror}')\n")


def _guarded(argv: tuple[str, ...]) -> tuple[str, ...]:
    """`argv` run so that it gets SIGKILL if the launcher dies, so nothing is orphaned."""
    if not sys.platform.startswith("linux"):
        return argv
    return (sys.executable, "-S", "-c", _ORPHAN_GUARD, str(os.getpid()), *argv)


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _how(rc: int) -> str:
    if rc < 0:
        return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with code {rc}"


# Worker output lines hidden unless --verbose: third-party logs that say nothing the launcher
# does not. gloo prints "[Gloo] Rank N is connected to M peer ranks. Expected number of
# connected peer ranks is : M" once per rank, from several threads without a lock, so its
# messages arrive cut and interleaved ("[Gloo] Rank [Gloo] Rank 1 is connected ..."): a line
# is gloo's when nothing is left of it once these pieces are taken out.
GLOO_PIECES = re.compile(r"\[Gloo\] Rank|\d+ is connected to \d+ peer ranks|"
                         r"Expected number of connected peer ranks is\s*:\s*\d+")


def is_noise(text: str) -> bool:
    """A worker output line (without its [pN] prefix) made only of gloo's connection lines."""
    return bool(GLOO_PIECES.search(text)) and not GLOO_PIECES.sub("", text).strip(" .\t")


def run(children: list[tuple[str, tuple[str, ...], dict[str, str] | None]], grace: float,
        timeout: float = 0, out=None, failed: list | None = None,
        verbose: bool = False, hang_timeout: float = 0, labelled: bool = False,
        stop_line: bool = True) -> int:
    """Start `children` ((name, argv, env)), prefix each line of their output with their name
    (gloo noise, `is_noise`, hidden unless `verbose`), and stop them all when one fails
    (SIGTERM, then SIGKILL after `grace` s), when a worker's heartbeat is `hang_timeout` s old
    (0: never) or after `timeout` s (0: no limit). `labelled`: the one child is srun, whose
    output lines begin with the task's `--label`; task N is the worker pN. Returns 0, or the
    exit code of the first failure (128 + signal; 1 for a hang), whose name is appended to
    `failed`: the worker whose heartbeat stopped, when one did, rather than the peer that exited
    first. With `stop_line` (training workers), Ctrl-C (KeyboardInterrupt) or SIGTERM sends each
    child `STOP_LINE` and the signal's name on its stdin (the workers save an agreed step and
    exit 130, or 75) and waits for them; a second signal (or the first, without `stop_line`)
    stops them at once."""
    out = out or sys.stdout
    children = list(children)
    lock = threading.Lock()
    hidden = [0]
    last_beat: dict[str, float] = {}  # worker -> time.monotonic() of its latest heartbeat
    finished: set[str] = set()  # workers that said they exit normally
    owner: dict[str, int] = {}  # worker -> the child whose output carries its heartbeat

    def say(line: str, worker: bool = False) -> None:
        if worker and not verbose and is_noise(line.split("] ", 1)[-1]):
            hidden[0] += 1
            return
        with lock:
            out.write(line + "\n")
            out.flush()

    def beat(child: int, worker: str, done: bool) -> None:
        with lock:
            owner[worker] = child
            if done:
                finished.add(worker)
            else:
                last_beat[worker] = time.monotonic()

    names = [name for name, _, _ in children]
    procs: list[subprocess.Popen] = []
    try:
        for name, argv, env in children:
            procs.append(subprocess.Popen(
                _guarded(argv), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True))
            say(f"hetjax launch: started {name} (pid {procs[-1].pid})")
    except OSError as e:
        _stop(procs, grace)
        raise HetjaxError(f"could not start {children[len(procs)][1][0]!r}: {e.strerror}") from None
    # Threads start only after every fork: forking while other threads run is unsafe.
    exits: queue.Queue = queue.Queue()
    pumps = [threading.Thread(target=_pump, args=(stream, f"[{n}] ", say,
                                                  lambda w, d, i=i: beat(i, w, d), labelled, n),
                              daemon=True)
             for i, (n, p) in enumerate(zip(names, procs)) for stream in (p.stdout, p.stderr)]
    for i, p in enumerate(procs):
        threading.Thread(target=lambda i, p: exits.put((i, p.wait())), args=(i, p),
                         daemon=True).start()
    for pump in pumps:
        pump.start()

    running = set(range(len(procs)))
    failure = None  # (name or None for the timeout, exit code, how) of the first failure
    kill_at = float("inf")
    stopping_on = None  # "SIGINT"/"SIGTERM" once passed on: the workers save and stop
    passed_on = False  # this launcher got Ctrl-C or SIGTERM and passed it on (a second one kills)
    stopped: list[str] = []  # the workers that then saved and stopped

    def stalled(exited: int = -1) -> tuple[str, float] | None:
        """The worker whose heartbeat is oldest, if older than STALLED_AFTER_S: of the running
        children's workers (and of those `exited` carried, other than itself: srun's tasks)."""
        now = time.monotonic()
        with lock:
            ages = [(now - t, w) for w, t in last_beat.items() if w not in finished
                    and (owner[w] in running or owner[w] == exited)
                    and (exited < 0 or w != names[exited])]
        age, w = max(ages, default=(0.0, ""))
        return (w, age) if age > STALLED_AFTER_S else None

    def where(worker: str) -> str:
        j = owner[worker]
        return f"srun task {worker[1:]}" if worker != names[j] else f"pid {procs[j].pid}"
    end = time.monotonic() + timeout if timeout else float("inf")

    def stop_all(reason: str) -> None:
        nonlocal kill_at
        rest = ", ".join(names[j] for j in sorted(running))
        say(f"hetjax launch: {reason}" + (f"; stopping {rest}" if rest else ""))
        _signal([procs[j] for j in running], signal.SIGTERM)
        kill_at = time.monotonic() + grace

    previous = (signal.signal(signal.SIGTERM, _terminate)  # stop the children, like Ctrl-C
                if threading.current_thread() is threading.main_thread() else None)
    try:
        while running:
            try:
                try:
                    i, rc = exits.get(timeout=0.2)
                except queue.Empty:
                    pass
                else:
                    running.discard(i)
                    if stopping_on and rc in (75, 130):  # saved and stopped, as asked
                        stopped.append(names[i])
                    elif rc in (75, 130) and stop_line and failure is None:
                        # Signalled itself (a scheduler preempting the job sends SIGTERM to
                        # every task): the workers agree on a step and save it, as on a stop
                        # line from here, so wait for the others rather than stop them.
                        stopping_on = "SIGTERM" if rc == 75 else "SIGINT"
                        stopped.append(names[i])
                        rest = ", ".join(names[j] for j in sorted(running))
                        say(f"hetjax launch: {names[i]} "
                            f"{'was preempted (SIGTERM)' if rc == 75 else 'was interrupted'} and "
                            "saved" + (f"; waiting for {rest} to save the same step" if rest else ""))
                    elif rc != 0 and failure is None:
                        hung = stalled(exited=i)
                        if hung is not None:  # a peer it waited for stopped first: blame it
                            w, age = hung
                            failure = (w, 1, "stopped making progress")
                            stop_all(f"{w} ({where(w)}) stopped making progress (no heartbeat "
                                     f"for {age:.0f} s), then {names[i]} {_how(rc)}")
                        else:
                            failure = (names[i], rc, _how(rc))
                            stop_all(f"{names[i]} (pid {procs[i].pid}) {_how(rc)}")
                if failure is None and hang_timeout:
                    hung = stalled()
                    if hung is not None and hung[1] > hang_timeout:
                        w, age = hung
                        failure = (w, 1, "stopped making progress")
                        stop_all(f"{w} ({where(w)}) stopped making progress: no heartbeat for "
                                 f"{age:.0f} s (--heartbeat-timeout {hang_timeout:g})")
                if failure is None and time.monotonic() > end:
                    failure = (None, 124, "")
                    stop_all(f"the job ran longer than --timeout {timeout:g} s")
                if running and time.monotonic() > kill_at:
                    say(f"hetjax launch: {', '.join(names[j] for j in sorted(running))} still "
                        f"running {grace:g} s after SIGTERM; sending SIGKILL")
                    _signal([procs[j] for j in running], signal.SIGKILL)
                    kill_at = float("inf")
            except KeyboardInterrupt as e:
                if passed_on or failure is not None or not stop_line:
                    raise  # a second signal: the finally stops them at once
                passed_on = True
                if stopping_on:  # the workers, signalled too, are saving already
                    continue
                stopping_on = "SIGTERM" if isinstance(e, _Terminated) else "SIGINT"
                rest = ", ".join(names[j] for j in sorted(running))
                how = "interrupted" if stopping_on == "SIGINT" else "preempted (SIGTERM)"
                say(f"hetjax launch: {how}: asking {rest} to save the step they agree on "
                    f"and stop ({'Ctrl-C' if stopping_on == 'SIGINT' else 'SIGTERM'} again "
                    "stops them at once, losing the steps since the latest checkpoint)")
                for j in running:
                    _tell(procs[j], f"{STOP_LINE} {stopping_on}")
    finally:
        if running:  # interrupted again, SIGTERM to the launcher: take the children along
            _stop([procs[j] for j in running], grace)
        for t in pumps:
            t.join(timeout=5)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if hidden[0]:
        say(f"hetjax launch: hid {hidden[0]} gloo connection lines (--verbose shows them)")
    if failure is None:
        if stopping_on and stopped:  # (the job may have completed before the stop step)
            say(f"hetjax launch: {'interrupted' if stopping_on == 'SIGINT' else 'preempted'}; "
                "the workers stopped as they said above; rerun the same command to resume")
            return 130 if stopping_on == "SIGINT" else 75
        return 0
    name, rc, how = failure
    if name is not None:
        say(f"hetjax launch: failed: {name} {how} first")
        if failed is not None:
            failed.append(name)
    return _exit_code(rc)


# Exit codes a restart cannot help: success, a user error (exit 2), a preemption the worker
# saved for (75: the scheduler wants the job gone), the --timeout, an interrupt.
NO_RESTART = (0, 2, 75, 124, 130)


def run_with_restarts(make_children, grace: float, timeout: float = 0, max_restarts: int = 0,
                      out=None, verbose: bool = False, hang_timeout: float = 0,
                      labelled: bool = False, stop_line: bool = True) -> int:
    """`run` the children `make_children(failed)` returns; after a failure, start them afresh
    up to `max_restarts` times (workers resume from the job's latest checkpoint). `failed` lists
    the names of the processes that failed first in earlier attempts. Returns the last
    attempt's exit code."""
    out = out or sys.stdout
    failed: list[str] = []
    for attempt in range(max_restarts + 1):
        rc = run(make_children(failed), grace, timeout, out, failed, verbose, hang_timeout,
                 labelled, stop_line)
        if rc in NO_RESTART or attempt == max_restarts:
            return rc
        out.write(f"hetjax launch: restarting the job ({attempt + 1} of --max-restarts "
                  f"{max_restarts}) after exit code {rc}; it resumes from its latest "
                  "checkpoint\n")
        out.flush()
    return rc


class _Terminated(KeyboardInterrupt):
    """SIGTERM to the launcher: stop the children now (a scheduler wants the job gone)."""


def _terminate(signum, frame):
    raise _Terminated


# What the launcher writes on a worker's stdin on Ctrl-C (over ssh too; should only one worker
# read it, as under `srun --input=0`, the workers' agreement tells the others).
STOP_LINE = stopping.STOP_LINE


def _tell(proc: subprocess.Popen, line: str) -> None:
    try:
        proc.stdin.write((line + "\n").encode())
        proc.stdin.flush()
    except (OSError, ValueError):  # it has exited (a broken pipe) or closed its stdin
        pass


def _pump(stream, prefix: str, say, beat, labelled: bool = False, name: str = "") -> None:
    """One prefixed line per line of `stream`; of a line redrawn with carriage returns (a
    progress bar), its last state. Heartbeat lines are taken out and reported as
    `beat(worker, done)`: the worker is `name`, or with `labelled` (srun) p<its task label>."""
    cut: dict[str, str] = {}  # label -> text a heartbeat landed after, before its newline
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n").rsplit("\r", 1)[-1]
        label, m = "", _SRUN_LABEL.match(line) if labelled else None
        if m:
            label, line = m.group(0), line[m.end():]
        h = _HEARTBEAT_RE.search(line)
        if h:
            beat(f"p{int(m.group(1))}" if m else name, bool(h.group(1)))
            if h.start():  # it cut a line: the rest of that line is the next line
                cut[label] = cut.get(label, "") + line[:h.start()]
            continue
        say(prefix + label + cut.pop(label, "") + line, worker=True)
    stream.close()


def _signal(procs, sig) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, sig)  # the child leads its own session: take its children too
        except ProcessLookupError:
            pass


def _stop(procs, grace: float) -> None:
    """SIGTERM, wait up to `grace` s, then SIGKILL whatever still runs."""
    alive = [p for p in procs if p.poll() is None]
    _signal(alive, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _signal([p for p in alive if p.poll() is None], signal.SIGKILL)
    for p in alive:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # stuck in the kernel; nothing more we can do
            pass


# --- the command -------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hetjax launch", allow_abbrev=False,
        usage="hetjax launch (--local N | --hostfile FILE | --slurm) [options] "
              "[--config=FILE] [--config.SECTION.FIELD=VALUE ...]",
        description="Start one training job as several jax.distributed processes, each with "
                    "its cluster's NIC environment. The --config flags are passed to every "
                    "'hetjax train' worker.")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--local", type=int, metavar="N",
                      help="N processes on this machine with simulated CPU devices")
    mode.add_argument("--hostfile", metavar="FILE",
                      help="one process per host listed (in topology node order), via --rsh")
    mode.add_argument("--slurm", action="store_true",
                      help="inside a SLURM allocation: one srun task per node")
    p.add_argument("--port", type=int, default=0,
                   help=f"coordinator port (default: a free one for --local, {DEFAULT_PORT} for "
                        "--hostfile, JAX's job-id port for --slurm)")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="process 0's address as the other hosts reach it (--hostfile; default: "
                        "the first host)")
    p.add_argument("--init-timeout", type=int, default=DEFAULT_INIT_TIMEOUT, metavar="S",
                   help="seconds to wait for every process to arrive (default %(default)s)")
    p.add_argument("--heartbeat-timeout", type=int, default=DEFAULT_HEARTBEAT_TIMEOUT,
                   metavar="S", help="seconds of silence after which JAX declares a process "
                                     "dead and stops the others (default %(default)s)")
    p.add_argument("--grace", type=float, default=10.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping (default %(default)s)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="after a worker fails, restart the whole job up to N times; it "
                        "resumes from its latest checkpoint (default 0)")
    p.add_argument("--elastic", action="store_true",
                   help="with --max-restarts: restart without the host whose process failed, "
                        "re-planned (parallel.* chosen by the planner) on the remaining "
                        "topology; training resumes from the plan-independent checkpoint")
    p.add_argument("--timeout", type=float, default=0, metavar="S",
                   help="stop the job after S seconds (default 0: no limit)")
    p.add_argument("--nic-policy", choices=nic.POLICIES, default="cluster",
                   help="cluster: each process uses its cluster's NIC (default); socket: all use "
                        "sockets (when cross-cluster groups join fabrics that cannot talk)")
    p.add_argument("--rsh", default=DEFAULT_RSH, metavar="TEMPLATE",
                   help="how to run a command on a host; {host} is replaced and the command "
                        "is appended as one argument (default: '%(default)s')")
    p.add_argument("--python", default=sys.executable,
                   help="python of the workers (default: this one, %(default)s)")
    p.add_argument("--chdir", default=os.getcwd(), metavar="DIR",
                   help="working directory on the hosts (default: this one)")
    p.add_argument("--command", choices=("train", "calibrate"), default="train",
                   help="what every worker runs: 'hetjax train' (default) or 'hetjax "
                        "calibrate' (writes <workdir>/calibration.json)")
    p.add_argument("--verbose", action="store_true",
                   help="also show third-party noise in the workers' output (gloo's "
                        "connection lines; tfds's and absl's, as 'hetjax train --verbose')")
    p.add_argument("--dry-run", action="store_true",
                   help="print each process's command line and environment; start nothing")
    return p


def main(argv: list[str]) -> int:
    args, config_args = parser().parse_known_args(argv)
    if args.command == "calibrate":  # calibrate's own flags go to every worker as given
        flags = tuple(a for a in config_args if a in CALIBRATE_FLAGS)  # --quick
        opts, config_args = take_options([a for a in config_args if a not in flags],
                                         CALIBRATE_OPTIONS)
        args.worker_options = flags + tuple(f"--{k}={v}" for k, v in opts.items())
    if args.verbose:  # the workers show their own third-party noise too (tfds, absl)
        args.worker_options = (*getattr(args, "worker_options", ()), "--verbose")
    stray = [a for a in config_args if not a.startswith("--config")]
    if stray:
        raise HetjaxError(f"hetjax launch does not know {stray}; its own flags are listed by "
                          "'hetjax launch --help', and training settings are --config flags")
    if args.max_restarts < 0:
        raise HetjaxError(f"--max-restarts {args.max_restarts}: give a number >= 0")
    if args.elastic and (args.slurm or not args.max_restarts):
        raise HetjaxError("--elastic re-plans at a restart: use it with --max-restarts N >= 1 "
                          "and --local or --hostfile (under SLURM, resubmit with fewer nodes)")
    if args.coordinator:
        check_host(args.coordinator.rpartition(":")[0] or args.coordinator, "--coordinator")
    if args.local is not None and args.local < 1:
        raise HetjaxError(f"--local {args.local}: give the number of processes (>= 1)")
    for name in ("init_timeout", "heartbeat_timeout"):
        if getattr(args, name) <= 0:
            raise HetjaxError(f"--{name.replace('_', '-')} must be a positive number of seconds")
    cfg = hconfig.load_config(next((a.split("=", 1)[1] for a in config_args
                                    if a.startswith("--config=")), None) or default_job_path(),
                              [a for a in config_args if a.startswith("--config.")])
    hconfig.validate(cfg)
    check_corpus_size(cfg)  # a corpus too small fails here too, not once per worker
    topology = hconfig.build_topology(cfg)
    plan = plan_from_config(cfg, topology)  # a bad layout fails here, before any process starts

    if args.slurm:
        cmd, env, slots = slurm_launch(topology, args, config_args)
        print(describe(topology, plan, slots, [f"task {s.index}" for s in slots],
                       args.nic_policy))
        if plan.executor == "mpmd" and plan.pp > 1:  # each task derives its world itself
            for line in world_lines(plan, topology, lambda w, slot: nic.world_environment(
                    topology, plan, w, slot, args.nic_policy), slots):
                print(line, flush=True)
        print(f"srun tasks compute their own environment; hetjax adds for all: "
              f"{_env_prefix(env)}")
        if args.dry_run:
            print(f"{_env_prefix(env)} {shlex.join(cmd)}")
            return 0
        return run_with_restarts(lambda _: [("srun", tuple(cmd), {**os.environ, **env})],
                                 args.grace, args.timeout, args.max_restarts,
                                 verbose=args.verbose, hang_timeout=args.heartbeat_timeout,
                                 labelled=True, stop_line=args.command == "train")

    workers = plan_workers(cfg, topology, plan, args, config_args)
    print(describe(topology, plan, [w.slot for w in workers], [w.host for w in workers],
                   args.nic_policy), flush=True)
    if plan.executor == "mpmd" and plan.pp > 1:
        for line in world_lines(plan, topology, lambda w, slot: nic.world_environment(
                topology, plan, w, slot, args.nic_policy), tuple(w.slot for w in workers)):
            print(line, flush=True)
    if args.dry_run:
        for w in workers:
            print(f"# process {w.index} on {w.host}")
            print(w.shell if w.local else shlex.join(w.argv))
        return 0

    def children(failed: list[str]):
        # Fresh workers per attempt: a --local restart takes a new free coordinator port.
        ws = workers
        if failed and args.elastic:
            ws = elastic_workers(cfg, args, config_args, failed)
        elif failed:
            ws = plan_workers(cfg, topology, plan, args, config_args)
        return [(f"p{w.index}", w.argv,
                 nic.merge_environment(os.environ, w.env, override=True) if w.local else None)
                for w in ws]

    return run_with_restarts(children, args.grace, args.timeout, args.max_restarts,
                             verbose=args.verbose, hang_timeout=args.heartbeat_timeout,
                             stop_line=args.command == "train")  # calibrate: stop at once


def elastic_workers(cfg, args, config_args, failed: list[str]) -> list[Worker]:
    """The workers of an elastic restart: the hosts of the processes in `failed` (names of
    the launches so far, each numbered in its own launch) are dropped, the topology loses
    their nodes, and the planner chooses the layout for what is left. The reduced topology
    and hostfile are written into the workdir for the workers to read."""
    hosts = ["127.0.0.1"] * args.local if args.local is not None else read_hostfile(args.hostfile)
    topology = hconfig.build_topology(cfg)
    for name in failed:  # replay the drops in order: process numbers shift after each
        slot = process_slots(topology, len(hosts))[int(name[1:])]
        topology = topology.without_nodes(slot.nodes)
        hosts.pop(slot.index)
    if not hosts:
        raise HetjaxError("--elastic: every host has failed; nothing is left to run on")
    os.makedirs(cfg.workdir, exist_ok=True)
    topo_file = os.path.abspath(os.path.join(cfg.workdir, "elastic_topology.json"))
    with open(topo_file, "w") as f:
        f.write(topology.to_json(indent=1))
    default = hconfig.base_config()
    extra = [f"--config.topology.file={topo_file}",
             f"--config.topology.preset={default.topology.preset}",
             "--config.topology.nodes=0", "--config.topology.devices_per_node=0",
             "--config.parallel.pp=0", "--config.parallel.dp=0", "--config.parallel.tp=0",
             "--config.pipeline.stage_layers=()"]
    config_args = [*config_args, *extra]
    new_cfg = hconfig.load_config(next((a.split("=", 1)[1] for a in config_args
                                        if a.startswith("--config=")), None),
                                  [a for a in config_args if a.startswith("--config.")])
    hconfig.validate(new_cfg)
    plan = plan_from_config(new_cfg, topology)  # a clear error if nothing fits the rest
    new_args = argparse.Namespace(**vars(args))
    if args.local is not None:
        new_args.local = len(hosts)
    else:
        new_args.hostfile = os.path.join(os.path.dirname(topo_file), "elastic_hosts.txt")
        with open(new_args.hostfile, "w") as f:
            f.write("\n".join(hosts) + "\n")
    print(f"hetjax launch: --elastic: dropped {', '.join(failed)}; re-planned on "
          f"{topology.num_devices} devices:\n{topology.describe()}\n{plan.describe(topology)}",
          flush=True)
    return plan_workers(new_cfg, topology, plan, new_args, config_args)


__all__ = ["main", "prepare_worker", "plan_workers", "slurm_launch", "slurm_worlds_environ",
           "join_slurm_worlds", "expand_nodelist", "run", "run_with_restarts",
           "describe",
           "read_hostfile", "fingerprint", "Worker"]

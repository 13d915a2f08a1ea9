"""`hetjax launch`: what to start for one training job of several `jax.distributed` processes.

    hetjax launch --local 4 --config.train.steps=100       # 4 processes on this machine
    hetjax launch --hostfile hosts.txt --config=...         # one process per host, over ssh
    hetjax launch --slurm --config=...                      # inside an allocation, via srun
    hetjax launch ... --dry-run                             # print command lines, run nothing

Each process runs the topology nodes `process_slots` gives it (one node per process on a real
cluster) with the environment `hetjax.parallel.nic.process_environment` computes for it: its
cluster's NCCL NIC settings and XLA flags; with `--local`, also its share of simulated CPU
devices. Workers are plain `hetjax train` processes that find their place in HETJAX_*
variables and join through `hetjax.worker.prepare_worker`. Under SLURM, srun cannot give each
task its own environment, so every task computes its own from the allocation
(`hetjax.worker.join_slurm_worlds`).

This module plans the processes (`plan_workers`, `slurm_launch`, `elastic_workers`: an
`--elastic` restart without the failed process's host, re-planned on the topology left),
describes them, and hands them to the supervisor (`hetjax.supervise.run_with_restarts`), which
starts them, prefixes and filters their output, stops the job when one fails or hangs, and
restarts it up to `--max-restarts` times.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass

from hetjax import config as hconfig
from hetjax.argv import CALIBRATE_FLAGS, CALIBRATE_OPTIONS, default_job_path, take_options
from hetjax.core.plan import Plan
from hetjax.core.topology import Topology
from hetjax.corpus_size import check_corpus_size
from hetjax.distributed import (BRIDGE_PORT_OFFSET, DEFAULT_HEARTBEAT_TIMEOUT,
                                DEFAULT_INIT_TIMEOUT, DEFAULT_PORT, ENV_CLUSTER,
                                ENV_HEARTBEAT_TIMEOUT, ENV_INIT_TIMEOUT, ProcessSlot, free_port,
                                check_host, free_port_block, process_slots)
from hetjax.errors import HetjaxError
from hetjax.parallel import nic
from hetjax.planner import plan_from_config
from hetjax.planner.worlds import (bridged, bridged_shape_problem, idle_problem,
                                   idle_processes, plan_worlds, world_lines)
from hetjax.supervise import run_with_restarts
from hetjax.worker import ENV_HEARTBEAT, ENV_NIC_POLICY, world_coordinators, world_worker_env


DEFAULT_RSH = "ssh -o BatchMode=yes {host}"
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def read_hosts(args) -> list[str]:
    """The hosts of a --local (this machine, N times) or --hostfile launch, in process order."""
    return ["127.0.0.1"] * args.local if args.local is not None else read_hostfile(args.hostfile)


def worker_command(python: str, config_args, command: str = "train",
                   options: tuple[str, ...] = ()) -> list[str]:
    """A worker's command line; `options` are the command's own flags (calibrate's)."""
    return [python, "-u", "-m", "hetjax", command, *options, *config_args]


def plan_workers(cfg, topology: Topology, plan: Plan, args, config_args) -> list[Worker]:
    """The processes of a --local or --hostfile launch: one jax.distributed job, or, for an
    MPMD plan whose stages sit on several fabrics or accelerator kinds, one job per world
    (`hetjax.planner.worlds`), each with its own coordinator, plus the bridge's addresses."""
    hosts = read_hosts(args)
    slots = process_slots(topology, len(hosts))
    worlds = plan_worlds(plan, topology, slots)
    idle = idle_processes(plan, slots)  # not started: the plan uses none of their devices
    problem = idle_problem(plan, idle) or bridged_shape_problem(plan, topology, slots)
    if problem:
        raise HetjaxError(problem)
    joined = bridged(plan, worlds, slots)
    if not joined:
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
        if slot in idle:
            continue
        env = world_worker_env(topology, plan, worlds, slot, coordinators, hosts, bridge_port,
                               args.init_timeout, args.heartbeat_timeout, args.nic_policy,
                               joined)
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
    given = next((a.split("=", 1)[1] for a in config_args if a.startswith("--config=")), None)
    cfg = hconfig.load_config(given or default_job_path(),
                              [a for a in config_args if a.startswith("--config.")],
                              default_job=given is None)
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
    started = {w.index for w in workers}
    for slot in process_slots(topology, len(read_hosts(args))):
        if slot.index not in started:
            print(f"process {slot.index} (topology nodes {list(slot.nodes)}) is not started: "
                  "the plan uses none of its devices", flush=True)
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
    hosts = read_hosts(args)
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
             "--config.pipeline.stage_layers=()", "--config.parallel.stage_dp=()",
             "--config.parallel.stage_tp=()", "--config.parallel.exclude=()"]
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


__all__ = ["main", "plan_workers", "slurm_launch", "elastic_workers", "describe",
           "read_hostfile", "Worker"]

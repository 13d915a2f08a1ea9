"""An emulated heterogeneous cluster on one machine: one network namespace per topology node.

`Testbed(topology, scale=..., cpus=...)` turns every node of a `Topology` into an emulated
host: a network namespace whose `eth0` is one end of a veth pair. The other ends hang on one
bridge that lives in a switch namespace of its own, so nothing is added to the machine's own
network namespace. Cluster i is the subnet 10.77.i.0/24 (node n of it is 10.77.i.(n+1)), so a
host's egress can be shaped per destination with tc: one htb class per destination cluster,
picked by a u32 filter on the destination subnet, at the cluster's NIC rate (own cluster) or
the inter-cluster rate (other clusters, honouring per-pair overrides). Every rate is the
topology's rate times one `scale`, so their ratios stay. Optionally each host's processes get a
cgroup v1 CPU quota, standing in for a slower accelerator. `tb.run(host, argv)` starts a
process inside a host, in its own UTS and mount namespace: the hostname is the host's name and
a private /etc/hosts maps every emulated host to its address, which is what gloo and
jax.distributed bind to.

Limits: only bandwidth is emulated. This kernel has no netem, and no fq or etf qdisc (which a
BPF earliest-departure-time delay would need), so links keep the veth's own latency (tens of
microseconds); the configured latencies are reported, not applied. Ingress is not shaped (a
host receiving from several peers at once can exceed its NIC rate), each destination cluster
is a pipe of its own, the bridge has no capacity limit, and htb counts Ethernet/IP/TCP headers,
so TCP goodput is about 4% below the configured rate. One host per node: devices inside a node
share that host's process, so intra-node links are not shaped.

Everything created is named hjtb-<id>-... and removed on exit, on error and on SIGINT/SIGTERM;
`cleanup()` (`hetjax testbed down`) removes what a killed run left behind.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from hetjax.distributed import DEFAULT_PORT
from hetjax.errors import HetjaxError
from hetjax.core.topology import Link, Topology

PREFIX = "hjtb-"
NET = "10.77"  # private /16; cluster i is NET.i.0/24
DEFAULT_SCALE = 1 / 500  # InfiniBand 200 Gb/s -> 400 Mbit/s, 25 GbE -> 50 Mbit/s
MAX_HOSTS = 64  # each host is a namespace plus at least one process on a small machine
# Unshaped veth moved about 13 Gbit/s here; above a few Gbit/s the endpoints, not htb, set the
# pace and the ratios between link classes would be lost. Below 1 Mbit/s every run crawls.
MAX_RATE_BPS = 4e9
MIN_RATE_BPS = 1e6
# CPU caps hand out cpus x period of CPU time per period, so a timed sample of a few hundred
# ms sees its periods' quotas give or take one. 10 ms periods would make samples steadier, but
# cost the machine 0.1-0.2 CPUs of kernel work and made training steps 5-15% slower than
# 100 ms periods (all-fast, side by side); calibration averages samples instead (measure.py).
CFS_PERIOD_US = 100_000
CGROUP_CPU = "/sys/fs/cgroup/cpu"
STATE_ROOT = tempfile.gettempdir()
IFACE = "eth0"


# --- the emulated cluster as plain data (no root needed) -----------------------------------------
@dataclass(frozen=True)
class Host:
    """One emulated host: a topology node with its namespace, hostname and address."""

    index: int  # node index over the whole topology (Topology.devices' global_node)
    name: str  # hostname inside the host, e.g. "ib-0"
    cluster: int
    node: int
    address: str
    netns: str


@dataclass(frozen=True)
class EgressClass:
    """One htb class on a host's egress: traffic to one destination cluster."""

    classid: str  # "1:2"
    dst_cluster: int
    subnet: str  # "10.77.1.0/24"
    link: Link  # the topology's link, unscaled
    rate_bps: int  # scaled rate, bits per second


@dataclass(frozen=True)
class TrainingRun:
    """What a `hetjax train` run inside the testbed did (`Testbed.train`)."""

    returncode: int
    seconds: float  # wall time, start-up and compilation included
    metrics: tuple[dict, ...]  # rows of the run's metrics.jsonl (written by process 0)
    # Bytes each host sent through each of its egress classes during the run:
    # {host name: {destination cluster: bytes}}
    traffic: dict[str, dict[int, int]]
    output: str  # what the run printed (the launcher prefixes each worker's lines)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and any("step_s" in m for m in self.metrics)

    def step_times(self, skip: int = 1) -> list[float]:
        """Seconds per step of the logged steps after the first (which includes compiling)
        and `skip` more warm-up steps. Log every step (train.log_every=1) to get each."""
        rows = [m for m in self.metrics if "step_s" in m]
        return [m["step_s"] for m in rows[skip:]]

    def error(self) -> str:
        """The last lines the run printed, for a failed run's report."""
        return "\n".join(self.output.strip().splitlines()[-15:])


def cluster_subnet(cluster: int) -> str:
    return f"{NET}.{cluster}.0/24"


def _hostnames(topology: Topology) -> list[str]:
    """`<cluster>-<node>` as a valid hostname; cluster indices if names clash after cleaning."""
    def clean(s):
        return re.sub(r"[^a-z0-9-]+", "-", s.lower()).strip("-") or "c"

    names = [f"{clean(c.name)}-{n}" for c in topology.clusters for n in range(c.nodes)]
    if len(set(names)) == len(names):
        return names
    return [f"c{ci}-{n}" for ci, c in enumerate(topology.clusters) for n in range(c.nodes)]


def layout(topology: Topology, run_id: str) -> tuple[Host, ...]:
    """One host per topology node; cluster i gets NET.i.0/24 so u32 can match it by prefix."""
    if topology.num_nodes > MAX_HOSTS:
        raise HetjaxError(
            f"topology {topology.name!r} has {topology.num_nodes} nodes, but the testbed "
            f"emulates one host (a network namespace and its processes) per node and allows at "
            f"most {MAX_HOSTS} on one machine; use fewer nodes per cluster, e.g. "
            "--config.topology.nodes=2")
    names = _hostnames(topology)
    hosts, i = [], 0
    for ci, c in enumerate(topology.clusters):
        for n in range(c.nodes):
            hosts.append(Host(i, names[i], ci, n, f"{NET}.{ci}.{n + 1}",
                              f"{PREFIX}{run_id}-h{i}"))
            i += 1
    return tuple(hosts)


def scaled_rate(link: Link, scale: float) -> int:
    """The link's rate in bit/s times `scale`, refused where shaping would not be faithful."""
    full = link.bandwidth_gbps * 1e9
    bps = full * scale
    what = f"the {link.kind} link ({link.bandwidth_gbps:g} Gb/s) scaled by {scale:g} is"
    if bps > MAX_RATE_BPS:
        raise HetjaxError(
            f"{what} {bps / 1e6:g} Mbit/s, more than the {MAX_RATE_BPS / 1e6:g} Mbit/s veth "
            f"links can be shaped to faithfully here; use a scale <= {MAX_RATE_BPS / full:.3g}")
    if bps < MIN_RATE_BPS:
        raise HetjaxError(
            f"{what} {bps / 1e6:g} Mbit/s, below the {MIN_RATE_BPS / 1e6:g} Mbit/s the testbed "
            f"allows (runs would crawl); use a scale >= {MIN_RATE_BPS / full:.3g}")
    return round(bps)


def egress_classes(topology: Topology, cluster: int, scale: float) -> tuple[EgressClass, ...]:
    """The htb classes of a host in `cluster`: its own cluster at the NIC rate, others at the
    inter-cluster rate of that pair."""
    if not 0 < scale <= 1:
        raise HetjaxError(f"testbed scale must be in (0, 1], got {scale}; it multiplies every "
                          f"link rate of the topology (default {DEFAULT_SCALE:g})")
    out = []
    for dst in range(len(topology.clusters)):
        lk = (topology.clusters[cluster].nic if dst == cluster
              else topology.cluster_link(cluster, dst))
        out.append(EgressClass(f"1:{dst + 1:x}", dst, cluster_subnet(dst), lk,
                               scaled_rate(lk, scale)))
    return tuple(out)


def tc_commands(host: Host, classes: Sequence[EgressClass]) -> list[list[str]]:
    """The tc command lines that shape `host`'s egress (run in its namespace)."""
    tc = ["tc", "-n", host.netns]
    # No `default` class: unmatched traffic (ARP) leaves unshaped.
    cmds = [tc + ["qdisc", "add", "dev", IFACE, "root", "handle", "1:", "htb"]]
    for c in classes:
        # An explicit burst of >= 1 ms of traffic (and one 64 KiB TSO segment): tc's default,
        # derived from the timer tick, under-delivers at Gbit/s rates. Quantum only matters when
        # classes borrow, which they do not (ceil = rate); a fixed one avoids htb's warnings.
        burst = str(max(64 * 1024, c.rate_bps // 8 // 1000))
        cmds.append(tc + ["class", "add", "dev", IFACE, "parent", "1:", "classid", c.classid,
                          "htb", "rate", f"{c.rate_bps}bit", "ceil", f"{c.rate_bps}bit",
                          "burst", burst, "cburst", burst, "quantum", "60000"])
        cmds.append(tc + ["filter", "add", "dev", IFACE, "parent", "1:", "protocol", "ip",
                          "prio", "1", "u32", "match", "ip", "dst", c.subnet,
                          "flowid", c.classid])
    return cmds


def parse_cpus(text: str) -> float | dict[str, float]:
    """`--cpus` as given on the command line: "1.5" or "ib:1,roce:0.5"."""
    try:
        if ":" not in text:
            return float(text)
        return {k.strip(): float(v) for k, v in (part.split(":") for part in text.split(","))}
    except ValueError:
        raise HetjaxError(f"--cpus={text!r} is not a number of CPUs per host (e.g. --cpus=1) "
                          "nor a list of CLUSTER:CPUS (e.g. --cpus=ib:1,roce:0.5)") from None


def cpu_quotas(topology: Topology, cpus: float | Mapping[str, float] | None) -> dict[int, float]:
    """CPUs per host for each capped cluster (by index).

    `cpus` is None (no caps), a number (hosts of the fastest accelerator kind get that many
    CPUs, the others proportionally fewer by peak_tflops), or {cluster name: CPUs per host}
    (clusters not named run uncapped).
    """
    if cpus is None:
        return {}
    if isinstance(cpus, Mapping):
        names = [c.name for c in topology.clusters]
        unknown = [k for k in cpus if k not in names]
        if unknown:
            raise HetjaxError(f"CPU quota names cluster(s) {unknown} that topology "
                              f"{topology.name!r} does not have; its clusters are {names}")
        quotas = {names.index(k): float(v) for k, v in cpus.items()}
    else:
        fastest = max(c.accelerator.peak_tflops for c in topology.clusters)
        quotas = {ci: float(cpus) * c.accelerator.peak_tflops / fastest
                  for ci, c in enumerate(topology.clusters)}
    for ci, q in quotas.items():
        if q < 0.01:  # the kernel's smallest quota is 1 ms per 100 ms period
            raise HetjaxError(
                f"cluster {topology.clusters[ci].name!r} would get {q:g} CPUs per host; a CPU "
                "quota must be at least 0.01 CPUs; give more CPUs (e.g. --cpus=1)")
    return quotas


def hosts_file(hosts: Sequence[Host]) -> str:
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost"]
    lines += [f"{h.address} {h.name}" for h in hosts]
    return "\n".join(lines) + "\n"


def host_command(host: Host, argv: Sequence[str], hosts_path: str,
                 cgroup_procs: str | None = None) -> list[str]:
    """argv wrapped to run inside `host`: its network namespace, its own UTS namespace (the
    hostname) and mount namespace (the private /etc/hosts), and its CPU cgroup if any."""
    if not argv:
        raise HetjaxError("Testbed.run needs a command to run, e.g. ['python', '-c', '...']")
    q = shlex.quote
    steps = [f"echo $$ > {q(cgroup_procs)}"] if cgroup_procs else []
    # nsenter, not `ip netns exec`: that remounts /sys, which hides /sys/fs/cgroup.
    steps += [f"printf %s {q(host.name)} > /proc/sys/kernel/hostname",
              f"mount --bind {q(hosts_path)} /etc/hosts", 'exec "$@"']
    return ["nsenter", f"--net=/run/netns/{host.netns}", "unshare", "--uts", "--mount", "--",
            "sh", "-c", " && ".join(steps), f"{PREFIX}{host.name}", *argv]


def rsh_script(run_id: str, commands: Mapping[str, Sequence[str]], pythonpath: str) -> str:
    """A shell script `rsh HOST COMMAND` that runs COMMAND (with sh -c) inside emulated host
    HOST: what `hetjax launch --hostfile ... --rsh '<script> {host}'` uses instead of ssh.

    `commands` maps each host name to its wrapper (`host_command(host, ["sh", "-c"])`); the
    command follows as the last argument. PYTHONPATH gets `pythonpath` (this checkout) first,
    as `Testbed.run` does, so workers import the launcher's hetjax."""
    q = shlex.quote
    lines = ["#!/bin/sh",
             f"# rsh HOST COMMAND: run COMMAND in emulated host HOST of testbed {run_id}",
             f"PYTHONPATH={q(pythonpath)}${{PYTHONPATH:+:$PYTHONPATH}}",
             "export PYTHONPATH",
             'if [ $# -ne 2 ]; then echo "usage: $0 HOST COMMAND" >&2; exit 2; fi',
             'case "$1" in']
    for name, wrapper in commands.items():
        lines.append(f'  {q(name)}) exec {shlex.join(wrapper)} "$2" ;;')
    lines += [f'  *) echo "testbed {run_id} has no host $1; its hosts are '
              f'{" ".join(commands)}" >&2; exit 2 ;;', "esac"]
    return "\n".join(lines) + "\n"


def hostfile_text(hosts: Sequence[Host], order: Sequence[str] | None = None) -> str:
    """A `hetjax launch` hostfile: host names, process i on line i (topology node order
    unless `order` lists the names in another)."""
    names = [h.name for h in hosts]
    order = list(order) if order is not None else names
    unknown = [n for n in order if n not in names]
    if unknown or len(set(order)) != len(order) or len(order) != len(names):
        raise HetjaxError(f"a testbed launch needs each of the hosts {names} exactly once, in "
                          f"the order processes 0, 1, ... run on them; got {list(order)}")
    return "".join(f"{n}\n" for n in order)


# --- running commands -----------------------------------------------------------------------------
def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a setup command; on failure raise with the command and what it printed."""
    p = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise HetjaxError(f"testbed setup failed: `{shlex.join(cmd)}` exited with "
                          f"{p.returncode}: {(p.stderr or p.stdout).strip()}")
    return p


def check_environment(cgroups: bool = False) -> None:
    """Refuse early, with the fix, when this machine cannot host the testbed."""
    if os.geteuid() != 0:
        raise HetjaxError(
            "the testbed needs root: it creates network namespaces, veth pairs, a bridge, tc "
            "qdiscs and cgroups; run it as root (e.g. `sudo hetjax testbed ...`)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nsenter", "util-linux"),
                          ("unshare", "util-linux"), ("mount", "util-linux")):
        if shutil.which(tool) is None:
            raise HetjaxError(f"the testbed needs the `{tool}` command; install {package} "
                              f"(e.g. apt-get install {package})")
    ns = f"{PREFIX}probe{os.getpid()}"
    _run(["ip", "netns", "add", ns])
    try:
        probes = [
            (["ip", "-n", ns, "link", "add", "hjtb-a", "type", "veth", "peer", "name", "hjtb-b"],
             "veth pairs (CONFIG_VETH)"),
            (["ip", "-n", ns, "link", "add", "hjtb-br", "type", "bridge"],
             "bridges (CONFIG_BRIDGE)"),
            (["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb"],
             "the htb qdisc (CONFIG_NET_SCH_HTB)"),
            (["tc", "-n", ns, "class", "add", "dev", "lo", "parent", "1:", "classid", "1:1",
              "htb", "rate", "1mbit"], "htb classes (CONFIG_NET_SCH_HTB)"),
            (["tc", "-n", ns, "filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip",
              "prio", "1", "u32", "match", "ip", "dst", cluster_subnet(0), "flowid", "1:1"],
             "the u32 classifier (CONFIG_NET_CLS_U32)"),
        ]
        for cmd, what in probes:
            p = _run(cmd, check=False)
            if p.returncode != 0:
                raise HetjaxError(
                    f"this kernel lacks {what}, which the testbed shapes links with "
                    f"(`{shlex.join(cmd)}` said: {(p.stderr or p.stdout).strip()}); use a kernel "
                    "built with it, or load its module (modprobe)")
    finally:
        _run(["ip", "netns", "del", ns], check=False)
    if cgroups and not os.path.isfile(os.path.join(CGROUP_CPU, "cpu.cfs_quota_us")):
        raise HetjaxError(
            f"CPU quotas need the cgroup v1 cpu controller at {CGROUP_CPU}, which is not "
            f"mounted; mount it (mkdir -p {CGROUP_CPU} && mount -t cgroup -o cpu cgroup "
            f"{CGROUP_CPU}) or run without CPU quotas (cpus=None, no --cpus)")


# --- finding and removing what a run created ------------------------------------------------------
def _run_id_of(name: str) -> str:
    return name[len(PREFIX):].split("-")[0]


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.strip() and line.startswith(PREFIX)]


def _root_links() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith(PREFIX)]


def _prefixed(directory: str) -> list[str]:
    """Subdirectories named hjtb-... (cgroups, state directories)."""
    try:
        return sorted(n for n in os.listdir(directory)
                      if n.startswith(PREFIX) and os.path.isdir(os.path.join(directory, n)))
    except FileNotFoundError:
        return []


def _objects(run_id: str | None = None) -> list[tuple[str, str]]:
    """(kind, name) of everything named hjtb-[run_id]... that exists now."""
    found = [("netns", n) for n in _namespaces()] + [("link", n) for n in _root_links()]
    found += [("cgroup", n) for n in _prefixed(CGROUP_CPU)]
    found += [("dir", n) for n in _prefixed(STATE_ROOT)]
    return [(kind, n) for kind, n in found if run_id is None or _run_id_of(n) == run_id]


def leftovers(run_id: str | None = None) -> list[str]:
    """Everything named hjtb-[run_id]... that exists now: namespaces, links, cgroups, dirs."""
    where = {"cgroup": CGROUP_CPU, "dir": STATE_ROOT}
    return [f"{kind} {os.path.join(where[kind], n) if kind in where else n}"
            for kind, n in _objects(run_id)]


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _remove_cgroup(path: str) -> None:
    """Kill what is left in a cgroup tree and remove it, leaves first."""
    for _ in range(50):
        if not os.path.isdir(path):
            return
        for sub, _dirs, _files in os.walk(path, topdown=False):
            try:
                with open(os.path.join(sub, "cgroup.procs")) as f:
                    _kill(f.read().split())
                os.rmdir(sub)
            except OSError:  # busy until killed processes have exited; retry
                pass
        time.sleep(0.05)
    raise HetjaxError(f"could not remove cgroup {path}: processes in it do not exit; "
                      f"see {path}/cgroup.procs")


def _remove(run_id: str) -> None:
    """Remove every kernel object and file of one run; safe to call again."""
    names = [n for n in _namespaces() if _run_id_of(n) == run_id]
    for ns in names:  # processes first, or a namespace outlives its name
        _kill(_run(["ip", "netns", "pids", ns], check=False).stdout.split())
    _remove_cgroup(os.path.join(CGROUP_CPU, PREFIX + run_id))
    for ns in names:  # deleting a namespace deletes its veth ends and the bridge
        _run(["ip", "netns", "del", ns], check=False)
    for n in _root_links():
        if _run_id_of(n) == run_id:
            _run(["ip", "link", "del", n], check=False)
    shutil.rmtree(os.path.join(STATE_ROOT, PREFIX + run_id), ignore_errors=True)


def _owner_alive(run_id: str) -> int | None:
    """The pid of the live process that owns a run, if any."""
    try:
        with open(os.path.join(STATE_ROOT, PREFIX + run_id, "owner")) as f:
            pid = int(f.read())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def _leftover_ids() -> set[str]:
    return {_run_id_of(n) for _, n in _objects()}


def cleanup(force: bool = False) -> tuple[list[str], list[str]]:
    """Remove what crashed testbed runs left. Runs whose owner process is alive are kept
    unless `force`. Returns (removed run ids, messages about kept runs)."""
    if os.geteuid() != 0:
        raise HetjaxError("removing testbed leftovers needs root (namespaces, cgroups); "
                          "run `sudo hetjax testbed down`")
    removed, kept = [], []
    for rid in sorted(_leftover_ids()):
        owner = _owner_alive(rid)
        if owner is not None and not force:
            kept.append(f"testbed {rid} belongs to running process {owner}; stop it (Ctrl-C) "
                        "or use --force")
            continue
        _remove(rid)
        removed.append(rid)
    return removed, kept


# --- the testbed ----------------------------------------------------------------------------------
def _checkout() -> str:
    """The directory holding the hetjax package this process imported."""
    import hetjax

    return os.path.dirname(os.path.dirname(os.path.abspath(hetjax.__file__)))


def _hetjax_pythonpath(current: str | None) -> str:
    """PYTHONPATH with this hetjax's checkout first: the venv's editable install may point at
    another checkout, and processes inside hosts must run the same code as the caller."""
    root = _checkout()
    rest = [p for p in (current or "").split(os.pathsep) if p and p != root]
    return os.pathsep.join([root, *rest])


class Testbed:
    """An emulated cluster; use as `with Testbed(topology) as tb: tb.run(...)`."""

    def __init__(self, topology: Topology, scale: float = DEFAULT_SCALE,
                 cpus: float | Mapping[str, float] | None = None):
        self.topology = topology
        self.scale = scale
        # Everything that can be wrong with the request is checked here, before any root work.
        self.egress = {ci: egress_classes(topology, ci, scale)
                       for ci in range(len(topology.clusters))}
        self.cpus = cpu_quotas(topology, cpus)
        self._name(secrets.token_hex(2))
        self._procs: list[subprocess.Popen] = []
        self._launches = 0
        self._old_handlers: dict[int, object] = {}
        self._up = False

    # --- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> "Testbed":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "Testbed":
        if self._up:
            raise HetjaxError(f"testbed {self.run_id} is already up")
        check_environment(cgroups=bool(self.cpus))
        taken = _leftover_ids()
        while self.run_id in taken:
            self._name(secrets.token_hex(2))
        self._catch_signals()
        self._up = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _name(self, run_id: str) -> None:
        self.run_id = run_id
        self.hosts: tuple[Host, ...] = layout(self.topology, run_id)

    @property
    def state_dir(self) -> str:
        return os.path.join(STATE_ROOT, PREFIX + self.run_id)

    @property
    def switch_netns(self) -> str:
        return f"{PREFIX}{self.run_id}-sw"

    @property
    def rsh_path(self) -> str:
        """`rsh HOST COMMAND` for this testbed's hosts (see `rsh_script`)."""
        return os.path.join(self.state_dir, "rsh")

    def _cgroup(self, host: Host | None = None) -> str:
        base = os.path.join(CGROUP_CPU, PREFIX + self.run_id)
        return base if host is None else os.path.join(base, host.name)

    def _build(self) -> None:
        os.makedirs(self.state_dir)
        with open(os.path.join(self.state_dir, "owner"), "w") as f:
            f.write(str(os.getpid()))
        with open(os.path.join(self.state_dir, "hosts"), "w") as f:
            f.write(hosts_file(self.hosts))
        with open(self.rsh_path, "w") as f:
            f.write(rsh_script(self.run_id, {h.name: self.command(h, ["sh", "-c"])
                                             for h in self.hosts}, _hetjax_pythonpath(None)))
        os.chmod(self.rsh_path, 0o755)
        sw = self.switch_netns
        _run(["ip", "netns", "add", sw])
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for h in self.hosts:
            port = f"p{h.index}"
            _run(["ip", "netns", "add", h.netns])
            _run(["ip", "-n", sw, "link", "add", port, "type", "veth",
                  "peer", "name", IFACE, "netns", h.netns])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"])
            # /16 on the interface: every host is on-link; the /24s only matter to the filters.
            _run(["ip", "-n", h.netns, "addr", "add", f"{h.address}/16", "dev", IFACE])
            _run(["ip", "-n", h.netns, "link", "set", IFACE, "up"])
            _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])
            for cmd in tc_commands(h, self.egress[h.cluster]):
                _run(cmd)
            if h.cluster in self.cpus:
                os.makedirs(self._cgroup(h))
                for name, value in (("cpu.cfs_period_us", CFS_PERIOD_US),
                                    ("cpu.cfs_quota_us",
                                     round(self.cpus[h.cluster] * CFS_PERIOD_US))):
                    with open(os.path.join(self._cgroup(h), name), "w") as f:
                        f.write(str(value))

    def close(self) -> None:
        """Stop every process and remove everything this testbed created; idempotent."""
        if not self._up:
            return
        # A second Ctrl-C must not cut teardown short: hold signals and re-raise them once
        # everything is removed (SIGTERM then ends the process as it would have).
        pending: list[int] = []
        held = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                held[s] = signal.signal(s, lambda signum, _frame: pending.append(signum))
        try:
            self._stop_processes()
            _remove(self.run_id)
            self._up = False
        finally:
            for s, handler in held.items():
                signal.signal(s, handler)
            self._restore_signals()
        for s in pending:
            signal.raise_signal(s)

    def _stop_processes(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 2.0
        for p in self._procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self._procs.clear()

    def _catch_signals(self) -> None:
        """Turn SIGINT/SIGTERM/SIGHUP into KeyboardInterrupt, so `with` blocks unwind and tear
        down instead of the process dying with namespaces left behind. SIGINT too: a process
        started in the background (or by a test runner's worker) inherits it ignored, and
        `hetjax testbed up` must still go down on Ctrl-C or `kill -INT`."""
        if threading.current_thread() is not threading.main_thread():
            return

        def interrupt(signum, _frame):
            raise KeyboardInterrupt(f"testbed received {signal.Signals(signum).name}")

        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[s] = signal.signal(s, interrupt)

    def _restore_signals(self) -> None:
        for s, handler in self._old_handlers.items():
            signal.signal(s, handler)
        self._old_handlers.clear()

    # --- using it --------------------------------------------------------------------------------
    def host(self, key: Host | str | int) -> Host:
        """A host by name ("ib-0"), index, or the Host itself."""
        if isinstance(key, Host):
            return key
        for h in self.hosts:
            if key == h.name or key == h.index:
                return h
        raise HetjaxError(f"the testbed has no host {key!r}; its hosts are "
                          f"{[h.name for h in self.hosts]} (or their indices)")

    def address(self, key: Host | str | int) -> str:
        return self.host(key).address

    def command(self, key: Host | str | int, argv: Sequence[str]) -> list[str]:
        """The full command line that runs argv inside a host (for logs or a shell)."""
        h = self.host(key)
        procs = (os.path.join(self._cgroup(h), "cgroup.procs")
                 if h.cluster in self.cpus else None)
        return host_command(h, argv, os.path.join(self.state_dir, "hosts"), procs)

    def run(self, key: Host | str | int, argv: Sequence[str],
            env: Mapping[str, str] | None = None, **popen_kwargs) -> subprocess.Popen:
        """Start argv inside a host; `env` is added to this process's environment.

        The process is stopped at teardown if still running. Pass stdout/stderr etc. as for
        subprocess.Popen.
        """
        if not self._up:
            raise HetjaxError("the testbed is not up; use `with Testbed(topology) as tb:` "
                              "(or tb.start()) before tb.run(...)")
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = _hetjax_pythonpath(full_env.get("PYTHONPATH"))
        p = subprocess.Popen(self.command(key, argv), env=full_env, start_new_session=True,
                             **popen_kwargs)
        self._procs.append(p)
        return p

    def launch_args(self, order: Sequence[str] | None = None,
                    port: int = DEFAULT_PORT) -> list[str]:
        """`hetjax launch` flags that run one worker per emulated host: a hostfile of host
        names (topology node order, or `order`), the rsh script, process 0's address on the
        emulated network as coordinator, and this checkout and python on every host."""
        if not self._up:
            raise HetjaxError("the testbed is not up; launch inside `with Testbed(...) as tb:`")
        text = hostfile_text(self.hosts, order)
        self._launches += 1
        path = os.path.join(self.state_dir, f"hostfile{self._launches}")
        with open(path, "w") as f:
            f.write(text)
        first = text.split()[0]
        return ["--hostfile", path, "--rsh", f"{self.rsh_path} {{host}}",
                "--coordinator", f"{self.address(first)}:{port}",
                "--chdir", _checkout(), "--python", sys.executable]

    def launch(self, config_args: Sequence[str], order: Sequence[str] | None = None,
               timeout: float = 600, port: int | None = None, launch_flags: Sequence[str] = (),
               **popen_kwargs) -> subprocess.Popen:
        """Start `hetjax launch` (in this namespace) with one `hetjax train` worker per
        emulated host, so every worker's jax.distributed traffic crosses the shaped links.

        `config_args` are the workers' `--config...` flags; their topology must have the
        testbed's node count (normally the testbed's own topology). `order` lists host names
        in process order (default: topology node order, process i on host i). The launcher
        stops the job after `timeout` s; the launcher itself is stopped at teardown.
        Pass stdout/stderr as for subprocess.Popen."""
        # A fresh coordinator port per launch: the previous job's sockets may linger.
        port = port or DEFAULT_PORT + self._launches
        argv = [sys.executable, "-m", "hetjax", "launch",
                *self.launch_args(order, port), "--timeout", f"{timeout:g}",
                *launch_flags, *config_args]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env["PYTHONPATH"] = _hetjax_pythonpath(env.get("PYTHONPATH"))
        p = subprocess.Popen(argv, env=env, cwd=_checkout(), start_new_session=True,
                             **popen_kwargs)
        self._procs.append(p)
        return p

    def train(self, config_args: Sequence[str], workdir: str,
              order: Sequence[str] | None = None, timeout: float = 600,
              host: Host | str | int | None = None) -> TrainingRun:
        """Run `hetjax train` with `config_args` and wait for it: one worker per emulated
        host through `launch` (process order `order`), or, with `host`, a single process in
        that host (for profiling; its topology must have one node). Metrics go to `workdir`
        (emptied first); the result carries them, the output and the traffic per egress class.
        The run is stopped after `timeout` s and then counts as failed."""
        shutil.rmtree(workdir, ignore_errors=True)
        os.makedirs(workdir)
        args = [*config_args, f"--config.workdir={workdir}"]
        before = {h.name: self.class_bytes(h) for h in self.hosts}
        t0 = time.monotonic()
        pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if host is None:
            p = self.launch(args, order, timeout=timeout, **pipe)
        else:  # jax sizes its devices from the 1-node topology (hetjax.cli.cmd_train)
            p = self.run(host, [sys.executable, "-u", "-m", "hetjax", "train", *args],
                         env={"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}, **pipe)
        try:  # the launcher enforces `timeout` itself; this is the backstop
            out, _ = p.communicate(timeout=timeout + 30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate()
            out += f"\n(stopped: no exit within {timeout + 30:g} s)"
        seconds = time.monotonic() - t0
        after = {h.name: self.class_bytes(h) for h in self.hosts}
        traffic = {n: {c: after[n][c] - before[n][c] for c in after[n]} for n in after}
        path = os.path.join(workdir, "metrics.jsonl")
        rows = ()
        if os.path.exists(path):
            with open(path) as f:
                rows = tuple(json.loads(line) for line in f if line.strip())
        return TrainingRun(p.returncode, seconds, rows, traffic, out)

    def threads(self, key: Host | str | int) -> list[int]:
        """Thread ids of the processes running in a host's CPU cgroup (the cgroup v1 `tasks`
        file; empty when the host has no CPU quota): per-thread CPU accounting reads them."""
        h = self.host(key)
        if h.cluster not in self.cpus:
            return []
        with open(os.path.join(self._cgroup(h), "tasks")) as f:
            return [int(t) for t in f.read().split()]

    def throttled(self, key: Host | str | int) -> dict[str, int]:
        """A capped host's CFS counters (cpu.stat: nr_periods, nr_throttled, throttled_time
        in ns): how often its quota ran out, i.e. whether it was CPU-bound."""
        h = self.host(key)
        if h.cluster not in self.cpus:
            return {}
        with open(os.path.join(self._cgroup(h), "cpu.stat")) as f:
            return {k: int(v) for k, v in (line.split() for line in f if line.strip())}

    def class_bytes(self, key: Host | str | int) -> dict[int, int]:
        """Bytes a host has sent so far to each destination cluster (its htb class counters)."""
        h = self.host(key)
        out = _run(["tc", "-n", h.netns, "-s", "class", "show", "dev", IFACE]).stdout
        sent = dict(re.findall(r"class htb (\S+) .*\n\s*Sent (\d+) bytes", out))
        return {c.dst_cluster: int(sent.get(c.classid, 0)) for c in self.egress[h.cluster]}

    def measure_links(self, seconds: float = 0.5):
        """Measured vs configured rate per link class (see hetjax.linkcheck)."""
        from hetjax import linkcheck

        return linkcheck.measure_links(self, seconds=seconds)

    def describe(self) -> str:
        lines = [f"testbed {self.run_id}: {len(self.hosts)} hosts, rates x "
                 f"{self.scale:g}, latency not emulated"]
        lines.append(f"  {'host':<14}{'address':<14}{'netns':<18}{'cpus':<7}egress classes")
        for h in self.hosts:
            cpus = f"{self.cpus[h.cluster]:.2f}" if h.cluster in self.cpus else "-"
            classes = ", ".join(
                f"{c.subnet} {c.link.kind} {c.rate_bps / 1e6:g}Mbit"
                for c in self.egress[h.cluster])
            lines.append(f"  {h.name:<14}{h.address:<14}{h.netns:<18}{cpus:<7}{classes}")
        return "\n".join(lines)

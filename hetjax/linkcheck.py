"""Checks that a running testbed delivers what it promises, and the programs they run in hosts.

`measure_links(tb)` times a plain TCP transfer (python sockets) over every link class of the
testbed, one after another so they do not compete for the CPU: inside each cluster with two
or more hosts (its NIC), and between every pair of clusters (the inter-cluster link or its
override), in the direction first cluster -> second. It reports measured goodput against the
configured (scaled) rate and, for reference, the measured round trip beside the configured
latency, which the testbed does not emulate.

`psum_smoke(tb)` runs a 2-process jax.distributed program (gloo CPU collectives) on two hosts
in different clusters, all-reduces an array, checks the sum, and reads the hosts' htb counters
to show the traffic crossed the shaped inter-cluster class.

`python -m hetjax.linkcheck recv|send|psum ...` are those in-host programs; each prints one
JSON line on stdout.
"""

from __future__ import annotations

import json
import socket
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

from hetjax.errors import HetjaxError
from hetjax.core.topology import Link

PORT = 5201  # every host is its own network namespace, so fixed ports cannot clash
COORDINATOR_PORT = 12355
PING_ROUNDS = 50
HEADER = struct.Struct("!IQ")  # ping rounds, bulk bytes


# --- run from the caller --------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkMeasurement:
    label: str  # "ib" (inside cluster ib) or "ib -> roce"
    src: str
    dst: str
    link: Link  # the topology's link, unscaled
    configured_bps: float
    measured_bps: float
    nbytes: int
    rtt_s: float  # median small-message round trip, python to python

    @property
    def ratio(self) -> float:
        return self.measured_bps / self.configured_bps


def link_pairs(tb) -> list[tuple[str, object, object, object]]:
    """(label, sender, receiver, shaped class) for each link class worth measuring."""
    first = {}
    for h in tb.hosts:
        first.setdefault((h.cluster, h.node), h)
    names = [c.name for c in tb.topology.clusters]
    pairs = []
    for ci, c in enumerate(tb.topology.clusters):
        if c.nodes > 1:  # a one-node cluster has no intra-cluster link between hosts
            pairs.append((names[ci], first[ci, 0], first[ci, 1], tb.egress[ci][ci]))
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            pairs.append((f"{names[a]} -> {names[b]}", first[a, 0], first[b, 0], tb.egress[a][b]))
    return pairs


def _python(module_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "hetjax.linkcheck", *module_args]


def _run_together(tb, jobs, timeout: float) -> list[str]:
    """Start (host, argv, env) jobs inside the testbed, wait for all; their stdouts."""
    procs = [tb.run(h, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for h, argv, env in jobs]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for (h, argv, _), p in zip(jobs, procs):
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise HetjaxError(
                    f"`{' '.join(argv)}` on testbed host {h.name} did not finish within "
                    f"{timeout:g} s; the testbed may be overloaded, or its links misconfigured "
                    "(see `hetjax testbed measure`)") from None
            if p.returncode != 0:
                raise HetjaxError(f"`{' '.join(argv)}` on testbed host {h.name} failed "
                                  f"(exit {p.returncode}):\n{err.strip()[-2000:]}")
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def measure_links(tb, seconds: float = 0.5, timeout: float = 60.0) -> list[LinkMeasurement]:
    """Each transfer is sized to last about `seconds` at the configured rate (1-64 MiB)."""
    results = []
    for label, src, dst, cls in link_pairs(tb):
        nbytes = int(min(64 << 20, max(1 << 20, cls.rate_bps / 8 * seconds)))
        _, out = _run_together(tb, [
            (dst, _python(["recv", dst.address, str(PORT)]), None),
            (src, _python(["send", dst.address, str(PORT), str(nbytes)]), None),
        ], timeout)
        r = _last_json(out)
        results.append(LinkMeasurement(label, src.name, dst.name, cls.link, cls.rate_bps,
                                       r["rate_bps"], nbytes, r["rtt_s"]))
    return results


def format_table(ms: list[LinkMeasurement], scale: float) -> str:
    lines = [f"link class (rates x {scale:g})  configured    measured      ratio  "
             "latency: configured (not emulated) / measured RTT/2"]
    for m in ms:
        lines.append(
            f"{m.label + ' (' + m.link.kind + ')':<28}{m.configured_bps / 1e6:>8.1f} Mbit/s"
            f"{m.measured_bps / 1e6:>8.1f} Mbit/s{m.ratio:>7.2f}  "
            f"{m.link.latency_us:g} us / {m.rtt_s / 2 * 1e6:.0f} us")
    return "\n".join(lines)


def traffic_by_link(tb, traffic: dict[str, dict[int, int]]) -> dict[str, int]:
    """Bytes per link class, both directions summed, from per-host egress counters
    ({host name: {destination cluster: bytes}}, e.g. `TrainingRun.traffic`): "ib" is the
    traffic inside cluster ib (its NIC), "ib <-> roce" the traffic between the two clusters."""
    names = [c.name for c in tb.topology.clusters]
    out: dict[str, int] = {}
    for h in tb.hosts:
        for dst, nbytes in traffic.get(h.name, {}).items():
            a, b = sorted((h.cluster, dst))
            label = names[a] if a == b else f"{names[a]} <-> {names[b]}"
            out[label] = out.get(label, 0) + nbytes
    return out


def format_traffic(tb, traffic: dict[str, dict[int, int]]) -> str:
    """One line per link class: the bytes a run moved over it and the link's kind and rate."""
    lines = []
    for label, nbytes in traffic_by_link(tb, traffic).items():
        ends = [next(i for i, c in enumerate(tb.topology.clusters) if c.name == n)
                for n in label.split(" <-> ")]
        cls = tb.egress[ends[0]][ends[-1]]
        lines.append(f"  {label + ' (' + cls.link.kind + ')':<28}{nbytes / 2**20:>10.2f} MiB  "
                     f"(shaped to {cls.rate_bps / 1e6:g} Mbit/s)")
    return "\n".join(lines)


@dataclass(frozen=True)
class PsumResult:
    hosts: tuple[str, str]
    link: Link
    rate_bps: int
    nbytes: int
    outputs: tuple[dict, dict]  # what each process printed
    traffic: tuple[int, int]  # bytes through a's class toward b's cluster, and b's toward a's

    @property
    def ok(self) -> bool:
        return all(o["ok"] for o in self.outputs)

    @property
    def crossed_shaped_link(self) -> bool:
        return min(self.traffic) >= self.nbytes

    def describe(self) -> str:
        a, b = self.hosts
        o = self.outputs[0]
        return (f"psum of {self.nbytes / 2**20:g} MiB across {a} <-> {b} over "
                f"{self.link.kind} ({self.link.bandwidth_gbps:g} Gb/s, shaped to "
                f"{self.rate_bps / 1e6:g} Mbit/s): result {o['value']:g} on both processes "
                f"(expected {o['expected']:g}): {'ok' if self.ok else 'WRONG'}; "
                f"{self.traffic[0] / 2**20:.2f} MiB went {a} -> {b}'s cluster and "
                f"{self.traffic[1] / 2**20:.2f} MiB {b} -> {a}'s through the shaped class; "
                f"the all-reduce took {max(x['seconds'] for x in self.outputs):.2f} s")


def smoke_hosts(tb):
    """Two hosts as far apart as the topology allows: different clusters if there are two."""
    if len(tb.hosts) < 2:
        raise HetjaxError("the smoke run needs two emulated hosts, but the topology has one "
                          "node; use --config.topology.nodes=2 or a two-cluster preset")
    a = tb.hosts[0]
    b = next((h for h in tb.hosts if h.cluster != a.cluster), tb.hosts[1])
    return a, b


def psum_smoke(tb, nbytes: int = 4 << 20, timeout: float = 120.0) -> PsumResult:
    a, b = smoke_hosts(tb)
    before = (tb.class_bytes(a)[b.cluster], tb.class_bytes(b)[a.cluster])
    # One CPU device per process: the run is about the link, not about compute.
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    coordinator = f"{a.address}:{COORDINATOR_PORT}"
    outs = _run_together(tb, [
        (h, _python(["psum", coordinator, "2", str(i), str(nbytes)]), env)
        for i, h in enumerate((a, b))], timeout)
    after = (tb.class_bytes(a)[b.cluster], tb.class_bytes(b)[a.cluster])
    cls = tb.egress[a.cluster][b.cluster]
    return PsumResult((a.name, b.name), cls.link, cls.rate_bps, nbytes,
                      tuple(_last_json(o) for o in outs),
                      (after[0] - before[0], after[1] - before[1]))


# --- run inside hosts -----------------------------------------------------------------------------
def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def recv(address: str, port: int) -> dict:
    """Serve one measurement: echo the pings, time the bulk bytes, report to the sender."""
    with socket.create_server((address, port)) as srv:
        conn, _ = srv.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rounds, nbytes = HEADER.unpack(_recv_exactly(conn, HEADER.size))
        for _ in range(rounds):
            conn.sendall(_recv_exactly(conn, 1))
        got, first, t0 = 0, 0, 0.0
        while got < nbytes:
            chunk = conn.recv(min(1 << 20, nbytes - got))
            if not chunk:
                raise ConnectionError(f"sender closed after {got} of {nbytes} bytes")
            if not got:  # the clock starts at the first chunk, so it does not count
                t0, first = time.perf_counter(), len(chunk)
            got += len(chunk)
        seconds = time.perf_counter() - t0
        report = {"bytes": got, "seconds": seconds,
                  "rate_bps": (got - first) * 8 / seconds if seconds > 0 else float("inf")}
        conn.sendall((json.dumps(report) + "\n").encode())
    return report


def send(address: str, port: int, nbytes: int, rounds: int = PING_ROUNDS) -> dict:
    deadline = time.monotonic() + 10.0
    while True:  # the receiver starts at the same time; wait for it to listen
        try:
            conn = socket.create_connection((address, port), timeout=30)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(HEADER.pack(rounds, nbytes))
        rtts = []
        for _ in range(rounds):
            t = time.perf_counter()
            conn.sendall(b"x")
            _recv_exactly(conn, 1)
            rtts.append(time.perf_counter() - t)
        block = bytes(1 << 20)
        left = nbytes
        while left:
            n = min(left, len(block))
            conn.sendall(block[:n])
            left -= n
        report = json.loads(conn.makefile().readline())
    report["rtt_s"] = statistics.median(rtts)
    return report


def psum(coordinator: str, num_processes: int, process_id: int, nbytes: int) -> dict:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)
    try:
        mesh = jax.make_mesh((jax.device_count(),), ("x",))
        local = np.full((jax.local_device_count(), nbytes // 4), process_id + 1, np.float32)
        arr = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
        f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "x"), mesh=mesh,
                                  in_specs=P("x"), out_specs=P("x"))).lower(arr).compile()
        t = time.perf_counter()
        out = f(arr)
        out.block_until_ready()
        seconds = time.perf_counter() - t
        got = np.asarray(out.addressable_shards[0].data)
        # Every device of process p holds p + 1.
        expected = float(sum((p + 1) for p in range(num_processes)) * jax.local_device_count())
        return {"process": process_id, "devices": jax.device_count(), "value": float(got.flat[0]),
                "expected": expected, "ok": bool((got == expected).all()), "seconds": seconds}
    finally:
        jax.distributed.shutdown()


def main(argv: list[str]) -> int:
    usage = ("usage: python -m hetjax.linkcheck recv ADDRESS PORT | send ADDRESS PORT NBYTES | "
             "psum COORDINATOR NUM_PROCESSES PROCESS_ID NBYTES")
    programs = {"recv": (recv, (str, int)), "send": (send, (str, int, int)),
                "psum": (psum, (str, int, int, int))}
    if not argv or argv[0] not in programs or len(argv) - 1 != len(programs[argv[0]][1]):
        print(usage, file=sys.stderr)
        return 2
    fn, types = programs[argv[0]]
    print(json.dumps(fn(*(t(a) for t, a in zip(types, argv[1:])))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

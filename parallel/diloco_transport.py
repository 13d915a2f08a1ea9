"""DiLoCo's transports: how the sites exchange pseudo-gradients when each site is its own
process of one `jax.distributed` job (in one process the executor, `hetjax.parallel.diloco`,
runs the exchange itself).

`CrossSiteExchange`: compiled collectives over a mesh of one device per site -- an all-reduce
of the float32 pseudo-gradients, or with a codec a reduce-scatter (all-to-all of quantized row
shards) and an all-gather of the requantized mean: the one-process exchange's arithmetic, so
the same losses, and what hetjax/planner/diloco_pricing.py prices. `OverlapTransport`: the
overlapped exchange (`diloco.overlap_steps` > 0) over the MPMD bridge's socket transport on a
background thread, so it travels while the sites train on.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from hetjax.core.wire import BITS
from hetjax.distributed import free_port
from hetjax.parallel import bridge as hbridge
from hetjax.parallel.codec import pack4, quantize_rows, unpack4
from hetjax.parallel.codec import rows as _rows


class CrossSiteExchange:
    """The sites' collective when each site is its own process of one `jax.distributed` job:
    a mesh of one device per site (its process's first) and shard_map collectives over it.

    codec none: the fp32 pseudo-gradients are all-reduced (psum; a ring sends 2 (n-1)/n of
    them a site). int8 / int4: per tensor, the rows are quantized (per-row scales), split into
    n shards and sent with an all-to-all (the reduce-scatter: site j receives every site's
    shard j), site j averages the dequantized shards in site order and quantizes the mean once
    more, and an all-gather returns every shard to every site: the same two rounding steps and
    the same arithmetic as the one-process exchange, 2 (n-1)/n of the payload a site, which is
    what hetjax/planner/diloco_pricing.py prices."""

    def __init__(self, site_devices, site: int, codec: str):
        self.n, self.site, self.codec = len(site_devices), site, codec
        self.device = site_devices[site]
        self.mesh = jax.sharding.Mesh(np.array(site_devices), ("site",))
        self.spread = NamedSharding(self.mesh, P("site"))
        self.everywhere = NamedSharding(self.mesh, P())
        self._mean = jax.jit(jax.shard_map(self._mean_block, mesh=self.mesh,
                                           in_specs=P("site"), out_specs=P("site")))
        self._gather = jax.jit(jax.shard_map(
            lambda v: jax.lax.all_gather(v[0], "site")[None], mesh=self.mesh,
            in_specs=P("site"), out_specs=P("site")))

    def _global(self, x):
        return jax.make_array_from_single_device_arrays((self.n, *x.shape), self.spread,
                                                        [x[None]])

    def replicated(self, x):
        """This site's copy of `x` (the same on every site: theta, the outer optimizer state,
        the step) as one global array replicated over the sites' mesh."""
        x = jax.device_put(x, self.device)
        return jax.make_array_from_single_device_arrays(x.shape, self.everywhere, [x])

    def stacked(self, x):
        """This site's own `x` as its row of a global [n_sites, ...] array over the mesh."""
        return self._global(jax.device_put(x, self.device))

    def gather(self, x) -> np.ndarray:
        """Every site's `x` (a small array on this site's devices), stacked in site order."""
        x = jax.device_put(x, self.device)
        return np.asarray(self._gather(self._global(x)).addressable_data(0)[0])

    def mean(self, delta):
        """The decoded mean of the sites' pseudo-gradients (`delta`: this site's, float32 on
        `self.device`) and the bytes this site sent."""
        out = self._mean(jax.tree.map(self._global, delta))
        return jax.tree.map(lambda g: g.addressable_data(0)[0], out), self._sent(delta)

    def _sent(self, delta) -> int:
        n = self.n
        total = 0
        for x in jax.tree.leaves(delta):
            if self.codec == "none":
                total += 2 * (n - 1) * x.size * 4 // n
                continue
            R, c = _rows(x).shape
            k = -(-R // n)
            cb = c if self.codec == "int8" else (c + 1) // 2
            total += 2 * (n - 1) * k * (cb + 4)  # my shards of codes + scales out, twice
        return total

    def _mean_block(self, tree):
        n = self.n
        if self.codec == "none":
            return jax.tree.map(lambda v: jax.lax.psum(v, "site") / n, tree)
        bits = BITS[self.codec]

        def one(v):
            x = v[0]
            r = _rows(x)
            R, c = r.shape
            k = -(-R // n)
            r = jnp.pad(r, ((0, k * n - R), (0, 0)))
            q, scale = quantize_rows(r, bits)
            q = pack4(q) if bits == 4 else q
            # reduce-scatter: shard j of every site goes to site j
            qs = jax.lax.all_to_all(q.reshape(n, k, -1), "site", 0, 0)
            ss = jax.lax.all_to_all(scale.reshape(n, k, 1), "site", 0, 0)
            codes = [unpack4(qs[j], c) if bits == 4 else qs[j] for j in range(n)]
            mean = sum(codes[j].astype(jnp.float32) * ss[j] for j in range(n)) / n
            q2, s2 = quantize_rows(mean, bits)
            q2 = pack4(q2) if bits == 4 else q2
            q2 = jax.lax.all_gather(q2, "site").reshape(n * k, -1)
            s2 = jax.lax.all_gather(s2, "site").reshape(n * k, 1)
            q2 = unpack4(q2, c) if bits == 4 else q2
            out = (q2.astype(jnp.float32) * s2)[:R]
            return out.reshape(x.shape)[None]

        return jax.tree.map(one, tree)


def _own_host(coordinator: str) -> str:
    """This process's address as the coordinator's host reaches it (the source address of a
    route to the coordinator; on the testbed each site's namespace has its own)."""
    host = coordinator.rpartition(":")[0].strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
        return s.getsockname()[0]


def _bridge_addresses(site: int, n: int, timeout_s: float) -> list[str]:
    """Every site's bridge control address, agreed through the job's key-value store (the
    sites of one `jax.distributed` job have no bridge variables from the launcher)."""
    from jax._src import distributed

    g = distributed.global_state
    me = f"{_own_host(g.coordinator_address)}:{free_port()}"
    g.client.key_value_set(f"hetjax/diloco_bridge/{site}", me)
    return [g.client.blocking_key_value_get(f"hetjax/diloco_bridge/{s}", int(timeout_s * 1e3))
            for s in range(n)]


class OverlapTransport:
    """The overlapped exchange across processes (`diloco.overlap_steps` > 0): each site's
    encoded pseudo-gradient of one fragment goes to every other site over the MPMD bridge
    (parallel/bridge.py, its socket transport: host bytes over TCP) from a background thread,
    while the main thread dispatches the next inner steps. A compiled collective would not
    do: on CPU (gloo) it runs on the site's devices in program order, behind the queued inner
    steps and in front of the next ones. Every site gets all n wires (an all-gather: n - 1
    payloads a site, what the planner's overlapped row prices) and forms their mean itself
    with the one-process executor's function, so the result is the one-process one."""

    def __init__(self, site: int, n: int, device, timeout_s: float):
        self.site, self.n = site, n
        self.sharding = SingleDeviceSharding(device)
        self.bridge = hbridge.Bridge(site, _bridge_addresses(site, n, timeout_s), "socket",
                                     timeout_s=timeout_s, max_in_flight=max(1, n - 1))
        self.bridge.peer_names = {s: f"DiLoCo site {s}" for s in range(n)}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-exchange",
                                        initializer=hbridge.name_os_thread,
                                        initargs=("diloco-exchange",))
        self._futures: list[Future] = []
        self.exchange_s = 0.0  # wall seconds the exchanges took on the background thread
        self.wait_s = 0.0  # seconds the main thread waited for them at landings (exposed)

    def start(self, step: int, fragment: int, wire) -> Future:
        """Send this site's `wire` (exchange `step`, `fragment`) and receive the others';
        the future holds every site's wire, in site order, on this site's exchange device."""
        leaves, treedef = jax.tree.flatten(wire)
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.sharding) for x in leaves]
        key = lambda to: hbridge.message_key(step, to, fragment, "diloco")  # noqa: E731

        def run():
            t0 = time.perf_counter()
            host = jax.device_get(leaves)  # waits here, not on the main thread, for the encode
            peers = [s for s in range(self.n) if s != self.site]
            for s in peers:
                self.bridge.send(key(s), host)
            # Pull from every peer at once: pulled one after another, a site's n - 1 wires
            # would cross their links in turn ((n - 1) x one wire's time when each pair of
            # sites has its own path, as the testbed's per-destination htb classes do).
            for s in peers:
                self.bridge.prefetch(s, key(self.site), specs)
            out = [jax.tree.unflatten(treedef, leaves if s == self.site else
                                      self.bridge.recv(s, key(self.site), specs))
                   for s in range(self.n)]
            self.exchange_s += time.perf_counter() - t0
            return out

        fut = self._pool.submit(run)
        self._futures = [f for f in self._futures if not f.done()] + [fut]
        return fut

    def finish(self) -> None:
        """Wait for the exchanges under way, then for every peer (which may still be pulling
        this site's last wire) before the process may exit."""
        for f in self._futures:
            f.result()
        self.bridge.barrier([s for s in range(self.n) if s != self.site])
        self._pool.shutdown()
        self.bridge.close()

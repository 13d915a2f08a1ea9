"""The bridge between JAX worlds: point-to-point array messages between processes that do not
share a `jax.distributed` job.

With one JAX world per cluster (docs/worlds.md), activations and their gradients, the tied
embedding's gradient, the loss and the clipping norm cross between worlds here. Every bridge
process has a global index (`rank`) and a small TCP control server at a known address; a peer
connects to it to learn the process's `jax.experimental.transfer` server address (and, with
the socket transport, to fetch message bytes). A message is one or more single-device arrays
under an integer key (`message_key(step, stage, microbatch, kind, part)`):

- `send(key, arrays)`: offer the arrays; with the transfer transport this is
  `TransferServer.await_pull`, which does not block (the arrays may still be computing).
- `prefetch(peer, key, specs)`: start pulling the message into the devices of `specs`
  (`jax.ShapeDtypeStruct`s with single-device shardings). `TransferConnection.pull` returns
  at once with arrays that become ready when the bytes have arrived, so a prefetch overlaps
  with compute; at most `max_in_flight` prefetches are outstanding (the oldest is waited for
  before a new one starts), which bounds the receive buffers.
- `recv(peer, key, specs)`: the prefetched (or a freshly pulled) message, waited for up to
  `timeout_s`, after which a `BridgeError` names the peer and the message.

Compressed boundaries (`codec="int8"`, the config's `pipeline.boundary_codec`): activations
and activation gradients travel as int8 codes with one float32 scale per row of their last
axis (parallel/codec.py; error <= max|row| / 254 per element), 1 + 4 / d bytes a value instead
of 4 (fp32) or 2 (bf16). Gradients get error feedback: the sender keeps, per message stream
(the key without its step: stage, micro-batch, kind, part), what quantization dropped last
time and adds it to the next gradient of that stream before quantizing, so the error does not
accumulate in the weights. Other kinds (the loss, norms, the embedding gradient) are sent
whole. Sender and receiver must use the same codec (the launcher gives every world the same
config).

A peer that never comes up fails `connect` after `timeout_s` with its rank and address. The
socket transport (HETJAX_BRIDGE_TRANSPORT=socket) carries the same messages as host bytes over
the control connection, for platforms where the transfer server is unavailable; it is slower
(a device -> host -> socket -> host -> device copy) and otherwise identical.

The launcher tells a worker its place through environment variables (`bridge_from_environ`):
HETJAX_BRIDGE_RANK (its global index), HETJAX_BRIDGE_HOSTS (every process's host, comma
separated, in rank order), HETJAX_BRIDGE_PORT (rank r listens on port + r).
"""

from __future__ import annotations

import collections
import json
import os
import socket
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import numpy as np

from hetjax.errors import HetjaxError
from hetjax.core.wire import BOUNDARY_CODECS as CODECS  # pipeline.boundary_codec

ENV_BRIDGE_RANK = "HETJAX_BRIDGE_RANK"
ENV_BRIDGE_HOSTS = "HETJAX_BRIDGE_HOSTS"
ENV_BRIDGE_PORT = "HETJAX_BRIDGE_PORT"
ENV_BRIDGE_TRANSPORT = "HETJAX_BRIDGE_TRANSPORT"
ENV_BRIDGE_TIMEOUT = "HETJAX_BRIDGE_TIMEOUT"
TRANSPORTS = ("transfer", "socket")
_COMPRESSED = ("activation", "gradient")  # the kinds a codec applies to
DEFAULT_TIMEOUT = 120.0
DEFAULT_IN_FLIGHT = 4

# What a message carries, as the low bits of its key.
KINDS = {"activation": 0, "gradient": 1, "embedding_gradient": 2, "loss": 3, "norm": 4,
         # evaluation's activations and losses; a stage's train state for a checkpoint; a
         # control value (the checkpoint step every world restores)
         "eval": 5, "eval_loss": 6, "state": 7, "control": 8,
         # DiLoCo's overlapped fragment exchange (parallel/diloco.py): a site's pseudo-gradient
         "diloco": 9,
         "test": 15}
KIND_NAMES = {v: k for k, v in KINDS.items()}
_PART_BITS, _KIND_BITS, _MB_BITS, _STAGE_BITS = 12, 4, 16, 8


class BridgeError(HetjaxError):
    """A bridge peer did not come up, or a message did not arrive in time."""


def message_key(step: int, stage: int, microbatch: int, kind: str, part: int = 0) -> int:
    """The transfer id of one message: unique per (step, sending stage, micro-batch, kind,
    part) and positive below 2**63 (the transfer server's id type)."""
    if kind not in KINDS:
        raise BridgeError(f"message kind {kind!r} is unknown; one of {sorted(KINDS)}")
    fields = ((stage, _STAGE_BITS, "stage"), (microbatch, _MB_BITS, "microbatch"),
              (part, _PART_BITS, "part"))
    for value, bits, name in fields:
        if not 0 <= value < 1 << bits:
            raise BridgeError(f"message {name} {value} is outside 0..{(1 << bits) - 1}")
    key = step
    key = (key << _STAGE_BITS) | stage
    key = (key << _MB_BITS) | microbatch
    key = (key << _KIND_BITS) | KINDS[kind]
    key = (key << _PART_BITS) | part
    if not 0 <= key < 1 << 63:
        raise BridgeError(f"message key for step {step} does not fit 63 bits")
    return key


def _kind_of(key: int) -> str:
    return KIND_NAMES[(key >> _PART_BITS) & ((1 << _KIND_BITS) - 1)]


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS name (Linux prctl PR_SET_NAME, 15 characters kept):
    Python 3.11 names only its own Thread objects, and per-thread CPU accounting (top -H,
    /proc/<tid>/comm; scripts/bench/diloco.py --testbed) needs the bridge's threads told
    apart from XLA's and the main thread. A no-op where prctl is unavailable."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


# --- framing on the control connection ---------------------------------------------------------
def _send_msg(conn: socket.socket, header: dict, payload: bytes = b"") -> None:
    head = json.dumps(header).encode()
    conn.sendall(struct.pack("!IQ", len(head), len(payload)) + head + payload)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("bridge peer closed the connection")
        buf += chunk
    return bytes(buf)


def _recv_msg(conn: socket.socket) -> tuple[dict, bytes]:
    n_head, n_payload = struct.unpack("!IQ", _recv_exact(conn, 12))
    header = json.loads(_recv_exact(conn, n_head))
    return header, _recv_exact(conn, n_payload) if n_payload else b""


class Bridge:
    """One process's end of the bridge (see the module docstring).

    `addresses[r]` is the control address host:port of bridge process r; this process is
    `rank` and listens on `addresses[rank]`."""

    def __init__(self, rank: int, addresses: Sequence[str], transport: str = "transfer",
                 timeout_s: float = DEFAULT_TIMEOUT, max_in_flight: int = DEFAULT_IN_FLIGHT,
                 codec: str = "none"):
        if codec not in CODECS:
            raise BridgeError(f"bridge codec {codec!r} is unknown; set pipeline.boundary_codec "
                              f"to one of {', '.join(CODECS)}")
        if transport not in TRANSPORTS:
            raise BridgeError(f"bridge transport {transport!r} is unknown; set "
                              f"{ENV_BRIDGE_TRANSPORT} to one of {', '.join(TRANSPORTS)}")
        if not 0 <= rank < len(addresses):
            raise BridgeError(f"bridge rank {rank} is outside 0..{len(addresses) - 1}")
        if max_in_flight < 1:
            raise BridgeError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.rank = rank
        self.addresses = list(addresses)
        self.transport = transport
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.codec = codec
        self._residual: dict[tuple[int, int], object] = {}  # (stream, part) -> gradient error
        self._encode_fns: dict[bool, object] = {}
        self._decode_fn = None
        self._server = None
        self._transfer_address = ""
        if transport == "transfer":
            import jax
            from jax.experimental import transfer

            # A numeric address: given a host name, the transfer server binds 0.0.0.0 and
            # advertises that, which a peer on another host cannot reach (e.g. the testbed's
            # hosts, whose names resolve only inside their own namespaces).
            host = _numeric_host(self.addresses[rank].rpartition(":")[0])
            self._server = transfer.start_transfer_server(
                jax.local_devices()[0].client, f"{host}:0", [f"{host}:0"])
            self._transfer_address = self._server.address()
        self._peers: dict[int, object] = {}  # rank -> TransferConnection or control socket
        self._outbox: dict[int, list[np.ndarray]] = {}  # socket transport: key -> host arrays
        self._cond = threading.Condition()
        # (peer, key) -> a pull under way, oldest first; and pulls waited for, not yet taken
        self._pending: collections.OrderedDict = collections.OrderedDict()
        self._arrived: dict[tuple[int, int], list] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight + 1,
                                        initializer=name_os_thread,
                                        initargs=("bridge-pull",)) if transport == "socket" \
            else None
        # A transfer pull is waited for by a thread blocked in block_until_ready, not by
        # polling: polling burns CPU the host's own compute needs (a capped host lost a tenth
        # of its CPU to it while waiting for its peer).
        self._waiter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bridge-wait") \
            if transport == "transfer" else None
        self._barriers = 0
        self.peer_names: dict[int, str] = {}  # rank -> what errors call it (e.g. its world)
        self.bytes_sent = 0  # offered; every message is pulled exactly once
        self.bytes_received: dict[int, int] = {}  # peer -> bytes pulled from it
        self.bytes_by_kind: dict[str, int] = {}  # message kind -> bytes pulled
        self._arrivals: dict[int, int] = {}  # peer -> the last barrier it reached
        self._closed = False
        host, _, port = self.addresses[rank].rpartition(":")
        self._listener = socket.create_server((host.strip("[]"), int(port)), reuse_port=False)
        self._listener.settimeout(0.5)
        self._thread = threading.Thread(target=self._serve, name="bridge-control", daemon=True)
        self._thread.start()

    # --- the control server ----------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except (socket.timeout, OSError):
                continue
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        name_os_thread("bridge-serve")
        with conn:
            try:
                while True:
                    header, _ = _recv_msg(conn)
                    if "hello" in header:
                        _send_msg(conn, {"transfer": self._transfer_address,
                                         "rank": self.rank})
                    elif "get" in header:
                        arrays = self._take(int(header["get"]))
                        _send_msg(conn, {"arrays": [[a.dtype.name, a.shape] for a in arrays]},
                                  b"".join(a.tobytes() for a in arrays))
                    elif "barrier" in header:
                        # ack first: once this process sees the arrival, the peer has its ack
                        _send_msg(conn, {"ack": header["barrier"]})
                        with self._cond:
                            self._arrivals[header["rank"]] = header["barrier"]
                            self._cond.notify_all()
            except (ConnectionError, OSError, struct.error):
                return

    def _take(self, key: int) -> list[np.ndarray]:
        with self._cond:
            while key not in self._outbox:
                self._cond.wait()
            return self._outbox.pop(key)

    # --- peers -------------------------------------------------------------------------------
    def connect(self, peer: int):
        """The connection to bridge process `peer`, made on first use: retried until
        `timeout_s`, then a BridgeError naming the peer."""
        if peer in self._peers:
            return self._peers[peer]
        if peer == self.rank or not 0 <= peer < len(self.addresses):
            raise BridgeError(f"bridge process {self.rank} cannot connect to peer {peer}")
        host, _, port = self.addresses[peer].rpartition(":")
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                conn = socket.create_connection((host.strip("[]"), int(port)), timeout=2.0)
                conn.settimeout(None)
                _send_msg(conn, {"hello": self.rank})
                header, _ = _recv_msg(conn)
                break
            except (OSError, ConnectionError, struct.error):
                if time.monotonic() > deadline:
                    name = f" ({self.peer_names[peer]})" if peer in self.peer_names else ""
                    raise BridgeError(
                        f"bridge peer {peer}{name} at {self.addresses[peer]} did not come up "
                        f"within "
                        f"{self.timeout_s:.0f} s (this is bridge process {self.rank}); check "
                        f"that its world started, or raise {ENV_BRIDGE_TIMEOUT}") from None
                time.sleep(0.2)
        if self.transport == "transfer":
            self._peers[peer] = self._server.connect(header["transfer"])
            conn.close()
        else:
            self._peers[peer] = conn
        return self._peers[peer]

    @property
    def in_flight(self) -> int:
        """Prefetches started and not yet waited for."""
        return len(self._pending)

    # --- the boundary codec ----------------------------------------------------------------------
    def _compressed(self, key: int) -> bool:
        return self.codec != "none" and _kind_of(key) in _COMPRESSED

    def _encode(self, key: int, arrays: Sequence) -> list:
        """arrays -> [codes, scales] per array; a gradient with its stream's carried error."""
        import jax

        from hetjax.parallel.codec import dequantize, quantize

        feedback = _kind_of(key) == "gradient"
        if feedback not in self._encode_fns:
            def enc(x, carried):
                e = x.astype("float32") + carried
                q, scale = quantize(e, 8)
                return q, scale, e - dequantize(q, scale, e.shape, 8)

            self._encode_fns[feedback] = jax.jit(enc)
        stream = key & ((1 << (_STAGE_BITS + _MB_BITS + _KIND_BITS + _PART_BITS)) - 1)
        out = []
        for i, x in enumerate(arrays):
            carried = self._residual.get((stream, i), 0.0) if feedback else 0.0
            q, scale, err = self._encode_fns[feedback](x, carried)
            if feedback:
                self._residual[stream, i] = err
            out += [q, scale]
        return out

    @staticmethod
    def _wire_specs(specs: Sequence) -> list:
        """The ShapeDtypeStructs of the (codes, scales) pairs that encode `specs`."""
        import jax

        out = []
        for s in specs:
            r = int(np.prod(s.shape[:-1])) if len(s.shape) else 1
            c = s.shape[-1] if len(s.shape) else 1
            out += [jax.ShapeDtypeStruct((r, c), np.int8, sharding=s.sharding),
                    jax.ShapeDtypeStruct((r, 1), np.float32, sharding=s.sharding)]
        return out

    def _decode(self, wire: list, specs: Sequence) -> list:
        import jax

        from hetjax.parallel.codec import dequantize

        if self._decode_fn is None:
            self._decode_fn = jax.jit(
                lambda q, scale, shape, dtype: dequantize(q, scale, shape, 8).astype(dtype),
                static_argnums=(2, 3))
        return [self._decode_fn(wire[2 * i], wire[2 * i + 1], tuple(s.shape), np.dtype(s.dtype))
                for i, s in enumerate(specs)]

    # --- messages ------------------------------------------------------------------------------
    def send(self, key: int, arrays: Sequence) -> None:
        """Offer single-device arrays under `key` to the one peer that will pull them."""
        if self._compressed(key):
            arrays = self._encode(key, arrays)
        self.bytes_sent += sum(a.nbytes for a in arrays)
        if self.transport == "transfer":
            self._server.await_pull(key, list(arrays))
            return
        host = [np.asarray(a) for a in arrays]
        with self._cond:
            self._outbox[key] = host
            self._cond.notify_all()

    def prefetch(self, peer: int, key: int, specs: Sequence) -> None:
        """Start receiving message `key` from `peer` into `specs` (ShapeDtypeStructs with
        single-device shardings); keeps at most `max_in_flight` outstanding."""
        if (peer, key) in self._pending or (peer, key) in self._arrived:
            return
        while len(self._pending) >= self.max_in_flight:
            oldest = next(iter(self._pending))
            self._arrived[oldest] = self._wait(*oldest)
        self._start(peer, key, self._wire_specs(specs) if self._compressed(key) else specs)

    def _start(self, peer: int, key: int, specs: Sequence) -> None:
        conn = self.connect(peer)
        n = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in specs)
        self.bytes_received[peer] = self.bytes_received.get(peer, 0) + n
        kind = _kind_of(key)
        self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + n
        if self.transport == "transfer":
            self._pending[peer, key] = conn.pull(key, list(specs))
        else:
            self._pending[peer, key] = self._pool.submit(self._socket_pull, peer, key,
                                                          list(specs))

    def _socket_pull(self, peer: int, key: int, specs) -> list:
        import jax
        import jax.numpy as jnp

        # A connection per message: a get waits until the peer has sent the message, and a
        # shared connection would make a later message wait behind an earlier one.
        host, _, port = self.addresses[peer].rpartition(":")
        with socket.create_connection((host.strip("[]"), int(port))) as conn:
            _send_msg(conn, {"get": key})
            header, payload = _recv_msg(conn)
        out, offset = [], 0
        for (dtype, shape), spec in zip(header["arrays"], specs):
            a = np.frombuffer(payload, jnp.dtype(dtype), int(np.prod(shape)), offset)
            offset += a.nbytes
            out.append(jax.device_put(a.reshape(shape), spec.sharding))
        return out

    def _wait(self, peer: int, key: int) -> list:
        """The arrays of pending message `key`, once ready (at most `timeout_s`)."""
        handle = self._pending.pop((peer, key))
        if not isinstance(handle, Future):  # a transfer pull: its arrays fill in place
            import jax

            arrays = handle
            handle = (self._waiter.submit(jax.block_until_ready, arrays)
                      if not all(a.is_ready() for a in arrays) else None)
        try:
            if handle is not None:
                arrays = handle.result(timeout=self.timeout_s)
        except TimeoutError:
            arrays = None
        except (ConnectionError, OSError) as e:
            raise BridgeError(f"bridge peer {peer} failed while sending message {key}: "
                              f"{e}") from None
        if arrays is None:
            raise BridgeError(f"message {key} from bridge peer {peer} did not arrive within "
                              f"{self.timeout_s:.0f} s (this is bridge process {self.rank}); "
                              "the peer may have stopped")
        return list(arrays)

    def recv(self, peer: int, key: int, specs: Sequence) -> list:
        """Message `key` from `peer` (prefetched or pulled now), waited for. A message not
        prefetched is pulled at once, beyond the in-flight bound: waiting for an older
        prefetch first could wait for a message the peer sends only after this one."""
        if (peer, key) in self._arrived:
            arrays = self._arrived.pop((peer, key))
        else:
            if (peer, key) not in self._pending:
                self._start(peer, key,
                            self._wire_specs(specs) if self._compressed(key) else specs)
            arrays = self._wait(peer, key)
        return self._decode(arrays, specs) if self._compressed(key) else arrays

    def barrier(self, peers: Sequence[int]) -> None:
        """Wait until every one of `peers` has reached its matching barrier: e.g. before
        exiting, so a process does not leave while a peer still pulls its last messages."""
        self._barriers += 1
        n = self._barriers
        deadline = time.monotonic() + self.timeout_s
        for peer in peers:
            host, _, port = self.addresses[peer].rpartition(":")
            try:
                with socket.create_connection((host.strip("[]"), int(port)),
                                              timeout=self.timeout_s) as conn:
                    _send_msg(conn, {"barrier": n, "rank": self.rank})
                    _recv_msg(conn)
            except (OSError, ConnectionError, struct.error) as e:
                raise BridgeError(f"bridge peer {peer} did not take barrier {n}: {e}") from None
        with self._cond:
            while not all(self._arrivals.get(p, 0) >= n for p in peers):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [p for p in peers if self._arrivals.get(p, 0) < n]
                    raise BridgeError(f"bridge peers {missing} did not reach barrier {n} within "
                                      f"{self.timeout_s:.0f} s (this is bridge process "
                                      f"{self.rank})")
                self._cond.wait(left)

    def close(self) -> None:
        self._closed = True
        for conn in self._peers.values():
            if isinstance(conn, socket.socket):
                conn.close()
        self._listener.close()
        for pool in (self._pool, self._waiter):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


def bridged(env=None) -> bool:
    """Whether this process is one world of a job whose worlds the bridge joins (the
    launcher set its HETJAX_BRIDGE_* variables): then its jax.distributed job holds only its
    world's processes, not every rank of the topology."""
    return ENV_BRIDGE_RANK in (os.environ if env is None else env)


def bridge_from_environ(env=None, **kwargs) -> Bridge | None:
    """This worker's bridge from HETJAX_BRIDGE_* variables, or None when they are unset (a
    single-world job)."""
    env = os.environ if env is None else env
    if ENV_BRIDGE_RANK not in env:
        return None
    try:
        rank, port = int(env[ENV_BRIDGE_RANK]), int(env[ENV_BRIDGE_PORT])
    except (KeyError, ValueError):
        raise BridgeError(f"{ENV_BRIDGE_RANK} and {ENV_BRIDGE_PORT} must be integers (the "
                          "launcher sets them for every worker of a multi-world job)") from None
    hosts = [h for h in env.get(ENV_BRIDGE_HOSTS, "").split(",") if h]
    if not hosts:
        raise BridgeError(f"{ENV_BRIDGE_HOSTS} is empty; it lists every bridge process's host")
    timeout = float(env.get(ENV_BRIDGE_TIMEOUT, DEFAULT_TIMEOUT))
    return Bridge(rank, bridge_addresses(hosts, port), env.get(ENV_BRIDGE_TRANSPORT, "transfer"),
                  timeout_s=timeout, **kwargs)


def _numeric_host(host: str) -> str:
    """`host` as an IP address (resolved here, as this process's peers reach it)."""
    bare = host.strip("[]")
    try:
        info = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise BridgeError(f"bridge host {host!r} does not resolve on this host ({e}); list "
                          f"resolvable names or addresses in {ENV_BRIDGE_HOSTS}") from None
    addr = info[0][4][0]
    return f"[{addr}]" if ":" in addr else addr


def bridge_addresses(hosts: Sequence[str], port: int) -> list[str]:
    """Control addresses: bridge process r on hosts[r], port + r."""
    return [f"{h}:{port + r}" for r, h in enumerate(hosts)]


def bridge_environ(rank: int, hosts: Sequence[str], port: int,
                   transport: str = "transfer") -> dict[str, str]:
    """The variables `bridge_from_environ` reads, for bridge process `rank`."""
    return {ENV_BRIDGE_RANK: str(rank), ENV_BRIDGE_HOSTS: ",".join(hosts),
            ENV_BRIDGE_PORT: str(port), ENV_BRIDGE_TRANSPORT: transport}


__all__ = ["Bridge", "BridgeError", "message_key", "bridged", "bridge_from_environ",
           "bridge_environ",
           "bridge_addresses", "KINDS", "TRANSPORTS", "CODECS"]

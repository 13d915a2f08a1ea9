"""The bridge between JAX worlds: two independent processes exchange arrays of several sizes,
dtypes and devices (transfer server and socket transport), prefetches stay bounded, and a peer
that never comes up is named."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hetjax.launch import free_port
from parallel.bridge import Bridge, BridgeError, bridge_environ, bridge_from_environ, message_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent("""
    import os, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import SingleDeviceSharding
    from parallel.bridge import bridge_from_environ, message_key

    bridge = bridge_from_environ(max_in_flight=2)
    me, peer = bridge.rank, 1 - bridge.rank
    devs = jax.local_devices()
    # (shape, dtype, sender device, receiver device): a scalar, bf16, int, 3 MiB, 2 devices
    cases = [((), np.float32, 0, 1), ((5, 7), jnp.bfloat16, 1, 0), ((4, 3), np.int32, 0, 0),
             ((3, 512, 512), np.float32, 1, 1)]

    def value(i, shape, dtype, who):
        n = int(np.prod(shape))
        return (np.arange(n, dtype=np.float32).reshape(shape) * (i + 1) + 100 * who).astype(dtype)

    for i, (shape, dtype, src, _) in enumerate(cases):  # everything offered first
        x = jax.device_put(value(i, shape, dtype, me), devs[src])
        bridge.send(message_key(0, me, i, "test"), [x * 1])
    specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(devs[dst]))
             for shape, dtype, _, dst in cases]
    for i in range(len(cases)):  # more prefetches than max_in_flight
        bridge.prefetch(peer, message_key(0, peer, i, "test"), [specs[i]])
        assert bridge.in_flight <= 2, bridge.in_flight
    for i, (shape, dtype, _, dst) in enumerate(cases):
        (y,) = bridge.recv(peer, message_key(0, peer, i, "test"), [specs[i]])
        assert y.devices() == {devs[dst]}, (y.devices(), dst)
        assert y.dtype == np.dtype(dtype) and y.shape == shape
        np.testing.assert_array_equal(np.asarray(y), value(i, shape, dtype, peer))
    # two arrays in one message, on two devices
    a, b = jax.device_put(np.full(3, me, np.float32), devs[0]), jax.device_put(
        np.full((2, 2), me, np.int32), devs[1])
    bridge.send(message_key(1, me, 0, "activation", part=1), [a, b])
    ya, yb = bridge.recv(peer, message_key(1, peer, 0, "activation", part=1),
                         [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=b.sharding)])
    assert (np.asarray(ya) == peer).all() and (np.asarray(yb) == peer).all()
    bridge.barrier([peer])
    total = sum(int(np.prod(c[0])) * np.dtype(c[1]).itemsize for c in cases) + 12 + 16
    assert bridge.bytes_sent == total and bridge.bytes_received == {peer: total}, (
        bridge.bytes_sent, bridge.bytes_received, total)
    assert bridge.bytes_by_kind == {"test": total - 28, "activation": 28}, bridge.bytes_by_kind
    print("ok", me, flush=True)
""")


@pytest.mark.parametrize("transport", ["transfer", "socket"])
def test_two_processes_exchange_arrays_of_every_kind(tmp_path, transport):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, **bridge_environ(rank, ["127.0.0.1"] * 2, port, transport),
               "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "HETJAX_BRIDGE_TIMEOUT": "30",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = [p.communicate(timeout=90)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"ok {rank}" in out, out[-3000:]


def test_a_peer_that_never_comes_up_is_named():
    addresses = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    bridge = Bridge(0, addresses, transport="socket", timeout_s=1.0)
    try:
        with pytest.raises(BridgeError, match=rf"peer 1 at {addresses[1]} did not come up"):
            bridge.recv(1, message_key(0, 1, 0, "activation"), [])
    finally:
        bridge.close()


def test_message_keys_are_unique_and_checked():
    keys = {message_key(step, stage, mb, kind, part) for step in (0, 1, 10**6)
            for stage in (0, 3) for mb in (0, 7) for kind in ("activation", "gradient", "loss")
            for part in (0, 5)}
    assert len(keys) == 3 * 2 * 2 * 3 * 2 and max(keys) < 2**63
    with pytest.raises(BridgeError, match="kind 'weights' is unknown"):
        message_key(0, 0, 0, "weights")
    with pytest.raises(BridgeError, match="microbatch 70000"):
        message_key(0, 0, 70000, "activation")


def test_the_environment_round_trips_and_bad_values_are_named():
    assert bridge_from_environ({}) is None
    with pytest.raises(BridgeError, match="HETJAX_BRIDGE_PORT must be integers"):
        bridge_from_environ({"HETJAX_BRIDGE_RANK": "0", "HETJAX_BRIDGE_PORT": "x"})
    with pytest.raises(BridgeError, match="transport 'carrier-pigeon' is unknown"):
        bridge_from_environ({**bridge_environ(0, ["127.0.0.1"], free_port()),
                             "HETJAX_BRIDGE_TRANSPORT": "carrier-pigeon"})


def test_a_host_name_becomes_the_address_the_transfer_server_advertises():
    """Given a name, the transfer server would bind and advertise 0.0.0.0, which a peer on
    another host cannot reach: the bridge resolves it first (the testbed's hosts are names)."""
    from parallel.bridge import _numeric_host

    assert _numeric_host("localhost") in ("127.0.0.1", "[::1]")
    assert _numeric_host("10.77.0.1") == "10.77.0.1"
    with pytest.raises(BridgeError, match="does not resolve.*HETJAX_BRIDGE_HOSTS"):
        _numeric_host("no-such-host.invalid")
    bridge = Bridge(0, [f"localhost:{free_port()}", "localhost:1"], timeout_s=1)
    try:
        assert bridge._transfer_address.split(":")[0] in ("127.0.0.1", "[::1]")
    finally:
        bridge.close()

"""Measuring the cost model's inputs on the devices of the current job (`hetjax calibrate`).

Two kinds of measurement, each timed over a few samples after a warm-up (the mean sample for
compute, the median for collectives):
- compute: the model's own decoder block, forward and forward + backward, on every local
  device of one accelerator kind at once (each device its own micro-batch, no communication:
  on simulated CPU devices they share the cores, as in training), at several micro-batch
  sizes and sequence lengths; and the block as the pipelines run it (forward and backward
  in separate programs, per recompute policy: part "staged:<policy>");
- operation kinds (`measure_kinds`): matmuls of several sizes, attention per implementation
  this platform runs, and a memory-bound stream, each on every device of a kind at once --
  what the per-kind compute model (hetjax/planner/compute.py) is calibrated with;
- collectives: all-reduce, reduce-scatter, all-gather and point-to-point (a ring shift) over
  groups that cover every device -- the devices of a node, one device per node of a cluster,
  a whole cluster, one device per cluster, everything -- at several message sizes. Every
  group of a layout runs at once, as a stage's DP groups do, so a shared NIC is shared.

Works in one process (simulated CPU devices, or the GPUs of one host) and in every process of
a `hetjax launch` job (all processes run the same programs; compute runs on each process's
own devices and the results are gathered). The rows go to `hetjax.planner.calibrate`, which
fits and stores them.

`Progress` makes a calibration speak: it states up front how many measurements it will take
and about how long, prints each one as it ends, and warns when a measurement's own samples
disagree by more than SPREAD_TOLERANCE (a busy machine or a changing clock: the fit would be
noise).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from hetjax.planner.calibrate import Calibration, ComputeRow, LinkRow, OPS_MEASURED
from hetjax.planner.compute_profile import ProfileRow
from hetjax.core.topology import Topology

if TYPE_CHECKING:
    from hetjax.core.model_config import ModelConfig

DEFAULT_BATCHES = (1, 4)
DEFAULT_MESSAGE_BYTES = (1 << 16, 1 << 20, 1 << 22)


# Every timed sample lasts at least this long by default: under a CPU quota (the testbed's
# emulated accelerators and most containers: CFS periods of 100 ms) or clock boost, a
# call of a few ms is throttled or not by chance; a sample spanning many periods averages that.
MIN_SAMPLE_S = 0.5
# Samples of one measurement that differ by more than this ((max - min) / mean) are flagged.
SPREAD_TOLERANCE = 0.10
# --quick: fewer, shorter samples, one micro-batch size and sequence length, no staged rows.
QUICK = dict(repeats=2, min_sample_s=0.1, batches=(1,), message_bytes=(1 << 16, 1 << 22))


class Progress:
    """Prints a calibration's progress: `start` states the count and an estimate, `done`
    each measurement with its spread, warning when the spread exceeds SPREAD_TOLERANCE."""

    def __init__(self, out=print):
        self.out, self.total, self.count, self.t0 = out, 0, 0, time.perf_counter()
        self.noisy: list[tuple[str, float]] = []

    def start(self, total: int, repeats: int, min_sample_s: float, compile_s: float) -> None:
        self.total, self.t0 = total, time.perf_counter()
        # each measurement: a compile, a warm-up and a timing call, then its samples
        each = compile_s + repeats * max(min_sample_s, 0.01) + min_sample_s
        self.out(f"calibrate: {total} measurements, about {_duration(total * each)} "
                 f"({repeats} samples of >= {min_sample_s:g} s each after a compile)")

    def done(self, label: str, samples: Sequence[float]) -> None:
        self.count += 1
        mean = float(np.mean(samples))
        spread = (max(samples) - min(samples)) / mean if mean > 0 and len(samples) > 1 else 0.0
        elapsed = time.perf_counter() - self.t0
        self.out(f"  [{self.count}/{max(self.total, self.count)}] {label}: {mean * 1e3:.3g} ms"
                 f" (spread {spread:.0%}; {elapsed:.0f} s so far)")
        if spread > SPREAD_TOLERANCE:
            self.noisy.append((label, spread))
            self.out(f"  warning: the samples of {label} disagree by {spread:.0%}, more than "
                     f"the {SPREAD_TOLERANCE:.0%} a calibration states; the machine is busy "
                     "or its clock changes -- rerun on a quiet machine or with --repeats=5 "
                     "--min_sample=1")

    def summary(self) -> str:
        head = f"calibrate: {self.count} measurements in {_duration(time.perf_counter() - self.t0)}"
        if not self.noisy:
            return head + f"; every measurement's samples within {SPREAD_TOLERANCE:.0%}"
        worst = max(self.noisy, key=lambda x: x[1])
        return (head + f"; warning: {len(self.noisy)} of them spread beyond "
                f"{SPREAD_TOLERANCE:.0%} (worst {worst[0]}: {worst[1]:.0%}) -- treat this "
                "calibration as noisy")


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min"


_PROGRESS: Progress | None = None  # set by `calibrate` while it runs


def _calls_per_sample(fn, args, min_sample_s: float, agree: bool = False) -> int:
    """How many back-to-back calls make a sample of `min_sample_s` (after a compile + warm-up
    call). With `agree`, every process of the job takes the largest count (a collective must
    run the same number of times everywhere); a process not in the collective passes fn=None."""
    import jax

    calls = 0
    if fn is not None:
        jax.block_until_ready(fn(*args))  # compile and warm up
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        calls = max(1, int(np.ceil(min_sample_s / max(time.perf_counter() - t0, 1e-6))))
    if agree and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        calls = int(np.max(multihost_utils.process_allgather(np.int64(calls))))
    return calls


def _sample_seconds(fn, args, repeats: int, calls: int) -> list[float]:
    """`repeats` samples of the mean seconds per call over `calls` back-to-back calls."""
    import jax

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):  # waited for one by one: many collectives queued at once
            jax.block_until_ready(fn(*args))  # deadlock XLA's in-process CPU rendezvous
        times.append((time.perf_counter() - t0) / calls)
    return times


def _reported(label: str, samples: list[float]) -> list[float]:
    if _PROGRESS is not None and label:
        _PROGRESS.done(label, samples)
    return samples


def _median_seconds(fn, args, repeats: int, calls: int, label: str = "") -> float:
    """A collective's time: the median sample (a sample that met a retransmit or a late peer
    is an outlier, not part of the link's rate)."""
    return float(np.median(_reported(label, _sample_seconds(fn, args, repeats, calls))))


def _mean_seconds(fn, args, repeats: int, calls: int, label: str = "") -> float:
    """A computation's time: the mean sample. Under a CPU quota a sample gets its periods'
    quotas give or take one, so samples come out in two clusters (a capped block's backward:
    26.5 or 36 ms in alternate 0.5 s samples under 100 ms periods); the median picks one
    cluster, the mean converges to the long-run rate."""
    return float(np.mean(_reported(label, _sample_seconds(fn, args, repeats, calls))))


def _mean_and_spread(fn, args, repeats: int, calls: int, label: str) -> tuple[float, float]:
    """`_mean_seconds` and the samples' (max - min) / mean."""
    samples = _reported(label, _sample_seconds(fn, args, repeats, calls))
    mean = float(np.mean(samples))
    return mean, float((max(samples) - min(samples)) / mean) if mean > 0 else 0.0


def tp_degrees(model: "ModelConfig", devices_per_node: int, local: int) -> tuple[int, ...]:
    """The TP degrees `hetjax calibrate` measures the layer at: the powers of two above 1
    that divide a node's devices (a TP group stays inside a node), this process's, and the
    model's heads, key/value heads and feed-forward width (what TP splits)."""
    out, t = [], 2
    while t <= min(devices_per_node, local):
        if all(x % t == 0 for x in (devices_per_node, local, model.n_heads, model.n_kv_heads,
                                    model.d_ff)):
            out.append(t)
        t *= 2
    return tuple(out)


def measure_tp_layers(model: "ModelConfig", devices: Sequence, kind: str,
                      degrees: Sequence[int], batches: Sequence[int], seq_lens: Sequence[int],
                      repeats: int = 3, min_sample_s: float = MIN_SAMPLE_S) -> list[ProfileRow]:
    """Compute profile rows of one decoder layer split over `tp` devices (Megatron's split,
    as the model's logical axes place it: heads and the MLP over 'tp', its collectives
    included), every group of `devices` running its own micro-batch of `b` sequences of `s`
    tokens at once: forward seconds, backward seconds (forward + backward less forward), the
    samples' spread, and XLA's temporary bytes of the forward + backward program per device
    (`peak_bytes`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from hetjax.core.plan import MESH_AXES
    from hetjax.layers.block import DecoderBlock
    from hetjax.parallel.sharding import named, param_specs

    block = DecoderBlock(model)
    dtype = jnp.dtype(model.dtype)
    rows = []
    for tp in degrees:
        n = len(devices) // tp * tp
        shape = {axis: 1 for axis in MESH_AXES} | {"dp": n // tp, "tp": tp}
        mesh = Mesh(np.asarray(devices[:n]).reshape(tuple(shape.values())), MESH_AXES)
        boxed = jax.eval_shape(lambda: block.init(jax.random.PRNGKey(0),
                                                  jnp.zeros((1, 8, model.d_model), dtype)))
        shardings = named(mesh, param_specs(boxed["params"]))
        params = jax.jit(lambda: block.init(jax.random.PRNGKey(0), jnp.zeros(
            (1, 8, model.d_model), dtype))["params"], out_shardings=shardings)()
        params = jax.tree.map(lambda a: a.value if hasattr(a, "value") else a, params,
                              is_leaf=lambda a: hasattr(a, "value"))
        batch = NamedSharding(mesh, P(("dp",), None, None))

        def fwd(p, x):
            return block.apply({"params": p}, x)

        def loss(p, x):
            return jnp.sum(fwd(p, x).astype(jnp.float32))

        run_fwd = jax.jit(fwd)
        run_grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        for s in seq_lens:
            for b in batches:
                x = jax.device_put(jnp.ones((n // tp * b, s, model.d_model), dtype), batch)
                what = f"{kind} layer tp={tp} b={b} s={s}"
                t_fwd, sp_f = _mean_and_spread(
                    run_fwd, (params, x), repeats,
                    _calls_per_sample(run_fwd, (params, x), min_sample_s), f"{what} forward")
                t_grad, sp_g = _mean_and_spread(
                    run_grad, (params, x), repeats,
                    _calls_per_sample(run_grad, (params, x), min_sample_s),
                    f"{what} forward + backward")
                ma = run_grad.lower(params, x).compile().memory_analysis()
                rows.append(ProfileRow(
                    accelerator=kind, piece="layer", tp=tp, tokens=b * s, seq_len=s,
                    fwd_s=t_fwd, bwd_s=max(t_grad - t_fwd, 1e-3 * t_fwd),
                    peak_bytes=float(getattr(ma, "temp_size_in_bytes", 0) or 0),
                    spread=max(sp_f, sp_g)))
    return rows


def _stacked(params, devices):
    """`params` copied onto each of `devices` (a leading axis, one slice per device)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    spread = NamedSharding(Mesh(np.asarray(devices), ("d",)), P("d"))
    n = len(devices)
    return jax.device_put(jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), params),
                          spread), spread


def _fwd_bwd_rows(part: str, fwd, loss, params, make_input, devices, kind: str,
                  peak_tflops: float, batches, seq_lens, repeats, min_sample_s):
    """ComputeRows of `part`: forward seconds of `fwd`, and the pure backward (gradient of
    `loss` with respect to the parameters and input, less the forward), on all of `devices`
    at once, for every (batch, seq_len)."""
    import jax

    stacked, spread = _stacked(params, devices)
    run_fwd = jax.jit(jax.vmap(fwd))
    run_grad = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1), allow_int=True)))
    rows = []
    for s in seq_lens:
        for b in batches:
            x = jax.device_put(make_input(len(devices), b, s), spread)
            what = f"{kind} {part} b={b} s={s}"
            t_fwd = _mean_seconds(run_fwd, (stacked, x), repeats,
                                  _calls_per_sample(run_fwd, (stacked, x), min_sample_s),
                                  f"{what} forward")
            t_grad = _mean_seconds(run_grad, (stacked, x), repeats,
                                   _calls_per_sample(run_grad, (stacked, x), min_sample_s),
                                   f"{what} forward + backward")
            rows.append(ComputeRow(kind, b, s, t_fwd, max(t_grad - t_fwd, 1e-3 * t_fwd),
                                   peak_tflops, part))
    return rows


def measure_compute(model: "ModelConfig", devices: Sequence, kind: str, peak_tflops: float,
                    batches: Sequence[int], seq_lens: Sequence[int],
                    repeats: int = 3, min_sample_s: float = MIN_SAMPLE_S,
                    staged: bool = True) -> list[ComputeRow]:
    """Forward and backward seconds per micro-batch of `b` sequences of `s` tokens, on all of
    `devices` at once: of one decoder block (part "block"), and of the embedding, final norm,
    head and loss together (part "head")."""
    import jax
    import jax.numpy as jnp

    from hetjax.layers.block import DecoderBlock
    from hetjax.layers.model import Transformer, cross_entropy

    block = DecoderBlock(model)
    dtype = jnp.dtype(model.dtype)
    params = block.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, model.d_model), dtype))["params"]

    def fwd(p, x):
        return block.apply({"params": p}, x)

    def loss(p, x):
        return jnp.sum(fwd(p, x).astype(jnp.float32))

    rows = _fwd_bwd_rows("block", fwd, loss, params,
                         lambda n, b, s: jnp.ones((n, b, s, model.d_model), dtype), devices,
                         kind, peak_tflops, batches, seq_lens, repeats, min_sample_s)
    net = Transformer(dataclasses.replace(model, n_layers=1))
    tokens0 = jnp.zeros((1, 8), jnp.int32)
    whole = net.init(jax.random.PRNGKey(0), tokens0)["params"]
    outer = {k: v for k, v in whole.items() if k != "layers"}  # embedding, norm, head

    def head_loss(p, tokens):
        logits = net.apply({"params": {**p, "layers": whole["layers"]}}, tokens,
                           method=lambda m, t: m.head(m.embed(t)))
        return cross_entropy(logits, tokens)

    rows += _fwd_bwd_rows("head", head_loss, head_loss, outer,
                          lambda n, b, s: jnp.zeros((n, b, s), jnp.int32), devices, kind,
                          peak_tflops, batches, seq_lens, repeats, min_sample_s)
    for policy in staged_policies(model) if staged else ():
        rows += _staged_rows(model, params, policy, devices, kind, peak_tflops, batches,
                             seq_lens, repeats, min_sample_s)
    return rows


def staged_policies(model: "ModelConfig") -> tuple[str, ...]:
    """The recompute policies `hetjax calibrate` measures the block under as the pipelines
    run it: none and full always (the executors' defaults), dots when the model asks for it or
    leaves the choice to the planner (model.remat=auto)."""
    return ("none", "full") + (("dots",) if model.remat in ("dots", "auto") else ())


def _staged_rows(model: "ModelConfig", params, policy: str, devices, kind: str,
                 peak_tflops: float, batches, seq_lens, repeats, min_sample_s):
    """ComputeRows of part "staged:<policy>": one block as both pipeline executors run it
    (`hetjax.parallel.residuals`): F is the block under `jax.vjp` keeping the policy's residuals, in
    one program; B is the pullback from those residuals, in another program -- so the
    recompute is real (in one program XLA merges it with the forward) and B's time includes
    it. Measured because it costs more than its FLOPs say: on CPU a layer's B under 'full'
    took 1.3x a plain forward + backward."""
    import jax
    import jax.numpy as jnp

    from hetjax.parallel.residuals import layer_fn, pullback, vjp_stash

    fn = layer_fn(model, policy)
    spec = {}

    def forward(p, x):
        out, kept, spec["r"] = vjp_stash(fn, p, x)
        return out, kept

    def backward(p, kept, dy):
        return pullback(spec["r"], p, kept)(dy)

    stacked, spread = _stacked(params, devices)
    run_f, run_b = jax.jit(jax.vmap(forward)), jax.jit(jax.vmap(backward))
    dtype = jnp.dtype(model.dtype)
    rows = []
    for s in seq_lens:
        for b in batches:
            x = jax.device_put(jnp.ones((len(devices), b, s, model.d_model), dtype), spread)
            out, kept = run_f(stacked, x)
            what = f"{kind} staged:{policy} b={b} s={s}"
            t_f = _mean_seconds(run_f, (stacked, x), repeats,
                                _calls_per_sample(run_f, (stacked, x), min_sample_s),
                                f"{what} forward")
            args = (stacked, kept, out)
            t_b = _mean_seconds(run_b, args, repeats,
                                _calls_per_sample(run_b, args, min_sample_s), f"{what} backward")
            # bytes per device: what the forward keeps (the stash the executors hold per
            # micro-batch in flight) and, while the backward runs, that, the incoming
            # gradient and the backward program's temporaries
            n = len(devices)
            kept_b = sum(a.nbytes for a in jax.tree.leaves(kept)) / n
            temp = getattr(run_b.lower(*args).compile().memory_analysis(),
                           "temp_size_in_bytes", 0) or 0
            rows.append(ComputeRow(kind, b, s, t_f, t_b, peak_tflops, f"staged:{policy}",
                                   kept_bytes=kept_b, peak_bytes=kept_b + out.nbytes / n + temp))
    return rows


def measure_update(model: "ModelConfig", devices: Sequence, kind: str, optimizer=None,
                   repeats: int = 3, min_sample_s: float = MIN_SAMPLE_S) -> ComputeRow:
    """Seconds of one optimizer update (`optimizer`, default AdamW) of the whole model's
    parameters on each of `devices` at once, as a ComputeRow of part "update" whose
    `params` says how many parameters one device updated (batch and seq_len 0)."""
    import jax
    import jax.numpy as jnp
    import optax

    from hetjax.layers.model import Transformer

    tx = optimizer or optax.adamw(1e-3)
    params = Transformer(model).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    stacked, _ = _stacked(params, devices)
    state = jax.jit(jax.vmap(tx.init))(stacked)

    def update(p, s):
        updates, s = tx.update(jax.tree.map(jnp.ones_like, p), s, p)
        return optax.apply_updates(p, updates), s

    run = jax.jit(jax.vmap(update))
    seconds = _mean_seconds(run, (stacked, state), repeats,
                            _calls_per_sample(run, (stacked, state), min_sample_s),
                            f"{kind} optimizer update")
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    return ComputeRow(kind, 0, 0, seconds, 0.0, 0.0, "update", n)


# Square matmul sizes (n x n x n) per platform: small ones run far below peak, large ones near it.
MATMUL_SIZES = {"cpu": (32, 64, 128, 256), "gpu": (512, 1024, 2048, 4096, 8192),
                "tpu": (512, 1024, 2048, 4096, 8192)}
# Elements of the memory-bound stream (y = 2x + 1: one read and one write of each)
STREAM_ELEMENTS = {"cpu": 1 << 20, "gpu": 1 << 27, "tpu": 1 << 27}


def attention_impls(platform: str) -> tuple[str, ...]:
    """The attention implementations (model.attention) measured on this platform: XLA's
    everywhere, cuDNN's fused kernel on GPUs."""
    return ("xla", "cudnn") if platform == "gpu" else ("xla",)


def kinds_count(platform: str) -> int:
    return len(MATMUL_SIZES.get(platform, MATMUL_SIZES["cpu"])) + 2 * len(
        attention_impls(platform)) + 1


def measure_kinds(model: "ModelConfig", devices: Sequence, kind: str, peak_tflops: float,
                  batch: int, seq_len: int, repeats: int = 3,
                  min_sample_s: float = MIN_SAMPLE_S) -> list[ComputeRow]:
    """The per-kind compute model's inputs, on every device of `kind` at once: square matmuls
    (part "matmul", `params` = FLOPs of one call), causal attention of the model's heads at
    (`batch`, `seq_len`) per implementation (part "attention:<impl>", forward and pure
    backward, `params` = forward FLOPs over the full square), and a memory-bound stream
    (part "memory", `params` = bytes read and written)."""
    import jax
    import jax.numpy as jnp

    platform = devices[0].platform
    n_dev = len(devices)
    dtype = jnp.dtype(model.dtype)
    spread = _stacked(jnp.zeros(()), devices)[1]
    rows = []

    def put(shape, dt=dtype):
        return jax.device_put(jnp.ones((n_dev, *shape), dt), spread)

    def timed(fn, args, label):
        return _mean_seconds(fn, args, repeats, _calls_per_sample(fn, args, min_sample_s), label)

    def lift(fn):
        """fn on every device's slice at once (vmap over the device axis); on one device
        without the vmap, so a fused kernel sees its own shapes."""
        if n_dev > 1:
            return jax.jit(jax.vmap(fn))
        return jax.jit(lambda *xs: fn(*(x[0] for x in xs)))

    mm = lift(lambda a, b: a @ b)
    for n in MATMUL_SIZES.get(platform, MATMUL_SIZES["cpu"]):
        a = put((n, n))
        t = timed(mm, (a, a), f"{kind} matmul {n}x{n}x{n}")
        rows.append(ComputeRow(kind, n, n, t, 0.0, peak_tflops, "matmul", 2 * n ** 3))
    h, hd = model.n_heads, model.head_dim
    for impl in attention_impls(platform):
        adt = dtype if impl == "xla" or dtype != jnp.float32 else jnp.bfloat16

        def attend(q, k, v, impl=impl):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

        def loss(q, k, v, attend=attend):
            return jnp.sum(attend(q, k, v).astype(jnp.float32))

        q = put((batch, seq_len, h, hd), adt)
        fwd = lift(attend)
        grad = lift(jax.grad(loss, argnums=(0, 1, 2)))
        what = f"{kind} attention:{impl} b={batch} s={seq_len}"
        t_f = timed(fwd, (q, q, q), f"{what} forward")
        t_g = timed(grad, (q, q, q), f"{what} forward + backward")
        rows.append(ComputeRow(kind, batch, seq_len, t_f, max(t_g - t_f, 1e-3 * t_f),
                               peak_tflops, f"attention:{impl}",
                               4 * batch * seq_len * seq_len * h * hd))
    n = STREAM_ELEMENTS.get(platform, STREAM_ELEMENTS["cpu"])
    x = put((n,))
    stream = lift(lambda v: v * 2 + 1)
    t = timed(stream, (x,), f"{kind} memory stream {n * dtype.itemsize} bytes")
    rows.append(ComputeRow(kind, 0, 0, t, 0.0, peak_tflops, "memory", 2 * n * dtype.itemsize))
    return rows


def group_layouts(topology: Topology) -> list[np.ndarray]:
    """Rank groups [groups, size] covering every device once, one layout per span: inside a
    node, one device per node of a cluster, a whole cluster, one device per cluster, all.
    Clusters of different shapes get the node and the all-device layouts only."""
    n = topology.num_devices
    ranks = np.arange(n)
    shapes = {(c.nodes, c.devices_per_node) for c in topology.clusters}
    layouts = []
    if len(shapes) == 1:
        (nodes, per_node), = shapes
        grid = ranks.reshape(len(topology.clusters), nodes, per_node)  # [C, N, D]
        layouts = [grid.reshape(-1, per_node),                             # a node
                   grid.transpose(0, 2, 1).reshape(-1, nodes),              # a device per node
                   grid.reshape(len(topology.clusters), -1),                # a cluster
                   grid.transpose(1, 2, 0).reshape(-1, len(topology.clusters))]  # per cluster
    elif len({d for _, d in shapes}) == 1:
        layouts = [ranks.reshape(-1, topology.clusters[0].devices_per_node)]
    layouts.append(ranks[None, :])
    seen, out = set(), []
    for g in layouts:
        key = frozenset(frozenset(row) for row in g.tolist())
        if g.shape[1] > 1 and key not in seen:
            seen.add(key)
            out.append(g)
    return out


def split_by_class(topology: Topology, groups: np.ndarray) -> list[np.ndarray]:
    """The rows of a layout grouped by the link class each crosses (its slowest link), so
    each measurement belongs to one class."""
    from hetjax.planner.cost import CostModel
    from hetjax.core.model_config import ModelConfig

    cm = CostModel(topology, ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=1,
                                         n_kv_heads=1, d_ff=8))
    kinds = np.array([lk.kind for lk in cm.group_links(groups)])
    return [groups[kinds == k] for k in dict.fromkeys(kinds.tolist())]


def measure_links(topology: Topology, devices: Sequence, message_bytes: Sequence[int],
                  repeats: int = 3, min_sample_s: float = MIN_SAMPLE_S) -> list[LinkRow]:
    """Seconds of each operation over each group layout of `group_layouts` (split by link
    class) at each size (float32 elements; all-gather's size is the gathered result,
    reduce-scatter's its input, point-to-point's what each device sends). A process owning
    none of a layout's devices does not run it and records 0 s (see _gather)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    me = jax.process_index()
    rows = []
    for layout in group_layouts(topology):
        for groups in split_by_class(topology, layout):
            r, g = groups.shape
            devs = np.asarray(devices, dtype=object)[groups]
            mine = any(d.process_index == me for d in devs.ravel())
            mesh = Mesh(devs, ("r", "g"))
            sharding = NamedSharding(mesh, P("r", "g"))
            bodies = {
                "all_reduce": lambda x: jax.lax.psum(x, "g"),
                "reduce_scatter": lambda x, g=g: jax.lax.psum_scatter(
                    x, "g", scatter_dimension=2, tiled=True),
                "all_gather": lambda x: jax.lax.all_gather(x, "g", axis=2, tiled=True),
                "p2p": lambda x, g=g: jax.lax.ppermute(x, "g",
                                                       [(i, (i + 1) % g) for i in range(g)]),
            }
            for op in OPS_MEASURED:
                fn = jax.jit(jax.shard_map(bodies[op], mesh=mesh, in_specs=P("r", "g"),
                                           out_specs=P("r", "g")))
                for nbytes in message_bytes:
                    elems = max(g, nbytes // 4 // g * g)  # divisible by the group
                    seconds, x = 0.0, None
                    if mine:
                        local = elems // g if op == "all_gather" else elems
                        x = jax.make_array_from_callback(
                            (r, g, local), sharding,
                            lambda idx, local=local: np.ones((1, 1, local), np.float32))
                    calls = _calls_per_sample(fn if mine else None, (x,), min_sample_s, agree=True)
                    if mine:
                        seconds = _median_seconds(fn, (x,), repeats, calls,
                                                  f"{op} {r} x {g} devices, {elems * 4} bytes")
                    rows.append(LinkRow(op, elems * 4, tuple(map(tuple, groups.tolist())),
                                        seconds))
    return rows


def calibrate(topology: Topology, model: "ModelConfig", seq_lens: Sequence[int],
              batches: Sequence[int] = DEFAULT_BATCHES,
              message_bytes: Sequence[int] = DEFAULT_MESSAGE_BYTES,
              repeats: int = 3, min_sample_s: float = MIN_SAMPLE_S,
              optimizer=None, staged: bool = True, kinds: bool = True,
              progress: Progress | None = None, tp: bool = True) -> Calibration:
    """Measure this job's devices: compute (block, head, optimizer update, and with `kinds`
    matmuls / attention / memory-bound work) per accelerator kind, collectives per link
    class. `staged`: also the block as the pipelines run it. `tp`: also the layer split over
    each TP degree a node allows (one process only: compute profile rows). `progress` reports each
    measurement (see Progress). In a multi-process job every process must call it; all get
    the whole Calibration."""
    import jax

    global _PROGRESS
    devices = topology.jax_devices()
    me = jax.process_index()
    local_ranks = [r for r, d in enumerate(devices) if d.process_index == me]
    compute = []
    by_kind: dict[str, list[int]] = {}
    for r in local_ranks:
        by_kind.setdefault(topology.accelerator_of(r).name, []).append(r)
    platform = devices[0].platform
    degrees = {}  # accelerator kind -> the TP degrees its layer is measured at
    if tp and jax.process_count() == 1:
        for kind, ranks in by_kind.items():
            per_node = topology.cluster_of(ranks[0]).devices_per_node
            degrees[kind] = tp_degrees(model, per_node, len(ranks))
    if progress is not None:
        points = len(batches) * len(seq_lens)
        per_kind = 2 * points * (2 + (len(staged_policies(model)) if staged else 0)) + 1 + (
            kinds_count(platform) if kinds else 0)
        per_kind += 2 * points * max((len(d) for d in degrees.values()), default=0)
        links = sum(len(split_by_class(topology, g)) for g in group_layouts(topology)) * len(
            OPS_MEASURED) * len(message_bytes)
        progress.start(len(by_kind) * per_kind + links, repeats, min_sample_s,
                       compile_s=0.5 if platform == "cpu" else 2.0)
    _PROGRESS = progress
    try:
        compute, links = _measure(topology, model, devices, by_kind, seq_lens, batches,
                                  message_bytes, repeats, min_sample_s, optimizer, staged, kinds)
        profile = [row for kind, ranks in sorted(by_kind.items()) for row in measure_tp_layers(
            model, [devices[r] for r in ranks], kind, degrees.get(kind, ()), batches,
            seq_lens, repeats, min_sample_s)]
    finally:
        _PROGRESS = None
    return Calibration(topology, model, tuple(compute), tuple(links),
                       processes=jax.process_count(),
                       collectives=str(jax.config.jax_cpu_collectives_implementation or "")
                       if platform == "cpu" and jax.process_count() > 1 else platform,
                       profile_rows=tuple(profile))


def _measure(topology, model, devices, by_kind, seq_lens, batches, message_bytes, repeats,
             min_sample_s, optimizer, staged, kinds):
    import jax

    compute = []
    for kind, ranks in sorted(by_kind.items()):
        mine = [devices[r] for r in ranks]
        peak = topology.accelerator_of(ranks[0]).peak_tflops
        compute += measure_compute(model, mine, kind, peak, batches, seq_lens, repeats,
                                   min_sample_s, staged=staged)
        compute.append(measure_update(model, mine, kind, optimizer, repeats, min_sample_s))
        if kinds:
            compute += measure_kinds(model, mine, kind, peak, max(batches), max(seq_lens),
                                     repeats, min_sample_s)
    if jax.process_count() > 1:
        # Slower kinds finish their compute later; wait for them at the coordination
        # service's barrier (as orbax does), since the first collective below would give its
        # gloo context only 30 s to assemble (a collective barrier would too).
        from jax._src import distributed

        distributed.global_state.client.wait_at_barrier("hetjax_calibrate_compute_done",
                                                        timeout_in_ms=24 * 3600 * 1000)
    links = measure_links(topology, devices, message_bytes, repeats, min_sample_s)
    if jax.process_count() > 1:
        compute, links = _gather(compute, links)
    return compute, links


def _gather(compute: list[ComputeRow], links: list[LinkRow]):
    """Every process's compute rows merged per accelerator kind (`merge_compute`), and the
    slowest process's time of each collective (it ends when its last member is done)."""
    from jax.experimental import multihost_utils

    comp = np.array([[r.fwd_s, r.bwd_s, r.peak_tflops] for r in compute])
    link = np.array([r.seconds for r in links])
    all_comp = multihost_utils.process_allgather(comp)  # [processes, rows, 3]
    all_link = multihost_utils.process_allgather(link)  # [processes, rows]
    kinds = multihost_utils.process_allgather(
        np.frombuffer(compute[0].kind.encode().ljust(32), np.uint8))
    kinds = [bytes(k).decode().strip() for k in kinds]
    slowest = all_link.max(axis=0)
    return (merge_compute(compute, all_comp, kinds),
            [LinkRow(r.op, r.nbytes, r.groups, float(t)) for r, t in zip(links, slowest)])


def merge_compute(rows: list[ComputeRow], per_process: np.ndarray,
                  kinds: Sequence[str]) -> list[ComputeRow]:
    """One row per accelerator kind and measured point: the mean over that kind's
    processes. `per_process[p, i]` is process p's (fwd_s, bwd_s, peak_tflops) of the point of
    `rows[i]`; `kinds[p]` is process p's kind.

    The mean, not the slowest: processes of one kind run the same device, and what sets their
    times apart is when their samples were throttled or shared a core, so the slowest of
    several is biased up."""
    merged = []
    for kind in dict.fromkeys(kinds):
        mine = np.mean(per_process[[p for p, k in enumerate(kinds) if k == kind]], axis=0)
        merged += [dataclasses.replace(r, kind=kind, fwd_s=float(f), bwd_s=float(b),
                                       peak_tflops=float(peak))
                   for r, (f, b, peak) in zip(rows, mine)]
    return merged


__all__ = ["calibrate", "measure_compute", "measure_kinds", "Progress", "QUICK",
           "SPREAD_TOLERANCE", "merge_compute", "staged_policies", "measure_update",
           "measure_links", "group_layouts", "DEFAULT_BATCHES", "DEFAULT_MESSAGE_BYTES"]

"""DiLoCo between sites: local SGD with an outer optimizer, as one executor of the Trainer.

A site is a topology cluster or a group of clusters (`diloco.sites`). Each site trains on its
own devices with its own plan (the planner's, for the site's sub-topology and its share of the
global batch: rows [s B / n, (s + 1) B / n) go to site s) and its own inner optimizer state.
Every `diloco.inner_steps` (H) steps the sites exchange pseudo-gradients
delta_s = theta - theta_s (theta: the outer parameters of the round's start), optionally
quantized with per-row scales (`diloco.codec` int8 / int4: what crosses the slow links is the
quantized payload), average them, and every site applies the same outer optimizer step
(`diloco.outer_optimizer`: Nesterov momentum or SGD) to theta and restarts from the result,
keeping its inner optimizer state. The quantized exchange is a reduce-scatter + all-gather:
each pseudo-gradient is quantized once, the mean of the dequantized ones is quantized once
more (hetjax/planner/diloco.py prices exactly that).

In one process the sites are groups of devices; the exchange is a device-to-device copy of
the payloads. `DilocoState` holds every site's train state, its copy of theta and of the outer
optimizer state, so a checkpoint resumes mid-round exactly. With inner_steps = 1, no codec, an
SGD inner optimizer and outer SGD at learning rate 1 a step is synchronous data parallelism
(theta - mean_s(theta - theta_s) = mean_s theta_s); tests/test_diloco.py checks it against a
single-device reference.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from hetjax import checkpoint as hckpt
from hetjax.errors import ConfigError
from hetjax.hardware import Topology
from hetjax.planner.config_plan import plan_from_config
from hetjax.planner.diloco import (BITS, site_clusters, site_config, site_first_ranks,
                                   site_topology)
from parallel import sharding as shd
from parallel.executor import SingleProgramExecutor
from parallel.train_state import Executor, TrainState, opt_state_specs


# --- the codec: per-row symmetric quantization ----------------------------------------------
def _rows(x):
    return x.reshape(1, 1) if x.ndim == 0 else x.reshape(-1, x.shape[-1])


def quantize(x: jax.Array, bits: int):
    """`x` -> (codes, scales): each row (last axis) scaled by max|row| / (2^(bits-1) - 1) and
    rounded; int4 codes are packed two to a byte. Error bound: |x - dequantize| <= scale / 2 =
    max|row| / (2 (2^(bits-1) - 1)) per element."""
    r = _rows(x.astype(jnp.float32))
    qmax = 2 ** (bits - 1) - 1
    peak = jnp.max(jnp.abs(r), axis=1, keepdims=True)
    scale = jnp.where(peak > 0, peak / qmax, 1.0)
    q = jnp.clip(jnp.round(r / scale), -qmax, qmax).astype(jnp.int8)
    if bits == 4:
        flat = (q.reshape(-1) + 8).astype(jnp.uint8)  # 1..15
        flat = jnp.pad(flat, (0, flat.size % 2))
        q = flat[0::2] | (flat[1::2] << 4)
    return q, scale


def dequantize(codes, scale, shape, bits: int) -> jax.Array:
    n = int(np.prod(shape)) if shape else 1
    if bits == 4:
        lo = (codes & 0xF).astype(jnp.int8) - 8
        hi = (codes >> 4).astype(jnp.int8) - 8
        codes = jnp.stack([lo, hi], axis=1).reshape(-1)[:n]
    rows = scale.shape[0]
    return (codes.reshape(rows, -1).astype(jnp.float32) * scale).reshape(shape)


def encode(tree, codec: str):
    """A pytree of float arrays -> its wire form under `codec` (fp32 arrays for 'none')."""
    if codec == "none":
        return jax.tree.map(lambda x: x.astype(jnp.float32), tree)
    return jax.tree.map(lambda x: quantize(x, BITS[codec]), tree)


def decode(wire, like, codec: str):
    """The inverse of `encode`; `like` gives the shapes."""
    if codec == "none":
        return wire
    return jax.tree.map(lambda w, x: dequantize(w[0], w[1], x.shape, BITS[codec]), wire, like,
                        is_leaf=lambda w: isinstance(w, tuple))


def wire_bytes(wire) -> int:
    """Bytes of an encoded pytree (what one site sends per exchange, before the ring's
    2 (n - 1) / n factor)."""
    return int(sum(x.nbytes for x in jax.tree.leaves(wire)))


# --- the state and the executor ---------------------------------------------------------------
@flax.struct.dataclass
class DilocoState:
    step: jax.Array  # inner steps done (the same on every site)
    sites: tuple  # each site's TrainState (its parameters, inner optimizer state)
    outer: tuple  # each site's copy of the outer parameters theta (the round's start)
    outer_opt: tuple  # each site's copy of the outer optimizer state


def outer_optimizer(d) -> optax.GradientTransformation:
    if d.outer_optimizer == "sgd":
        return optax.sgd(d.outer_lr)
    return optax.sgd(d.outer_lr, momentum=d.outer_momentum, nesterov=True)


def inner_optimizer(c, tx, schedule) -> optax.GradientTransformation:
    """The sites' optimizer: the trainer's (AdamW) or plain SGD at train.lr's schedule."""
    return tx if c.diloco.inner_optimizer == "adamw" else optax.sgd(schedule)


@dataclasses.dataclass(frozen=True)
class _PlacedTopology(Topology):
    """A site's sub-topology on a given list of JAX devices (a device group of this process)."""

    placed: tuple = ()

    def jax_devices(self):
        return list(self.placed)


class DilocoExecutor(Executor):
    """Sites as device groups of one process, each a `SingleProgramExecutor` on its own plan;
    an outer step every `diloco.inner_steps` steps."""

    def __init__(self, config, topology: Topology, model_cfg, tx, lr_schedule):
        if jax.process_count() > 1:
            raise ConfigError("diloco.inner_steps", "DiLoCo runs in one process for now (sites "
                              "as device groups)", "run without hetjax launch, or set "
                              "diloco.inner_steps=0")
        d = config.diloco
        self.H, self.codec = d.inner_steps, d.codec
        self.sites = site_clusters(topology, tuple(d.sites))
        n = len(self.sites)
        if n < 2:
            raise ConfigError("diloco.sites", f"topology {topology.name!r} gives one site",
                              "use a topology with two clusters or more, or diloco.inner_steps=0")
        sc = site_config(config, n)
        devices = topology.jax_devices()
        self.site_plans, self.site_execs = [], []
        inner = inner_optimizer(config, tx, lr_schedule)
        for (name, clusters), ranks in zip(self.sites, site_first_ranks(topology, self.sites)):
            sub = site_topology(topology, clusters)
            plan = plan_from_config(sc, sub)
            if plan.pp != 1:
                raise ConfigError("parallel.pp", f"site {name!r} would pipeline (pp = {plan.pp})"
                                  "; DiLoCo sites run pp = 1 plans for now",
                                  "set --config.parallel.pp=1")
            placed = _PlacedTopology(sub.name, sub.clusters, sub.inter_cluster,
                                     sub.cluster_links, placed=tuple(devices[r] for r in ranks))
            self.site_plans.append(plan)
            self.site_execs.append(SingleProgramExecutor(plan, placed, model_cfg, inner,
                                                         lr_schedule))
        super().__init__(self.site_plans[0], topology, model_cfg, inner, lr_schedule)
        self.rows_per_site = sc.train.batch_size
        self.outer_tx = outer_optimizer(d)
        self.outer_name = d.outer_optimizer
        self.exchanges = 0  # outer steps taken by this executor (not restored ones)
        self.bytes_sent = 0  # wire bytes of the site pseudo-gradients it exchanged
        self._build()

    def _build(self):
        self.outer_opt_shardings = []
        self._encode, self._apply = [], []
        for ex in self.site_execs:
            params_sh = ex.state_sharding.params
            self.outer_opt_shardings.append(None)  # set by init_state
            self._encode.append(jax.jit(
                lambda theta, params: encode(jax.tree.map(jnp.subtract, theta, params),
                                             self.codec)))
            self._apply.append(jax.jit(self._outer_step, out_shardings=(params_sh, None)))
        first = self.site_execs[0].mesh.devices.flat[0]
        self.hub = SingleDeviceSharding(first)  # where the shard owners' mean is formed
        self._reduce = jax.jit(self._mean_of)

    def _outer_step(self, theta, opt, wire):
        delta = decode(wire, theta, self.codec)
        updates, opt = self.outer_tx.update(delta, opt, theta)
        return optax.apply_updates(theta, updates), opt

    def _mean_of(self, wires, like):
        deltas = [decode(w, like, self.codec) for w in wires]
        mean = jax.tree.map(lambda *xs: sum(xs) / len(xs), *deltas)
        return encode(mean, self.codec)

    # --- state --------------------------------------------------------------------------------
    def init_state(self, seed: int) -> DilocoState:
        sites, outer, opts = [], [], []
        for i, ex in enumerate(self.site_execs):
            st = ex.init_state(seed)  # the same seed: every site starts from the same theta
            sites.append(st)
            theta = jax.tree.map(lambda x: x.copy(), st.params)
            outer.append(theta)
            specs = opt_state_specs(self.outer_tx, jax.eval_shape(self.outer_tx.init, theta),
                                    ex.param_specs)
            self.outer_opt_shardings[i] = shd.named(ex.mesh, specs)
            opts.append(jax.jit(self.outer_tx.init,
                                out_shardings=self.outer_opt_shardings[i])(theta))
        step = jax.device_put(jnp.zeros((), jnp.int32),
                              NamedSharding(self.site_execs[0].mesh, P()))
        return DilocoState(step=step, sites=tuple(sites), outer=tuple(outer),
                           outer_opt=tuple(opts))

    def params(self, state: DilocoState):
        """The outer parameters theta (the model as of the last exchange)."""
        return state.outer[0]

    def checkpoint_layout(self, state) -> hckpt.Layout:
        shardings = jax.tree.map(lambda x: x.sharding, state)
        return hckpt.NaturalLayout(hckpt.abstract_with_shardings(state, shardings))

    # --- batches --------------------------------------------------------------------------------
    @property
    def data_rows(self) -> np.ndarray:
        return np.arange(self.rows_per_site * len(self.site_execs))

    def put_batch(self, batch, rows=None):
        """The global batch -> one device batch per site (site s: its block of rows)."""
        b = self.rows_per_site
        if rows is not None and len(rows) != b * len(self.site_execs):
            raise ValueError(f"DiLoCo needs every row of the global batch, got {len(rows)}")
        return [ex.put_batch({k: np.asarray(v)[s * b:(s + 1) * b] for k, v in batch.items()})
                for s, ex in enumerate(self.site_execs)]

    # --- the step -------------------------------------------------------------------------------
    def step(self, state: DilocoState, batches):
        sites, metrics = [], []
        for ex, st, b in zip(self.site_execs, state.sites, batches):
            st, m = ex.step(st, b)
            sites.append(st)
            metrics.append(m)
        step = state.step + 1
        state = state.replace(step=step, sites=tuple(sites))
        if int(step) % self.H == 0:
            state = self.exchange(state)
        hub = self.hub
        out = {k: sum(jax.device_put(m[k], hub) for m in metrics) / len(metrics)
               for k in ("loss", "grad_norm")}
        out["lr"] = metrics[0]["lr"]
        return state, out

    def exchange(self, state: DilocoState) -> DilocoState:
        """The outer step: pseudo-gradients encoded on each site, their mean formed (and
        re-encoded) at the hub, the mean sent to every site, which updates its theta."""
        wires = [enc(theta, st.params)
                 for enc, theta, st in zip(self._encode, state.outer, state.sites)]
        self.bytes_sent += sum(wire_bytes(w) for w in wires)
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32),
                            state.outer[0])
        mean = self._reduce([jax.device_put(w, self.hub) for w in wires], like)
        sites, outer, opts = [], [], []
        for i, ex in enumerate(self.site_execs):
            wire = jax.device_put(mean, NamedSharding(ex.mesh, P()))
            theta, opt = self._apply[i](state.outer[i], state.outer_opt[i], wire)
            opt = jax.device_put(opt, self.outer_opt_shardings[i])
            outer.append(theta)
            opts.append(opt)
            params = jax.tree.map(lambda x: x.copy(), theta)
            sites.append(state.sites[i].replace(params=params))
        self.exchanges += 1
        return state.replace(sites=tuple(sites), outer=tuple(outer), outer_opt=tuple(opts))

    def eval_loss(self, state: DilocoState, batch) -> float:
        ex = self.site_execs[0]
        return ex.eval_loss(TrainState(step=state.step, params=state.outer[0], opt_state=None),
                            batch)

    def describe(self) -> str:
        lines = [f"DiLoCo: {len(self.sites)} sites, an outer {self.outer_name} step every "
                 f"{self.H} steps, pseudo-gradients as {self.codec}"]
        for (name, _), plan in zip(self.sites, self.site_plans):
            lines.append(f"  site {name}: pp {plan.pp} dp {plan.dp} tp {plan.tp}, "
                         f"{plan.global_batch} sequences a step")
        return "\n".join(lines)


__all__ = ["DilocoExecutor", "DilocoState", "quantize", "dequantize", "encode", "decode",
           "wire_bytes", "outer_optimizer", "inner_optimizer"]

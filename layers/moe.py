"""Mixture-of-Experts feed-forward: a router, stacked SwiGLU experts, an optional shared expert.

A token's hidden state goes to `experts_per_token` (k) of `n_experts` (E) experts chosen by a
linear router, and comes back as the router-weighted sum of their outputs (plus, with a shared
expert, that expert's output scaled by a sigmoid gate, as Qwen2-MoE). The router runs in
float32: softmax over all E logits, top-k, and with `moe_norm_topk_prob` the k weights
renormalised to sum to 1 (Mixtral, Qwen3-MoE; OLMoE and Qwen2-MoE keep the softmax values).

Parameters of one MoE layer (under `params['layers']['block']['moe']`, every leaf with the
model's leading `[n_layers]` axis in front; f = `moe_d_ff`, s = `shared_expert_d_ff`, d =
`d_model`), each with its logical axis names:

    router/kernel         [d, E]      (embed, None)           logits = x @ kernel
    experts/gate          [E, d, f]   (expert, embed, mlp)    h = silu(x @ gate[e]) * (x @ up[e])
    experts/up            [E, d, f]   (expert, embed, mlp)
    experts/down          [E, f, d]   (expert, mlp, embed)    y_e = h @ down[e]
    shared/gate/kernel    [d, s]      (embed, mlp)            only when shared_expert_d_ff > 0:
    shared/up/kernel      [d, s]      (embed, mlp)            the dense SwiGLU `MLP` of width s
    shared/down/kernel    [s, d]      (mlp, embed)
    shared_gate/kernel    [d, 1]      (embed, None)           only with moe_shared_expert_gate

(HuggingFace stores per-expert `w1` / `gate_proj` as [f, d]: the transpose of `gate[e]`.)

Dispatch (`model.moe_dispatch`) -- how tokens reach their experts; all give the same output
when nothing is dropped:
- `dense`: every expert runs on every token and the router's weights (zero outside the top-k)
  combine them. The reference: E / k times the FLOPs.
- `dropless`: the (token, choice) assignments sorted by expert and run with
  `jax.lax.ragged_dot` (grouped matmul; XLA's CPU backend computes it densely).
- `capacity`: each expert takes at most C = ceil(capacity_factor * tokens * k / E) assignments
  (first choices before second ones, earlier tokens first); the rest are dropped (their
  weight contributes nothing) and counted. Fixed shapes, exactly the active FLOPs at factor 1.
- `auto`: dropless.

Expert parallelism: under a mesh with an `expert` axis of size > 1 (parallel/mesh.py) the
experts' leading axis is split over it, and the layer exchanges tokens with
`jax.lax.all_to_all` on fixed-size buffers inside `jax.shard_map` (manual over 'expert' only;
the other axes stay automatic): each device routes its own tokens, sends each (token, choice)
to the device holding its expert, runs its E / ep experts (dropless: ragged_dot over what it
received; capacity: its slots) and sends the outputs back.

Auxiliary losses, recorded per layer with `self.sow('moe', ...)` (`Transformer` stacks them
over layers; `moe_loss` turns them into the term added to the training loss):
- load balance (Switch Transformer / Megatron-Core's convention): B = E * sum_e f_e * P_e, with
  f_e the fraction of the T * k assignments that chose expert e and P_e the mean router
  probability of e. A uniform router gives B = 1, a router that sends every token to one expert
  with k = 1 gives B = E. transformers' `load_balancing_loss_func` on one layer's logits is
  k * B (it sums f over the k choices without dividing by k).
- router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2; zero logits give (ln E)^2.
The training loss adds moe_aux_loss_coef * mean over MoE layers of B, plus moe_z_loss_coef *
mean over MoE layers of z. Also recorded: the load (f_e) of each expert and the fraction of
assignments dropped.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hetjax.core.model_config import ModelConfig
from hetjax.layers.attention import dense_init
from hetjax.layers.mlp import MLP

# The mesh axis the experts' leading axis is split over (named by parallel/mesh.py's mesh).
EXPERT_AXIS = "expert"
# What Transformer.apply(..., mutable=[STATS]) returns per MoE layer (stacked over layers).
STATS = "moe"


# --- routing and the auxiliary losses ----------------------------------------------------------
def route(logits, k: int, norm_topk: bool):
    """Router probabilities [T, E], and the top-k experts [T, k] (int32) with their weights
    [T, k] (float32) of router logits [T, E] (float32)."""
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, experts.astype(jnp.int32), weights


def expert_counts(experts, n_experts: int):
    """Assignments per expert [E] (float32) of the top-k choices [T, k]."""
    return jnp.zeros((n_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)


def balance_loss(probs, experts, n_experts: int):
    """Switch / Megatron-Core load-balance loss E * sum_e f_e * P_e (1 for a uniform router).
    f_e (a count) carries no gradient; the router learns through P_e."""
    f = jax.lax.stop_gradient(expert_counts(experts, n_experts) / experts.size)
    return n_experts * jnp.sum(f * jnp.mean(probs, axis=0))


def z_loss(logits):
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))


def capacity(tokens: int, k: int, n_experts: int, factor: float) -> int:
    """Slots per expert under the capacity dispatch: ceil(factor * tokens * k / E) (>= 1, and
    never more than `tokens`: a token picks an expert at most once)."""
    return max(1, min(tokens, math.ceil(factor * tokens * k / n_experts)))


# --- the experts ---------------------------------------------------------------------------------
def swiglu(x, gate, up, down):
    """Batched experts: x [E, C, d] -> [E, C, d] with gate/up [E, d, f], down [E, f, d]."""
    h = nn.silu(jnp.einsum("ecd,edf->ecf", x, gate)) * jnp.einsum("ecd,edf->ecf", x, up)
    return jnp.einsum("ecf,efd->ecd", h, down)


def ragged_swiglu(x, group_sizes, gate, up, down):
    """Experts on rows grouped by expert: x [N, d] whose first group_sizes[0] rows go to expert
    0, the next to expert 1, ...; rows past sum(group_sizes) come back as zeros."""
    h = (nn.silu(jax.lax.ragged_dot(x, gate, group_sizes))
         * jax.lax.ragged_dot(x, up, group_sizes))
    return jax.lax.ragged_dot(h, down, group_sizes)


def dispatch_dense(x, experts, weights, w, n_experts: int):
    """The reference: every expert on every token, combined by the router's weights."""
    combine = jnp.zeros((x.shape[0], n_experts), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
    y = swiglu(jnp.broadcast_to(x, (n_experts,) + x.shape), *w)  # [E, T, d]
    return jnp.einsum("te,etd->td", combine.astype(x.dtype), y)


def _sorted_assignments(experts):
    """The T * k assignments sorted by expert (stable: token order inside an expert)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return flat, order


def dispatch_dropless(x, experts, weights, w, n_experts: int):
    """Sort the assignments by expert and run the experts as grouped matmuls: no drops."""
    t, k = experts.shape
    flat, order = _sorted_assignments(experts)
    rows = x[order // k]  # assignment a = token * k + choice
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    out = jnp.zeros_like(rows).at[order].set(ragged_swiglu(rows, sizes, *w))
    return jnp.einsum("tkd,tk->td", out.reshape(t, k, -1), weights.astype(x.dtype))


def slot_positions(experts, n_experts: int):
    """Position of each assignment [T, k] in its expert's queue: first choices of all tokens
    (in token order) before second choices, and so on (GShard's priority)."""
    onehot = jax.nn.one_hot(experts.T, n_experts, dtype=jnp.int32)  # [k, T, E]
    pos = jnp.cumsum(onehot.reshape(-1, n_experts), axis=0).reshape(onehot.shape) - 1
    return jnp.sum(pos * onehot, axis=-1).T  # [T, k]


def dispatch_capacity(x, experts, weights, w, n_experts: int, slots: int):
    """Each expert takes `slots` assignments (slot_positions order), the rest are dropped;
    returns the output and the number of dropped assignments."""
    t, k = experts.shape
    pos = slot_positions(experts, n_experts)
    keep = pos < slots
    # kept assignments land in their slot of an [E * slots] buffer; dropped ones in a last,
    # discarded row
    slot = jnp.where(keep, experts * slots + pos, n_experts * slots).reshape(-1)
    buf = jnp.zeros((n_experts * slots + 1, x.shape[-1]), x.dtype)
    buf = buf.at[slot].set(jnp.repeat(x, k, axis=0))
    out = swiglu(buf[:-1].reshape(n_experts, slots, -1), *w).reshape(n_experts * slots, -1)
    out = jnp.concatenate([out, jnp.zeros_like(out[:1])])[slot].reshape(t, k, -1)
    y = jnp.einsum("tkd,tk->td", out, (weights * keep).astype(x.dtype))
    return y, jnp.sum(~keep).astype(jnp.float32)


# --- expert parallelism --------------------------------------------------------------------------
def expert_parallelism() -> int:
    """The size of the ambient mesh's `expert` axis (1 without a mesh or without the axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[EXPERT_AXIS]


def _exchange_dispatch(x, experts, weights, w, n_experts: int, ep: int, mode: str,
                       slots: int):
    """Expert-parallel dispatch of this device's tokens (inside shard_map over 'expert').

    Send buffers have a fixed shape [ep, E / ep, S, d]: for each destination device, a queue of
    S rows per expert it holds. S is the capacity (capacity) or the local tokens (dropless: a
    token picks an expert at most once, so no queue overflows). all_to_all delivers, the
    destination runs its experts, a second all_to_all returns the outputs to their tokens."""
    t, k = experts.shape
    local = n_experts // ep
    pos = slot_positions(experts, n_experts)
    keep = pos < slots
    slot = jnp.where(keep, experts * slots + pos, n_experts * slots).reshape(-1)
    buf = jnp.zeros((n_experts * slots + 1, x.shape[-1]), x.dtype)
    buf = buf.at[slot].set(jnp.repeat(x, k, axis=0))[:-1]
    send = buf.reshape(ep, local, slots, -1)
    # recv[src] = the rows device `src` queued for this device's experts
    recv = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0, tiled=False)
    rows = jnp.swapaxes(recv, 0, 1).reshape(local, ep * slots, -1)  # [local, ep * S, d]
    if mode == "dropless":
        # only the filled rows are computed: sort the queues' rows by (expert, filled first)
        counts = jnp.zeros((n_experts,), jnp.int32).at[experts.reshape(-1)].add(1)
        filled = jnp.minimum(counts, slots).reshape(ep, local)
        got = jax.lax.all_to_all(filled, EXPERT_AXIS, 0, 0, tiled=False)  # [src, local]
        valid = (jnp.arange(slots)[None, None, :] < got[:, :, None])  # [src, local, S]
        valid = jnp.swapaxes(valid, 0, 1).reshape(-1)  # [local * ep * S]
        flat_rows = rows.reshape(local * ep * slots, -1)
        order = jnp.argsort(~valid, stable=True)  # filled rows first, grouped by expert
        sizes = jnp.sum(got, axis=0).astype(jnp.int32)
        out = jnp.zeros_like(flat_rows).at[order].set(
            ragged_swiglu(flat_rows[order], sizes, *w))
        out = out.reshape(local, ep * slots, -1)
    else:
        out = swiglu(rows, *w)
    back = jnp.swapaxes(out.reshape(local, ep, slots, -1), 0, 1)  # [dst... -> src, local, S, d]
    back = jax.lax.all_to_all(back, EXPERT_AXIS, 0, 0, tiled=False).reshape(n_experts * slots,
                                                                            -1)
    back = jnp.concatenate([back, jnp.zeros_like(back[:1])])[slot].reshape(t, k, -1)
    y = jnp.einsum("tkd,tk->td", back, (weights * keep).astype(x.dtype))
    return y, jnp.sum(~keep).astype(jnp.float32)


def expert_parallel_dispatch(x, experts, weights, w, n_experts: int, ep: int, mode: str,
                             capacity_factor: float):
    """Run `_exchange_dispatch` on each device's tokens with the experts split over the
    ambient mesh's 'expert' axis; x [B, L, d], experts / weights [B, L, k]. Returns the output
    [B, L, d] and the dropped assignments (a global count)."""
    b, l, _ = x.shape
    if b % ep:
        from hetjax.errors import HetjaxError

        raise HetjaxError(f"expert parallelism over {ep} devices splits the batch rows, but a "
                          f"micro-batch has {b}. Fix: make the micro-batch size a multiple of "
                          f"{ep} (train.batch_size / train.microbatches)")
    tokens = (b // ep) * l
    k = experts.shape[-1]
    slots = tokens if mode == "dropless" else capacity(tokens, k, n_experts, capacity_factor)

    def local(x, experts, weights, *w):
        y, dropped = _exchange_dispatch(
            x.reshape(tokens, -1), experts.reshape(tokens, k), weights.reshape(tokens, k), w,
            n_experts, ep, mode, slots)
        return y.reshape(x.shape), jax.lax.psum(dropped, EXPERT_AXIS)

    rows, ex = P(EXPERT_AXIS), P(EXPERT_AXIS)
    fn = jax.shard_map(local, in_specs=(rows, rows, rows, ex, ex, ex), out_specs=(rows, P()),
                       axis_names=frozenset({EXPERT_AXIS}), check_vma=False)
    return fn(x, experts, weights, *w)


# --- the layer -----------------------------------------------------------------------------------
class Experts(nn.Module):
    """The stacked expert weights (gate, up [E, d, f], down [E, f, d]) in the compute dtype."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self):
        cfg = self.cfg
        e, d, f = cfg.n_experts, cfg.d_model, cfg.expert_d_ff
        pdtype = jnp.dtype(cfg.param_dtype)
        # fan-in of one expert (the leading expert axis is a batch axis, not fan-in)
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", batch_axis=0)
        down_init = nn.initializers.variance_scaling(1.0 / (2 * cfg.n_layers), "fan_in",
                                                     "truncated_normal", batch_axis=0)

        def param(name, shape, axes, init):
            return self.param(name, nn.with_logical_partitioning(init, axes), shape, pdtype)

        w = (param("gate", (e, d, f), ("expert", "embed", "mlp"), init),
             param("up", (e, d, f), ("expert", "embed", "mlp"), init),
             param("down", (e, f, d), ("expert", "mlp", "embed"), down_init))
        return tuple(a.astype(jnp.dtype(cfg.dtype)) for a in w)


class MoE(nn.Module):
    """The MoE feed-forward of one decoder block (see the module docstring for its parameters
    and what it records)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        e, k, d = cfg.n_experts, cfg.experts_per_token, cfg.d_model
        b, l, _ = x.shape

        # The router in float32 whatever the compute dtype: top-k choices are sensitive to
        # rounding.
        logits = nn.Dense(e, use_bias=False, dtype=jnp.float32, param_dtype=pdtype,
                          name="router", kernel_init=nn.with_logical_partitioning(
                              dense_init(), ("embed", None)))(x.astype(jnp.float32))
        w = Experts(cfg, name="experts")()
        self.sow("router_logits", "logits", logits)  # kept only when the caller asks
        flat_logits = logits.reshape(b * l, e)
        probs, experts, weights = route(flat_logits, k, cfg.moe_norm_topk_prob)
        mode = "dropless" if cfg.moe_dispatch == "auto" else cfg.moe_dispatch
        ep = expert_parallelism()
        dropped = jnp.zeros((), jnp.float32)
        if ep > 1:
            y, dropped = expert_parallel_dispatch(
                x, experts.reshape(b, l, k), weights.reshape(b, l, k), w, e, ep,
                "capacity" if mode == "capacity" else "dropless", cfg.moe_capacity_factor)
        else:
            xt = x.reshape(b * l, d)
            if mode == "dense":
                y = dispatch_dense(xt, experts, weights, w, e)
            elif mode == "dropless":
                y = dispatch_dropless(xt, experts, weights, w, e)
            else:
                y, dropped = dispatch_capacity(xt, experts, weights, w, e, capacity(
                    b * l, k, e, cfg.moe_capacity_factor))
            y = y.reshape(b, l, d)

        if cfg.shared_expert_d_ff:
            s = MLP(cfg, d_ff=cfg.shared_expert_d_ff, name="shared")(x)
            if cfg.moe_shared_expert_gate:
                g = nn.Dense(1, use_bias=False, dtype=dtype, param_dtype=pdtype,
                             name="shared_gate", kernel_init=nn.with_logical_partitioning(
                                 dense_init(), ("embed", None)))(x)
                s = nn.sigmoid(g) * s
            y = y + s

        self.sow(STATS, "balance", balance_loss(probs, experts, e))
        self.sow(STATS, "z", z_loss(flat_logits))
        self.sow(STATS, "load", expert_counts(experts, e) / experts.size)
        self.sow(STATS, "dropped", dropped / experts.size)
        return nn.with_logical_constraint(y.astype(dtype), ("batch", "length", "embed"))


def moe_loss(stats, cfg: ModelConfig):
    """The auxiliary term the training loss adds, from the stats of `Transformer.apply(...,
    mutable=[STATS])` (or of any subset of its layers, e.g. a pipeline stage's): the
    coefficients times the per-layer losses averaged over the model's MoE layers."""
    if not stats:
        return jnp.zeros((), jnp.float32)
    layers = cfg.n_moe_layers
    total = jnp.zeros((), jnp.float32)
    for name, coef in (("balance", cfg.moe_aux_loss_coef), ("z", cfg.moe_z_loss_coef)):
        if coef:
            total = total + coef * sum(jnp.sum(v) for v in find_stat(stats, name)) / layers
    return total


def find_stat(stats, name: str) -> list:
    """Every array recorded under `name` in a (nested) stats tree."""
    out = []

    def walk(t):
        for key, v in t.items():
            if key == name:
                out.extend(v if isinstance(v, tuple) else (v,))
            elif isinstance(v, dict) or hasattr(v, "items"):
                walk(v)

    walk(stats)
    return out

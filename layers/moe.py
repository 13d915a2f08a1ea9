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
`jax.lax.all_to_all` on fixed-size buffers [ep, E / ep, slots, d] inside `jax.shard_map`
(manual over the data axes and 'expert'; tensor parallelism stays automatic): each device
routes its own tokens, sends each (token, choice) to the device holding its expert, runs its
E / ep experts (dropless: grouped matmuls over the rows it received; capacity: its slots) and
sends the outputs back. `jax.lax.ragged_all_to_all` would send only the filled rows, but XLA's
CPU backend does not implement it, so the fixed buffers are used everywhere. (Dense dispatch
exchanges like dropless: only the experts' own tokens cross the links.)

Auxiliary losses, recorded per layer with `self.sow('moe', ...)` (`Transformer` stacks them
over layers; `moe_loss` sums them into the term the training loss adds, reported as a metric).
Their gradient enters the backward inside the layer (`with_aux_gradient`), so every executor,
pipeline stages included, trains on cross-entropy + that term while reporting the
cross-entropy as the loss:
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
from jax.custom_batching import custom_vmap
from jax.sharding import PartitionSpec as P

from hetjax.core.model_config import ModelConfig
from hetjax.core.plan import DP_AXES, EXPERT_AXIS
from hetjax.layers.attention import dense_init
from hetjax.layers.mlp import MLP

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


# --- the experts ---------------------------------------------------------------------------------
def swiglu(x, gate, up, down):
    """Batched experts: x [E, C, d] -> [E, C, d] with gate/up [E, d, f], down [E, f, d]."""
    h = nn.silu(jnp.einsum("ecd,edf->ecf", x, gate)) * jnp.einsum("ecd,edf->ecf", x, up)
    return jnp.einsum("ecf,efd->ecd", h, down)


# Grouped matmuls. `jax.lax.ragged_dot` has no batching rule for batched group sizes (jax
# 0.10), and the single-program executor vmaps the loss over each data-parallel device's rows;
# so the two products a grouped SwiGLU needs (forward and input gradient: `_gmm`; weight
# gradient: `_tgmm`) carry their own batching rule, `ragged_dot_general` with a batch dimension,
# and the gradient is defined on top of them.
_RDN = jax.lax.RaggedDotDimensionNumbers


def _broadcast(args, batched, size):
    return [a if b else jnp.broadcast_to(a, (size,) + a.shape) for a, b in zip(args, batched)]


@custom_vmap
def _gmm(x, w, sizes):
    """[M, K] rows grouped by `sizes` [G] times w [G, K, N] -> [M, N]."""
    return jax.lax.ragged_dot(x, w, sizes)


@_gmm.def_vmap
def _gmm_batched(size, batched, x, w, sizes):
    x, w, sizes = _broadcast((x, w, sizes), batched, size)
    return jax.lax.ragged_dot_general(x, w, sizes, _RDN((([2], [2]), ([0], [0])), [1], [1])), True


@custom_vmap
def _tgmm(x, dy, sizes):
    """Per group g: x_g^T dy_g -> [G, K, N] (the weight gradient of `_gmm`)."""
    return jax.lax.ragged_dot_general(x, dy, sizes, _RDN((([0], [0]), ([], [])), [0], []))


@_tgmm.def_vmap
def _tgmm_batched(size, batched, x, dy, sizes):
    x, dy, sizes = _broadcast((x, dy, sizes), batched, size)
    out = jax.lax.ragged_dot_general(x, dy, sizes, _RDN((([1], [1]), ([0], [0])), [1], []))
    return jnp.swapaxes(out, 0, 1), True  # it comes out [G, batch, K, N]


@jax.custom_vjp
def grouped_matmul(x, w, sizes):
    """`jax.lax.ragged_dot(x, w, sizes)` that also runs under vmap (see above)."""
    return _gmm(x, w, sizes)


def _grouped_matmul_fwd(x, w, sizes):
    return _gmm(x, w, sizes), (x, w, sizes)


def _grouped_matmul_bwd(res, dy):
    x, w, sizes = res
    return _gmm(dy, jnp.swapaxes(w, -1, -2), sizes), _tgmm(x, dy, sizes), None


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def ragged_swiglu(x, group_sizes, gate, up, down):
    """Experts on rows grouped by expert: x [N, d] whose first group_sizes[0] rows go to expert
    0, the next to expert 1, ...; rows past sum(group_sizes) come back as zeros."""
    h = nn.silu(grouped_matmul(x, gate, group_sizes)) * grouped_matmul(x, up, group_sizes)
    return grouped_matmul(h, down, group_sizes)


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


def row_split() -> tuple[str, ...]:
    """The mesh axes the exchange splits a batch's rows over: the logical 'batch' here (the
    data axes and 'expert' in one program; 'expert' alone inside the executors' per-device
    vmap, whose batching adds the data axes to the specs itself), always with 'expert'."""
    mesh = jax.sharding.get_abstract_mesh()
    split = nn.logical_to_mesh_axes(("batch",))[0]
    split = tuple(a for a in ((split,) if isinstance(split, str) else split or ())
                  if mesh.shape.get(a, 1) > 1 or a == EXPERT_AXIS)
    return split if EXPERT_AXIS in split else split + (EXPERT_AXIS,)


def expert_parallel_dispatch(x, experts, weights, w, cfg: ModelConfig, ep: int):
    """Run `_exchange_dispatch` on each device's tokens with the experts split over the
    ambient mesh's 'expert' axis; x [B, L, d] (B a multiple of the devices `row_split`
    names), experts / weights [B, L, k]. Returns the output [B, L, d] and the dropped
    assignments (a global count). The shard_map is manual over every data axis."""
    mesh = jax.sharding.get_abstract_mesh()
    split = row_split()
    b, l, _ = x.shape
    tokens = (b // math.prod(mesh.shape[a] for a in split)) * l
    k = experts.shape[-1]
    slots = cfg.expert_slots(tokens)
    # the exchange fills fixed queues either way; only capacity dispatch lets them overflow
    mode = "capacity" if cfg.moe_dispatch == "capacity" else "dropless"

    def local(x, experts, weights, *w):
        y, dropped = _exchange_dispatch(
            x.reshape(tokens, -1), experts.reshape(tokens, k), weights.reshape(tokens, k), w,
            cfg.n_experts, ep, mode, slots)
        return y.reshape(x.shape), dropped[None]

    manual = set(mesh.manual_axes) if not mesh.empty else set()
    axes = frozenset(a for a in (*DP_AXES, EXPERT_AXIS) if a not in manual)
    rows, ex = P(split), P(EXPERT_AXIS)
    fn = jax.shard_map(local, in_specs=(rows, rows, rows, ex, ex, ex), out_specs=(rows, rows),
                       axis_names=axes, check_vma=False)
    y, dropped = fn(x, experts, weights, *w)
    return y, jnp.sum(dropped)


@jax.custom_vjp
def with_aux_gradient(y, aux):
    """`y`, with the gradient of the scalar `aux` added to the backward as if `aux` were a term
    of the loss (Megatron-Core's MoEAuxLossAutoScaler): the loss value stays the
    cross-entropy, while the router learns from the auxiliary losses wherever the layer runs."""
    return y


def _with_aux_fwd(y, aux):
    return y, aux


def _with_aux_bwd(aux, dy):
    return dy, jnp.ones_like(aux)


with_aux_gradient.defvjp(_with_aux_fwd, _with_aux_bwd)


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
        # (initialisation traces one row: only the parameters' shapes matter then)
        ep = 1 if self.is_initializing() else expert_parallelism()
        if ep > 1 and b % math.prod(jax.sharding.get_abstract_mesh().shape[a]
                                    for a in row_split()):
            # rows that do not split over the exchange's devices (a few prompts decoding):
            # every device runs the layer on all of them, the experts gathered where needed
            ep = 1
        dropped = jnp.zeros((), jnp.float32)
        if ep > 1:
            y, dropped = expert_parallel_dispatch(
                x, experts.reshape(b, l, k), weights.reshape(b, l, k), w, cfg, ep)
        else:
            xt = x.reshape(b * l, d)
            if mode == "dense":
                y = dispatch_dense(xt, experts, weights, w, e)
            elif mode == "dropless":
                y = dispatch_dropless(xt, experts, weights, w, e)
            else:
                y, dropped = dispatch_capacity(xt, experts, weights, w, e,
                                               cfg.expert_slots(b * l))
            y = y.reshape(b, l, d)

        if cfg.shared_expert_d_ff:
            s = MLP(cfg, d_ff=cfg.shared_expert_d_ff, name="shared")(x)
            if cfg.moe_shared_expert_gate:
                g = nn.Dense(1, use_bias=False, dtype=dtype, param_dtype=pdtype,
                             name="shared_gate", kernel_init=nn.with_logical_partitioning(
                                 dense_init(), ("embed", None)))(x)
                s = nn.sigmoid(g) * s
            y = y + s

        balance, z = balance_loss(probs, experts, e), z_loss(flat_logits)
        # The auxiliary losses' gradient joins the backward here, whoever runs the layer (one
        # program, or a pipeline stage's own vjp): this layer's share of the training loss.
        y = with_aux_gradient(y, (cfg.moe_aux_loss_coef * balance + cfg.moe_z_loss_coef * z)
                              / cfg.n_moe_layers)
        self.sow(STATS, "balance", balance)
        self.sow(STATS, "z", z)
        self.sow(STATS, "load", expert_counts(experts, e) / experts.size)
        self.sow(STATS, "dropped", dropped / experts.size)
        return nn.with_logical_constraint(y.astype(dtype), ("batch", "length", "embed"))


def moe_loss(stats, cfg: ModelConfig):
    """The auxiliary term the training loss adds, from the stats of `Transformer.apply(...,
    mutable=[STATS])` (or of any subset of its layers, e.g. a pipeline stage's): the
    coefficients times the per-layer losses averaged over the model's MoE layers."""
    layers = cfg.n_moe_layers
    total = jnp.zeros((), jnp.float32)
    for name, coef in (("balance", cfg.moe_aux_loss_coef), ("z", cfg.moe_z_loss_coef)):
        if coef:
            total = total + coef * sum(jnp.sum(v) for v in find_stat(stats, name)) / layers
    return total


def layer_stats(collections) -> dict:
    """{name: [MoE layers, ...]} of what `Transformer.apply(..., mutable=[STATS])` returned
    (the layers' records, stacked over layers by the scan)."""
    return {n: find_stat(collections, n)[0] for n in ("balance", "z", "load", "dropped")}


def moe_metrics(stats, aux_loss) -> dict:
    """Scalar metrics of `layer_stats` (averaged over a step): the auxiliary term added to the
    loss, the mean balance loss, z-loss and drop fraction over layers, and per layer i the
    most and least loaded expert's share of the assignments relative to an even share (1.0:
    balanced; E: one expert takes all) and the fraction dropped."""
    load = stats["load"] * stats["load"].shape[-1]
    out = {"moe_aux_loss": aux_loss, "moe_balance": jnp.mean(stats["balance"]),
           "moe_z": jnp.mean(stats["z"]), "moe_drop": jnp.mean(stats["dropped"])}
    for i in range(load.shape[0]):
        out[f"moe_load_max/{i}"] = jnp.max(load[i])
        out[f"moe_load_min/{i}"] = jnp.min(load[i])
        out[f"moe_drop/{i}"] = stats["dropped"][i]
    return out


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

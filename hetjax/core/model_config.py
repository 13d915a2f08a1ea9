"""The model's hyper-parameters as a frozen dataclass, with its parameter and FLOP counts.

The fields cover the LLaMA family as HuggingFace's `LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen2ForCausalLM` and `Qwen3ForCausalLM` define it: grouped key/value heads, a head width that
need not be d_model / n_heads (`head_dim`), RoPE scaling (`rope_type` 'linear' or 'llama3', with
the parameters transformers reads from `rope_scaling`), q/k/v projection biases (Qwen2),
sliding-window attention on every layer or on some (`sliding_window`, `full_attention_layers`),
QK-norm (`qk_norm`: per head as Qwen3, or over all heads as OLMoE) and a tied or untied output
head.

Mixture-of-Experts models (`n_experts` > 0; the layer is `layers/moe.py`) replace every block's
feed-forward with `n_experts` SwiGLU experts of width `moe_d_ff` of which a router picks
`experts_per_token` per token, optionally beside a shared expert (Qwen2-MoE). Their parameter
counts distinguish all parameters (`num_params`, what memory holds) from the active ones per
token (`active_params`, what the FLOPs follow).

`ModelConfig.flops_per_token` is the one FLOPs formula hetjax uses: for MFU in the trainer and
for compute time in the cost model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The names a ModelConfig accepts, defined here (no JAX) so the config's checks and --help read
# them without starting JAX. `layers/model.py` maps the recomputing policies to JAX's; 'none'
# keeps every intermediate and 'auto' lets the planner choose. `layers/attention_kernels.py`
# turns an attention request into a kernel.
REMAT_POLICIES = ("auto", "none", "full", "dots")
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas")
# RMSNorm of the queries and keys before RoPE: 'head' normalises each head's vector (scale
# [head_dim], Qwen3), 'all_heads' the projection's whole output (scale [heads * head_dim], OLMoE).
QK_NORMS = ("none", "head", "all_heads")
# How an MoE layer sends tokens to experts (layers/moe.py): dense (every expert on every token,
# the reference), dropless (sorted, grouped matmuls), capacity (fixed slots per expert, overflow
# dropped and counted); auto: dropless.
MOE_DISPATCH = ("auto", "dense", "dropless", "capacity")
# The largest value each shape field may take: well above every published model (vocabulary
# 262,144 in Gemma 3; width 16,384, 126 layers and 128 heads in Llama-3.1-405B; feed-forward
# 53,248; context 10M in Llama 4 Scout), so a damaged or hostile config.json (a vocabulary of
# 10^12, a million layers) is refused before anything is allocated.
LIMITS = {"vocab_size": 1 << 22, "d_model": 1 << 16, "n_layers": 1024, "n_heads": 1024,
          "n_kv_heads": 1024, "d_ff": 1 << 18, "max_seq_len": 1 << 24, "head_dim": 4096}


def vocab_rows(vocab_size: int, shards: int = 1) -> int:
    """Rows of the embedding and head for a vocabulary split over `shards` devices (the
    plan's tp). A vocabulary that is a multiple of 128 and of `shards` is kept; any other is
    rounded up to a multiple of lcm(128, shards), as Megatron pads (to a multiple of 128 x tp),
    so 333 tokens get 384 rows and Llama-2 fine-tunes' 32001 get 32128. For every tp that
    divides 128 the rows do not depend on tp, so checkpoints stay plan-independent."""
    step = math.lcm(128, shards)
    if vocab_size % 128 == 0 and vocab_size % shards == 0:
        return vocab_size
    return -(-vocab_size // step) * step


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    attention: str = "auto"  # layers/attention_kernels.py: auto | xla | cudnn | pallas
    loss_chunk_tokens: int = 0  # cross-entropy in chunks of this many tokens; 0: in one piece
    # 0: d_model // n_heads (resolved in __post_init__, so `head_dim` is always the width).
    head_dim: int = 0
    # RoPE frequency scaling as transformers' modeling_rope_utils: 'default' (none), 'linear'
    # (every frequency / rope_factor) or 'llama3' (low frequencies / rope_factor, high ones
    # kept, a smooth ramp between, from rope_low/high_freq_factor and rope_original_max_len).
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    qkv_bias: bool = False
    # A query attends to at most the `sliding_window` latest positions, itself included (HF's
    # sliding_window); 0: full causal attention. The layers in `full_attention_layers` attend
    # fully all the same (HF's layer_types 'full_attention').
    sliding_window: int = 0
    full_attention_layers: tuple = ()
    qk_norm: str = "none"  # QK_NORMS
    # Rows of the embedding and the output head: `vocab_size` (0), or more so that tensor
    # parallelism splits them evenly (`vocab_rows`); the extra rows start at zero, their
    # logits are masked out of the softmax, and exports leave them out.
    vocab_rows: int = 0
    # Mixture-of-Experts (layers/moe.py); n_experts = 0: a dense model (none of the rest is read).
    n_experts: int = 0
    experts_per_token: int = 2  # k: experts each token is routed to
    moe_d_ff: int = 0  # hidden width of one expert; 0: d_ff
    shared_expert_d_ff: int = 0  # a shared expert every token passes (Qwen2-MoE); 0: none
    moe_shared_expert_gate: bool = True  # the shared expert's output scaled by sigmoid(x @ g)
    # Which layers are MoE, as HF's Qwen2-MoE / DeepSeek configs say: layer i (from 0) when
    # i >= first_dense_layers and (i + 1) % decoder_sparse_step == 0.
    decoder_sparse_step: int = 1
    first_dense_layers: int = 0
    moe_norm_topk_prob: bool = True  # renormalise the k routing weights to sum to 1
    moe_aux_loss_coef: float = 0.01  # load-balance loss coefficient (1.0 * coef if uniform)
    moe_z_loss_coef: float = 0.0  # router z-loss coefficient
    moe_dispatch: str = "auto"  # one of MOE_DISPATCH
    moe_capacity_factor: float = 1.25  # capacity dispatch: slots = factor * tokens * k / E

    def __post_init__(self):
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        object.__setattr__(self, "full_attention_layers",
                           tuple(sorted(int(i) for i in self.full_attention_layers)))
        if not self.vocab_rows:
            object.__setattr__(self, "vocab_rows", self.vocab_size)

    def window_flags(self) -> tuple[bool, ...]:
        """Per layer: whether it attends through the sliding window."""
        return tuple(bool(self.sliding_window) and i not in self.full_attention_layers
                     for i in range(self.n_layers))

    @property
    def mixed_windows(self) -> bool:
        """Some layers attend through the window and others fully: each layer's flag is then
        data of the layer stack (`window_flags`), not one constant of the model."""
        return len(set(self.window_flags())) > 1

    @property
    def window(self) -> int:
        """The window every layer attends through, when they agree (0: full attention)."""
        return self.sliding_window if all(self.window_flags()) else 0

    @staticmethod
    def from_config(m, vocab_size: int | None = None, shards: int = 1) -> "ModelConfig":
        """From the `model` section of a hetjax config (vocab 0 -> `vocab_size`), with the
        embedding and head padded for `shards`-way tensor parallelism (`vocab_rows`)."""
        vocab = m.vocab_size or vocab_size
        return ModelConfig(
            vocab_size=vocab, vocab_rows=vocab_rows(vocab, shards), d_model=m.d_model,
            n_layers=m.n_layers,
            n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, d_ff=m.d_ff,
            max_seq_len=m.max_seq_len, rope_theta=m.rope_theta, norm_eps=m.norm_eps,
            # dtype 'auto' needs the devices: callers that know them resolve it first
            # (hetjax.config.compute_dtype); without them, float32 (the CPU default)
            tie_embeddings=m.tie_embeddings,
            dtype="float32" if m.dtype == "auto" else m.dtype, param_dtype=m.param_dtype,
            remat=m.remat, attention=m.attention, loss_chunk_tokens=m.loss_chunk_tokens,
            head_dim=m.head_dim, rope_type=m.rope_type,
            rope_factor=m.rope_factor, rope_low_freq_factor=m.rope_low_freq_factor,
            rope_high_freq_factor=m.rope_high_freq_factor,
            rope_original_max_len=m.rope_original_max_len, qkv_bias=m.qkv_bias,
            sliding_window=m.sliding_window,
            full_attention_layers=tuple(m.full_attention_layers), qk_norm=m.qk_norm,
            **{f: m[f] for f in MOE_FIELDS})

    # --- Mixture-of-Experts ----------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def expert_d_ff(self) -> int:
        return self.moe_d_ff or self.d_ff

    @property
    def active_d_ff(self) -> int:
        """The feed-forward width one token passes: d_ff, or in an MoE layer its k experts'
        and the shared expert's (what the planner's compute and activations follow)."""
        if not self.is_moe:
            return self.d_ff
        return self.experts_per_token * self.expert_d_ff + self.shared_expert_d_ff

    def moe_layer(self, i: int) -> bool:
        """Whether layer i (from 0) is an MoE layer."""
        return (self.is_moe and i >= self.first_dense_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def n_moe_layers(self) -> int:
        return sum(self.moe_layer(i) for i in range(self.n_layers))

    @property
    def mixed_layers(self) -> bool:
        """An MoE model some of whose layers are dense."""
        return self.is_moe and self.n_moe_layers != self.n_layers

    def _ffn_params(self, active: bool) -> int:
        d = self.d_model
        if not self.is_moe:
            return 3 * d * self.d_ff
        experts = self.experts_per_token if active else self.n_experts
        shared = 3 * d * self.shared_expert_d_ff
        if self.shared_expert_d_ff and self.moe_shared_expert_gate:
            shared += d
        return d * self.n_experts + experts * 3 * d * self.expert_d_ff + shared

    def expert_slots(self, tokens: int) -> int:
        """Rows per expert in the buffers of an expert-parallel exchange of `tokens` tokens
        per device (layers/moe.py): the capacity under `capacity` dispatch, else `tokens` (a
        token picks an expert at most once, so no queue overflows)."""
        if self.moe_dispatch == "capacity":
            return capacity_slots(tokens, self.experts_per_token, self.n_experts,
                                  self.moe_capacity_factor)
        return tokens

    def all_to_all_bytes(self, tokens: int, value_bytes: int) -> int:
        """V of one token exchange of an MoE layer under expert parallelism: the [ep, E / ep,
        slots, d_model] buffer each device sends and receives (what the HLO's all-to-all
        moves; forward dispatch and combine, and the two of the backward, are each one)."""
        return self.n_experts * self.expert_slots(tokens) * self.d_model * value_bytes

    @property
    def expert_params(self) -> int:
        """Routed experts' parameters of one MoE layer (what expert parallelism splits)."""
        return self.n_experts * 3 * self.d_model * self.expert_d_ff if self.is_moe else 0

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder block."""
        d, h = self.d_model, self.head_dim
        attn = d * self.n_heads * h * 2 + d * self.n_kv_heads * h * 2
        if self.qkv_bias:
            attn += (self.n_heads + 2 * self.n_kv_heads) * h
        attn += {"none": 0, "head": 2 * h, "all_heads": (self.n_heads + self.n_kv_heads) * h}[
            self.qk_norm]
        return attn + self._ffn_params(active=False) + 2 * d

    @property
    def active_layer_params(self) -> int:
        """Parameters one token passes through in one block (the k routed experts only)."""
        return self.layer_params - self._ffn_params(False) + self._ffn_params(True)

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.d_model

    @property
    def head_params(self) -> int:
        """Final norm plus the output projection when it is not tied to the embedding."""
        return self.d_model + (0 if self.tie_embeddings else self.vocab_size * self.d_model)

    @property
    def num_params(self) -> int:
        return self.embed_params + self.n_layers * self.layer_params + self.head_params

    @property
    def active_params(self) -> int:
        """Parameters per token: num_params with only k experts of each MoE layer."""
        return self.embed_params + self.n_layers * self.active_layer_params + self.head_params

    def layer_flops(self, seq_len: int) -> float:
        """Forward FLOPs of one block per token: matmuls (2 per MAC) plus causal attention."""
        d, h = self.d_model, self.head_dim
        proj = 2 * (d * self.n_heads * h * 2 + d * self.n_kv_heads * h * 2)
        mlp = 2 * self._ffn_params(active=True)
        # QK^T and AV over the full (uncausal-masked) square, as MFU conventions count it.
        attn = 2 * 2 * seq_len * self.n_heads * h
        return proj + mlp + attn

    def head_flops(self) -> float:
        """Forward FLOPs per token of the output projection."""
        return 2 * self.d_model * self.vocab_size

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward), without recompute."""
        return 3 * (self.n_layers * self.layer_flops(seq_len) + self.head_flops())


def capacity_slots(tokens: int, k: int, n_experts: int, factor: float) -> int:
    """Slots per expert under capacity dispatch: ceil(factor * tokens * k / E), at least 1 and
    at most `tokens` (a token picks an expert at most once)."""
    return max(1, min(tokens, math.ceil(factor * tokens * k / n_experts)))


# The ModelConfig fields of an MoE model, as the config's `model.*` fields of the same names.
MOE_FIELDS = ("n_experts", "experts_per_token", "moe_d_ff", "shared_expert_d_ff",
              "moe_shared_expert_gate", "decoder_sparse_step", "first_dense_layers",
              "moe_norm_topk_prob", "moe_aux_loss_coef", "moe_z_loss_coef", "moe_dispatch",
              "moe_capacity_factor")

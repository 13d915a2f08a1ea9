"""The model's hyper-parameters as a frozen dataclass, with its parameter and FLOP counts.

`ModelConfig.flops_per_token` is the one FLOPs formula hetjax uses: for MFU in the trainer and
for compute time in the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    attention: str = "auto"  # auto | xla | cudnn | pallas (hetjax/config.py, model.attention)

    @staticmethod
    def from_config(m, vocab_size: int | None = None) -> "ModelConfig":
        """From the `model` section of a hetjax config (vocab 0 -> `vocab_size`)."""
        return ModelConfig(
            vocab_size=m.vocab_size or vocab_size, d_model=m.d_model, n_layers=m.n_layers,
            n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, d_ff=m.d_ff,
            max_seq_len=m.max_seq_len, rope_theta=m.rope_theta, norm_eps=m.norm_eps,
            tie_embeddings=m.tie_embeddings,
            # 'auto' needs the devices: callers that know them resolve it first
            # (hetjax.config.compute_dtype); without them, float32 (the CPU default)
            dtype="float32" if m.dtype == "auto" else m.dtype, param_dtype=m.param_dtype,
            remat=m.remat, attention=m.get("attention", "auto"))

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder block."""
        d, h = self.d_model, self.head_dim
        attn = d * self.n_heads * h * 2 + d * self.n_kv_heads * h * 2
        mlp = 3 * d * self.d_ff
        return attn + mlp + 2 * d

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

    def layer_flops(self, seq_len: int) -> float:
        """Forward FLOPs of one block per token: matmuls (2 per MAC) plus causal attention."""
        d, h = self.d_model, self.head_dim
        proj = 2 * (d * self.n_heads * h * 2 + d * self.n_kv_heads * h * 2)
        mlp = 2 * 3 * d * self.d_ff
        # QK^T and AV over the full (uncausal-masked) square, as MFU conventions count it.
        attn = 2 * 2 * seq_len * self.n_heads * h
        return proj + mlp + attn

    def head_flops(self) -> float:
        """Forward FLOPs per token of the output projection."""
        return 2 * self.d_model * self.vocab_size

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward), without recompute."""
        return 3 * (self.n_layers * self.layer_flops(seq_len) + self.head_flops())

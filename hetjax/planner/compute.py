"""Compute time by operation kind: what one device spends on a decoder layer, the head and the
optimizer update, priced per kind of work rather than at one efficiency for every FLOP.

- matmuls (projections, MLP, output projection) at a fraction of peak that grows with the
  matmul's size: a small matmul cannot fill the device (a 2,048 x 2,304 x 6,912 GEMM on an
  A100 reaches well under what a 2,048 x 25,600 x 9,600 one does);
- attention per implementation (`model.attention`): "xla" as two batched matmuls plus the
  softmax's float32 [heads, q, k] scores streamed through memory; "fused_softmax" the same with
  the scores in the compute dtype (Megatron-LM's fused scale-mask-softmax kernel); "cudnn" and
  "pallas" as fused flash kernels at their own fraction of peak, skipping the causal half;
- memory-bound work as bytes over the memory bandwidth: norms and residual adds (replicated
  over tensor parallelism, as Megatron without sequence parallelism runs them), RoPE, the MLP
  activation, the cross-entropy over the vocabulary, Adam's update.

`KernelRates` holds the per-kind constants of one accelerator kind: nominal defaults, the fit
on Megatron-LM's published runs (hetjax/planner/reference_runs.py) or what `hetjax calibrate`
measured (a `SizeCurve` of matmul efficiency against size, attention and memory-bound rates).
The functions here are pure arithmetic on a `ModelConfig`'s shapes; hetjax/planner/cost.py
calls them when `CostOptions.compute == "kinds"`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hetjax.errors import PlanError
from hetjax.core.hardware import Accelerator

if TYPE_CHECKING:
    from hetjax.core.model_config import ModelConfig

# model.attention's implementations (layers/attention_kernels.py), plus the Megatron-LM
# kernel the reference runs used. "auto" is resolved by `attention_impl`.
ATTENTION_IMPLS = ("xla", "cudnn", "pallas", "fused_softmax")
FLASH = ("cudnn", "pallas")
# Peak FLOPs per byte of memory bandwidth assumed for an accelerator whose bandwidth the
# catalogue does not give (an A100: 312 TFLOP/s over 2.04 TB/s = 153).
FLOPS_PER_BYTE_FALLBACK = 150.0
# Adam with float32 states: parameter, first and second moment read and written, the
# gradient read (7 float32 values a parameter).
ADAM_BYTES_PER_PARAM = 28.0


def attention_impl(requested: str, vendor: str) -> str:
    """The implementation `model.attention` = `requested` runs on a device of `vendor`:
    'auto' takes cuDNN's fused attention on NVIDIA GPUs and XLA elsewhere (CPU, TPU, others)."""
    if requested in ("", "auto"):
        return "cudnn" if vendor == "nvidia" else "xla"
    if requested not in ATTENTION_IMPLS:
        raise PlanError(f"model.attention = {requested!r}; choose one of auto, xla, cudnn, "
                        "pallas")
    return requested


@dataclass(frozen=True)
class SizeCurve:
    """Measured fraction of peak against the FLOPs of one call, interpolated linearly in log
    FLOPs and held constant beyond the measured range."""

    flops: tuple[float, ...]
    efficiency: tuple[float, ...]

    def __post_init__(self):
        if not len(self.flops) == len(self.efficiency) >= 1:
            raise PlanError(f"a size curve needs as many efficiencies as sizes, got "
                            f"{len(self.flops)} and {len(self.efficiency)}")
        if min(self.flops) <= 0 or min(self.efficiency) <= 0:
            raise PlanError("a size curve's sizes and efficiencies must be > 0")

    def __call__(self, flops: float) -> float:
        order = np.argsort(self.flops)
        return float(np.interp(np.log(max(flops, 1e-30)),
                               np.log(np.asarray(self.flops, float)[order]),
                               np.asarray(self.efficiency, float)[order]))


@dataclass(frozen=True)
class KernelRates:
    """Per operation kind, what one accelerator kind reaches.

    matmul_peak, matmul_half_flops: a matmul of F FLOPs runs at
    matmul_peak x F / (F + matmul_half_flops) of peak (a saturating curve: launch and tile
    quantisation costs weigh less as the matmul grows); `matmul_curve`, when measured, is used
    instead. flash: fraction of peak of each fused attention kernel (forward; its backward
    does 2.5x the forward's FLOPs at the same rate). memory_efficiency: achieved / nominal
    memory bandwidth on streaming kernels (memory_bytes_per_s, when measured, instead).
    softmax_passes: reads + writes of each attention
    score in the forward (logits written, read, probabilities written, read by the second
    matmul), the backward twice as many."""

    matmul_peak: float = 0.80
    matmul_half_flops: float = 4e9
    matmul_curve: SizeCurve | None = None
    flash: dict[str, float] = field(default_factory=lambda: {"cudnn": 0.55, "pallas": 0.35})
    memory_efficiency: float = 0.80
    softmax_passes: float = 4.0
    # measured bytes/s of a memory-bound stream (`hetjax calibrate`); 0: nominal x efficiency
    memory_bytes_per_s: float = 0.0

    def __post_init__(self):
        for name, v in (("matmul_peak", self.matmul_peak),
                        ("memory_efficiency", self.memory_efficiency), *self.flash.items()):
            if not 0 < v <= 1:
                raise PlanError(f"kernel rate {name} = {v} must lie in (0, 1]")
        if self.matmul_half_flops < 0:
            raise PlanError(f"kernel rate matmul_half_flops = {self.matmul_half_flops} must be "
                            ">= 0")

    def bandwidth(self, acc: Accelerator) -> float:
        """Achieved bytes/s of memory-bound work on `acc`."""
        if self.memory_bytes_per_s > 0:
            return self.memory_bytes_per_s
        return memory_bandwidth(acc) * self.memory_efficiency

    def matmul_efficiency(self, flops: float) -> float:
        if self.matmul_curve is not None:
            return self.matmul_curve(flops)
        return self.matmul_peak * flops / (flops + self.matmul_half_flops)


@dataclass(frozen=True)
class Work:
    """Seconds of one pass (forward or backward), by kind."""

    matmul: float = 0.0
    attention: float = 0.0
    memory: float = 0.0

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.memory

    def __add__(self, o: "Work") -> "Work":
        return Work(self.matmul + o.matmul, self.attention + o.attention, self.memory + o.memory)


def memory_bandwidth(acc: Accelerator) -> float:
    """Nominal bytes/s of `acc`'s memory (the catalogue's, else a ratio to its peak)."""
    if acc.memory_bandwidth_gbs > 0:
        return acc.memory_bandwidth_gbs * 1e9
    return acc.peak_tflops * 1e12 / FLOPS_PER_BYTE_FALLBACK


def _gemms(m: "ModelConfig", tokens: float, tp: int) -> list[float]:
    """FLOPs of each forward matmul of one layer on one device: QKV, output projection,
    MLP gate + up (one fused call), MLP down (Megatron's column / row split over tp)."""
    d, hd = m.d_model, m.head_dim
    qkv = (m.n_heads + 2 * m.n_kv_heads) * hd
    return [2 * tokens * d * qkv / tp, 2 * tokens * m.n_heads * hd * d / tp,
            2 * tokens * d * 2 * m.active_d_ff / tp, 2 * tokens * m.active_d_ff * d / tp]


def _matmul_time(rates: KernelRates, peak: float, flops: list[float]) -> float:
    return sum(f / (peak * rates.matmul_efficiency(f)) for f in flops)


def layer_work(m: "ModelConfig", acc: Accelerator, rates: KernelRates, tokens: float,
               seq_len: int, tp: int = 1, attention: str = "xla", act_bytes: int = 2
               ) -> tuple[Work, Work]:
    """(forward, backward) of one decoder layer on one device: `tokens` tokens of sequences
    of `seq_len` (the device's micro-batch), heads and MLP split over `tp`. The backward is
    the pure backward (no recompute: `recompute_work` adds it)."""
    peak = acc.peak_tflops * 1e12
    bw = rates.bandwidth(acc)
    gemms = _gemms(m, tokens, tp)
    mm_f = _matmul_time(rates, peak, gemms)
    # QK^T and PV over the full square (the FLOPs layer_flops counts), per device
    heads = m.n_heads / tp
    attn_flops = 2 * 2 * tokens * seq_len * heads * m.head_dim
    if attention in FLASH:
        # a causal flash kernel skips the masked half; its backward recomputes the scores
        at_f = attn_flops / 2 / (peak * rates.flash[attention])
        at_b = 2.5 * at_f
    else:
        batched = attn_flops / 2  # one batched matmul call: QK^T (PV alike)
    # (kept in step with `xla_attention_parts`, which calibrate inverts)
        mm = 2 * batched / (peak * rates.matmul_efficiency(batched))
        scores = tokens * seq_len * heads  # [heads, q, k] elements per device
        elem = 4 if attention == "xla" else act_bytes  # XLA keeps scores in float32
        at_f = mm + scores * elem * rates.softmax_passes / bw
        at_b = 2 * mm + 2 * scores * elem * rates.softmax_passes / bw
    # Streaming work per token: two norms (read + write d) and two residual adds (read 2d,
    # write d), replicated over tp; RoPE on q and k and the MLP activation, split over tp.
    per_token = 10 * m.d_model + (2 * (m.n_heads + m.n_kv_heads) * m.head_dim
                                  + 3 * m.active_d_ff) / tp
    mem_f = tokens * per_token * act_bytes / bw
    fwd = Work(mm_f, at_f, mem_f)
    bwd = Work(2 * mm_f, at_b, 2 * mem_f)
    return fwd, bwd


def xla_attention_parts(m_heads: float, head_dim: int, tokens: float, seq_len: int,
                        rates: KernelRates, peak: float) -> tuple[float, float]:
    """The forward of unfused attention split as (matmul seconds, score elements): what
    `hetjax calibrate` needs to solve softmax_passes from a measured time."""
    attn_flops = 2 * 2 * tokens * seq_len * m_heads * head_dim
    batched = attn_flops / 2
    return 2 * batched / (peak * rates.matmul_efficiency(batched)), tokens * seq_len * m_heads


def recompute_work(fwd: Work, remat: str) -> Work:
    """What the backward recomputes under `remat`: the whole forward ('full'), everything but
    the matmuls ('dots', which saves matmul outputs), nothing ('none')."""
    if remat == "full":
        return fwd
    if remat == "dots":
        return Work(0.0, 0.0, fwd.memory)
    return Work()


def head_work(m: "ModelConfig", acc: Accelerator, rates: KernelRates, tokens: float,
              tp: int = 1, act_bytes: int = 2) -> tuple[Work, Work]:
    """(forward, backward) of the final norm, output projection and cross-entropy on one
    device: the projection's matmul, the float32 logits streamed through the softmax and the
    loss (written, read, and their gradient written: three float32 passes each way)."""
    peak = acc.peak_tflops * 1e12
    bw = rates.bandwidth(acc)
    f = 2 * tokens * m.d_model * m.vocab_size / tp
    mm = f / (peak * rates.matmul_efficiency(f))
    logits = tokens * m.vocab_size / tp * 4 * 3 / bw
    norm = tokens * m.d_model * act_bytes * 2 / bw
    return Work(mm, 0.0, logits + norm), Work(2 * mm, 0.0, logits + 2 * norm)


def update_seconds_per_param(acc: Accelerator, rates: KernelRates) -> float:
    """Adam's update, memory-bound: ADAM_BYTES_PER_PARAM over the memory bandwidth."""
    return ADAM_BYTES_PER_PARAM / rates.bandwidth(acc)


# The per-kind rates used where no calibration file gives a device's own: the matmul curve
# fitted on two rows of Megatron-LM's published scaling table (A100s, 1.7B and 310.1B;
# `reference_runs.fit_megatron`, which a test checks reproduces these numbers and predicts
# the other eight rows within 10%), the other rates nominal. The fitted matmul peak (0.63)
# is below what a large cuBLAS GEMM reaches alone (~0.8): it also carries the work this
# model does not price (dropout, bias + GELU, the fp16 loss scaling, data loading).
FITTED = KernelRates(matmul_peak=0.6274, matmul_half_flops=1.054e9)


__all__ = ["ATTENTION_IMPLS", "KernelRates", "SizeCurve", "Work", "attention_impl",
           "layer_work", "head_work", "recompute_work", "update_seconds_per_param",
           "memory_bandwidth", "ADAM_BYTES_PER_PARAM", "FITTED"]

"""What a plan's per-device memory is made of, and what to say when it does not fit.

The cost model (`hetjax.planner.cost`) sums these terms per pipeline stage; this module owns
the terms that depend on how the step is compiled rather than on the layout's algebra
(`hetjax.planner.zero_factors` owns the model states under the ZeRO factors):

- activations a layer keeps for its backward, per recompute policy (`model.remat`) and
  attention implementation (`model.attention`): XLA's attention materialises f32
  [batch, heads, q, k] logits and probabilities; cuDNN's and the Pallas flash kernel keep only
  O(batch x heads x q) softmax statistics;
- the logits and cross-entropy buffers of the output layer;
- XLA's workspace: what one layer's backward holds beside the kept activations;
- the runtime's reserve per accelerator vendor (`RuntimeReserve`): what a device spends before
  the step's own buffers -- its context, the collectives' buffers, library workspaces and the
  allocator's fragmentation -- taken off the device's memory before the plan's margin.

The optimizer update's temporaries are not priced: XLA schedules the update after the
backward has freed the activations, so they overlap (they decide the peak only at a few
tokens per device, where the step is far from any memory limit).

Each coefficient is fitted to and checked against XLA's own `compiled.memory_analysis()` over
a grid of configurations on CPU (tests/test_memory.py); on GPU the same terms are scaled to the
compute dtype, which no GPU measurement has checked yet. It also words the two memory
failures the user sees: a plan predicted not to fit (`hetjax plan` prints it, `hetjax train`
refuses it) and XLA running out of memory anyway (`oom_message`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetjax.core.model_config import ModelConfig

GIB = 2.0 ** 30
FUSED_ATTENTION = ("cudnn", "pallas")


def attention_implementation(model: "ModelConfig", platform: str = "cpu") -> str:
    """The implementation `model.attention` runs as on `platform` ('auto': fused on GPU, XLA
    on CPU and TPU), which decides the attention buffers priced below."""
    impl = getattr(model, "attention", "auto")
    if impl != "auto":
        return impl
    return "cudnn" if platform == "gpu" else "xla"


@dataclass(frozen=True)
class Widths:
    """Bytes per token per value of a layer's widths, at 4-byte activations: of its residual
    width (d_model + the key/value width), of its feed-forward width, and of its attention
    (heads x keys: XLA's f32 score rows)."""

    width: float = 0.0
    ffn: float = 0.0
    attention: float = 0.0


@dataclass(frozen=True)
class ActivationTerms:
    """One recompute policy: what each layer keeps for its backward (`kept`, stacked over the
    stage's layers and the micro-batches in flight), what lives only while one layer runs its
    backward (`transient`: its recompute and its gradients' buffers), and the output layer's
    bytes per token per vocabulary entry (f32 logits, log-probabilities, their gradients)."""

    kept: Widths
    transient: Widths
    vocab: float


# Fitted (non-negative least squares) on XLA:CPU's buffer assignment of hetjax's train step
# over model width, feed-forward width, layers, sequence length, vocabulary and batch: every
# fitted point within 8% of argument + output + temp - alias, and tests/test_memory.py checks
# a grid of layouts, dtypes and ZeRO points within 10%. What the fit says: 'none' keeps about
# nine values of each width per token and layer and one f32 score row per head (the backward
# holds three more of one layer); 'dots' keeps the projections' outputs (about 2.5 values of
# the residual width, one of the feed-forward width) and not the scores, which the backward
# recomputes one layer at a time; 'full' keeps only the layer's input (fixed at d_model
# values, the fit taken over the rest) and recomputes a whole layer in its backward.
TERMS = {
    "none": ActivationTerms(kept=Widths(34.675, 26.167, 4.414),
                            transient=Widths(attention=13.498), vocab=15.403),
    "dots": ActivationTerms(kept=Widths(10.203, 4.556),
                            transient=Widths(attention=13.336), vocab=15.14),
    "full": ActivationTerms(kept=Widths(),  # the layer's input: layer_bytes_per_token
                            transient=Widths(19.434, 13.329, 8.658), vocab=12.444),
}
# Softmax statistics a fused kernel keeps per query and head (row max and sum, f32).
FUSED_STATS_BYTES = 8.0
# Off CPU, XLA keeps twice the score rows the CPU fit finds under 'none' (the f32 logits and
# the probabilities, where XLA:CPU fuses one away). Measured once: one H200, jax 0.11.2, a
# TinyLlama-1.1B-shaped step at 4 x 2048 with XLA attention needed 144 GiB; the CPU terms give
# 94.5 GiB, with this factor 143.1 (-1%). The 'dots' (30.9 vs 28.5 GiB) and 'full' (24.9 vs
# 23.7) steps of the same run keep no scores and are within 9% as fitted on CPU.
GPU_KEPT_SCORE_FACTOR = 2.0


def _bytes(w: Widths, model: "ModelConfig", seq_len: int, tp: int, attention: str,
           act_bytes: float, score_factor: float = 1.0) -> float:
    """Bytes per token of widths `w`: the activations scale with the compute dtype (off
    CPU), XLA's score rows are f32 whatever it is, a fused kernel keeps only statistics."""
    # the residual-width values a layer keeps are mostly the residual stream and its norms,
    # which tp replicates (measured: priced split, a tp = 2 step came out 11% under XLA's)
    width = model.d_model + model.n_kv_heads * model.head_dim
    heads = model.n_heads / tp
    scores = (score_factor * w.attention * heads * seq_len if attention not in FUSED_ATTENTION
              else FUSED_STATS_BYTES * heads * (w.attention > 0))
    return act_bytes / 4.0 * (w.width * width + w.ffn * model.active_d_ff / tp) + scores


def layer_bytes_per_token(model: "ModelConfig", seq_len: int, tp: int, remat: str,
                          attention: str = "xla", act_bytes: float = 4.0,
                          cpu: bool = True) -> float:
    """Bytes per token one layer keeps for its backward under `remat`, split over tp
    ('full': its input, the residual stream, replicated over tp); `cpu` False: as XLA keeps
    score rows on a GPU (GPU_KEPT_SCORE_FACTOR)."""
    if remat == "full":
        return model.d_model * act_bytes
    return _bytes(TERMS[remat].kept, model, seq_len, tp, attention, act_bytes,
                  1.0 if cpu else GPU_KEPT_SCORE_FACTOR)


def transient_bytes_per_token(model: "ModelConfig", seq_len: int, tp: int, remat: str,
                              attention: str = "xla", act_bytes: float = 4.0) -> float:
    """Bytes per token that live only while one layer runs its backward."""
    return _bytes(TERMS[remat].transient, model, seq_len, tp, attention, act_bytes)


def head_bytes_per_token(model: "ModelConfig", tp: int, remat: str) -> float:
    """The f32 logits, log-probabilities and their gradients, per token (last stage)."""
    return TERMS[remat].vocab * model.vocab_size / tp


@dataclass(frozen=True)
class RuntimeReserve:
    """Bytes a device spends beyond the step's own buffers, each with its source: the
    runtime's context (`context_gib`), the collectives library's buffers (`collectives_gib`),
    kernel libraries' workspaces (`workspace_gib`), and the allocator's fragmentation
    (`fragmentation`: a share of the step's bytes it holds but cannot reuse)."""

    context_gib: float = 0.0
    collectives_gib: float = 0.0
    workspace_gib: float = 0.0
    fragmentation: float = 0.0

    @property
    def fixed_bytes(self) -> float:
        return (self.context_gib + self.collectives_gib + self.workspace_gib) * GIB

    def device_bytes(self, step_bytes: float) -> float:
        """What a device holds at the step's peak of `step_bytes`: the step's bytes, what the
        allocator cannot reuse of them, and the fixed parts."""
        return step_bytes * (1.0 + self.fragmentation) + self.fixed_bytes

    def usable_for_step(self, usable_bytes: float) -> float:
        """The step's bytes that fit a device of which `usable_bytes` may be used."""
        return max(usable_bytes - self.fixed_bytes, 0.0) / (1.0 + self.fragmentation)


# Per device vendor. NVIDIA (and AMD, the same stack): a CUDA context with cuBLAS / cuDNN
# loaded holds 0.7-0.8 GiB before any tensor (781 MB in nvidia-smi at a PyTorch process's
# start: pytorch/pytorch#34323); NCCL allocates NCCL_BUFFSIZE (4 MiB by default, NCCL's
# environment documentation) per channel and direction for each peer of a communicator, about
# 0.5 GiB for a TP and a DP communicator at 16-32 channels; cuBLASLt's and cuDNN's workspaces
# (32 MiB for cuBLAS on Hopper, cuDNN's fused attention and XLA's autotuned GEMMs) about
# 0.25 GiB; a caching allocator (PyTorch's, XLA's BFC) holds blocks it cannot reuse for the
# next size: 5% of the step's bytes, an estimate no measurement here has checked (the H200's
# recorded peaks are the allocator's bytes in use, without it). TPU: the runtime reserves a
# small program area (the HBM `bytes_limit` is below the chip's nominal size, which the local
# preset reads); CPU: none.
RESERVES = {
    "nvidia": RuntimeReserve(0.75, 0.5, 0.25, 0.05),
    "amd": RuntimeReserve(0.75, 0.5, 0.25, 0.05),
    "tpu": RuntimeReserve(0.0, 0.0, 0.25, 0.05),
    "cpu": RuntimeReserve(),
}


def runtime_reserve(vendor: str) -> RuntimeReserve:
    """The reserve of a device of `vendor` (an unknown vendor: NVIDIA's)."""
    return RESERVES.get(vendor, RESERVES["nvidia"])


def what_to_change(remat: str, microbatches: int, zero: str) -> str:
    """The knobs that lower a step's memory, most effective first for this plan."""
    fixes = []
    if remat != "full":
        fixes.append("--config.model.remat=full (keeps only each layer's input)")
    fixes.append(f"a smaller micro-batch (--config.train.microbatches={2 * microbatches})")
    if zero != "zero3":
        fixes.append("--config.zero.preset=zero3 (shards parameters, gradients and optimizer "
                     "states over the data-parallel devices)")
    return "; or ".join(fixes)


def fit_problem(predicted: dict[str, Any], remat: str, microbatches: int,
                zero: str) -> str | None:
    """One line when a plan's predicted memory exceeds its devices' usable memory (the
    words `hetjax plan` prints and `hetjax train` refuses with), else None."""
    if predicted.get("fits", True) or "stage_memory_gib" not in predicted:
        return None
    need, cap = predicted["stage_memory_gib"], predicted["stage_capacity_gib"]
    worst = max(range(len(need)), key=lambda s: need[s] / cap[s])
    where = f"stage {worst} needs" if len(need) > 1 else "needs"
    return (f"the plan does not fit in device memory: {where} {need[worst]:.3g} GiB per device "
            f"of {cap[worst]:.3g} GiB usable (planner.memory_margin kept aside); fix: "
            f"{what_to_change(remat, microbatches, zero)}")


_ALLOC = re.compile(r"allocat\w*\s+(\d+)\s*bytes", re.I)
_SIZED = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT])i?B\b")
_UNITS = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def is_out_of_memory(error: BaseException) -> bool:
    """Whether an XLA runtime error is an out-of-memory (RESOURCE_EXHAUSTED)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def asked_bytes(error: BaseException) -> float | None:
    """The bytes XLA's out-of-memory message says it asked for, when it says so: 'trying to
    allocate 123 bytes' (GPU), else the largest size it names ('144.00GiB')."""
    text = str(error)
    m = _ALLOC.search(text)
    if m:
        return float(m.group(1))
    sizes = [float(v) * _UNITS[u] for v, u in _SIZED.findall(text)]
    return max(sizes) if sizes else None


def oom_message(predicted: float | None, asked: float | None, capacity: float | None,
                remat: str, microbatches: int, zero: str) -> str:
    """The one message a run ends with when XLA runs out of device memory."""
    def gib(x):
        return f"{x / GIB:.3g} GiB" if x else "unknown"

    return (f"out of device memory: XLA asked for {gib(asked)} per device, the planner "
            f"predicted {gib(predicted)}, the device has {gib(capacity)}; fix: "
            f"{what_to_change(remat, microbatches, zero)}")

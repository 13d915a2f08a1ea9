"""HuggingFace `config.json` <-> hetjax `model.*` fields, and the named model presets.

One mapping serves three callers: `model.preset` (a preset *is* the architecture part of a
published config.json, so it goes through the same code), `model.init_from` (the config.json
beside the weights) and `hetjax export --format=hf` (the reverse direction). Llama, Mistral,
Qwen2 and Qwen3 configs map onto `ModelConfig`, sliding windows (every layer's, or per layer as
`layer_types` says) and QK-norm included; anything hetjax's model cannot compute exactly
(another activation, MLP or output-projection biases, a RoPE type other than default / linear /
llama3, partial rotary, mixtures of experts) is refused with one `ConfigError` naming the
config.json key. JAX-free: `hetjax.config` imports it.
"""

from __future__ import annotations

import json
import math
import os

from hetjax.core.model_config import LIMITS
from hetjax.errors import ConfigError, HetjaxError

# The architecture keys of the published config.json files (huggingface.co/<repo>/config.json),
# copied as published; the rest of each file (token ids, torch_dtype, ...) plays no part here.
PRESETS: dict[str, dict] = {
    # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T
    "tinyllama_1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
        max_position_embeddings=2048, rms_norm_eps=1e-05, rope_theta=10000.0,
        rope_scaling=None, tie_word_embeddings=False),
    # meta-llama/Llama-2-7b-hf
    "llama2_7b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
        max_position_embeddings=4096, rms_norm_eps=1e-05, rope_theta=10000.0,
        rope_scaling=None, tie_word_embeddings=False),
    # meta-llama/Meta-Llama-3-8B
    "llama3_8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rms_norm_eps=1e-05, rope_theta=500000.0,
        rope_scaling=None, tie_word_embeddings=False),
    # meta-llama/Llama-3.1-8B
    "llama3_1_8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-05, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=False),
    # meta-llama/Llama-3.2-1B
    "llama3_2_1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-05, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=True),
    # mistralai/Mistral-7B-v0.3 (v0.1's 4096-token sliding window is not this preset)
    "mistral_7b": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
        max_position_embeddings=32768, rms_norm_eps=1e-05, rope_theta=1000000.0,
        sliding_window=None, tie_word_embeddings=False),
    # Qwen/Qwen2-0.5B
    "qwen2_0_5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=131072, rms_norm_eps=1e-06, rope_theta=1000000.0,
        sliding_window=131072, use_sliding_window=False, max_window_layers=24,
        tie_word_embeddings=True),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts, top-2 (46.7B parameters, 12.9B active)
    "mixtral_8x7b": dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=32768, rms_norm_eps=1e-05, rope_theta=1000000.0,
        sliding_window=None, num_local_experts=8, num_experts_per_tok=2,
        router_aux_loss_coef=0.02, tie_word_embeddings=False),
    # Qwen/Qwen3-30B-A3B: 128 experts, top-8, per-head QK-norm (30.5B parameters, 3.3B active)
    "qwen3_30b_a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rms_norm_eps=1e-06, rope_theta=1000000.0, rope_scaling=None, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=0.001, use_sliding_window=False, sliding_window=None,
        max_window_layers=48, attention_bias=False, tie_word_embeddings=False),
    # allenai/OLMoE-1B-7B-0924: 64 experts, top-8, QK-norm over all heads (6.9B parameters,
    # 1.3B active)
    "olmoe_1b_7b": dict(
        model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, vocab_size=50304,
        max_position_embeddings=4096, rms_norm_eps=1e-05, rope_theta=10000.0,
        rope_scaling=None, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
        router_aux_loss_coef=0.01, clip_qkv=None, attention_bias=False,
        tie_word_embeddings=False),
    # Qwen/Qwen1.5-MoE-A2.7B: 60 experts, top-4, and a shared expert (14.3B parameters, 2.7B
    # active)
    "qwen2_moe_a2_7b": dict(
        model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
        vocab_size=151936, max_position_embeddings=8192, rms_norm_eps=1e-06,
        rope_theta=1000000.0, num_experts=60, num_experts_per_tok=4, norm_topk_prob=False,
        decoder_sparse_step=1, router_aux_loss_coef=0.001, use_sliding_window=False,
        sliding_window=32768, max_window_layers=21, tie_word_embeddings=False),
}

# model.* fields a preset or an HF config sets; the others (dtype, remat, ...) stay the run's.
ARCH_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
               "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings", "head_dim",
               "rope_type", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
               "rope_original_max_len", "qkv_bias", "sliding_window", "full_attention_layers",
               "qk_norm", "n_experts", "experts_per_token", "moe_d_ff", "shared_expert_d_ff",
               "moe_shared_expert_gate", "decoder_sparse_step", "first_dense_layers",
               "moe_norm_topk_prob", "moe_aux_loss_coef")
# The ARCH_FIELDS that decide the weights' shapes: a run from a checkpoint must keep them
# (those of a mixture of experts only where the checkpoint is one).
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "head_dim",
                "tie_embeddings", "qkv_bias", "qk_norm", "n_experts", "moe_d_ff",
                "shared_expert_d_ff", "moe_shared_expert_gate", "decoder_sparse_step",
                "first_dense_layers")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
               "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}
# The mixtures of experts among them, and what their configs say beyond the dense fields:
# where the experts' count and width are, and which have QK-norm, q/k/v biases and a shared
# expert (transformers' modeling files).
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_QK_NORM = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "all_heads"}
# transformers' config defaults where config.json may leave a key out: Mistral's
# sliding_window, the Qwen families' max_window_layers.
_MISTRAL_WINDOW = 4096
_MAX_WINDOW_LAYERS = 28
ROPE_TYPES = ("default", "linear", "llama3")
# Keys of architectures hetjax's model does not have (mixtures of experts, ...).
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def read_config_json(directory: str, field: str = "model.init_from") -> dict:
    """The parsed `config.json` of an HF model directory (ConfigError naming `field` if none)."""
    path = os.path.join(os.path.expanduser(directory), "config.json")
    if not os.path.isfile(path):
        raise ConfigError(field, f"{directory!r} has no config.json",
                          "give a HuggingFace model directory (config.json + *.safetensors)")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(field, f"{path} is not readable JSON ({e})",
                          "give a directory written by save_pretrained or hetjax export") from None


def model_fields(hf: dict, source: str) -> dict:
    """hetjax `model.*` values (ARCH_FIELDS) for an HF config dict; `source` names where it came
    from in messages. Raises ConfigError naming the config.json key hetjax cannot represent."""

    def refuse(key: str, problem: str, fix: str = "use a Llama, Mistral, Qwen2 or Qwen3 "
               "checkpoint without it"):
        raise ConfigError(source, f"config.json {key}: {problem}", fix)

    def number(key: str, field: str | None = None, default=None, table=None, real=False):
        """`table[key]` (default: the config; else the RoPE block) as an int (a float if
        `real`), within hetjax's limit for `field` (LIMITS) when it has one; one ConfigError
        naming the key otherwise."""
        value = (hf if table is None else table).get(key)
        key = key if table is None else f"{rope_key}.{key}"
        value = default if value is None else value
        if value is None:
            refuse(key, "is missing", "give the config.json written with these weights")
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and (real or float(value).is_integer()) and math.isfinite(value))
        hi = LIMITS.get(field or "")
        if not ok or (not real and value < 1) or (real and value <= 0) or (hi and value > hi):
            refuse(key, f"{value!r} is not {'a number > 0' if real else 'an integer >= 1'}"
                   + (f" up to {hi:,}" if hi else ""),
                   "give the config.json written with these weights")
        return float(value) if real else int(value)

    mtype = hf.get("model_type")
    if mtype not in MODEL_TYPES:
        refuse("model_type", f"{mtype!r} is not one hetjax can load",
               f"use one of {', '.join(MODEL_TYPES)}")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"{hf['hidden_act']!r}; hetjax's MLP is SwiGLU (silu)")
    if hf.get("mlp_bias"):
        refuse("mlp_bias", "true; hetjax's MLP has no biases")
    if mtype in ("llama", "qwen3", "qwen3_moe", "olmoe") and hf.get("attention_bias"):
        refuse("attention_bias", "true puts a bias on the output projection too; hetjax has "
               "q/k/v biases only (as Qwen2)")
    if mtype not in MOE_TYPES:
        for key in _MOE_KEYS:
            if hf.get(key):
                refuse(key, f"{hf[key]}: a mixture of experts in a {mtype!r} config",
                       f"give model_type {' / '.join(MOE_TYPES)} for a mixture of experts")
    if hf.get("clip_qkv") is not None:
        refuse("clip_qkv", f"{hf['clip_qkv']}: hetjax does not clamp q/k/v")
    max_len = number("max_position_embeddings", "max_seq_len", 2048)
    n_layers = number("num_hidden_layers", "n_layers")
    window, full_layers = _windows(hf, mtype, n_layers, refuse, number)
    # transformers >= 5 writes rope_parameters (theta inside); older files rope_scaling +
    # rope_theta.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    if not isinstance(rope, dict):
        refuse(rope_key, f"{rope!r} is not an object")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        refuse("rope_scaling.rope_type", f"{rope_type!r} is not one hetjax implements",
               f"use a checkpoint with rope_type in {', '.join(ROPE_TYPES)}")
    if float(hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))) != 1.0:
        refuse("partial_rotary_factor", "hetjax rotates the whole head")
    d, n_heads = number("hidden_size", "d_model"), number("num_attention_heads", "n_heads")
    out = dict(
        vocab_size=number("vocab_size", "vocab_size"), d_model=d, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=number("num_key_value_heads", "n_kv_heads", n_heads),
        d_ff=number("intermediate_size", "d_ff"), max_seq_len=max_len,
        rope_theta=number("rope_theta", default=rope.get("rope_theta", 10000.0), real=True),
        norm_eps=number("rms_norm_eps", default=1e-6, real=True),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        head_dim=number("head_dim", "head_dim", max(1, d // n_heads)),
        rope_type=rope_type, rope_factor=1.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_max_len=8192, sliding_window=window,
        full_attention_layers=full_layers,
        qkv_bias=mtype == "qwen2" or (mtype == "qwen2_moe" and bool(hf.get("qkv_bias", True))),
        qk_norm=_QK_NORM.get(mtype, "none"), n_experts=0)
    if mtype in MOE_TYPES:
        out.update(_experts(hf, mtype, refuse, number))
    # transformers requires these keys of each scaling type (its rope validation names them)
    needs = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                               "original_max_position_embeddings")}
    for key in needs.get(rope_type, ()):
        if key not in rope:
            refuse(f"{rope_key}.{key}", f"is missing; {rope_type} RoPE scaling needs "
                   f"{', '.join(needs[rope_type])}", "give the config.json written with these "
                   "weights (transformers refuses it too)")
    if rope_type in ("linear", "llama3"):
        out["rope_factor"] = number("factor", table=rope, real=True)
    if rope_type == "llama3":
        out.update(rope_low_freq_factor=number("low_freq_factor", table=rope, real=True),
                   rope_high_freq_factor=number("high_freq_factor", table=rope, real=True),
                   rope_original_max_len=number("original_max_position_embeddings",
                                                "max_seq_len", table=rope))
    return out


def _experts(hf: dict, mtype: str, refuse, number) -> dict:
    """The `model.*` MoE fields of a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE config.

    transformers' load-balance loss (`load_balancing_loss_func`) is k times hetjax's on a layer
    (hetjax.layers.moe), so `router_aux_loss_coef` becomes moe_aux_loss_coef = coef * k: the
    same term for one MoE layer (transformers pools the layers' counts and probabilities before
    multiplying them, hetjax averages the layers' losses)."""
    # Mixtral and OLMoE name the count either way; Qwen3-MoE files of transformers >= 5 write
    # num_local_experts, the published ones num_experts.
    count = "num_local_experts" if hf.get("num_local_experts") else "num_experts"
    n, k = number(count, "n_experts"), number("num_experts_per_tok", default=2)
    if k > n:
        refuse("num_experts_per_tok", f"{k} is more than the {n} experts",
               "give the config.json written with these weights")
    width = number("moe_intermediate_size" if mtype in ("qwen2_moe", "qwen3_moe")
                   else "intermediate_size", "d_ff")
    out = dict(n_experts=n, experts_per_token=k, moe_d_ff=width, shared_expert_d_ff=0,
               moe_shared_expert_gate=True, decoder_sparse_step=1, first_dense_layers=0,
               # Mixtral always renormalises its top-k weights; the others as configured
               # (transformers' default: no).
               moe_norm_topk_prob=mtype == "mixtral" or bool(hf.get("norm_topk_prob", False)),
               moe_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0) * k)
    if mtype == "qwen2_moe":
        out["shared_expert_d_ff"] = number("shared_expert_intermediate_size", "d_ff", 5632)
    if mtype in ("qwen2_moe", "qwen3_moe"):
        # layer i is MoE unless in mlp_only_layers, and when (i + 1) % decoder_sparse_step == 0;
        # hetjax's rule is the same with mlp_only_layers a leading run (first_dense_layers)
        dense = sorted(int(i) for i in hf.get("mlp_only_layers") or ())
        if dense != list(range(len(dense))):
            refuse("mlp_only_layers", f"{dense}: hetjax keeps only the first layers dense "
                   "(model.first_dense_layers)", "use a checkpoint whose dense layers lead")
        out.update(decoder_sparse_step=number("decoder_sparse_step", "n_layers", 1),
                   first_dense_layers=len(dense))
    return out


def _windows(hf: dict, mtype: str, n_layers: int, refuse, number) -> tuple[int, tuple]:
    """(model.sliding_window, model.full_attention_layers) as transformers reads config.json:
    Mistral and Mixtral window every layer (Mistral's config defaults to 4096 when the key is
    absent); the Qwen families only with use_sliding_window: Qwen3-MoE every layer, Qwen2,
    Qwen3 and Qwen2-MoE the layers `layer_types` calls 'sliding_attention' (transformers >= 4.53
    writes it; older files: Qwen2 and Qwen3 from max_window_layers on, Qwen2-MoE the even layers
    below it); Llama and OLMoE never."""
    window = hf.get("sliding_window", _MISTRAL_WINDOW if mtype == "mistral" else None)
    if window:  # transformers writes null or 0 for none
        window = number("sliding_window", "max_seq_len", window)
    if mtype in ("mistral", "mixtral") or (mtype == "qwen3_moe" and hf.get("use_sliding_window")):
        return (window, ()) if window else (0, ())
    if mtype not in ("qwen2", "qwen3", "qwen2_moe") or not hf.get("use_sliding_window"):
        return 0, ()
    types = hf.get("layer_types")
    if types is None:
        first = int(hf.get("max_window_layers", _MAX_WINDOW_LAYERS))
        sliding = ([(i + 1) % 2 == 1 and i < first for i in range(n_layers)]
                   if mtype == "qwen2_moe" else [i >= first for i in range(n_layers)])
        types = ["sliding_attention" if w else "full_attention" for w in sliding]
    odd = sorted(set(types) - {"sliding_attention", "full_attention"})
    if odd or len(types) != n_layers:
        refuse("layer_types", f"{odd or len(types)}: hetjax reads one 'sliding_attention' or "
               f"'full_attention' per layer ({n_layers})")
    if not window and "sliding_attention" in types:
        refuse("sliding_window", f"{window!r} with sliding layers", "give the window's length")
    full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    if len(full) == n_layers:
        return 0, ()
    return window, full


def preset_fields(name: str) -> dict:
    """The `model.*` values of a named preset (ConfigError listing the presets if unknown)."""
    if name not in PRESETS:
        raise ConfigError("model.preset", f"unknown preset {name!r}",
                          f"choose one of {', '.join(PRESETS)}, or model.init_from=<HF dir>")
    return model_fields(PRESETS[name], "model.preset")


def export_type(m) -> str:
    """The transformers model_type that computes a `ModelConfig` exactly: for a dense model
    Qwen3 (per-head QK-norm), Qwen2 (q/k/v biases, or windows on some layers only), Mistral
    (one window on every layer) or Llama; for a mixture of experts OLMoE (QK-norm over all
    heads), Qwen3-MoE (per-head QK-norm), Qwen2-MoE (a gated shared expert, or q/k/v biases) or
    Mixtral. A model none of them computes is a HetjaxError naming the field."""

    def refuse(field, problem):
        raise HetjaxError(f"model.{field}: {problem}, which no transformers model the export "
                          "writes has; fix: export a model without it")

    if not m.n_experts:
        if m.qk_norm == "all_heads":
            refuse("qk_norm", "'all_heads' in a dense model")
        if m.qk_norm == "head":
            if m.qkv_bias:
                refuse("qk_norm", "'head' with q/k/v biases")
            return "qwen3"
        if m.qkv_bias:
            return "qwen2"
        if m.mixed_windows:
            refuse("full_attention_layers", f"{list(m.full_attention_layers)} (windows on some "
                   "layers only) without q/k/v biases or QK-norm")
        return "mistral" if m.sliding_window else "llama"
    if m.qk_norm == "all_heads":
        mtype = "olmoe"
    elif m.qk_norm == "head":
        mtype = "qwen3_moe"
    elif m.shared_expert_d_ff or m.qkv_bias:
        mtype = "qwen2_moe"
    else:
        mtype = "mixtral"
    if m.qkv_bias and mtype != "qwen2_moe":
        refuse("qkv_bias", f"true with model.qk_norm = {m.qk_norm!r} in a mixture of experts")
    if m.shared_expert_d_ff and (mtype != "qwen2_moe" or not m.moe_shared_expert_gate):
        refuse("shared_expert_d_ff", "a shared expert " + (
            "without its gate" if mtype == "qwen2_moe" else f"with model.qk_norm = "
                                                            f"{m.qk_norm!r}"))
    if mtype == "qwen2_moe" and not m.shared_expert_d_ff:
        refuse("qkv_bias", "true in a mixture of experts without a shared expert")
    if mtype == "mixtral" and not m.moe_norm_topk_prob:
        refuse("moe_norm_topk_prob", "false without QK-norm or a shared expert (Mixtral "
               "always renormalises)")
    if m.mixed_layers and mtype in ("mixtral", "olmoe"):
        refuse("first_dense_layers", "dense layers in a mixture without a shared expert or "
               "per-head QK-norm")
    if m.sliding_window and mtype == "olmoe":
        refuse("sliding_window", "a window with QK-norm over all heads")
    if m.mixed_windows and mtype != "qwen2_moe":
        refuse("full_attention_layers", "windows on some layers only, outside Qwen2-MoE")
    return mtype


def hf_config(m, *, torch_dtype: str = "float32") -> dict:
    """An HF config.json dict for a `ModelConfig` (of the model_type `export_type` names), which
    transformers loads as it is."""
    mtype = export_type(m)
    out = {
        "architectures": [MODEL_TYPES[mtype]], "model_type": mtype, "hidden_act": "silu",
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim, "intermediate_size": m.d_ff,
        "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "tie_word_embeddings": m.tie_embeddings,
        "torch_dtype": torch_dtype, "use_cache": True,
    }
    if mtype in ("llama", "qwen3", "qwen3_moe", "olmoe"):
        out.update(attention_bias=False)
    if mtype == "llama":
        out.update(mlp_bias=False)
    elif mtype in ("mistral", "mixtral"):
        out.update(sliding_window=m.sliding_window or None)
    elif mtype == "qwen3_moe":  # its window, when used, is every layer's
        out.update(use_sliding_window=bool(m.sliding_window),
                   sliding_window=m.sliding_window or None)
    elif mtype != "olmoe":  # Qwen2 / Qwen3 / Qwen2-MoE: the window's layers named one by one
        flags = m.window_flags()
        out.update(use_sliding_window=any(flags), sliding_window=m.sliding_window or None,
                   max_window_layers=m.n_layers,
                   layer_types=["sliding_attention" if f else "full_attention" for f in flags])
    if m.n_experts:
        k = m.experts_per_token
        out.update(num_experts_per_tok=k, router_aux_loss_coef=m.moe_aux_loss_coef / k,
                   output_router_logits=False)
        if mtype == "mixtral":
            out.update(num_local_experts=m.n_experts, intermediate_size=m.expert_d_ff)
        else:
            out.update(num_experts=m.n_experts, norm_topk_prob=m.moe_norm_topk_prob)
        if mtype == "olmoe":
            out.update(intermediate_size=m.expert_d_ff, clip_qkv=None)
        if mtype in ("qwen2_moe", "qwen3_moe"):
            out.update(moe_intermediate_size=m.expert_d_ff,
                       decoder_sparse_step=m.decoder_sparse_step,
                       mlp_only_layers=list(range(min(m.first_dense_layers, m.n_layers))))
        if mtype == "qwen2_moe":
            out.update(shared_expert_intermediate_size=m.shared_expert_d_ff,
                       qkv_bias=m.qkv_bias)
    if m.rope_type == "default":
        out["rope_scaling"] = None
    else:
        out["rope_scaling"] = {"rope_type": m.rope_type, "factor": m.rope_factor}
        if m.rope_type == "llama3":
            out["rope_scaling"].update(
                low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor,
                original_max_position_embeddings=m.rope_original_max_len)
    return out

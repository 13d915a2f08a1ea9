"""HuggingFace `config.json` <-> hetjax `model.*` fields, and the named model presets.

One mapping serves three callers: `model.preset` (a preset *is* the architecture part of a
published config.json, so it goes through the same code), `model.init_from` (the config.json
beside the weights) and `hetjax export --format=hf` (the reverse direction). Llama, Mistral and
Qwen2 configs map onto `ModelConfig`; anything hetjax's model cannot compute exactly (another
activation, MLP or output-projection biases, a sliding window shorter than the context, a RoPE
type other than default / linear / llama3, partial rotary, mixtures of experts) is refused with
one `ConfigError` naming the config.json key. JAX-free: `hetjax.config` imports it.
"""

from __future__ import annotations

import json
import math
import os

from hetjax.core.model_config import LIMITS
from hetjax.errors import ConfigError

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
}

# model.* fields a preset or an HF config sets; the others (dtype, remat, ...) stay the run's.
ARCH_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
               "max_seq_len", "rope_theta", "norm_eps", "tie_embeddings", "head_dim",
               "rope_type", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
               "rope_original_max_len", "qkv_bias")
# The ARCH_FIELDS that decide the weights' shapes: a run from a checkpoint must keep them.
SHAPE_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "head_dim",
                "tie_embeddings", "qkv_bias")
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM"}
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

    def refuse(key: str, problem: str, fix: str = "use a Llama, Mistral or Qwen2 checkpoint "
               "without it"):
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
    if mtype == "llama" and hf.get("attention_bias"):
        refuse("attention_bias", "true puts a bias on the output projection too; hetjax has "
               "q/k/v biases only (as Qwen2)")
    for key in _MOE_KEYS:
        if hf.get(key):
            refuse(key, f"{hf[key]}: a mixture of experts; hetjax's MLP is dense")
    max_len = number("max_position_embeddings", "max_seq_len", 2048)
    window = hf.get("sliding_window")
    uses_window = window is not None and (mtype != "qwen2" or hf.get("use_sliding_window"))
    if uses_window and number("sliding_window") < max_len:
        if mtype == "mistral":  # full causal attention equals the window up to its length
            max_len = int(window)
        else:
            refuse("sliding_window", f"{window} with use_sliding_window = true; hetjax "
                   "attends to the full context")
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
        vocab_size=number("vocab_size", "vocab_size"), d_model=d,
        n_layers=number("num_hidden_layers", "n_layers"), n_heads=n_heads,
        n_kv_heads=number("num_key_value_heads", "n_kv_heads", n_heads),
        d_ff=number("intermediate_size", "d_ff"), max_seq_len=max_len,
        rope_theta=number("rope_theta", default=rope.get("rope_theta", 10000.0), real=True),
        norm_eps=number("rms_norm_eps", default=1e-6, real=True),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        head_dim=number("head_dim", "head_dim", max(1, d // n_heads)),
        rope_type=rope_type, rope_factor=1.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_max_len=8192, qkv_bias=mtype == "qwen2")
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


def preset_fields(name: str) -> dict:
    """The `model.*` values of a named preset (ConfigError listing the presets if unknown)."""
    if name not in PRESETS:
        raise ConfigError("model.preset", f"unknown preset {name!r}",
                          f"choose one of {', '.join(PRESETS)}, or model.init_from=<HF dir>")
    return model_fields(PRESETS[name], "model.preset")


def hf_config(m, *, torch_dtype: str = "float32") -> dict:
    """An HF config.json dict for a `ModelConfig` (Qwen2 when it has q/k/v biases, else Llama),
    which transformers loads as it is."""
    mtype = "qwen2" if m.qkv_bias else "llama"
    out = {
        "architectures": [MODEL_TYPES[mtype]], "model_type": mtype, "hidden_act": "silu",
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim, "intermediate_size": m.d_ff,
        "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "tie_word_embeddings": m.tie_embeddings,
        "torch_dtype": torch_dtype, "use_cache": True,
    }
    if mtype == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    if m.rope_type == "default":
        out["rope_scaling"] = None
    else:
        out["rope_scaling"] = {"rope_type": m.rope_type, "factor": m.rope_factor}
        if m.rope_type == "llama3":
            out["rope_scaling"].update(
                low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor,
                original_max_position_embeddings=m.rope_original_max_len)
    return out

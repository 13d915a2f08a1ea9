"""Build the small random HuggingFace checkpoints under tests/fixtures/hf/ and their reference
outputs (needs torch + transformers; the tests that read them do not).

Each fixture is a directory as `save_pretrained` writes it (config.json, sharded
model-*.safetensors + model.safetensors.index.json) plus `reference.npz` holding fixed `tokens`
and transformers' float32 `logits` for them; for a mixture of experts also every MoE layer's
`router_logits` [layers, tokens, experts] and `aux_loss` (transformers'
`load_balancing_loss_func` over them; `aux_loss_per_layer`: over each layer's alone); with a
`generate` entry a `prompt` and the tokens transformers' greedy `generate` continues it with
(`generated`), and `min_margin`, the smallest gap between the best and the second-best logit
along the way (a prompt is drawn again until it is at least MARGIN, so float32 rounding cannot
flip a choice). Mixtures of experts are held to
the same rule at their routers: tokens and prompts are drawn again until every token's k-th
routing probability leads the (k+1)-th by ROUTER_MARGIN (`min_router_margin`), so every
implementation picks the same experts. Every weight is random, norm scales and biases included
(transformers initialises those to 1 and 0, which would hide a mapping error).

    python scripts/tools/make_hf_fixture.py [--out tests/fixtures/hf] [names...]
"""

from __future__ import annotations

import argparse
import importlib
import os

import numpy as np

MARGIN = 1e-3
ROUTER_MARGIN = 1e-4

# name -> (model class, config class, config kwargs[, options]); options: `tokens` (rows,
# length) of the logits reference (default (2, 16)), `generate` (prompt length, new tokens).
FIXTURES = {
    # GQA, untied head, vocab 512 (the byte tokenizer's 257 fit): the docs' walkthrough model.
    "llama_gqa": ("LlamaForCausalLM", "LlamaConfig", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)),
    # llama3 RoPE scaling with a short original context (so the scaled, the kept and the
    # smoothed frequency bands all occur) and head_dim 32 != hidden 64 / 4 heads; tied head.
    "llama3_rope": ("LlamaForCausalLM", "LlamaConfig", dict(
        vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64))),
    # Qwen2: q/k/v biases, linear RoPE scaling, tied head.
    "qwen2_bias": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="linear", factor=2.0), use_sliding_window=False)),
    # Mistral with a 160-token window read at 256 positions (96 of them past the window), and
    # greedy decoding from 150 to 256 positions; the byte tokenizer's 257 tokens fit.
    "mistral_window": ("MistralForCausalLM", "MistralConfig", dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=160, tie_word_embeddings=False),
        dict(tokens=(1, 256), generate=(150, 106))),
    # Qwen3: per-head QK-norm, and an 8-token window on layer 1 only (use_sliding_window with
    # max_window_layers 1: layer_types [full, sliding]) read at 16 positions.
    "qwen3_window": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        use_sliding_window=True, sliding_window=8, max_window_layers=1),
        dict(generate=(6, 14))),
    # Mixtral: 4 experts, top-2, renormalised top-k weights, untied head.
    "mixtral_moe": ("MixtralForCausalLM", "MixtralConfig", dict(
        vocab_size=320, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=1000000.0, num_local_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=0.02, tie_word_embeddings=False),
        dict(generate=(6, 14))),
    # Qwen2-MoE: q/k/v biases, 4 experts top-2 without renormalisation, and the shared expert
    # (its own width) behind a sigmoid gate.
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_theta=1000000.0, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        tie_word_embeddings=False),
        dict(generate=(6, 14))),
    # Qwen3-MoE: per-head QK-norm, explicit head_dim, 8 experts top-2 renormalised.
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False),
        dict(generate=(6, 14))),
    # OLMoE: QK-norm over all heads, 8 experts top-2 without renormalisation.
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(
        vocab_size=320, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, clip_qkv=None, pad_token_id=1, eos_token_id=2,
        tie_word_embeddings=False),
        dict(generate=(6, 14))),
}


def _experts(config) -> int:
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)


def _router_margin(model, seq) -> float:
    """The smallest lead of a token's k-th routing probability over its (k+1)-th, over every
    MoE layer and token of `seq` (inf for a dense model)."""
    import torch

    if not _experts(model.config):
        return float("inf")
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        res = model(torch.tensor(seq), output_router_logits=True)
    probs = torch.softmax(torch.stack(res.router_logits).float(), dim=-1)
    top = probs.topk(k + 1, dim=-1).values
    return float((top[..., k - 1] - top[..., k]).min())


def _randomise(model) -> None:
    import torch

    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))


def _greedy(model, vocab: int, prompt_len: int, new: int) -> dict:
    """A prompt and transformers' greedy continuation of it, drawn until every step's best
    logit leads the second by MARGIN."""
    import torch

    model.generation_config.eos_token_id = None  # run all `new` steps
    model.generation_config.pad_token_id = 0
    for seed in range(100):
        prompt = np.random.default_rng(1000 + seed).integers(0, vocab, size=(1, prompt_len))
        with torch.no_grad():
            # an explicit mask: without one, generate takes pad_token_id tokens for padding
            out = model.generate(torch.tensor(prompt), attention_mask=torch.ones(prompt.shape),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        top2 = torch.stack(out.logits).float().topk(2, dim=-1).values
        margin = float((top2[..., 0] - top2[..., 1]).min())
        # the routers along the way (prefill and each decoded token) pick clear winners too
        if margin >= MARGIN and _router_margin(model, out.sequences.numpy()) >= ROUTER_MARGIN:
            return dict(prompt=prompt.astype(np.int32),
                        generated=out.sequences[:, prompt_len:].numpy().astype(np.int32),
                        min_margin=np.float32(margin))
    raise SystemExit(f"no prompt of 100 decodes with every margin >= {MARGIN}")


def build(name: str, out: str) -> None:
    import torch  # here, so that --help works without torch
    import transformers

    model_cls, config_cls, kwargs, *rest = FIXTURES[name]
    opts = rest[0] if rest else {}
    torch.manual_seed(0)
    # initializer_range 0.08 (not HF's 0.02): logits of a few units, not ~1, so the 1e-4
    # comparison is a tight one.
    config = getattr(transformers, config_cls)(initializer_range=0.08, **kwargs)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval()
    _randomise(model)
    path = os.path.join(out, name)
    # Shards of ~200 kB: the fixture has several files and an index, as real checkpoints do.
    model.save_pretrained(path, max_shard_size="200KB", safe_serialization=True)
    experts = _experts(config)
    for seed in range(100):
        tokens = np.random.default_rng(seed).integers(0, kwargs["vocab_size"],
                                                      size=opts.get("tokens", (2, 16)))
        if _router_margin(model, tokens) >= ROUTER_MARGIN:
            break
    else:
        raise SystemExit(f"no tokens of 100 route with every margin >= {ROUTER_MARGIN}")
    ref = {}
    with torch.no_grad():
        res = model(torch.tensor(tokens), output_router_logits=bool(experts))
    ref.update(tokens=tokens.astype(np.int32), logits=res.logits.float().numpy())
    if experts:
        module = importlib.import_module(type(model).__module__)
        ref["router_logits"] = torch.stack(res.router_logits).float().numpy()
        balance = module.load_balancing_loss_func
        ref["aux_loss"] = np.float32(balance(res.router_logits, experts,
                                             config.num_experts_per_tok).item())
        # ... and of each layer alone (over several layers it pools their counts first)
        ref["aux_loss_per_layer"] = np.array([balance((r,), experts, config.num_experts_per_tok)
                                              .item() for r in res.router_logits], np.float32)
        ref["min_router_margin"] = np.float32(_router_margin(model, tokens))
    if "generate" in opts:
        ref.update(_greedy(model, kwargs["vocab_size"], *opts["generate"]))
    np.savez(os.path.join(path, "reference.npz"), **ref)
    print(f"{path}: {sum(p.numel() for p in model.parameters())} parameters, "
          f"{ {k: v.shape for k, v in ref.items()} }, files {sorted(os.listdir(path))}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests",
                                                  "fixtures", "hf"))
    ap.add_argument("names", nargs="*", default=list(FIXTURES))
    args = ap.parse_args(argv)
    for name in args.names:
        build(name, args.out)


if __name__ == "__main__":
    main()

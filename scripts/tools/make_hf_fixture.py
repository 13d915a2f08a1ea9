"""Build the small random HuggingFace checkpoints under tests/fixtures/hf/ and their reference
logits (needs torch + transformers; the tests that read them do not).

Each fixture is a directory as `save_pretrained` writes it (config.json, sharded
model-*.safetensors + model.safetensors.index.json) plus `reference.npz` holding fixed `tokens`
[2, 16] and transformers' float32 `logits` for them. Every weight is random, norm scales and
biases included (transformers initialises those to 1 and 0, which would hide a mapping error).

    python scripts/tools/make_hf_fixture.py [--out tests/fixtures/hf]
"""

from __future__ import annotations

import argparse
import os

import numpy as np

# name -> (model class, config class, config kwargs)
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
}


def build(name: str, out: str) -> None:
    import torch  # here, so that --help works without torch
    import transformers

    model_cls, config_cls, kwargs = FIXTURES[name]
    torch.manual_seed(0)
    # initializer_range 0.08 (not HF's 0.02): logits of a few units, not ~1, so the 1e-4
    # comparison is a tight one.
    config = getattr(transformers, config_cls)(initializer_range=0.08, **kwargs)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    path = os.path.join(out, name)
    # Shards of ~200 kB: the fixture has several files and an index, as real checkpoints do.
    model.save_pretrained(path, max_shard_size="200KB", safe_serialization=True)
    tokens = np.random.default_rng(0).integers(0, kwargs["vocab_size"], size=(2, 16))
    with torch.no_grad():
        logits = model(torch.tensor(tokens)).logits.float().numpy()
    np.savez(os.path.join(path, "reference.npz"), tokens=tokens.astype(np.int32),
             logits=logits.astype(np.float32))
    print(f"{path}: {sum(p.numel() for p in model.parameters())} parameters, "
          f"files {sorted(os.listdir(path))}")


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

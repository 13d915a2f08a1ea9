"""A vocabulary that tensor parallelism cannot split evenly (333 tokens over tp = 2, Llama-2
fine-tunes' 32001): the embedding and head are padded (`ModelConfig.vocab_rows`), the padding
rows start at zero, stay out of the loss, the samples and the exports, and the losses are the
unpadded model's."""

import dataclasses
import json
import os

import flax.linen as nn
import jax
import numpy as np
import pytest

from conftest import tiny_config
from hetjax.core.model_config import ModelConfig, vocab_rows
from hetjax.layers import Transformer, cross_entropy
from hetjax.layers.embeddings import PADDED_LOGIT


@pytest.mark.parametrize("vocab,shards,rows", [
    (384, 1, 384), (384, 2, 384), (333, 1, 384), (333, 2, 384), (32001, 2, 32128),
    (32000, 8, 32000), (50257, 8, 50304), (256, 3, 384), (128256, 4, 128256)])
def test_the_vocabulary_is_padded_to_a_multiple_of_128_and_the_shards(vocab, shards, rows):
    assert vocab_rows(vocab, shards) == rows
    assert ModelConfig(vocab_size=vocab, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1,
                       d_ff=8).vocab_rows == vocab  # built directly: unpadded unless asked


def _unpadded(cfg: ModelConfig, params):
    """The model with `cfg.vocab_size` rows and the real rows of `params`."""
    m = dataclasses.replace(cfg, vocab_rows=cfg.vocab_size)
    p = dict(params, embedder={"embedding": params["embedder"]["embedding"][:cfg.vocab_size]})
    if "lm_head" in params:
        p["lm_head"] = {"kernel": params["lm_head"]["kernel"][:, :cfg.vocab_size]}
    return m, p


def test_a_padded_model_is_the_unpadded_one():
    """Same initial rows (the padding zero), the same loss and gradients (zero for the padding),
    padded logits masked out of the softmax (untied: both the embedding and the head padded)."""
    small = ModelConfig(vocab_size=45, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                        d_ff=32, tie_embeddings=False)
    padded = dataclasses.replace(small, vocab_rows=vocab_rows(45, 2))
    tokens = np.random.default_rng(0).integers(0, 45, (2, 9))
    params, ref = (nn.unbox(jax.jit(Transformer(cfg).init)(jax.random.key(3),
                                                           tokens[:, :-1]))["params"]
                   for cfg in (padded, small))
    jax.tree.map(np.testing.assert_array_equal, _unpadded(padded, params)[1], ref)

    def loss(cfg, p):
        return cross_entropy(Transformer(cfg).apply({"params": p}, tokens[:, :-1]),
                             tokens[:, 1:])

    (lp, gp), (lu, gu) = (jax.jit(jax.value_and_grad(lambda p: loss(padded, p)))(params),
                          jax.jit(jax.value_and_grad(lambda p: loss(small, p)))(ref))
    np.testing.assert_allclose(lp, lu, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 _unpadded(padded, gp)[1], gu)
    assert not np.asarray(gp["embedder"]["embedding"])[45:].any()
    assert not np.asarray(gp["lm_head"]["kernel"])[:, 45:].any()
    logits = np.asarray(jax.jit(Transformer(padded).apply)({"params": params}, tokens))
    assert logits.shape[-1] == 128 and (logits[..., 45:] == PADDED_LOGIT).all()


@pytest.mark.slow  # (a training; the padded model's numerics are the default tier's, above)
def test_an_odd_vocabulary_trains_with_tp_and_its_losses_are_the_unpadded_models(tmp_path):
    """vocab 333, dp = 4 x tp = 2 (IndivisibleError before): each step's loss equals the
    unpadded model's on the same parameters and batch, and the padding rows stay exactly zero
    (so through the optimizer they change nothing either)."""
    from hetjax.train import Trainer

    c = tiny_config(**{"model.vocab_size": 333, "parallel.dp": 4, "parallel.tp": 2,
                       "workdir": str(tmp_path), "checkpoint.every": 0})
    trainer = Trainer(c, quiet=True)
    assert trainer.model_cfg.vocab_rows == 384
    assert trainer.state.params["embedder"]["embedding"].addressable_shards[0].data.shape[0] == 192
    m = dataclasses.replace(trainer.model_cfg, vocab_rows=333)
    unpadded = jax.jit(lambda p, b: cross_entropy(
        Transformer(m).apply({"params": p}, b["inputs"]), b["targets"]))
    for _ in range(2):
        batch = next(trainer.data)
        want = unpadded(_unpadded(trainer.model_cfg, jax.device_get(trainer.params))[1], batch)
        np.testing.assert_allclose(float(trainer.step(batch)["loss"]), float(want), rtol=1e-6)
    table = np.asarray(jax.device_get(trainer.params)["embedder"]["embedding"])
    assert not table[333:].any() and table[:333].any()


def _odd_vocab_checkpoint(directory, vocab: int):
    """The llama_gqa fixture (512 tokens, untied head) cut to its first `vocab` tokens."""
    from hetjax.interop.safetensors_files import SafetensorsDir, write_file
    from test_interop import fixture

    src = SafetensorsDir(fixture("llama_gqa"))
    tensors = {n: src.read(n) for n in src.names()}
    for n in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[n] = tensors[n][:vocab]
    os.makedirs(directory)
    write_file(os.path.join(directory, "model.safetensors"), tensors)
    config = json.load(open(os.path.join(fixture("llama_gqa"), "config.json")))
    json.dump({**config, "vocab_size": vocab}, open(os.path.join(directory, "config.json"), "w"))


@pytest.mark.slow
def test_an_hf_checkpoint_with_an_odd_vocabulary_loads_under_tp_and_exports_unpadded(tmp_path):
    """An HF vocabulary of 333 (as Llama-2 fine-tunes' 32001) under dp = 4 x tp = 2: it loads
    padded to 384 rows, its logits are the full fixture's for those tokens, and `hetjax export`
    writes 333 rows and vocab_size 333 that load back to the same logits."""
    from hetjax.cli import main
    from test_interop import fixture, load_single, logits, trainer_from

    _odd_vocab_checkpoint(str(tmp_path / "hf333"), 333)
    trainer = trainer_from(str(tmp_path / "hf333"), {"parallel.pp": 1, "parallel.dp": 4,
                                                     "parallel.tp": 2}, tmp_path / "run",
                           **{"train.steps": 1, "checkpoint.every": 1})
    assert trainer.model_cfg.vocab_rows == 384
    tokens = np.random.default_rng(1).integers(0, 333, (2, 12))
    full_cfg, full = load_single(fixture("llama_gqa"))
    got = logits(trainer.model_cfg, trainer.params, tokens)
    np.testing.assert_allclose(got[..., :333], logits(full_cfg, full, tokens)[..., :333],
                               atol=1e-4, rtol=0)
    assert (got[..., 333:] == PADDED_LOGIT).all()
    trainer.train()
    trainer.checkpointer.wait()
    out = tmp_path / "export"
    assert main(["hetjax", "export", "--format=hf", f"--checkpoint={tmp_path / 'run'}",
                 f"--out={out}"]) in (0, None)
    assert json.load(open(out / "config.json"))["vocab_size"] == 333
    m, params = load_single(str(out))
    assert params["embedder"]["embedding"].shape[0] == 333 and m.vocab_rows == 333
    np.testing.assert_allclose(logits(m, params, tokens),
                               logits(trainer.model_cfg, trainer.params, tokens)[..., :333],
                               atol=1e-5, rtol=0)

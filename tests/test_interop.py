"""hetjax.interop: HF config.json mapping and presets, loading HF safetensors checkpoints under
any plan, exporting checkpoints as HF directories. The fixtures under tests/fixtures/hf/ are
random HF models with transformers' own logits (scripts/tools/make_hf_fixture.py), so no torch is
needed here; the one test that loads an export with transformers skips without it."""

import json
import os

import jax
import numpy as np
import pytest

from conftest import tiny_config
from hetjax.config import apply_model_source, load_config, validate
from hetjax.errors import ConfigError
from hetjax.core import hf_config
from hetjax.interop import hf_checkpoint
from hetjax.interop.safetensors_files import SafetensorsDir
from hetjax.layers import ModelConfig, Transformer

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
PP1 = {"parallel.pp": 1, "parallel.dp": 4, "parallel.tp": 2}
PP2 = {"parallel.pp": 2, "pipeline.stage_layers": (3, 1), "parallel.dp": 2, "parallel.tp": 2}


def fixture(name):
    return os.path.join(FIXTURES, name)


def reference(name):
    with np.load(os.path.join(fixture(name), "reference.npz")) as z:
        return z["tokens"], z["logits"]


def trainer_from(directory, plan, tmp_path, **over):
    from hetjax.train import Trainer

    c = tiny_config(**{"model.init_from": directory, "workdir": str(tmp_path), **plan, **over})
    apply_model_source(c)
    return Trainer(c, quiet=True)


def load_single(directory, sharded=False):
    """(ModelConfig, params) of an HF directory without a Trainer (no compile). `sharded`: every
    leaf cut over a (4, 2) mesh of the 8 devices, its last even dim over the 2 and its first
    other dim divisible by 4 over the 4, so reads cut heads, head_dim, rows and columns."""
    import flax.linen as nn
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from hetjax.interop.hf_checkpoint import load_params

    m = ModelConfig(**hf_config.model_fields(hf_config.read_config_json(directory), "x"))
    target = nn.unbox(jax.eval_shape(lambda: Transformer(m).init(
        jax.random.key(0), np.zeros((1, 4), np.int32)))["params"])
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))

    def place(x):
        spec = [None] * x.ndim
        if sharded:
            b = max((d for d in range(x.ndim) if x.shape[d] % 2 == 0), default=None)
            a = next((d for d in range(x.ndim) if d != b and x.shape[d] % 4 == 0), None)
            for d, axis in ((b, "b"), (a, "a")):
                if d is not None:
                    spec[d] = axis
        return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                    sharding=NamedSharding(mesh, PartitionSpec(*spec)))

    return m, load_params(directory, m, jax.tree.map(place, target))[0]


def logits(model_cfg, params, tokens):
    return np.asarray(Transformer(model_cfg).apply({"params": jax.device_get(params)}, tokens))


# --- config.json and presets (no JAX) -------------------------------------------------------------
@pytest.mark.parametrize("preset,params", [
    ("tinyllama_1b", 1_100_048_384), ("llama2_7b", 6_738_415_616),
    ("llama3_8b", 8_030_261_248), ("llama3_1_8b", 8_030_261_248),
    ("llama3_2_1b", 1_235_814_400), ("mistral_7b", 7_248_023_552),
    ("qwen2_0_5b", 494_032_768)])
def test_presets_have_the_published_parameter_counts(preset, params):
    c = load_config(None, [f"--config.model.preset={preset}"])
    validate(c)
    assert ModelConfig.from_config(c.model).num_params == params


def test_a_preset_yields_to_explicit_overrides():
    c = load_config(None, ["--config.model.preset=llama3_1_8b", "--config.model.n_layers=2"])
    assert (c.model.n_layers, c.model.d_model, c.model.rope_type, c.model.rope_factor) == \
        (2, 4096, "llama3", 8.0)


def test_an_unknown_preset_is_one_error_listing_them():
    with pytest.raises(ConfigError, match="(?s)model.preset.*unknown preset 'llama9'.*tinyllama_1b"):
        load_config(None, ["--config.model.preset=llama9"])


@pytest.mark.parametrize("change,key", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"num_local_experts": 8}, "num_local_experts"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64},
     "sliding_window")])
def test_configs_hetjax_cannot_represent_are_refused_naming_the_key(change, key):
    hf = {**hf_config.PRESETS["llama3_8b"], **change}
    with pytest.raises(ConfigError, match=f"config.json {key}:"):
        hf_config.model_fields(hf, "model.init_from")


def test_a_mistral_window_longer_than_the_context_is_full_attention():
    hf = {**hf_config.PRESETS["mistral_7b"], "sliding_window": 4096}
    assert hf_config.model_fields(hf, "model.init_from")["max_seq_len"] == 4096


def test_hf_config_round_trips_through_model_fields():
    for name in ("llama3_1_8b", "qwen2_0_5b", "tinyllama_1b"):
        fields = hf_config.preset_fields(name)
        m = ModelConfig(**fields)
        assert hf_config.model_fields(hf_config.hf_config(m), "x") == fields


# --- loading the fixtures -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama_gqa", "llama3_rope", "qwen2_bias"])
def test_an_hf_checkpoint_gives_transformers_logits(name):
    """GQA + untied head; llama3 RoPE scaling + explicit head_dim + MQA + tied head; Qwen2 q/k/v
    biases + linear RoPE scaling: each read shard by shard, against transformers' logits."""
    m, params = load_single(fixture(name), sharded=True)
    tokens, ref = reference(name)
    np.testing.assert_allclose(logits(m, params, tokens), ref, atol=1e-4, rtol=0)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params),
                 jax.device_get(load_single(fixture(name))[1]))


@pytest.mark.slow
def test_a_trainer_starts_from_the_checkpoint(tmp_path):
    """model.init_from in a Trainer under dp = 4 x tp = 2: its parameters give the reference."""
    trainer = trainer_from(fixture("llama_gqa"), PP1, tmp_path)
    tokens, ref = reference("llama_gqa")
    np.testing.assert_allclose(logits(trainer.model_cfg, trainer.params, tokens), ref,
                               atol=1e-4, rtol=0)
    assert trainer.init_from_bytes == 854272  # one process: every byte, each once


def test_rope_scaling_is_not_a_no_op():
    """The llama3 fixture's reference differs from the same weights without scaling, so the
    test above checks the scaling itself."""
    import dataclasses

    m, params = load_single(fixture("llama3_rope"))
    tokens, ref = reference("llama3_rope")
    plain = logits(dataclasses.replace(m, rope_type="default"), params, tokens)
    assert np.abs(plain - ref).max() > 1e-3


@pytest.mark.slow
def test_a_pipeline_plan_loads_the_same_parameters_and_loss(tmp_path):
    """pp = 2 x dp = 2 x tp = 2: the natural parameters equal the pp = 1 load bit for bit, and
    the pipeline's own forward gives the loss of transformers' logits."""
    from hetjax.layers import cross_entropy

    piped = trainer_from(fixture("llama_gqa"), PP2, tmp_path / "b",
                         **{"train.seq_len": 15, "train.batch_size": 4})
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(piped.params),
                 load_single(fixture("llama_gqa"))[1])
    tokens, ref = reference("llama_gqa")
    rows = np.concatenate([tokens, tokens])
    want = float(cross_entropy(np.concatenate([ref, ref])[:, :-1], rows[:, 1:]))
    got = piped.evaluate({"inputs": rows[:, :-1], "targets": rows[:, 1:]})
    assert abs(float(got) - want) < 1e-4


# --- export -------------------------------------------------------------------------------------
def test_export_then_import_is_bit_exact(tmp_path):
    m, params = load_single(fixture("llama_gqa"))
    out = tmp_path / "export"
    files = hf_checkpoint.write_hf(str(out), jax.device_get(params), m,
                                   max_shard_bytes=300_000)
    assert "model.safetensors.index.json" in files and len(files) > 3
    a, b = SafetensorsDir(fixture("llama_gqa")), SafetensorsDir(str(out))
    assert a.names() == b.names()
    for n in a.names():
        np.testing.assert_array_equal(a.read(n), b.read(n))
    jax.tree.map(np.testing.assert_array_equal, load_single(str(out))[1],
                 jax.device_get(params))


@pytest.fixture(scope="module")
def trained_export(tmp_path_factory):
    """Two training steps from the fixture under a pipeline plan, checkpointed, exported with
    the CLI."""
    from hetjax.cli import main

    root = tmp_path_factory.mktemp("trained")
    trainer = trainer_from(fixture("llama_gqa"), PP2, root / "run",
                           **{"train.steps": 2, "checkpoint.every": 2})
    trainer.train()
    trainer.checkpointer.wait()
    out = root / "export"
    assert main(["hetjax", "export", "--format=hf", f"--checkpoint={root / 'run'}", f"--out={out}"]) in \
        (0, None)
    return trainer, out


@pytest.mark.slow
def test_a_trained_checkpoint_exports_and_loads_back_with_the_same_logits(trained_export,
                                                                         tmp_path):
    trainer, out = trained_export
    m, params = load_single(str(out))
    jax.tree.map(np.testing.assert_array_equal, params, jax.device_get(trainer.params))
    tokens, _ = reference("llama_gqa")
    np.testing.assert_array_equal(logits(m, params, tokens),
                                  logits(trainer.model_cfg, trainer.params, tokens))
    assert json.load(open(out / "config.json"))["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.slow
def test_transformers_loads_an_export_as_it_is(request):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    trained_export = request.getfixturevalue("trained_export")
    trainer, out = trained_export
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
    tokens, _ = reference("llama_gqa")
    with torch.no_grad():
        got = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, logits(trainer.model_cfg, trainer.params, tokens), atol=1e-4)


# --- two processes --------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("plan", [
    {"zero.preset": "zero3"},
    {"parallel.pp": 2, "parallel.tp": 2, "train.microbatches": 2}], ids=["zero3", "pp2"])
def test_two_processes_each_read_only_their_own_slices(tmp_path, plan):
    """`hetjax launch --local 2`: with ZeRO-3 over dp = 8 each process's devices hold half of
    every parameter and it reads exactly half the bytes; with one pipeline stage per process it
    reads the embedding, final norm and head (every stage holds them) and its own two layers."""
    import re

    from test_launch import TINY, config_args, hetjax

    st = SafetensorsDir(fixture("llama_gqa"))
    size = {n: e["data_offsets"][1] - e["data_offsets"][0] for n, (_, e, _) in st.entries.items()}
    total = sum(size.values())
    if "parallel.pp" in plan:
        expect = [sum(v for n, v in size.items() if not any(
            n.startswith(f"model.layers.{i}.") for i in other)) for other in ((2, 3), (0, 1))]
    else:
        expect = [total // 2, total // 2]
    cfg = {**TINY, "model.init_from": fixture("llama_gqa"), "train.steps": 1, **plan,
           "workdir": str(tmp_path / "run")}
    for k in hf_config.ARCH_FIELDS:  # the checkpoint's architecture, not TINY's
        cfg.pop(f"model.{k}", None)
    run = hetjax("launch", "--local", "2", "--timeout", "200", *config_args(cfg))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    read = {int(p): int(n) for p, n in re.findall(
        r"^\[p(\d)\] hetjax: model.init_from: process \d read (\d+) bytes", run.stdout, re.M)}
    assert [read.get(0), read.get(1)] == expect, (read, expect, total)


def test_overriding_a_weight_shape_of_init_from_is_one_error():
    with pytest.raises(ConfigError, match="(?s)model.n_layers: is 2, but the weights of "
                       "model.init_from.* have 4.*drop the override"):
        validate(load_config(None, [f"--config.model.init_from={fixture('llama_gqa')}",
                                    "--config.model.n_layers=2"]))
    c = load_config(None, [f"--config.model.init_from={fixture('llama_gqa')}",
                           "--config.model.max_seq_len=128", "--config.train.seq_len=64"])
    validate(c)  # a field that does not shape the weights may change
    assert (c.model.max_seq_len, c.model.n_layers, c.model.vocab_size) == (128, 4, 512)


def test_bfloat16_checkpoints_load_into_float32_parameters(tmp_path):
    """Real LLaMA checkpoints are bfloat16 (which the safetensors package's numpy reader lacks):
    a bfloat16 export reads back as the bfloat16-rounded float32 parameters."""
    import ml_dtypes

    m, params = load_single(fixture("llama_gqa"))
    half = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16), params)
    hf_checkpoint.write_hf(str(tmp_path), half, m)
    assert json.load(open(tmp_path / "config.json"))["torch_dtype"] == "bfloat16"
    _, back = load_single(str(tmp_path), sharded=True)
    jax.tree.map(lambda b, h: np.testing.assert_array_equal(np.asarray(b),
                                                            h.astype(np.float32)), back, half)

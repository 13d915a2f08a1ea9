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
from hetjax.core import hf_config
from hetjax.errors import ConfigError, HetjaxError
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


@pytest.mark.parametrize("preset,total,active,published", [
    ("mixtral_8x7b", 46_702_792_704, 12_879_925_248, (46.7, 12.9)),
    ("qwen3_30b_a3b", 30_532_122_624, 3_353_032_704, (30.5, 3.3)),
    ("olmoe_1b_7b", 6_919_161_856, 1_282_017_280, (6.9, 1.3)),
    ("qwen2_moe_a2_7b", 14_315_784_192, 2_689_173_504, (14.3, 2.7))])
def test_moe_presets_have_the_published_parameter_counts(preset, total, active, published):
    """All parameters and those one token passes through (k of the experts, the shared one, the
    routers, attention, embedding and head); the model cards give billions to one decimal
    (Mixtral's safetensors hold exactly `total`; Qwen3's card writes 3.35B active as 3.3B)."""
    c = load_config(None, [f"--config.model.preset={preset}"])
    validate(c)
    m = ModelConfig.from_config(c.model)
    assert (m.num_params, m.active_params) == (total, active)
    for n, pub in zip((total, active), published):
        assert pub in (round(n / 1e9, 1), int(n / 1e8) / 10)


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
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64,
      "layer_types": ["chunked_attention"] * 32}, "layer_types")])
def test_configs_hetjax_cannot_represent_are_refused_naming_the_key(change, key):
    hf = {**hf_config.PRESETS["llama3_8b"], **change}
    with pytest.raises(ConfigError, match=f"config.json {key}:"):
        hf_config.model_fields(hf, "model.init_from")


def _window(**change):
    f = hf_config.model_fields({**hf_config.PRESETS["llama3_8b"], **change}, "x")
    return f["sliding_window"], f["full_attention_layers"], f["max_seq_len"]


def test_sliding_windows_are_read_as_transformers_reads_them():
    """Mistral: every layer, its config's 4096 when the key is absent, none when null; Qwen2 and
    Qwen3 only with use_sliding_window, on the layers layer_types names (older files: from
    max_window_layers on); the context stays max_position_embeddings."""
    assert _window(model_type="mistral", sliding_window=4096) == (4096, (), 8192)
    hf = {k: v for k, v in hf_config.PRESETS["llama3_8b"].items()}
    assert hf_config.model_fields({**hf, "model_type": "mistral"}, "x")["sliding_window"] == 4096
    assert _window(model_type="mistral", sliding_window=None)[:2] == (0, ())
    assert _window(model_type="llama", sliding_window=64)[:2] == (0, ())
    qwen = dict(model_type="qwen2", sliding_window=64, max_window_layers=30)
    assert _window(**qwen)[:2] == (0, ())  # use_sliding_window false
    assert _window(**qwen, use_sliding_window=True)[:2] == (64, tuple(range(30)))
    types = ["full_attention", "sliding_attention"] * 16
    assert _window(**qwen, use_sliding_window=True, layer_types=types)[:2] == \
        (64, tuple(range(0, 32, 2)))
    assert _window(**{**qwen, "model_type": "qwen3", "max_window_layers": 32},
                   use_sliding_window=True)[:2] == (0, ())  # every layer full


def test_the_qwen3_window_fixture_reads_the_same_without_layer_types():
    hf = hf_config.read_config_json(fixture("qwen3_window"))
    fields = hf_config.model_fields(hf, "x")
    assert (fields["sliding_window"], fields["full_attention_layers"], fields["qk_norm"]) == \
        (8, (0,), "head")
    del hf["layer_types"]
    assert hf_config.model_fields(hf, "x") == fields


def test_mixed_windows_need_the_whole_layer_stack():
    with pytest.raises(ConfigError, match=r"(?s)model.full_attention_layers: \[0\] attend "
                       "fully.*parallel.pp = 2.*--config.parallel.pp=1"):
        validate(load_config(None, [f"--config.model.init_from={fixture('qwen3_window')}",
                                    "--config.parallel.pp=2", "--config.train.seq_len=16"]))
    with pytest.raises(ConfigError, match=r"model.full_attention_layers: \[5\] names layers "
                       "outside 0 .. 3"):
        validate(load_config(None, ["--config.model.sliding_window=8",
                                    "--config.model.full_attention_layers=(5,)"]))


def test_hf_config_round_trips_through_model_fields():
    for name in ("llama3_1_8b", "qwen2_0_5b", "tinyllama_1b"):
        fields = hf_config.preset_fields(name)
        m = ModelConfig(**fields)
        assert hf_config.model_fields(hf_config.hf_config(m), "x") == fields
    for name in ("mistral_window", "qwen3_window", "qwen2_bias"):
        fields = hf_config.model_fields(hf_config.read_config_json(fixture(name)), "x")
        hf = hf_config.hf_config(ModelConfig(**fields))
        assert hf["model_type"] == json.load(open(os.path.join(fixture(name), "config.json")))[
            "model_type"]
        assert hf_config.model_fields(hf, "x") == fields
    m = ModelConfig(**{**fields, "qk_norm": "all_heads"})
    with pytest.raises(HetjaxError, match="model.qk_norm: 'all_heads' in a dense model, which "
                       "no transformers model"):
        hf_config.hf_config(m)


# --- loading the fixtures -----------------------------------------------------------------------
MOE = ["mixtral_moe", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.mark.parametrize("name", ["llama_gqa", "llama3_rope", "qwen2_bias", "mistral_window",
                                  "qwen3_window"])
def test_an_hf_checkpoint_gives_transformers_logits(name):
    """GQA + untied head; llama3 RoPE scaling + explicit head_dim + MQA + tied head; Qwen2 q/k/v
    biases + linear RoPE scaling; Mistral's 160-token window at 256 positions; Qwen3's per-head
    QK-norm with a window on one of two layers: each read shard by shard, against
    transformers' logits. (The mixtures of experts: the router test below.)"""
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


def test_sliding_windows_are_not_a_no_op():
    """Past the window, the references differ from the same weights attending fully (so the
    test above checks the window): by a relative 0.4 at Mistral's positions 160 .. 255."""
    import dataclasses

    for name, past in (("mistral_window", 160), ("qwen3_window", 8)):
        m, params = load_single(fixture(name))
        tokens, ref = reference(name)
        full = logits(dataclasses.replace(m, sliding_window=0, full_attention_layers=()), params,
                      tokens)
        np.testing.assert_allclose(full[:, :past], ref[:, :past], atol=1e-4, rtol=0)
        assert np.abs(full[:, past:] - ref[:, past:]).max() > 0.1 * np.abs(ref).max()


def saved(name, key):
    with np.load(os.path.join(fixture(name), "reference.npz")) as z:
        return z[key]


@pytest.mark.parametrize("name", ["qwen2_moe"] + [
    pytest.param(n, marks=pytest.mark.slow) for n in ("mistral_window", "qwen3_window",
                                                      "mixtral_moe", "qwen3_moe", "olmoe")])
def test_greedy_decoding_equals_transformers_generate(name):
    """hetjax's KV-cache decoding continues the prompt with transformers' greedy tokens, past
    the window: Mistral from 150 to 256 positions (window 160), Qwen3 from 6 to 20 (window 8 on
    layer 1); the mixtures of experts from 6 to 20. Every step's best logit led the second by
    >= 1e-3 in transformers, and every router's k-th choice the next by >= 1e-4."""
    from hetjax.layers.generate import generate

    m, params = load_single(fixture(name))
    prompt, want = saved(name, "prompt"), saved(name, "generated")
    assert saved(name, "min_margin") >= 1e-3
    got = generate(Transformer(m), jax.device_get(params), prompt.tolist(), want.shape[1])
    assert got == want.tolist()


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


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["spmd", "mpmd"])
def test_a_pipeline_trains_at_256_positions_through_the_window(tmp_path, executor):
    """Mistral's 160-token window under pp = 2 x dp = 2 x tp = 2 at 255 positions (each stage
    runs its layer alone, the window a constant of the model): the pipeline's loss is the loss
    of transformers' logits."""
    from hetjax.layers import cross_entropy

    plan = {**PP2, "pipeline.stage_layers": (1, 1), "pipeline.executor": executor}
    piped = trainer_from(fixture("mistral_window"), plan, tmp_path,
                         **{"train.seq_len": 255, "train.batch_size": 4})
    assert (piped.model_cfg.sliding_window, piped.model_cfg.max_seq_len) == (160, 512)
    tokens, ref = reference("mistral_window")
    rows = np.concatenate([tokens] * 4)
    want = float(cross_entropy(np.concatenate([ref] * 4)[:, :-1], rows[:, 1:]))
    got = piped.evaluate({"inputs": rows[:, :-1], "targets": rows[:, 1:]})
    assert abs(float(got) - want) < 1e-4


def _routed(name):
    """hetjax's forward of the fixture's tokens (loaded shard by shard) with its MoE records:
    logits, router logits [layers, tokens, E], and the per-layer stats (balance, load)."""
    m, params = load_single(fixture(name), sharded=True)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params),
                 jax.device_get(load_single(fixture(name))[1]))
    tokens, _ = reference(name)
    out, rec = Transformer(m).apply({"params": jax.device_get(params)}, tokens,
                                    mutable=["router_logits", "moe"])
    stats = rec["moe"]["layers"]["block"]["moe"]
    router = np.asarray(jax.tree.leaves(rec["router_logits"])[0])
    return m, np.asarray(out), router.reshape(m.n_layers, -1, m.n_experts), {
        k: np.asarray(v)[0] for k, v in stats.items()}


# Qwen3-MoE's per-head QK-norm is read as the dense qwen3_window's is (the default tier's):
# its MoE reading runs in the slow tier.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "qwen3_moe"
                                  else n for n in MOE])
def test_router_logits_and_balance_loss_match_transformers(name):
    """Mixtral; Qwen2-MoE's shared expert and biases; Qwen3-MoE's per-head and OLMoE's
    all-heads QK-norm: read shard by shard (the stacked experts split too, each expert's
    tensors read apart), the logits (dropless dispatch, the default) are transformers' within
    1e-4 of the largest, and every layer's router logits within 1e-6; transformers'
    `load_balancing_loss_func` on one layer is k times hetjax's balance loss of that layer
    (hetjax.layers.moe's convention: 1 for a uniform router), within 1e-6; over all layers it
    pools the layers' expert loads and mean probabilities first, which hetjax's recorded loads
    and router probabilities reproduce."""
    import scipy.special

    m, out, router, stats = _routed(name)
    _, ref = reference(name)
    np.testing.assert_allclose(out, ref, atol=1e-4 * np.abs(ref).max(), rtol=0)
    want = saved(name, "router_logits")
    np.testing.assert_allclose(router, want, atol=1e-6 * np.abs(want).max(), rtol=0)
    k = m.experts_per_token
    np.testing.assert_allclose(k * stats["balance"], saved(name, "aux_loss_per_layer"),
                               rtol=1e-6)
    probs = scipy.special.softmax(router.astype(np.float64), axis=-1).mean(axis=1)  # [L, E]
    pooled = m.n_experts * k * np.sum(stats["load"].mean(0) * probs.mean(0))
    np.testing.assert_allclose(pooled, saved(name, "aux_loss"), rtol=1e-6)
    assert saved(name, "min_router_margin") >= 1e-4


def test_an_expert_shard_reads_only_its_experts():
    """A shard holding experts 1 and 2 of Mixtral's 4 (expert parallelism) and half of their
    hidden width (tensor parallelism) reads just those rows of those experts' tensors."""
    from hetjax.interop.hf_checkpoint import _leaves, _read_leaf

    m = ModelConfig(**hf_config.model_fields(hf_config.read_config_json(
        fixture("mixtral_moe")), "x"))
    st = SafetensorsDir(fixture("mixtral_moe"))
    leaf = _leaves(m, True, "mixtral")[("layers", "block", "moe", "experts", "gate")]
    got = _read_leaf(st, leaf, 1, (slice(1, 3), slice(None), slice(0, 24)))
    assert st.bytes_read == 2 * 24 * m.d_model * 4  # of 4 experts x 48 rows x d_model
    want = [SafetensorsDir(fixture("mixtral_moe")).read(
        f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight").T[:, :24] for e in (1, 2)]
    np.testing.assert_array_equal(got, np.stack(want))


def test_moe_configs_map_as_transformers_reads_them():
    """Each family's fields: expert count (Qwen3-MoE files of transformers 5 name it
    num_local_experts), width, top-k, renormalisation (Mixtral always), the shared expert,
    QK-norm, biases; the load-balance coefficient times k (hetjax's loss is 1/k of
    transformers'); leading mlp_only_layers as first_dense_layers, others refused."""
    read = {n: hf_config.model_fields(hf_config.read_config_json(fixture(n)), "x") for n in MOE}
    pick = ("n_experts", "experts_per_token", "moe_d_ff", "shared_expert_d_ff",
            "moe_norm_topk_prob", "qk_norm", "qkv_bias", "moe_aux_loss_coef")
    assert {n: tuple(f[k] for k in pick) for n, f in read.items()} == {
        "mixtral_moe": (4, 2, 48, 0, True, "none", False, 0.04),
        "qwen2_moe": (4, 2, 32, 80, False, "none", True, 0.002),
        "qwen3_moe": (8, 2, 32, 0, True, "head", False, 0.002),
        "olmoe": (8, 2, 32, 0, False, "all_heads", False, 0.02)}
    hf = hf_config.read_config_json(fixture("qwen3_moe"))
    hf["num_experts"] = hf.pop("num_local_experts")  # as the published files write it
    assert hf_config.model_fields(hf, "x") == read["qwen3_moe"]
    for n in MOE:  # export writes the family it came from, which reads back the same
        cfg = hf_config.hf_config(ModelConfig(**read[n]))
        assert cfg["model_type"] == hf_config.read_config_json(fixture(n))["model_type"]
        assert hf_config.model_fields(cfg, "x") == read[n]
    assert hf_config.model_fields({**hf, "mlp_only_layers": [0, 1]}, "x")[
        "first_dense_layers"] == 2
    with pytest.raises(ConfigError, match=r"config.json mlp_only_layers: \[1\]"):
        hf_config.model_fields({**hf, "mlp_only_layers": [1]}, "x")
    # windows: Mixtral's on every layer; Qwen2-MoE's (older files without layer_types) on the
    # even layers below max_window_layers; Qwen3-MoE's on every layer; OLMoE none
    windows = {}
    for n, extra in (("mixtral_moe", {"sliding_window": 8}),
                     ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8,
                                    "max_window_layers": 1, "layer_types": None}),
                     ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}),
                     ("olmoe", {"sliding_window": 8})):
        f = hf_config.model_fields({**hf_config.read_config_json(fixture(n)), **extra}, "x")
        windows[n] = (f["sliding_window"], f["full_attention_layers"])
    assert windows == {"mixtral_moe": (8, ()), "qwen2_moe": (8, (1,)), "qwen3_moe": (8, ()),
                       "olmoe": (0, ())}
    with pytest.raises(ConfigError, match="config.json clip_qkv: 8.0"):
        hf_config.model_fields({**hf_config.read_config_json(fixture("olmoe")),
                                "clip_qkv": 8.0}, "x")


# --- export -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama_gqa", "qwen3_window", "mixtral_moe", "qwen2_moe"])
def test_export_then_import_is_bit_exact(tmp_path, name):
    """Every tensor of the fixture, under its own name (Qwen3's q_norm / k_norm; each expert's
    w1 / w2 / w3 or gate_proj / up_proj / down_proj apart, the router, the shared expert and
    its gate)."""
    m, params = load_single(fixture(name))
    out = tmp_path / "export"
    files = hf_checkpoint.write_hf(str(out), jax.device_get(params), m,
                                   max_shard_bytes=200_000)
    assert "model.safetensors.index.json" in files and len(files) > 3
    a, b = SafetensorsDir(fixture(name)), SafetensorsDir(str(out))
    assert a.names() == b.names()
    for n in a.names():
        np.testing.assert_array_equal(a.read(n), b.read(n))
    jax.tree.map(np.testing.assert_array_equal, load_single(str(out))[1],
                 jax.device_get(params))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral_window", "qwen3_window", *MOE])
def test_transformers_reads_an_exported_model_as_saved(tmp_path, name):
    """hetjax's export of the window and MoE fixtures (Mistral's sliding_window; Qwen3's
    layer_types and q_norm / k_norm; each family's per-expert tensors and config) gives
    transformers' saved logits in transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    m, params = load_single(fixture(name))
    hf_checkpoint.write_hf(str(tmp_path), jax.device_get(params), m)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                              dtype=torch.float32)
    tokens, ref = reference(name)
    with torch.no_grad():
        got = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


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


@pytest.fixture(scope="module")
def trained_moe_export(tmp_path_factory):
    """Two training steps from the Qwen2-MoE fixture under dp = 4 x tp = 2, checkpointed,
    exported with the CLI."""
    from hetjax.cli import main

    root = tmp_path_factory.mktemp("trained_moe")
    trainer = trainer_from(fixture("qwen2_moe"), PP1, root / "run",
                           **{"train.steps": 2, "checkpoint.every": 2,
                              "model.moe_dispatch": "dense"})
    trainer.train()
    trainer.checkpointer.wait()
    out = root / "export"
    assert main(["hetjax", "export", "--format=hf", f"--checkpoint={root / 'run'}",
                 f"--out={out}"]) in (0, None)
    return trainer, out


@pytest.mark.slow
def test_a_trained_moe_checkpoint_exports_per_expert_tensors(trained_moe_export):
    """`hetjax export` writes every tensor under the name transformers saved it with (each
    expert's gate_proj / up_proj / down_proj, the router, the shared expert and its gate), the
    trained values, loading back bit for bit; transformers (where installed) computes hetjax's
    logits from it."""
    trainer, out = trained_moe_export
    assert SafetensorsDir(str(out)).names() == SafetensorsDir(fixture("qwen2_moe")).names()
    assert json.load(open(out / "config.json"))["architectures"] == ["Qwen2MoeForCausalLM"]
    m, params = load_single(str(out))
    trained = jax.device_get(trainer.params)  # the vocabulary padded for tp: 320 -> 384 rows
    assert trainer.model_cfg.vocab_rows == 384
    trained["embedder"]["embedding"] = trained["embedder"]["embedding"][:320]
    trained["lm_head"]["kernel"] = trained["lm_head"]["kernel"][:, :320]
    jax.tree.map(np.testing.assert_array_equal, params, trained)
    tokens, ref = reference("qwen2_moe")
    mine = logits(trainer.model_cfg, trainer.params, tokens)[..., :320]
    assert np.abs(mine - ref).max() > 0.1  # trained: not the fixture's logits any more
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        got = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(got, mine, atol=1e-4, rtol=0)


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

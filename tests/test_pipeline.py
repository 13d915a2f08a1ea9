"""Pipeline parallelism: the stage-stacked layout, the executor against the plain model, training
with pp > 1, activation memory of the schedules, where collectives go, and user mistakes."""

import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, tiny_config
from hetjax.errors import ConfigError, PlanError
from hetjax.core.plan import Plan
from hetjax.train import Trainer
from hetjax.parallel import pipeline as pl


def plan_for(split, **kw):
    args = dict(pp=len(split), dp=1, tp=1, stage_layers=tuple(split), microbatches=1,
                global_batch=1, seq_len=8)
    return Plan(**{**args, **kw})


def pipe_config(split, schedule="1f1b", dp=2, tp=2, microbatches=4, **overrides):
    """A tiny model split over len(split) stages, with 2 sequences per device per micro-batch."""
    return tiny_config(**{
        "model.d_model": 32, "model.d_ff": 64, "model.n_layers": sum(split),
        "parallel.pp": len(split), "parallel.dp": dp, "parallel.tp": tp,
        "pipeline.stage_layers": tuple(split), "pipeline.schedule": schedule,
        "pipeline.microbatches": microbatches, "train.batch_size": 2 * dp * microbatches,
        **overrides})


# --- the stage-stacked layout ------------------------------------------------------------------
@pytest.mark.parametrize("split", [(17, 13), (5, 3, 2, 6), (1, 7)])
def test_natural_to_stages_to_natural_is_exact_and_pads_with_zeros(split):
    plan = plan_for(split)
    rng = np.random.default_rng(0)
    natural = jax.tree.map(lambda shape: rng.normal(size=shape).astype(np.float32), {
        "embedder": {"embedding": (5, 3)},
        "layers": {"block": {"w": (sum(split), 3, 2), "scale": (sum(split), 3)}}},
        is_leaf=lambda x: isinstance(x, tuple))
    stacked = pl.to_stages(natural, plan)
    w = stacked["layers"]["block"]["w"]
    assert w.shape == (len(split), max(split), 3, 2)
    assert stacked["embedder"]["embedding"] is natural["embedder"]["embedding"]
    mask = pl.slot_mask(plan)
    assert mask.sum() == sum(split)
    assert not np.any(w[~mask])  # padded slots are zero
    for s, r in enumerate(plan.layer_range(s) for s in range(plan.pp)):
        np.testing.assert_array_equal(w[s, :len(r)], natural["layers"]["block"]["w"][r.start:r.stop])
    back = pl.from_stages(stacked, plan)
    jax.tree.map(np.testing.assert_array_equal, back, natural)
    # jax arrays and the boxed (logically named) parameters the model initialises convert too
    back_jax = pl.from_stages(pl.to_stages(jax.tree.map(jnp.asarray, natural), plan), plan)
    jax.tree.map(np.testing.assert_array_equal, back_jax, natural)
    boxed = {"layers": {"block": {"w": nn.Partitioned(natural["layers"]["block"]["w"],
                                                       ("layers", "embed", "mlp"))}}}
    stacked_boxed = pl.to_stages(boxed, plan)["layers"]["block"]["w"]
    assert stacked_boxed.names == ("stage", "layers", "embed", "mlp")
    assert pl.from_stages(pl.to_stages(boxed, plan), plan)["layers"]["block"]["w"].names == \
        ("layers", "embed", "mlp")


def test_freeze_padding_zeroes_only_padded_updates_and_keeps_the_state():
    import optax

    plan = plan_for((1, 3))
    params = {"embedder": {"embedding": np.ones((4, 2), np.float32)},
              "layers": {"block": {"w": np.ones((2, 3, 5), np.float32)}}}
    sgd = optax.sgd(1.0, momentum=0.9)
    tx = pl.freeze_padding(sgd, plan)
    state = tx.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(sgd.init(params))
    updates, _ = tx.update(jax.tree.map(np.negative, params), state, params)
    np.testing.assert_array_equal(updates["layers"]["block"]["w"][:, :, 0],
                                  [[1, 0, 0], [1, 1, 1]])
    np.testing.assert_array_equal(updates["embedder"]["embedding"], 1)


# --- the executor against the plain model ------------------------------------------------------
def compute_grads(trainer, batch):
    """Loss and natural-layout gradients of the trainer's loss_and_grads, compiled as in a step."""
    with trainer._context():
        loss, grads = jax.jit(trainer.loss_and_grads)(trainer.state.params, batch)
    return float(loss), jax.device_get(trainer.pipeline.from_stages(grads))


def reference_grads(trainer, batch):
    """The non-pipelined model on one device: mean loss over the micro-batches and its grads."""
    params = jax.device_get(trainer.params)
    batch = jax.device_get(batch)

    def loss(p):
        return jnp.mean(jax.vmap(lambda i, t: trainer.loss_fn(p, i, t))(
            batch["inputs"], batch["targets"]))

    with jax.default_device(jax.devices()[0]):
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), jax.device_get(grads)


def assert_grads_match(grads, ref):
    assert jax.tree.structure(grads) == jax.tree.structure(ref)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref)):
        assert g.shape == r.shape, path
        err = np.max(np.abs(g - r)) / np.max(np.abs(r))
        assert err < 1e-5, (jax.tree_util.keystr(path), err)


def check_against_reference(config):
    trainer = Trainer(config, quiet=True)
    batch = trainer.put_batch(next(trainer.data))
    loss, grads = compute_grads(trainer, batch)
    ref_loss, ref_grads = reference_grads(trainer, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_grads_match(grads, ref_grads)
    return trainer


# (schedule, layers per stage, dp, tp, micro-batches, extra config); every recompute policy
# (model.remat; 'auto' is 'full' here) with dp and tp inside stages and a one-layer stage
EXECUTOR_CASES = [
    ("1f1b", (1, 2), 2, 2, 4, {"model.remat": "none"}),  # a single-layer first stage
    ("gpipe", (3, 1), 2, 2, 2, {"model.remat": "dots"}),  # a single-layer last stage
    ("1f1b", (2, 1, 3, 1), 2, 1, 8, {"model.tie_embeddings": False}),  # 1F1B steady state
    ("gpipe", (1, 3, 2, 1), 1, 2, 4, {"model.remat": "full"}),
]


@pytest.mark.parametrize("schedule, split, dp, tp, mb, extra", [  # the first: default tier
    pytest.param(*c, marks=[pytest.mark.slow] if i >= 1 else [],
                 id=f"{c[0]}-{'.'.join(map(str, c[1]))}-dp{c[2]}-tp{c[3]}-m{c[4]}")
    for i, c in enumerate(EXECUTOR_CASES)])
def test_loss_and_every_gradient_equal_the_plain_model(schedule, split, dp, tp, mb, extra):
    trainer = check_against_reference(pipe_config(split, schedule, dp, tp, mb, **extra))
    assert dict(trainer.mesh.shape)["pp"] == len(split)


SIXTEEN_DEVICES = """
import os, sys
sys.path.insert(0, {tests!r})
import conftest  # noqa: F401  (puts the repository on sys.path)
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=16"
import test_pipeline as t
for schedule in ("1f1b", "gpipe"):
    trainer = t.check_against_reference(t.pipe_config(
        (2, 1, 1, 3), schedule, dp=2, tp=2, microbatches=4, **{{
            "topology.preset": "holmes_hybrid", "topology.nodes": 4,
            "topology.devices_per_node": 2}}))
    print(schedule, dict(trainer.mesh.shape), "ok")
"""


@pytest.mark.slow
def test_four_stages_with_dp_and_tp_on_sixteen_devices():
    """pp = 4 with dp = tp = 2 needs 16 devices: a subprocess simulates them."""
    code = SIXTEEN_DEVICES.format(tests=os.path.join(REPO, "tests"))
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=900, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("ok") == 2, r.stdout


# --- training with pp > 1 ----------------------------------------------------------------------
HOLMES_MINI = {"topology.preset": "holmes_hybrid", "topology.nodes": 2,
               "topology.devices_per_node": 2}


@pytest.fixture(scope="module")
def holmes_run():
    """Three 1F1B steps on the 2-cluster Holmes preset (pp=2: one stage per cluster, dp=2 in a
    cluster, tp=2 in a node) and the same steps on one device without a pipeline."""
    config = pipe_config((1, 2), "1f1b", dp=2, tp=2, microbatches=4, **HOLMES_MINI)
    trainer = Trainer(config, quiet=True)
    compiled = trainer.compiled_step()  # the HLO audit reads it; step() reuses the compilation
    losses = [float(trainer.step()["loss"]) for _ in range(3)]
    single = pipe_config((3,), dp=1, tp=1, microbatches=4, **{
        "topology.preset": "cpu_single", "topology.devices_per_node": 1,
        "pipeline.stage_layers": (), "train.batch_size": config.train.batch_size})
    ref = Trainer(single, quiet=True)
    ref_losses = [float(ref.step()["loss"]) for _ in range(3)]
    return trainer, compiled, losses, ref, ref_losses


def test_train_steps_equal_the_single_device_steps(holmes_run):
    trainer, _, losses, ref, ref_losses = holmes_run
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6),
                 jax.device_get(trainer.params), jax.device_get(ref.state.params))


def test_evaluate_uses_the_natural_parameters(holmes_run):
    trainer, _, _, ref, _ = holmes_run
    batch = next(ref.data)
    np.testing.assert_allclose(trainer.evaluate(batch), ref.evaluate(batch), rtol=1e-5)


def test_user_tree_has_no_padding_and_padded_slots_never_change(holmes_run):
    trainer, _, _, ref, _ = holmes_run
    natural = jax.tree.map(lambda a: a.shape, trainer.params)
    assert natural == jax.tree.map(lambda a: a.shape, ref.state.params)
    stacked = trainer.state.params["layers"]["block"]
    mask = pl.slot_mask(trainer.plan)  # stage 0 has 1 layer in 2 slots
    assert not mask.all()
    for path, leaf in jax.tree_util.tree_leaves_with_path(stacked):
        assert leaf.shape[:2] == mask.shape
        assert not np.any(np.asarray(leaf)[~mask]), jax.tree_util.keystr(path)
    # the optimizer moments of padded slots stay zero too
    for leaf in jax.tree.leaves(trainer.state.opt_state):
        if leaf.ndim >= 2 and leaf.shape[:2] == mask.shape:
            assert not np.any(np.asarray(leaf)[~mask])


def test_checkpoint_layout_gives_the_single_device_state_tree(holmes_run):
    """StageLayout (hetjax.checkpoint's Layout protocol): the natural state of a pp = 2 run has
    the tree, shapes and values of the pp = 1 run's state, and converts back exactly."""
    trainer, _, _, ref, _ = holmes_run
    abstract = jax.eval_shape(lambda s: s, trainer.state)
    layout = pl.StageLayout(trainer.plan, abstract, trainer.state_sharding)
    natural = layout.to_natural(trainer.state)
    assert jax.tree.structure(natural) == jax.tree.structure(ref.state)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6),
                 jax.device_get(natural), jax.device_get(ref.state))
    target = layout.natural_target()
    assert jax.tree.map(lambda t: t.shape, target) == jax.tree.map(lambda a: a.shape, natural)
    block_q = target.params["layers"]["block"]["attn"]["query"]
    stacked_q = trainer.state_sharding.params["layers"]["block"]["attn"]["query"]
    assert stacked_q.spec[0] == "pp" and tuple(block_q.sharding.spec) == stacked_q.spec[1:]
    back = layout.from_natural(natural)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 back, trainer.state)
    assert jax.tree.map(lambda a: a.sharding, back) == trainer.state_sharding


def test_shared_parameters_stay_identical_on_every_stage(holmes_run):
    """Embedding and final norm are replicated over 'pp'; the ring sum must keep the copies
    bit-identical on every device."""
    trainer = holmes_run[0]
    stage_of = {d: s for s in range(trainer.plan.pp) for d in trainer.mesh.devices[s].flat}
    for leaf in (trainer.state.params["embedder"]["embedding"],
                 trainer.state.params["final_norm"]["scale"]):
        by_index = {}
        for shard in leaf.addressable_shards:
            by_index.setdefault(str(shard.index), []).append(shard)
        for copies in by_index.values():
            assert {stage_of[c.device] for c in copies} == {0, 1}
            for c in copies[1:]:
                np.testing.assert_array_equal(np.asarray(c.data), np.asarray(copies[0].data))


# --- where the collectives go ------------------------------------------------------------------
COLLECTIVE = re.compile(
    r"=\s*(?P<shape>.*?)\s(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"ragged-all-to-all|collective-permute|collective-broadcast)(?:-start)?\(")


def _iota(spec: str) -> np.ndarray:
    """XLA's iota tile assignment '[d1,d2,...]' or '[d1,d2,...]T(p1,p2,...)' as an array."""
    m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    dims = [int(v) for v in m.group(1).split(",")]
    a = np.arange(int(np.prod(dims))).reshape(dims)
    return a.transpose([int(v) for v in m.group(2).split(",")]) if m.group(2) else a


def replica_groups(line: str, n: int) -> list[list[int]]:
    """The device groups of one collective in compiled HLO text (partition ids).

    Reads the four spellings XLA prints: source_target_pairs (collective-permute), explicit
    lists, iota '[G,S]<=[dims]T(perm)', and mesh axes 'mesh[...] device_ids=(...) {axes}'."""
    if "source_target_pairs=" in line:
        text = line[line.index("source_target_pairs="):]
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", text.split("}}")[0])]
    text = line[line.index("replica_groups=") + len("replica_groups="):]
    if text.startswith("{}"):
        return [list(range(n))]
    if text.startswith("{{"):
        return [[int(v) for v in g.split(",")]
                for g in re.findall(r"\{([\d,]+)\}", text[:text.index("}}") + 2])]
    m = re.match(r"\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", text)
    if m:
        return _iota(m.group(3)).reshape(int(m.group(1)), int(m.group(2))).tolist()
    m = re.match(r"mesh\[([^\]]*)\](?:, device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?)\))?"
                 r"\s*\{([^}]*)\}", text)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        ids = _iota(m.group(2)) if m.group(2) else np.arange(int(np.prod(sizes)))
        grouped = re.findall(r"'([^']+)'(:[^,}]+)?", m.group(3))
        assert not any(sub for _, sub in grouped), f"sub-axis groups not read: {text[:120]}"
        g = [names.index(a) for a, _ in grouped]
        arr = ids.reshape(sizes).transpose([i for i in range(len(names)) if i not in g] + g)
        return arr.reshape(-1, int(np.prod([sizes[i] for i in g]))).tolist()
    raise AssertionError(f"unknown replica-group format: {text[:120]}")


def collectives(compiled):
    """(op, result shape, groups of topology ranks, op_name) of every collective."""
    devices = compiled.runtime_executable().local_devices()  # partition id -> device
    out = []
    for line in compiled.as_text().splitlines():
        m = COLLECTIVE.search(line)
        if m:
            groups = [[devices[p] for p in g] for g in replica_groups(line, len(devices))]
            name = re.search(r'op_name="([^"]*)"', line)
            out.append((m.group("op"), m.group("shape"), groups, name.group(1) if name else ""))
    return out


def test_only_pipeline_permutes_cross_clusters_on_the_holmes_preset(holmes_run):
    trainer, compiled = holmes_run[:2]
    topo, plan = trainer.topology, trainer.plan
    rank = {d: r for r, d in enumerate(topo.jax_devices())}
    ops = [(op, shape, [sorted(rank[d] for d in g) for g in groups], name)
           for op, shape, groups, name in collectives(compiled)]

    def spans(groups, attr):
        return any(len({getattr(topo.devices[r], attr) for r in g}) > 1 for g in groups)

    crossing = [c for c in ops if spans(c[2], "cluster")]
    # activations forward and gradients backward ([this data-parallel device, 2 sequences, 16
    # tokens, d_model 32]) ...
    assert any(op == "collective-permute" and shape.startswith("f32[1,2,16,32]")
               for op, shape, _, _ in crossing)
    for op, shape, groups, name in crossing:
        if op == "collective-permute":  # ... and the ring sums of loss and shared gradients
            assert "shard_map" in name, name
            continue
        # The one other kind: the optimizer's global gradient norm (clipping and the grad_norm
        # metric) adds per-stage scalars over the pipeline groups, as Megatron-LM does too.
        assert op == "all-reduce" and "shard_map" not in name, (op, shape, name)
        parts = re.sub(r"/\*index=\d+\*/", "", shape).strip("()").split(", ")
        assert set(parts) == {"f32[]"}, shape
        assert sorted(groups) == sorted(sorted(g) for g in plan.pp_groups())
    # Gradient reductions over DP run on the plan's DP groups (inside a cluster), the
    # all-reduces of tensor parallelism on its TP groups (inside a node).
    reduces = [c for c in ops if c[0] == "all-reduce" and not spans(c[2], "cluster")]
    dp_groups = sorted(sorted(g) for g in plan.dp_groups())
    tp_groups = sorted(sorted(g) for g in plan.tp_groups())
    assert any(sorted(c[2]) == dp_groups for c in reduces)
    assert any(sorted(c[2]) == tp_groups for c in reduces)
    assert not spans(tp_groups, "global_node") and not spans(dp_groups, "cluster")


# --- two strands per tick (DHelix's strand interleaving) ---------------------------------------
@pytest.fixture(scope="module")
def strands_run():
    """The strands schedule on pp 2 with a one-layer stage, dp 2, tp 2 and no recompute: the
    trainer, a batch and the compiled loss and gradients (shared by the tests below)."""
    trainer = Trainer(pipe_config((1, 2), "strands", 2, 2, 4, **{"model.remat": "none"}),
                      quiet=True)
    batch = trainer.put_batch(next(trainer.data))
    with trainer._context():
        compiled = jax.jit(trainer.loss_and_grads).lower(trainer.state.params, batch).compile()
    return trainer, batch, compiled


@pytest.mark.slow  # test_folded.py runs strands in the default tier
def test_strands_loss_and_every_gradient_equal_the_plain_model(strands_run):
    trainer, batch, compiled = strands_run
    assert trainer.pipeline.program.paired  # some tick runs an F and a B
    with trainer._context():
        loss, grads = compiled(trainer.state.params, batch)
    ref_loss, ref_grads = reference_grads(trainer, batch)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-6)
    assert_grads_match(jax.device_get(trainer.pipeline.from_stages(grads)), ref_grads)


def strands_in(lines: list[str]) -> set[str]:
    """Which strands the tensor-parallel all-reduces of a computation's layer ops belong to:
    'F' (jvp of a DecoderBlock) and / or 'B' (its transpose). XLA may combine two into one op."""
    out = set()
    for line in lines:
        name = re.search(r'op_name="([^"]*)"', line)
        if " all-reduce" not in line or not name:
            continue
        if re.search(r"(?<!transpose\()jvp\(DecoderBlock\)", name.group(1)):
            out.add("F")
        if "transpose(jvp(DecoderBlock))" in name.group(1):
            out.add("B")
    return out


@pytest.mark.slow  # test_folded.py runs strands in the default tier
def test_a_strands_tick_puts_both_strands_collectives_in_one_computation(strands_run):
    """The condition for XLA's scheduler to overlap one strand's communication with the
    other's compute: the layers' tp all-reduces of the forward and of the backward sit in one
    computation (the fused layer loop's body). GPipe and 1F1B run them in separate loops."""
    from hetjax.core import hlo

    comps = hlo.computations(strands_run[2].as_text())
    assert any(strands_in(lines) == {"F", "B"} for lines in comps.values())
    assert any(strands_in(lines) == {"F"} for lines in comps.values())  # warm-up F ticks


# --- activation memory of the schedules --------------------------------------------------------
def temp_bytes(schedule, microbatches):
    """Temporary memory of the compiled step at a fixed micro-batch size (2 sequences/device)."""
    trainer = Trainer(pipe_config((1, 1), schedule, dp=4, tp=1, microbatches=microbatches,
                                  **{"train.seq_len": 32}), quiet=True)
    return trainer.compiled_step().memory_analysis().temp_size_in_bytes, trainer


@pytest.mark.slow  # compiles eight programs; test_memory.py checks memory against XLA's
def test_1f1b_memory_stays_flat_while_gpipe_grows():
    (g2, tg), (g6, _) = temp_bytes("gpipe", 2), temp_bytes("gpipe", 6)
    (o2, to), (o6, _) = temp_bytes("1f1b", 2), temp_bytes("1f1b", 6)
    # A stash slot holds max_layers + 1 = 2 activations of 2 sequences x 32 tokens x d 32, fp32.
    slot = 2 * (2 * 32 * 32 * 4)
    assert g6 - g2 >= 4 * slot  # GPipe stashes 6 micro-batches instead of 2
    assert abs(o6 - o2) < slot  # 1F1B stashes pp = 2 whatever M is
    assert tg.pipeline.program.stash_slots == 2 and to.pipeline.program.stash_slots == 2


# --- user mistakes -----------------------------------------------------------------------------
CONFIG_MISTAKES = [
    ({"pipeline.stage_layers": (2, 2)}, "pipeline.stage_layers", "sum to 3"),
    ({"pipeline.stage_layers": (3, 0)}, "pipeline.stage_layers", ">= 1 layer"),
    ({"parallel.pp": 3, "pipeline.stage_layers": (1, 1, 1), "parallel.dp": 0},
     "parallel.pp", "choose pp from [1, 2, 4, 8]"),
    ({"pipeline.microbatches": 3}, "train.batch_size", "multiple of 3"),
    ({"pipeline.microbatches": 4, "train.batch_size": 12}, "train.batch_size",
     "multiple of microbatches x dp = 8"),
]


@pytest.mark.parametrize("overrides, field, fix", CONFIG_MISTAKES,
                         ids=[m[1] + ":" + ",".join(map(str, m[0].values()))
                              for m in CONFIG_MISTAKES])
def test_pipeline_mistakes_in_the_config_name_field_and_fix(overrides, field, fix):
    base = {"model.n_layers": 3, "parallel.pp": 2, "parallel.dp": 2, "parallel.tp": 2,
            "pipeline.stage_layers": (1, 2), "train.batch_size": 16}
    with pytest.raises(ConfigError) as e:
        Trainer(tiny_config(**{**base, **overrides}), quiet=True)
    assert e.value.field == field and fix in str(e.value), str(e.value)


def test_a_plan_the_executor_cannot_run_is_refused():
    from hetjax.layers import ModelConfig

    cfg = ModelConfig(vocab_size=128, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64)
    with pytest.raises(PlanError, match="sum to model.n_layers = 4"):
        pl.check_plan(plan_for((3, 2)), cfg.n_layers)
    with pytest.raises(PlanError, match="at least one layer"):
        pl.check_plan(plan_for((4, 0)), cfg.n_layers)
    with pytest.raises(PlanError, match="multiple of pipeline.microbatches"):
        pl.check_plan(plan_for((2, 2), microbatches=3, global_batch=8), cfg.n_layers)
    with pytest.raises(PlanError, match="microbatches x dp = 8"):
        pl.check_plan(plan_for((2, 2), microbatches=2, global_batch=4, dp=4), cfg.n_layers)


# --- the command line --------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_trains_holmes_mini_and_loss_falls(tmp_path):
    from test_config import run_cli

    r = run_cli("train", "--config=configs/holmes_mini.py", "--config.train.steps=30",
                f"--config.workdir={tmp_path}", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pipeline: 1f1b" in r.stdout
    first, last = map(float, re.search(r"loss\s+([\d.]+) -> ([\d.]+)", r.stdout).groups())
    assert last < first - 1.0, r.stdout[-2000:]

"""ZeRO / AMSP sharding (parallel/zero_sharding.py): factor rules, P/G/OS specs, and the train step.

Every preset and two partial points train 3 steps with 4 micro-batches on 8 devices and must
equal the single-device run; each device's P and OS bytes are read from the state's shard
shapes and G from what the compiled micro-batch loop carries; the compiled step's collectives
must be exactly the ones the cost model lists, with no cross-replica reduction in the loop.
The same byte rules are checked for a 7B model on 1,024 abstract devices.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import tiny_config
from hetjax.core import topology as topo
from hetjax.config import base_config, build_topology, validate
from hetjax.errors import ConfigError
from hetjax.core.plan import Plan, ZeroFactors
from hetjax.planner import plan_from_config, zero_factors as zr
from hetjax.train import Trainer, make_optimizer, opt_state_specs
from hetjax.layers import ModelConfig, Transformer
from hetjax.core import hlo
from hetjax.parallel import sharding as shd
from hetjax.parallel import zero_sharding as zero
from hetjax.parallel.mesh import DP_AXES, build_mesh

STEPS, MICRO = 3, 4
BASE = {"train.microbatches": MICRO, "train.batch_size": 32}
POINTS = {  # name: (config overrides, expected (s_p, s_g, s_os))
    "ddp": ({"zero.preset": "ddp"}, (1, 1, 1)),
    "zero1": ({"zero.preset": "zero1"}, (1, 1, 8)),
    "zero2": ({"zero.preset": "zero2"}, (1, 8, 8)),
    "zero3": ({"zero.preset": "zero3"}, (8, 8, 8)),
    "mics": ({"zero.preset": "mics"}, (2, 2, 2)),  # cpu_hybrid: 2 devices per node
    # Partial points: G like P inside a node, OS over all 8; and G like OS beyond P, with tp.
    "p2-g2-os8": ({"zero.preset": "custom", "zero.s_p": 2, "zero.s_g": 2, "zero.s_os": 8},
                  (2, 2, 8)),
    "p2-g4-os4-tp2": ({"zero.preset": "custom", "zero.s_p": 2, "zero.s_g": 4, "zero.s_os": 4,
                       "parallel.dp": 4, "parallel.tp": 2}, (2, 4, 4)),
}


def run_steps(config):
    """Three steps through the compiled step the audit reads (one compilation)."""
    trainer = Trainer(config, quiet=True)
    compiled = trainer.compiled_step()
    losses = []
    for _ in range(STEPS):
        trainer.state, metrics = compiled(trainer.state, trainer.put_batch(next(trainer.data)))
        losses.append(float(metrics["loss"]))
    return trainer, compiled, losses


@pytest.fixture(scope="module")
def reference():
    """The same three steps on one device (fp32): what every point must reproduce."""
    trainer, _, losses = run_steps(tiny_config(**BASE, **{
        "topology.preset": "cpu_single", "topology.devices_per_node": 1, "parallel.dp": 1}))
    return losses, jax.device_get(trainer.state.params)


def per_device_bytes(tree, keep=lambda a: True) -> dict:
    """Bytes each device holds of the arrays in `tree` (those `keep` selects)."""
    out = {}
    for a in jax.tree.leaves(tree):
        if keep(a):
            for s in a.addressable_shards:
                out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


def accumulator_bytes(hlo_text: str) -> int:
    """Bytes per device of the gradient accumulator in the compiled step: the arrays the
    micro-batch loop updates each iteration, minus its counter and per-device loss."""
    return sum(b for t, b, updated in hlo.loop_carry(hlo_text, MICRO)
               if updated and t.startswith("f32") and b > 4)


def check_equals_reference(trainer, losses, reference):
    """Loss and (natural-layout) parameters after the steps equal the single-device run."""
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6),
                 jax.device_get(trainer.params), ref_params)


def check_state_bytes(trainer, accumulator: int) -> int:
    """Each device holds exactly 1/s_x of the bytes it would hold without ZeRO (after tp and
    pp, a stage's padded slots included): P and OS read from the state's shard shapes, G =
    `accumulator`, read from what the compiled loop carries. Returns those bytes."""
    z, zs = trainer.plan.zero, trainer.zero_specs
    # Every tiny parameter has a divisible dimension, so nothing is left replicated.
    assert zs.unsharded == ()
    full = zero.shard_bytes(jax.eval_shape(lambda: trainer.state.params), zs.base, trainer.mesh)
    p_bytes = per_device_bytes(trainer.state.params)
    os_bytes = per_device_bytes(trainer.state.opt_state, keep=lambda a: a.ndim > 0)
    assert set(p_bytes.values()) == {full // z.s_p}
    assert set(os_bytes.values()) == {2 * full // z.s_os}  # Adam mu and nu, fp32
    assert accumulator == full // z.s_g
    scalars = [a for a in jax.tree.leaves(trainer.state.opt_state) if a.ndim == 0]
    assert scalars and all(a.sharding.is_fully_replicated for a in scalars)
    return full


def check_collectives(trainer, ops: list[hlo.Collective]):
    """The data-parallel collectives of the compiled step, each with the times it runs per
    step, are exactly the cost model's list; inside the micro-batch loop only the G-group
    reduce-scatter (nothing for s_g = 1): the cross-replica reduction runs once per step."""
    z, zs = trainer.plan.zero, trainer.zero_specs
    split, replicated = zero.split_bytes(jax.eval_shape(lambda: trainer.state.params), zs,
                                         trainer.mesh)
    expected = zr.expected_collectives(z, trainer.plan.dp, MICRO, split, replicated)
    assert hlo.totals(ops, DP_AXES) == hlo.totals(expected)
    in_loop = {(c.kind, c.axes, c.count) for c in ops
               if c.loop_depth and not c.scalar and set(c.axes) & set(DP_AXES)}
    g_group = tuple(a for a in DP_AXES if a in zs.axes.g)  # in mesh order, as HLO reads
    assert in_loop == ({("reduce-scatter", g_group, MICRO)} if z.s_g > 1 else set())


# p2-g4-os4-tp2 (every factor a different width, beside tp): the default tier's; the other points
# are the slow tier's (zero3 also in tests/test_zero_pipeline.py's default tier)
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "p2-g4-os4-tp2" else
                                               [pytest.mark.slow]) for n in POINTS])
def test_point_equals_single_device_with_sharded_bytes_and_audited_collectives(reference, name):
    overrides, factors = POINTS[name]
    trainer, compiled, losses = run_steps(tiny_config(**BASE, **overrides))
    z = trainer.plan.zero
    assert (z.s_p, z.s_g, z.s_os) == factors
    check_equals_reference(trainer, losses, reference)
    hlo_text = compiled.as_text()
    full = check_state_bytes(trainer, accumulator_bytes(hlo_text))  # G: the loop's carry
    if trainer.plan.tp == 1:
        assert full == 4 * trainer.model_cfg.num_params
    check_collectives(trainer, hlo.collectives(hlo_text, trainer.mesh.shape))


def test_os_shard_lies_inside_the_p_shard_and_g_follows_p_or_os():
    t = topo.preset("cpu_single")
    plan = Plan(pp=1, dp=8, tp=1, stage_layers=(2,), microbatches=1, global_batch=8,
                seq_len=8, zero=ZeroFactors(2, 2, 8, "custom"))
    mesh = build_mesh(plan, t)
    shape = (16, 64)
    base = P(None, None)
    zs = zero.zero_specs({"w": jax.ShapeDtypeStruct(shape, jnp.float32)}, {"w": base},
                         {"w": P("embed", "mlp")}, plan.zero)
    assert zs.p["w"] == P(None, "dp_p") and zs.os["w"] == P(None, ("dp_p", "dp_os"))
    assert zs.g["w"] == zs.p["w"]
    p_idx = NamedSharding(mesh, zs.p["w"]).devices_indices_map(shape)
    os_idx = NamedSharding(mesh, zs.os["w"]).devices_indices_map(shape)
    for d, (_, p_cols) in p_idx.items():
        o_cols = os_idx[d][1]
        assert p_cols.start <= o_cols.start and o_cols.stop <= p_cols.stop
        assert o_cols.stop - o_cols.start == 64 // 8
    assert zero.ZeroAxes.of(ZeroFactors(2, 8, 8)).g == ("dp_p", "dp_os")


def test_shard_dim_skips_mesh_and_stacked_dims_and_reports_indivisible():
    # Largest free divisible dimension; a tp dimension and a stacked layer axis are not free.
    assert zero.shard_dim((4, 12, 16), P(None, None, "tp"), ("layers", "embed", "mlp"), 4) == \
        (1, "")
    # A leading pipeline-stage dimension stays on 'pp'.
    assert zero.shard_dim((2, 8, 64), P("pp", None, None), ("stage", "layers", "embed"), 8) == \
        (2, "")
    dim, reason = zero.shard_dim((6, 10), P(None, None), ("embed", "mlp"), 4)
    assert dim is None and "divisible by s_os = 4" in reason and "[6, 10]" in reason
    zs = zero.zero_specs({"a": jax.ShapeDtypeStruct((6, 10), jnp.float32),
                          "b": jax.ShapeDtypeStruct((12, 16), jnp.float32)},
                         {"a": P(), "b": P()}, {"a": P("embed", "mlp"), "b": P("embed", "mlp")},
                         ZeroFactors(1, 4, 4))
    assert zs.os["a"] == P(None, None) and zs.os["b"] == P(None, "dp_os")
    assert [u.path for u in zs.unsharded] == ["['a']"]
    assert "replicated (not split): ['a'] (6, 10)" in zs.describe()


# --- factors from config: presets, rules, errors ------------------------------------------------
def plan_for(**overrides) -> Plan:
    c = tiny_config(**{**BASE, **overrides})
    validate(c)
    return plan_from_config(c, build_topology(c))


def test_presets_map_to_factors_from_dp_and_devices_per_node():
    assert plan_for(**{"zero.preset": "mics"}).zero == ZeroFactors(2, 2, 2, "mics")
    one_node = {"topology.preset": "cpu_single"}  # 8 devices in one node
    assert plan_for(**one_node, **{"zero.preset": "mics"}).zero == ZeroFactors(8, 8, 8, "mics")
    # tp = 2 fills each 2-device node, so a node holds one replica: MiCS degenerates to ddp.
    assert plan_for(**{"zero.preset": "mics", "parallel.tp": 2}).zero.s_p == 1
    assert plan_for(**{"zero.preset": "zero2", "parallel.dp": 4, "parallel.tp": 2}).zero == \
        ZeroFactors(1, 4, 4, "zero2")


BAD = [  # (overrides, field, words of the message)
    ({"zero.s_p": 3, "zero.s_g": 3, "zero.s_os": 3}, "zero.s_p", "[1, 2, 4, 8]"),
    ({"zero.s_p": 2, "zero.s_g": 4, "zero.s_os": 8}, "zero.s_g", "set zero.s_g to 2 or 8"),
    ({"zero.s_p": 4, "zero.s_g": 4, "zero.s_os": 2}, "zero.s_p", "divisors of s_os = 2: [1, 2]"),
    ({"zero.s_p": 2, "zero.s_g": 2, "zero.s_os": 3}, "zero.s_os", "multiples of s_p = 2"),
    ({"zero.s_p": 1, "zero.s_g": 1, "zero.s_os": 16}, "zero.s_os", "[1, 2, 4, 8]"),
]


@pytest.mark.parametrize("overrides, field, words", BAD, ids=[b[1] for b in BAD])
def test_bad_factors_name_the_field_and_the_valid_choices(overrides, field, words):
    with pytest.raises(ConfigError) as e:
        plan_for(**{"zero.preset": "custom", **overrides})
    assert e.value.field == field and words in str(e.value)


def test_groups_must_fill_a_node_before_spanning_nodes():
    # 2 nodes x 3 devices: a pair (2, 3) would straddle the nodes with half of each.
    six = {"topology.preset": "cpu_single", "topology.nodes": 2,
           "topology.devices_per_node": 3, "train.batch_size": 24}
    assert plan_for(**six, **{"zero.preset": "mics"}).zero == ZeroFactors(3, 3, 3, "mics")
    with pytest.raises(ConfigError, match=r"valid factors for dp = 6 .*: \[1, 3, 6\]") as e:
        plan_for(**six, **{"zero.preset": "custom", "zero.s_p": 2, "zero.s_g": 2,
                           "zero.s_os": 2})
    assert e.value.field == "zero.s_p"


def test_a_named_preset_rejects_explicit_factors():
    with pytest.raises(ConfigError, match="only read when zero.preset = 'custom'"):
        validate(tiny_config(**{"zero.preset": "zero3", "zero.s_p": 2}))


# --- real scale, nothing allocated -----------------------------------------------------------
LLAMA_7B = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                       d_ff=11008, tie_embeddings=False)


def abstract_states(model_cfg: ModelConfig, plan: Plan):
    """Abstract parameters and optimizer state of a model with their ZeRO specs."""
    boxed = jax.eval_shape(Transformer(model_cfg).init, jax.random.key(0),
                           jnp.zeros((1, 8), jnp.int32))["params"]
    params = nn.unbox(boxed)
    zs = zero.zero_specs(params, shd.param_specs(boxed), shd.logical_specs(boxed), plan.zero)
    tx, _ = make_optimizer(base_config().train)
    opt = jax.eval_shape(tx.init, params)
    return params, opt, zs, opt_state_specs(tx, opt, zs.os)


@pytest.mark.parametrize("preset, factors", [
    ("ddp", (1, 1, 1)), ("zero1", (1, 1, 1024)), ("zero2", (1, 1024, 1024)),
    ("zero3", (1024, 1024, 1024)), ("mics", (8, 8, 8)), ("custom", (8, 8, 64))])
def test_7b_on_1024_devices_holds_1_over_s_of_each_state(preset, factors):
    t = topo.preset("holmes_infiniband", nodes=128, devices_per_node=8)
    plan = Plan(pp=1, dp=1024, tp=1, stage_layers=(32,), microbatches=8, global_batch=1024,
                seq_len=2048)
    k = zr.node_local_factor(zr.replica_nodes(plan, t))
    assert k == 8
    z = zr.named(preset, 1024, k) if preset != "custom" else \
        ZeroFactors(*factors, "custom")
    zr.check_factors(z, plan, t)
    assert (z.s_p, z.s_g, z.s_os) == factors
    plan = dataclasses.replace(plan, zero=z)
    params, opt, zs, opt_specs = abstract_states(LLAMA_7B, plan)
    phi = LLAMA_7B.num_params
    assert sum(a.size for a in jax.tree.leaves(params)) == phi
    assert zs.unsharded == ()
    mesh = zero.abstract_mesh(plan)
    assert zero.shard_bytes(params, zs.p, mesh) == 4 * phi // z.s_p
    assert zero.shard_bytes(params, zs.g, mesh) == 4 * phi // z.s_g
    tensors = [(a, s) for a, s in zip(jax.tree.leaves(opt), jax.tree.leaves(
        opt_specs, is_leaf=lambda x: isinstance(x, P))) if a.ndim]
    assert zero.shard_bytes(*zip(*tensors), mesh) == 8 * phi // z.s_os


# --- reading compiled programs (hetjax/core/hlo.py) ------------------------------------------------
HLO = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (c: (s32[], f32[4], f32[16])) -> pred[] {
  %c = (s32[], f32[4]{0}, f32[16]{0}) parameter(0)
  %n = s32[] get-tuple-element(%c), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%n, %k), direction=LT
}

%skip (s: f32[16]) -> f32[16] {
  ROOT %s0 = f32[16]{0} parameter(0)
}

%reduce (r: f32[16]) -> f32[16] {
  %r = f32[16]{0} parameter(0)
  ROOT %ar2 = f32[16]{0} all-reduce(%r), channel_id=4, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%add
}

%body (p: (s32[], f32[4], f32[16])) -> (s32[], f32[4], f32[16]) {
  %p = (s32[], f32[4]{0}, f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %acc = f32[4]{0} get-tuple-element(%p), index=1
  %w = f32[16]{0} get-tuple-element(%p), index=2
  %rs = f32[4]{0} reduce-scatter(%w), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, dimensions={0}, to_apply=%add
  %new = f32[4]{0} add(%acc, %rs)
  %branch = f32[16]{0} conditional(%i, %w, %w), branch_computations={%skip, %reduce}
  %one = s32[] constant(1)
  %i2 = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4]{0}, f32[16]{0}) tuple(%i2, %new, %w)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %ag = f32[16]{0} all-gather(%x), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %z = s32[] constant(0)
  %init = (s32[], f32[4]{0}, f32[16]{0}) tuple(%z, %x, %ag)
  %loop = (s32[], f32[4]{0}, f32[16]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %acc = f32[4]{0} get-tuple-element(%loop), index=1
  %ar = (f32[4]{0}, f32[]) all-reduce(%acc, %z), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}, use_global_device_ids=true, to_apply=%add
  ROOT %out = f32[4]{0} get-tuple-element(%ar), index=0
}
"""  # noqa: E501


def test_hlo_reader_maps_groups_to_mesh_axes_and_counts_loop_trips():
    ops = hlo.collectives(HLO, {"a": 2, "b": 4})
    got = {(c.kind, c.axes, c.group_size, c.nbytes, c.count, c.loop_depth, c.scalar,
            c.conditional) for c in ops}
    assert got == {
        ("all-gather", ("b",), 4, 64, 1, 0, False, False),  # explicit groups {0..3}, {4..7}
        ("reduce-scatter", ("a",), 2, 32, 3, 1, False, False),  # iota groups; V = operand
        ("all-reduce", ("a", "b"), 4, 16, 1, 0, False, False),  # mesh form; scalar not in V
        ("all-reduce", ("b",), 2, 64, 3, 1, False, True),  # in a branch: at most 3 times
    }
    assert hlo.totals(ops, axes=("a",)) == {("reduce-scatter", ("a",)): 96}
    # A caller that knows the branch runs once per loop (only ops over the axes it names).
    runs = {(c.kind, c.count) for c in hlo.with_branch_runs(ops, 3, 1, ("b",))}
    assert runs == {("all-gather", 1), ("reduce-scatter", 3), ("all-reduce", 1)}
    assert hlo.loop_carry(HLO, 3) == [("s32[]", 4, True), ("f32[4]", 16, True),
                                      ("f32[16]", 64, False)]


def test_auto_with_a_fixed_layout_asks_the_planner_for_the_zero_point_only():
    from hetjax.config import build_topology
    from hetjax.planner import plan_from_config

    c = tiny_config(**{"parallel.pp": 2, "parallel.dp": 2, "parallel.tp": 2,
                       "pipeline.stage_layers": (1, 1), "train.microbatches": 2,
                       "zero.preset": "auto"})
    plan = plan_from_config(c, build_topology(c))
    assert (plan.pp, plan.dp, plan.tp, plan.microbatches, plan.stage_layers) == \
        (2, 2, 2, 2, (1, 1))
    assert plan.source == "planner" and plan.zero.name == "ddp"  # tiny model: least traffic

    # A 13B-class model on 32 A100s, pp=1 tp=2 dp=16: replicated fp32 states (16 bytes per
    # parameter over tp=2) need ~100 GiB per device, so auto must shard them.
    big = tiny_config(**{"topology.preset": "holmes_hybrid", "topology.nodes": 0,
                         "topology.devices_per_node": 0, "parallel.pp": 1, "parallel.dp": 16,
                         "parallel.tp": 2, "model.d_model": 5120, "model.n_heads": 40,
                         "model.n_kv_heads": 40, "model.d_ff": 13824, "model.n_layers": 40,
                         "model.max_seq_len": 2048, "train.seq_len": 2048,
                         "train.batch_size": 64, "train.microbatches": 4,
                         "zero.preset": "auto"})
    plan = plan_from_config(big, build_topology(big))
    assert (plan.pp, plan.dp, plan.tp) == (1, 16, 2)
    assert plan.zero.s_os > 1 and plan.predicted["fits"]

"""The folded placement (DHelix's W, ZB-V's V) of the SPMD pipeline: two model chunks per device
in a V, so device 0 holds the first chunk (embedding) and the last (head). The layout, the
executor's loss and gradients against the plain model for GPipe, 1F1B and strands (dp and tp
inside stages, a one-layer device, tied embedding), and the HLO audit that the embedding's
gradient never crosses the pipeline axis."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from hetjax.errors import ConfigError
from hetjax.core.plan import Plan
from hetjax.train import Trainer
from hetjax.core import hlo
from hetjax.parallel import pipeline as pl
from hetjax.core import schedules as sch
from hetjax.core.timeline import timeline
from hetjax.planner.lockstep import folded_lockstep_time, lockstep_time
from test_pipeline import assert_grads_match, pipe_config, reference_grads


def folded_plan(split, **kw):
    return Plan(**{**dict(pp=len(split), dp=1, tp=1, stage_layers=tuple(split), microbatches=1,
                          global_batch=1, seq_len=8, placement="folded"), **kw})


# --- the layout --------------------------------------------------------------------------------
def test_folded_devices_hold_a_down_and_an_up_chunk_in_v_order():
    plan = folded_plan((3, 2, 2))
    # ceil / floor: down chunks (2, 1, 1) on devices 0, 1, 2, then up chunks (1, 1, 1) on 2, 1, 0
    assert plan.chunk_layers() == ((2, 1), (1, 1), (1, 1))
    assert [plan.device_layers(d) for d in range(3)] == [(0, 1, 6), (2, 5), (3, 4)]
    assert folded_plan((1, 3)).device_layers(0) == (0,)  # a one-layer device: empty up chunk
    looped = dataclasses.replace(plan, placement="looped")
    assert [looped.device_layers(d) for d in range(3)] == [(0, 1, 2), (3, 4), (5, 6)]


def test_folded_layout_round_trips_and_keeps_shared_parameters_on_device_0():
    plan = folded_plan((3, 2, 2))
    rng = np.random.default_rng(0)
    natural = {"embedder": {"embedding": rng.normal(size=(5, 3)).astype(np.float32)},
               "layers": {"block": {"w": rng.normal(size=(7, 3, 2)).astype(np.float32)}}}
    stacked = pl.to_stages(natural, plan)
    w, emb = stacked["layers"]["block"]["w"], stacked["embedder"]["embedding"]
    assert w.shape == (3, 3, 3, 2) and emb.shape == (3, 5, 3)
    np.testing.assert_array_equal(w[0], natural["layers"]["block"]["w"][[0, 1, 6]])
    np.testing.assert_array_equal(w[1, :2], natural["layers"]["block"]["w"][[2, 5]])
    assert not np.any(w[1:, 2]) and not np.any(emb[1:])
    jax.tree.map(np.testing.assert_array_equal, pl.from_stages(stacked, plan), natural)
    # the shared parameters' padding (devices 1 ..) is frozen like the padded layer slots
    tx = pl.freeze_padding(optax.sgd(1.0), plan)
    updates, _ = tx.update(jax.tree.map(np.ones_like, stacked), tx.init(stacked), stacked)
    np.testing.assert_array_equal(updates["embedder"]["embedding"][:, 0, 0], [-1, 0, 0])


def test_folded_placement_mistakes_name_the_field_and_fix():
    from hetjax.config import validate

    for overrides, text in (({"pipeline.placement": "w"}, "choose one of looped, folded, auto"),
                            ({"pipeline.placement": "folded", "pipeline.executor": "mpmd",
                              "pipeline.schedule": "zb-h1"}, "or pipeline.placement=looped")):
        with pytest.raises(ConfigError, match="pipeline.placement") as e:
            validate(pipe_config((1, 2), **overrides))
        assert text in str(e.value)


# --- the executor against the plain model ------------------------------------------------------
@pytest.fixture(scope="module")
def folded_run():
    """A tied-embedding model folded over pp = 2 with dp = 2, tp = 2 inside each stage and
    layers (1, 3): device 0 runs one layer going down and none coming up (only the head)."""
    config = pipe_config((1, 3), "gpipe", dp=2, tp=2, microbatches=4,
                         **{"pipeline.placement": "folded"})
    assert config.model.tie_embeddings
    trainer = Trainer(config, quiet=True)
    batch = trainer.put_batch(next(trainer.data))
    return trainer, batch, reference_grads(trainer, batch)


@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("1f1b", marks=pytest.mark.slow),
                                      pytest.param("strands", marks=pytest.mark.slow)])
def test_folded_loss_and_every_gradient_equal_the_plain_model(folded_run, schedule):
    trainer, batch, (ref_loss, ref_grads) = folded_run
    pipe = pl.Pipeline(dataclasses.replace(trainer.plan, schedule=schedule), trainer.model_cfg,
                       trainer.mesh)
    assert pipe.schedule.stages == 4  # the grid of a virtual pipeline of 2 pp chunks
    with trainer._context():
        loss, grads = jax.jit(lambda p, b: pipe.loss_and_grads(p, b, trainer.zero_specs))(
            trainer.state.params, batch)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-6)
    assert_grads_match(jax.device_get(pipe.from_stages(grads)), ref_grads)


def test_folded_checkpoint_layout_gives_the_natural_tree(folded_run):
    """Checkpoints hold the natural state whatever the placement: the shared parameters and
    their moments unstacked (device 0's), the layers in model order; and convert back."""
    trainer = folded_run[0]
    abstract = jax.eval_shape(lambda s: s, trainer.state)
    layout = pl.StageLayout(trainer.plan, abstract, trainer.state_sharding)
    natural = layout.to_natural(trainer.state)
    emb = trainer.state.params["embedder"]["embedding"]
    assert natural.params["embedder"]["embedding"].shape == emb.shape[1:]
    np.testing.assert_array_equal(np.asarray(natural.params["embedder"]["embedding"]),
                                  np.asarray(emb)[0])
    assert natural.params["layers"]["block"]["attn"]["query"].shape[0] == 4
    back = layout.from_natural(natural)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 back, trainer.state)


def test_folded_ticks_hold_the_plain_pipelines_work():
    """In lockstep a folded tick lasts as long as its busiest device: two chunks (a whole
    stage's work) in the steady state, one in warm-up and cool-down. Priced in stage units
    (a chunk is half a stage), folded GPipe costs exactly the looped GPipe's step."""
    for p, m in ((2, 4), (4, 8)):
        looped = lockstep_time(sch.make_schedule("gpipe", p, m), [1.0] * p, [2.0] * p)
        assert folded_lockstep_time(sch.make_schedule("gpipe", 2 * p, m), [1.0] * p,
                                       [2.0] * p) == pytest.approx(looped)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "strands"])
def test_folded_orders_come_from_the_virtual_grid_and_play_without_deadlock(name):
    """`schedules.folded` (the MPMD executor's folded schedules): V placement, per-stage
    orders taken tick by tick from the 2 pp stage grid. Played asynchronously they finish no
    later than the looped schedule (1F1B at pp = 4, M = 8: 30 against 33 units, a 20% bubble)."""
    p, m = 4, 8
    f = sch.folded(name, p, m)
    assert f.placement() == (0, 1, 2, 3, 3, 2, 1, 0) and f.virtual == 2
    assert not f.spmd_compatible
    ends = [e.end for e in timeline(f, [1.0] * p, [2.0] * p)]  # raises on a deadlock
    looped = max(e.end for e in timeline(sch.make_schedule(name, p, m), [1.0] * p,
                                              [2.0] * p))
    assert max(ends) <= looped
    # each stage runs every micro-batch's F and B of both its chunks
    for order in f.orders:
        assert sorted((a.kind, a.stage_chunk, a.microbatch) for a in order) == sorted(
            (k, c, i) for k in "FB" for c in (0, 1) for i in range(m))
    with pytest.raises(ValueError, match="tick-grid schedule"):
        sch.folded("interleaved", p, m)


@pytest.mark.slow  # the SPMD executor's folded runs above are the default tier's
def test_folded_on_the_mpmd_executor_equals_the_plain_model():
    from test_mpmd import check_against_reference as mpmd_check, mpmd_config

    trainer = mpmd_check(mpmd_config((1, 3), "strands", dp=4, tp=1, microbatches=4,
                                     **{"pipeline.placement": "folded"}))
    ex = trainer.executor
    assert ex.schedule.placement() == (0, 1, 1, 0)
    # device 0: chunk 0 (embedding, layer 0) and chunk 3 (no layer, the head)
    assert [[(c.index, list(c.layers)) for c in st.chunks] for st in ex.stages] == \
        [[(0, [0]), (3, [])], [(1, [1, 2]), (2, [3])]]


# --- the HLO audit ----------------------------------------------------------------------------
def pp_collective_bytes(trainer) -> list[int]:
    """Bytes of every collective over the pipeline axis in the compiled train step."""
    ops = hlo.collectives(trainer.compiled_step().as_text(), dict(trainer.mesh.shape))
    return [op.nbytes for op in ops if "pp" in op.axes]


@pytest.mark.slow  # reads the compiled program's transfers (~1 min)
def test_folded_embedding_gradient_never_crosses_the_pipeline_axis(folded_run):
    """Folded, the tied embedding and the head live on device 0 and so do their gradients:
    nothing the size of the embedding's shard moves over 'pp' (only activations, gradients of
    activations and scalars). Looped, the ring sum of the shared gradients does."""
    trainer = folded_run[0]
    emb = trainer.state.params["embedder"]["embedding"]
    shard = emb.addressable_shards[0].data.nbytes  # [1, vocab / tp, d_model] on a device
    folded = pp_collective_bytes(trainer)
    assert folded and max(folded) < shard, (folded, shard)
    looped = Trainer(pipe_config((1, 3), "gpipe", dp=2, tp=2, microbatches=4), quiet=True)
    assert max(pp_collective_bytes(looped)) >= shard


# --- the cost model and the planner ------------------------------------------------------------
def _holmes_plans(schedule="gpipe"):
    from hetjax.planner import CostModel, CostOptions
    from hetjax.planner.reference_runs import holmes_model
    from hetjax.core.topology import preset

    cm = CostModel(preset("holmes_infiniband"), holmes_model(), CostOptions())
    looped = Plan(pp=2, dp=16, tp=1, stage_layers=(15, 15), microbatches=16, global_batch=256,
                  seq_len=2048, schedule=schedule)
    return cm, looped, dataclasses.replace(looped, placement="folded")


def test_cost_model_puts_embedding_and_head_on_device_0_when_folded():
    from hetjax.planner.layout import Layout

    cm, looped, folded = _holmes_plans()
    pl_, pf = cm.predict(looped), cm.predict(folded)
    # the head's time moves from the last device to device 0; the total stays
    assert pf.stage_time[0] > pl_.stage_time[0] and pf.stage_time[1] < pl_.stage_time[1]
    assert sum(pf.stage_time) == pytest.approx(sum(pl_.stage_time))
    # no ring sum of the shared gradients: less sync per step on every device
    sl, sf = (cm.stage_costs(Layout.of(p)) for p in (looped, folded))
    assert all(f.sync_fixed < lo.sync_fixed for f, lo in zip(sf, sl))
    # GPipe: the same lockstep ticks (within the head's move and the sync it saves)
    assert pf.step_time == pytest.approx(pl_.step_time, rel=0.05)


def test_planner_considers_the_placement_and_says_what_bound_it():
    from hetjax.planner import CostOptions, plan
    from hetjax.planner.reference_runs import holmes_model
    from hetjax.core.topology import preset

    best = plan(preset("holmes_infiniband"), holmes_model(), 256, 2048, pp=2, tp=1,
                microbatches=16, zero="ddp", schedule="1f1b", placement="auto",
                options=CostOptions()).plan
    # in lockstep a folded 1F1B tick pairs half-stage actions: cheaper than looped 1F1B's
    assert best.placement == "folded" and "placement=folded" in best.header()
    assert best.predicted["bound"]["placement"].startswith("time: the fastest predicted")
    looped = plan(preset("holmes_infiniband"), holmes_model(), 256, 2048, pp=2, tp=1,
                  microbatches=16, zero="ddp", schedule="1f1b").plan
    assert looped.placement == "looped"
    assert best.predicted["step_time_s"] < looped.predicted["step_time_s"]

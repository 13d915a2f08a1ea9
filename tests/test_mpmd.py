"""The MPMD pipeline executor: one program per stage against the plain model, training against
the SPMD executor, per-stage memory, checkpoints across executors."""

import jax
import numpy as np
import pytest

from hetjax.metrics import read_metrics
from hetjax.train import Trainer
from test_pipeline import assert_grads_match, pipe_config, reference_grads


def mpmd_config(split, schedule="1f1b", dp=2, tp=2, microbatches=4, **extra):
    return pipe_config(split, schedule, dp, tp, microbatches,
                       **{"pipeline.executor": "mpmd", **extra})


def check_against_reference(config):
    trainer = Trainer(config, quiet=True)
    batch = trainer.put_batch(next(trainer.data))
    loss, grads = trainer.executor.loss_and_grads(trainer.state, batch)
    ref_loss, ref_grads = reference_grads(trainer, batch)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-6)
    assert_grads_match(jax.device_get(grads), ref_grads)
    return trainer


# (schedule, layers per stage, dp, tp, micro-batches, extra config)
# The default tier runs the first; the others are the slow tier's (SLOW_CASES).
CASES = [
    ("1f1b", (1, 3), 2, 2, 4, {}),
    ("gpipe", (3, 1), 4, 1, 4, {"model.remat": "dots", "zero.preset": "zero1"}),
    ("1f1b", (2, 1, 3, 1), 2, 1, 8, {"model.tie_embeddings": False}),
    ("1f1b", (2, 2), 4, 1, 4, {"model.remat": "full", "zero.preset": "zero3"}),
    # two chunks per stage; stage 0's second chunk has no layer (it passes its input on)
    ("interleaved", (1, 3), 2, 2, 4, {}),
    ("zb-h1", (3, 1), 4, 1, 4, {"model.remat": "none"}),  # the backward split into I and W
    ("strands", (2, 1, 3, 1), 2, 1, 8, {}),  # the planner may choose it for the MPMD executor
]
SLOW_CASES = range(1, len(CASES))


@pytest.mark.parametrize("schedule, split, dp, tp, mb, extra", [
    pytest.param(*c, marks=[pytest.mark.slow] if i in SLOW_CASES else [],
                 id=f"{c[0]}-{'.'.join(map(str, c[1]))}-dp{c[2]}-tp{c[3]}-m{c[4]}"
                 + "".join(f"-{v}" for v in c[5].values())) for i, c in enumerate(CASES)])
def test_loss_and_every_gradient_equal_the_plain_model(schedule, split, dp, tp, mb, extra):
    trainer = check_against_reference(mpmd_config(split, schedule, dp, tp, mb, **extra))
    assert len(trainer.executor.stages) == len(split)
    if schedule in ("gpipe", "1f1b", "strands"):
        # Every stage but the first reduces its gradients in a program of its own after its
        # last backward (whose input gradient must not wait for the reduction); the first
        # stage's last backward sends nothing on and keeps the reduction in its program.
        times: dict = {}
        trainer.executor.stage_loss_and_grads(trainer.state, trainer.put_batch(
            next(trainer.data)), times)
        assert {s for s, kind in times if kind == "reduce"} == set(range(1, len(split)))


def three_steps(config):
    trainer = Trainer(config, quiet=True)
    batch = next(trainer.data)
    losses = [float(trainer.step(batch)["loss"]) for _ in range(3)]
    return losses, jax.device_get(trainer.params)


@pytest.mark.slow  # three runs; the loss-and-gradient equivalences below are the default's
def test_three_training_steps_equal_the_spmd_executor_and_one_device():
    split = (1, 3)
    mpmd = three_steps(mpmd_config(split))
    spmd = three_steps(pipe_config(split))
    single = three_steps(pipe_config(split, dp=1, tp=1, **{
        "parallel.pp": 1, "pipeline.stage_layers": (), "topology.preset": "cpu_single",
        "topology.devices_per_node": 1, "train.batch_size": 16}))
    for other in (spmd, single):
        np.testing.assert_allclose(mpmd[0], other[0], rtol=1e-6)
        # AdamW moves every element by about lr whatever its gradient's size, so an element
        # whose gradient is at rounding level may differ by a few 1e-5 (lr = 3e-3).
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5),
                     mpmd[1], other[1])


def test_a_short_stage_holds_only_its_own_parameters_and_optimizer_state():
    """Split [7, 1]: the one-layer stage's block parameters and moments are exactly 1/7 of the
    seven-layer stage's (the SPMD executor pads both to 7 slots); each also holds its share of
    the shared parameters (embedding, final norm)."""
    trainer = Trainer(mpmd_config((7, 1), dp=2, tp=2, microbatches=2), quiet=True)

    def device_bytes(tree, device):
        return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
                   if s.device == device)

    blocks = [device_bytes((s.params["layers"], [m for m in jax.tree.leaves(s.opt_state)
                                                if m.ndim > 2]), st.mesh.devices.flat[0])
              for st, s in zip(trainer.executor.stages, trainer.state.stages)]
    assert blocks[1] * 7 == blocks[0]
    shared = [sorted(k for k in s.params if k != "layers") for s in trainer.state.stages]
    assert shared == [["embedder"], ["embedder", "final_norm"]]


@pytest.mark.slow  # ~50 s; test_checkpoint.py restores a checkpoint under another plan in the default tier
def test_checkpoints_resume_across_executors(tmp_path):
    """SPMD -> MPMD -> SPMD through the plan-independent checkpoint, with another split: the
    straight SPMD run's checkpoint 2 resumes in the MPMD executor, whose checkpoint 4 resumes
    in the SPMD executor again; their losses at 4 and 6 are the straight run's."""
    import shutil

    def trainer(split, executor, workdir):  # the same train.steps, so the same lr schedule
        return Trainer(pipe_config(split, **{"pipeline.executor": executor, "train.steps": 6,
                                             "checkpoint.every": 2, "train.log_every": 1,
                                             "workdir": str(workdir)}), quiet=True)

    straight = trainer((2, 2), "spmd", tmp_path / "straight").train()
    losses = {r["step"]: r["loss"] for r in straight.history.rows}
    assert straight["resumed_from"] is None and sorted(losses) == list(range(1, 7))
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "2",
                    tmp_path / "chain" / "checkpoints" / "2")
    mid = trainer((1, 3), "mpmd", tmp_path / "chain").train(4)
    end = trainer((3, 1), "spmd", tmp_path / "chain").train(6)
    assert mid["resumed_from"] == 2 and end["resumed_from"] == 4
    np.testing.assert_allclose([mid["final_loss"], end["final_loss"]], [losses[4], losses[6]],
                               rtol=1e-5)


@pytest.mark.slow  # 40 steps; the equivalence tests above pin every loss and gradient to the plain model
def test_training_with_the_mpmd_executor_lowers_the_loss(tmp_path):
    config = mpmd_config((1, 3), **{"train.steps": 40, "train.lr": 1e-2,
                                    "train.warmup_steps": 4, "workdir": str(tmp_path)})
    trainer = Trainer(config, quiet=True)
    assert "mpmd" in trainer.describe()
    summary = trainer.train()
    assert summary["final_loss"] < 0.75 * summary["first_loss"]  # 5.97 -> 4.29 after 30


# --- each stage its own (dp, tp) sub-mesh ---------------------------------------------------
def staged_config(stage_dp, stage_tp, microbatches=2, **extra):
    """Two one-layer stages on cpu_hybrid with their own (dp, tp), two sequences per
    micro-batch on each of the widest stage's replicas."""
    return mpmd_config((1, 1), "1f1b", 0, 1, microbatches, **{
        "parallel.stage_dp": stage_dp, "parallel.stage_tp": stage_tp,
        "train.batch_size": 2 * max(stage_dp) * microbatches, **extra})


# (stage_dp, stage_tp, extra): (tp, dp) = (2, 1) then (1, 2) on four of the eight devices (two
# ib and two roce ones left out); (2, 2) then (1, 4) on all eight
STAGED = [
    pytest.param((1, 2), (2, 1), {"parallel.exclude": (2, 3, 6, 7)}, id="tp2dp1-tp1dp2-subset",
                 marks=pytest.mark.slow),  # each about 16 s: the slow tier's
    pytest.param((2, 4), (2, 1), {}, id="tp2dp2-tp1dp4", marks=pytest.mark.slow),
    # optimizer states sharded over 2 of each stage's replicas (a factor of both stages' dp)
    pytest.param((2, 2), (1, 2), {"topology.preset": "cpu_single", "parallel.exclude": (6, 7),
                                  "topology.devices_per_node": 8, "zero.preset": "custom",
                                  "zero.s_os": 2}, id="tp1dp2-tp2dp2-zero-os2",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("stage_dp, stage_tp, extra", STAGED)
def test_stages_with_their_own_shapes_give_the_plain_models_loss_and_gradients(
        stage_dp, stage_tp, extra):
    """The boundary moves each activation row (and its gradient) to the device of the other
    stage that holds it; the tied embedding's two gradients are summed across the shapes."""
    trainer = check_against_reference(staged_config(stage_dp, stage_tp, **extra))
    plan = trainer.plan
    assert plan.shapes() == tuple(zip(stage_dp, stage_tp))
    for st, (dp, tp) in zip(trainer.executor.stages, plan.shapes()):
        replicas = st.mesh.shape["dp"] * st.mesh.shape["dp_os"] * st.mesh.shape["dp_p"]
        assert (replicas, st.mesh.shape["tp"]) == (dp, tp)
        assert sorted(d.id for d in st.mesh.devices.flat) == st.ex.plan.stage_ranks(st.index)
    if "parallel.exclude" in extra:
        assert plan.unused_ranks(trainer.topology) == list(extra["parallel.exclude"])


@pytest.mark.slow  # three runs of a few steps; the equivalence test above is the default tier's
def test_checkpoints_resume_between_per_stage_shapes_and_one_shape(tmp_path):
    """uniform (dp 2 x tp 2 per stage) -> per-stage shapes on four of the eight devices ->
    uniform, through the plan-independent checkpoint: the losses at steps 4 and 6 are the
    straight uniform run's."""
    import shutil

    uniform = {"parallel.dp": 2, "parallel.tp": 2}
    staged = {"parallel.stage_dp": (1, 2), "parallel.stage_tp": (2, 1),
              "parallel.exclude": (2, 3, 6, 7)}

    def trainer(layout, workdir):  # the same train.steps and batch, so the same lr and data
        return Trainer(mpmd_config((1, 1), "1f1b", 0, 1, 2, **{
            "train.batch_size": 8, "train.steps": 6, "checkpoint.every": 2,
            "train.log_every": 1, "workdir": str(workdir), **layout}), quiet=True)

    straight = trainer(uniform, tmp_path / "straight").train()
    losses = {r["step"]: r["loss"] for r in straight.history.rows}
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "2",
                    tmp_path / "chain" / "checkpoints" / "2")
    mid = trainer(staged, tmp_path / "chain")
    assert not mid.plan.uniform
    mid = mid.train(4)
    end = trainer(uniform, tmp_path / "chain").train(6)
    assert mid["resumed_from"] == 2 and end["resumed_from"] == 4
    np.testing.assert_allclose([mid["final_loss"], end["final_loss"]], [losses[4], losses[6]],
                               rtol=1e-5)


# --- devices left out ---------------------------------------------------------------------------
def fast_and_slow_topology():
    """Three fast nodes (two devices each, InfiniBand) and one node behind a 1 Gb/s link."""
    from hetjax.core.catalogue import LINKS, make_cluster
    from hetjax.core.hardware import Link, Topology

    return Topology(name="three_fast_one_slow",
                    clusters=(make_cluster("fast", 3, 2, "cpu", "infiniband"),
                              make_cluster("slow", 1, 2, "cpu", "ethernet")),
                    inter_cluster=Link("ethernet", 1.0, LINKS["ethernet"].latency_us))


# the model and job of the two tests below (the default job's topology and layout replaced)
SMALL_JOB = ["--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.n_layers=2",
             "--config.model.n_heads=4", "--config.model.n_kv_heads=2",
             "--config.model.max_seq_len=64", "--config.model.dtype=float32",
             "--config.train.seq_len=16", "--config.train.batch_size=8",
             "--config.train.microbatches=2", "--config.train.steps=3",
             "--config.train.warmup_steps=1", "--config.train.log_every=1",
             "--config.train.progress=False", "--config.data.source=synthetic",
             "--config.tensorboard=False", "--config.eval.every=0", "--config.checkpoint.every=0"]


def slow_node_left_out(tmp_path) -> list[str]:
    """The layout that leaves the slow node's devices (ranks 6-7) out: stage 0 data parallel
    on the first fast node, stage 1 two TP pairs on the other two."""
    topology = tmp_path / "topology.json"
    topology.write_text(fast_and_slow_topology().to_json())
    return [f"--config.topology.file={topology}", "--config.parallel.pp=2",
            "--config.pipeline.executor=mpmd", "--config.parallel.stage_dp=[2,2]",
            "--config.parallel.stage_tp=[1,2]", "--config.parallel.exclude=[6,7]"]


def test_hetjax_plan_shows_each_stages_degrees_and_the_devices_left_out(tmp_path, capsys):
    from hetjax.cli import main

    assert main(["hetjax", "plan", *SMALL_JOB, *slow_node_left_out(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pp=2 dp,tp per stage: 2x1 2x2" in out
    assert "  unused: ranks 6-7 (slow): left out by parallel.exclude" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("  0 ", "  1 "))]
    assert [r[3:6] for r in rows] == [["2", "1", "0-1"], ["2", "2", "2-5"]]  # dp, tp, ranks


@pytest.mark.slow  # two runs through the CLI; the default tier has the equivalence test above
def test_a_plan_that_leaves_the_slow_node_out_trains_like_one_device(tmp_path):
    """3 fast nodes + 1 node behind a 1 Gb/s link: `hetjax train` with the slow node left out
    trains with the single-device run's losses."""
    from hetjax.cli import main

    runs = {}
    for name, args in (("left_out", slow_node_left_out(tmp_path)), ("one_device", [
            "--config.topology.preset=cpu_single", "--config.topology.devices_per_node=1",
            "--config.parallel.pp=1", "--config.parallel.dp=1", "--config.parallel.tp=1"])):
        assert main(["hetjax", "train", *SMALL_JOB, *args,
                     f"--config.workdir={tmp_path / name}"]) == 0
        runs[name] = [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")]
    assert len(runs["one_device"]) == 3
    np.testing.assert_allclose(runs["left_out"], runs["one_device"], rtol=1e-5)

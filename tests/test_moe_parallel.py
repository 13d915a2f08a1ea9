"""Expert parallelism and MoE training through the executors: the `expert` mesh axis against
one device, both pipeline executors, ZeRO and tensor parallelism, the all-to-alls the compiled
program holds, and the step's MoE metrics."""

import jax
import numpy as np
import pytest
from conftest import tiny_config

from hetjax.train import Trainer

MOE = {"model.n_experts": 8, "model.experts_per_token": 2, "model.moe_d_ff": 64,
       "model.moe_z_loss_coef": 0.001, "model.moe_aux_loss_coef": 0.05}


def run(devices, steps=2, **overrides):
    config = tiny_config(**{**MOE, "topology.preset": "cpu_single",
                            "topology.devices_per_node": devices, **overrides})
    trainer = Trainer(config, quiet=True)
    metrics = [{k: float(v) for k, v in trainer.step().items()} for _ in range(steps)]
    return trainer, metrics, jax.device_get(trainer.executor.params(trainer.state))


def assert_same_run(got, ref, rtol=2e-6, atol=3e-6):
    (_, m1, p1), (_, m0, p0) = got, ref
    np.testing.assert_allclose([m["loss"] for m in m1], [m["loss"] for m in m0], rtol=rtol)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)


@pytest.fixture(scope="module")
def single():
    return run(1, **{"parallel.dp": 1})


@pytest.mark.parametrize("ep", [2, pytest.param(4, marks=pytest.mark.slow),
                                pytest.param(8, marks=pytest.mark.slow)])
def test_expert_parallel_steps_equal_one_device(single, ep):
    """dp = ep: one expert-parallel group holding the whole batch; its loss, MoE metrics and
    parameters after two steps are those of one device."""
    trainer, metrics, params = got = run(ep, **{"parallel.dp": ep, "parallel.ep": ep})
    assert dict(trainer.executor.mesh.shape)["expert"] == ep
    assert_same_run(got, single)
    for k in ("moe_balance", "moe_z", "moe_aux_loss", "moe_load_max/0", "moe_load_max/1"):
        assert metrics[-1][k] == pytest.approx(single[1][-1][k], rel=1e-5)
    # each device holds n_experts / ep experts
    gate = trainer.state.params["layers"]["block"]["moe"]["experts"]["gate"]
    assert gate.addressable_shards[0].data.shape[1] == 8 // ep
    # evaluation runs the exchange too, and sampling a prompt that does not split over the
    # devices runs the layer whole
    toks = np.random.default_rng(0).integers(0, 256, (16, 17))
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
    assert trainer.evaluate(batch) == pytest.approx(single[0].evaluate(batch), rel=1e-5)
    assert trainer.generate("the", 4) == single[0].generate("the", 4)


@pytest.fixture(scope="module")
def single_two_microbatches():
    """The balance loss is per micro-batch: a pipeline's reference has its micro-batches."""
    return run(1, **{"parallel.dp": 1, "train.microbatches": 2})


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["spmd", "mpmd"])
@pytest.mark.parametrize("ep", [1, 2])
def test_pipelined_moe_equals_one_device(single_two_microbatches, executor, ep):
    """pp = 2 under either pipeline executor, each stage's layers adding their share of the
    auxiliary losses to its own backward, with and without expert parallelism inside the
    stages: the single device's losses and parameters."""
    got = run(2 * ep, **{"parallel.pp": 2, "parallel.dp": ep, "parallel.ep": ep,
                         "train.microbatches": 2, "pipeline.executor": executor})
    assert_same_run(got, single_two_microbatches)


@pytest.mark.slow
def test_expert_parallelism_beside_tensor_parallelism_equals_one_device(single):
    got = run(4, **{"parallel.dp": 2, "parallel.ep": 2, "parallel.tp": 2})
    assert dict(got[0].executor.mesh.shape)["tp"] == 2
    assert_same_run(got, single)


@pytest.mark.slow
def test_expert_parallelism_under_zero3_equals_ep1():
    """ZeRO-3 over the experts' data-parallel group (dp / ep = 2 replicas, s_p = s_os = 2): the
    run of EP 1 with the same ZeRO factors. The balance loss is each expert-parallel group's
    (each device's without EP), so the two runs group tokens differently: its coefficient is 0
    here (the z-loss, a mean over tokens, stays)."""
    layout = {"parallel.dp": 4, "zero.preset": "custom", "zero.s_p": 2, "zero.s_g": 2,
              "zero.s_os": 2, "model.moe_aux_loss_coef": 0.0}
    got = run(4, **layout, **{"parallel.ep": 2})
    gate = got[0].state.params["layers"]["block"]["moe"]["experts"]["gate"]
    assert gate.addressable_shards[0].data.size == gate.size // 4  # split over ep and s_p
    assert_same_run(got, run(4, **layout))


@pytest.mark.slow  # a training run; test_metrics.py is the default tier's
def test_moe_metrics_reach_the_file_tensorboard_and_progress_line(tmp_path, capsys):
    """Per-layer expert load and drops, the balance and z losses and the auxiliary term in
    metrics.jsonl and TensorBoard, and the balance and drop fraction on the progress line."""
    from test_never_lose import tensorboard_scalars

    from hetjax.metrics import read_metrics

    config = tiny_config(**{**MOE, "topology.preset": "cpu_single",
                            "topology.devices_per_node": 1, "parallel.dp": 1,
                            "train.steps": 2, "train.log_every": 1, "train.progress": True,
                            "workdir": str(tmp_path), "tensorboard": True,
                            "model.moe_dispatch": "capacity", "model.moe_capacity_factor": 1.0})
    Trainer(config, quiet=False).train()
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    last = rows[-1]
    for i in range(config.model.n_layers):
        assert 1.0 <= last[f"moe_load_max/{i}"] <= 8.0
        assert 0.0 <= last[f"moe_load_min/{i}"] <= 1.0
        assert 0.0 <= last[f"moe_drop/{i}"] < 1.0
    assert last["moe_drop"] == pytest.approx(
        np.mean([last[f"moe_drop/{i}"] for i in range(2)]), rel=1e-5)
    assert last["moe_aux_loss"] == pytest.approx(
        0.05 * last["moe_balance"] + 0.001 * last["moe_z"], rel=1e-5)
    assert tensorboard_scalars(tmp_path / "tensorboard", "train/moe_balance") == [
        (r["step"], pytest.approx(r["moe_balance"])) for r in rows]
    out = capsys.readouterr().out
    assert f"balance={last['moe_balance']:.3g}" in out and "dropped=" in out


@pytest.mark.slow
def test_strands_schedule_overlaps_moe_strands_and_equals_one_device(single_two_microbatches):
    """DHelix's strands (one micro-batch's forward beside another's backward in one loop, so
    one strand's all-to-alls may overlap the other's compute) under the SPMD pipeline with EP
    inside the stages: the single device's run."""
    got = run(4, **{"parallel.pp": 2, "parallel.dp": 2, "parallel.ep": 2,
                    "train.microbatches": 2, "pipeline.schedule": "strands",
                    "pipeline.executor": "spmd"})
    assert_same_run(got, single_two_microbatches)


@pytest.mark.slow
def test_diloco_sites_with_expert_parallelism_synchronise_experts_and_router(tmp_path):
    """Two DiLoCo sites, each with EP over its two devices; H = 1, inner and outer SGD at outer
    lr 1 is synchronous SGD on the global batch: the experts and the router are exchanged and
    averaged like every other parameter. (The auxiliary losses are off: each site's balance
    loss is over its own rows, which a global-batch step would not group alike.)"""
    import jax.numpy as jnp

    config = tiny_config(**{**MOE, "model.moe_aux_loss_coef": 0.0, "model.moe_z_loss_coef": 0.0,
                            "topology.nodes": 1, "topology.devices_per_node": 2,
                            "diloco.inner_steps": 1, "diloco.inner_optimizer": "sgd",
                            "diloco.outer_optimizer": "sgd", "diloco.outer_lr": 1.0,
                            "parallel.ep": 2, "train.grad_clip": 0.0, "train.batch_size": 8,
                            "train.lr": 0.5, "checkpoint.every": 0, "workdir": str(tmp_path)})
    trainer = Trainer(config, quiet=True)
    assert [s.plan.ep for s in trainer.executor.site_execs] == [2, 2]
    params = jax.device_get(trainer.params)
    ref = jax.device_put(params, jax.devices()[0])
    rng = np.random.default_rng(1)

    @jax.jit
    def sgd(p, inputs, targets, step):
        g = jax.grad(lambda q: trainer.executor.loss_fn(q, inputs, targets))(p)
        return jax.tree.map(lambda a, b: a - trainer.schedule(step) * b, p, g)

    for i in range(2):
        toks = rng.integers(0, 256, (8, config.train.seq_len + 1))
        trainer.step({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
        ref = sgd(ref, jnp.asarray(toks[:, :-1]), jnp.asarray(toks[:, 1:]), i)
    got, ref = jax.device_get(trainer.params), jax.device_get(ref)
    router = [p["layers"]["block"]["moe"]["router"]["kernel"] for p in (ref, params)]
    assert float(np.abs(router[0] - router[1]).max()) > 1e-4  # the router did learn
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_compiled_flops_follow_the_active_parameters():
    """Capacity dispatch at factor 1 runs each token through k experts only: the compiled
    step's FLOPs are within 5% of 6 x active parameters x tokens (the rest: attention's
    QK^T / AV, elementwise work, AdamW over all parameters). One layer, since XLA's cost
    analysis counts a loop's body once."""
    config = tiny_config(**{**MOE, "model.n_experts": 4, "model.moe_d_ff": 512,
                            "model.d_model": 256, "model.d_ff": 512, "model.n_layers": 1,
                            "model.n_kv_heads": 4, "model.remat": "none",
                            "model.moe_dispatch": "capacity", "model.moe_capacity_factor": 1.0,
                            "train.batch_size": 32, "topology.preset": "cpu_single",
                            "topology.devices_per_node": 1, "parallel.dp": 1})
    trainer = Trainer(config, quiet=True)
    cost = trainer.executor.compiled_step(trainer.state).cost_analysis()
    flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
    m = trainer.executor.model_cfg
    tokens = config.train.batch_size * config.train.seq_len
    assert m.num_params > 1.6 * m.active_params  # the experts the tokens skip are many
    assert flops == pytest.approx(6 * m.active_params * tokens, rel=0.05)

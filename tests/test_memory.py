"""The planner's per-device memory (hetjax/planner/memory.py, cost.py) against XLA's own
buffer assignment of the compiled train step, and the two memory failures a user sees: a plan
predicted not to fit, and XLA running out of memory anyway.

XLA's figure is `compiled.memory_analysis()`: argument + output + temp - alias bytes of one
device's program. Compiling only (no step runs); every configuration of the grid within 10%.
"""

import pytest

from conftest import tiny_config
from hetjax.errors import PlanError
from hetjax.planner import memory as mem
from hetjax.planner.config_plan import predict_for_config

TOLERANCE = 0.10


def memory_config(remat, dtype, pp=1, dp=2, tp=1, zero="ddp", **extra):
    """The tiny model at 128 tokens a sequence, 8 sequences a step, on pp x dp x tp CPUs."""
    return tiny_config(**{
        "model.remat": remat, "model.dtype": dtype, "model.max_seq_len": 256,
        "parallel.pp": pp, "parallel.dp": dp, "parallel.tp": tp, "zero.preset": zero,
        "topology.preset": "cpu_single", "topology.devices_per_node": pp * dp * tp,
        "train.seq_len": 128, "train.batch_size": 8, **extra})


def xla_bytes(trainer) -> int:
    ma = trainer.compiled_step().memory_analysis()
    return (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
            - ma.alias_size_in_bytes)


def check(config):
    from hetjax.train import Trainer

    trainer = Trainer(config, quiet=True)
    predicted = max(predict_for_config(config, trainer.plan, trainer.topology).stage_memory)
    measured = xla_bytes(trainer)
    assert abs(predicted / measured - 1) <= TOLERANCE, (predicted, measured)


# One configuration runs by default; the grid (remat x dtype x layout x ZeRO, and the model's
# sizes) is in the slow tier: each point is a compile of a few seconds to a minute.
def test_memory_matches_xla():
    check(memory_config("none", "float32"))


GRID = ([(r, d, 1, 2, 1, z, {}) for r in ("none", "dots", "full")
         for d in ("float32", "bfloat16") for z in ("ddp", "zero3")
         if (r, d, z) != ("none", "float32", "ddp")]
        + [(r, d, 1, 1, 2, "ddp", {}) for r in ("none", "dots", "full")
           for d in ("float32", "bfloat16")]
        + [(r, "float32", 1, 2, 1, "zero1", {}) for r in ("none", "dots", "full")]
        + [("none", "float32", 1, 2, 1, "ddp", {"model.n_layers": 4}),
           ("dots", "float32", 1, 2, 1, "ddp", {"model.vocab_size": 1024}),
           ("full", "float32", 1, 2, 1, "ddp", {"train.seq_len": 256, "train.batch_size": 4}),
           ("none", "float32", 1, 2, 1, "ddp", {"model.d_ff": 256}),
           ("none", "float32", 1, 2, 1, "ddp", {"train.microbatches": 2})])


@pytest.mark.slow
@pytest.mark.parametrize("remat,dtype,pp,dp,tp,zero,extra", GRID,
                         ids=[f"{r}-{d}-pp{p}dp{q}tp{t}-{z}" + "".join(
                             f"-{k.split('.')[1]}{v}" for k, v in e.items())
                             for r, d, p, q, t, z, e in GRID])
def test_memory_grid_matches_xla(remat, dtype, pp, dp, tp, zero, extra):
    check(memory_config(remat, dtype, pp, dp, tp, zero, **extra))


def test_the_grid_covers_what_it_claims():
    points = [("none", "float32", 1, 2, 1, "ddp", {})] + GRID
    assert len(points) >= 20
    assert {p[0] for p in points} == {"none", "dots", "full"}
    assert {p[1] for p in points} == {"float32", "bfloat16"}
    assert {p[5] for p in points} >= {"ddp", "zero1", "zero3"}
    assert {(p[3], p[4]) for p in points} >= {(2, 1), (1, 2)}


# --- a plan that does not fit, and XLA out of memory -------------------------------------------
def small_memory_config(**extra):
    """A fixed layout on a topology whose devices hold 4 MiB: less than the step needs."""
    return memory_config("none", "float32", **{"topology.preset": "local",
                                               "topology.devices_per_node": 0,
                                               "topology.peak_tflops": 0.025,
                                               "topology.memory_gib": 4 / 1024,
                                               "parallel.dp": 8, **extra})


def test_train_refuses_what_plan_reports_as_not_fitting(capsys):
    from hetjax.cli import main
    from hetjax.train import Trainer

    c = small_memory_config()
    with pytest.raises(PlanError) as refused:
        Trainer(c, quiet=True)
    message = str(refused.value)
    assert message.startswith("the plan does not fit in device memory: needs ")
    assert "model.remat=full" in message and "zero.preset=zero3" in message
    assert "train.microbatches=2" in message
    main(["hetjax", "plan", "--config.model.remat=none", "--config.model.dtype=float32",
          "--config.model.max_seq_len=256", "--config.train.seq_len=128",
          "--config.train.batch_size=8", "--config.train.microbatches=1",
          "--config.parallel.pp=1", "--config.parallel.dp=8",
          "--config.parallel.tp=1", "--config.topology.preset=local",
          "--config.topology.peak_tflops=0.025", f"--config.topology.memory_gib={4 / 1024}",
          "--config.model.d_model=64", "--config.model.n_layers=2", "--config.model.n_heads=4",
          "--config.model.n_kv_heads=2", "--config.model.d_ff=128"])
    assert message in capsys.readouterr().out  # the same words


def test_xla_out_of_memory_is_one_message(monkeypatch):
    """The planner underestimates (forced here) and XLA runs out of memory on the step: the
    run ends with one message naming predicted, asked-for and available bytes and the fix."""
    import jax

    from hetjax.train import Trainer

    c = small_memory_config(**{"topology.memory_gib": 64.0})  # fits: the planner lets it run
    trainer = Trainer(c, quiet=True)
    asked = 14_500_000

    def exhausted(state, batch):
        raise jax.errors.JaxRuntimeError(
            f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate {asked} bytes.")

    monkeypatch.setattr(trainer.executor, "step", exhausted)
    with pytest.raises(PlanError) as oom:
        trainer.step()
    text = str(oom.value)
    predicted = max(trainer.predicted["stage_memory_gib"]) * 2**30
    assert text.startswith(f"out of device memory: XLA asked for {asked / 2**30:.3g} GiB")
    assert f"the planner predicted {predicted / 2**30:.3g} GiB" in text
    assert "the device has 64 GiB" in text and "model.remat=full" in text


def test_asked_bytes_reads_the_sizes_xla_names():
    assert mem.asked_bytes(RuntimeError("Out of memory while trying to allocate 1024 bytes")) \
        == 1024
    assert mem.asked_bytes(RuntimeError("RESOURCE_EXHAUSTED: ... 144.00GiB ... 2.5GiB")) == \
        144 * 2**30
    assert mem.asked_bytes(RuntimeError("RESOURCE_EXHAUSTED")) is None
    assert mem.is_out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: x"))
    assert not mem.is_out_of_memory(RuntimeError("INVALID_ARGUMENT: x"))


def test_fused_attention_keeps_statistics_not_the_score_matrix():
    from hetjax.planner import model_from_config

    m = model_from_config(tiny_config())
    xla = mem.layer_bytes_per_token(m, 2048, 1, "none", "xla")
    fused = mem.layer_bytes_per_token(m, 2048, 1, "none", "cudnn")
    # XLA's f32 logits + probabilities grow with the keys; the fused kernel's do not
    assert xla - fused == pytest.approx(
        mem.TERMS["none"].kept.attention * m.n_heads * 2048 - mem.FUSED_STATS_BYTES * m.n_heads)
    assert mem.layer_bytes_per_token(m, 4096, 1, "none", "cudnn") == fused


# One H200 (jax 0.11.2), a TinyLlama-1.1B-shaped step (bf16 compute, fp32 parameters, untied
# head, AdamW) at 4 x 2048 with XLA attention: what XLA needed (remat none: the program asked
# for 144 GiB of the card's 141 and did not run) or peaked at (dots, full), in GiB.
H200_MEASURED = {"none": 144.0, "dots": 28.5, "full": 23.7}


@pytest.mark.parametrize("remat", sorted(H200_MEASURED))
def test_memory_matches_what_one_h200_measured(remat):
    from hetjax.core.catalogue import ACCELERATORS, LINKS, make_cluster
    from hetjax.config import apply_model_source, base_config
    from hetjax.core.hardware import Topology
    from hetjax.planner import plan_from_config
    from hetjax.planner.config_plan import predict_for_config

    topo = Topology(name="one_h200", clusters=(make_cluster(
        "gpu", 1, 1, ACCELERATORS["h200"], "infiniband", intra="nvlink"),),
        inter_cluster=LINKS["ethernet"])
    c = base_config()
    c.model.preset = "tinyllama_1b"
    apply_model_source(c)
    c.model.dtype, c.model.param_dtype, c.model.remat, c.model.attention = (
        "bfloat16", "float32", remat, "xla")
    c.parallel.pp = c.parallel.dp = c.parallel.tp = 1
    c.train.batch_size, c.train.seq_len, c.train.microbatches = 4, 2048, 1
    c.data.source = "synthetic"
    predicted = predict_for_config(c, plan_from_config(c, topo), topo).as_dict()
    (gib,) = predicted["stage_memory_gib"]
    assert gib == pytest.approx(H200_MEASURED[remat], rel=0.10)


def test_a_device_holds_the_step_and_the_runtime_reserve_within_the_margin():
    """A GPU spends its context, the collectives' buffers and workspaces, and its allocator
    keeps a share of the step's bytes it cannot reuse: a device holds step x (1 + 5%) +
    1.5 GiB, which must fit (1 - margin) of its memory; the plan shows both. CPU devices
    reserve nothing; a user's reserve replaces the vendor's."""
    import dataclasses

    from hetjax.core.model_config import ModelConfig
    from hetjax.core.plan import Plan
    from hetjax.core.topology import Topology, make_cluster, preset
    from hetjax.planner.cost import CostModel, CostOptions
    from hetjax.units import gib

    model = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=128, max_seq_len=64)
    plan_ = Plan(pp=1, dp=8, tp=1, stage_layers=(2,), microbatches=1, global_batch=8,
                 seq_len=64)
    gpu = Topology("a", (make_cluster("a", 1, 8, "a100", "infiniband"),), None)
    r = mem.RESERVES["nvidia"]
    fixed = (r.context_gib + r.collectives_gib + r.workspace_gib) * mem.GIB
    assert fixed == 1.5 * mem.GIB and r.fragmentation == 0.05
    memory = gpu.clusters[0].accelerator.memory_bytes
    pred = CostModel(gpu, model, CostOptions(memory_fraction=0.9)).predict(plan_)
    (step,) = pred.stage_memory
    assert pred.stage_reserve == pytest.approx((fixed + 0.05 * step,))
    # the step may use what leaves the device's whole holding within 90% of its memory
    assert pred.stage_capacity == pytest.approx(((memory * 0.9 - fixed) / 1.05,))
    assert pred.as_dict()["memory_margin"] == pytest.approx(0.1)
    shown = dataclasses.replace(plan_, predicted=pred.as_dict()).summary_line()
    assert f"a device holds up to {gib(step * 1.05 + fixed)}: the step's {gib(step)} and " \
        f"the runtime reserve {gib(fixed + 0.05 * step)}" in shown
    assert "margin of 10%" in shown
    cpu = CostModel(preset("cpu_single"), model).predict(plan_)
    assert cpu.stage_reserve == (0.0,)
    mine = CostModel(gpu, model, CostOptions(reserve={"a100": mem.RuntimeReserve(2.0)})
                     ).predict(plan_)
    assert mine.stage_capacity == pytest.approx((memory * 0.9 - 2 * mem.GIB,))

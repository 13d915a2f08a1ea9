"""pipeline.executor = auto: the planner prices the SPMD and the MPMD executor and says which
it chose and why (jax-free)."""

from conftest import tiny_config
from hetjax.planner import plan_from_config
from hetjax.core.topology import preset


def holmes_36b(**overrides):
    """Holmes' GPT 3.6B layout on its 32-A100 hybrid: a stage per cluster, ZeRO-1, 1F1B."""
    return tiny_config(**{
        "topology.preset": "holmes_hybrid", "topology.nodes": 2,
        "topology.devices_per_node": 8, "model.d_model": 3072, "model.n_layers": 30,
        "model.n_heads": 32, "model.n_kv_heads": 32, "model.d_ff": 8192,
        "model.max_seq_len": 2048, "model.dtype": "bfloat16", "model.param_dtype": "bfloat16",
        "model.remat": "full", "train.seq_len": 2048, "train.batch_size": 768,
        "parallel.pp": 2, "parallel.dp": 16, "parallel.tp": 1, "pipeline.microbatches": 48,
        "zero.preset": "zero1", **overrides})


def test_auto_chooses_the_mpmd_executor_for_holmes_layout_and_says_why():
    c = holmes_36b(**{"pipeline.executor": "auto"})
    t = preset("holmes_hybrid", nodes=2, devices_per_node=8)
    plan = plan_from_config(c, t)
    assert plan.executor == "mpmd"
    note = plan.predicted["executor_choice"]
    assert note.startswith("mpmd (predicted step: spmd ") and ", mpmd " in note
    spmd = float(note.split("spmd ")[1].split(" s")[0])
    mpmd = float(note.split(", mpmd ")[1].split(" s")[0])
    assert mpmd < spmd / 1.4  # the SPMD executor's lockstep and recompute tax
    assert "executor: mpmd" in plan.describe(t)


def test_a_configured_executor_is_kept():
    t = preset("holmes_hybrid", nodes=2, devices_per_node=8)
    for executor in ("spmd", "mpmd"):
        plan = plan_from_config(holmes_36b(**{"pipeline.executor": executor}), t)
        assert plan.executor == executor and "executor_choice" not in plan.predicted

"""Training: sharded steps equal the single-device step; accumulation; loss falls; metrics."""

import json
import os

import jax
import numpy as np
import pytest

from conftest import tiny_config
from hetjax.metrics import read_metrics
from hetjax.train import Trainer


def run_steps(config, steps=3):
    trainer = Trainer(config, quiet=True)
    losses = [float(trainer.step()["loss"]) for _ in range(steps)]
    return trainer, losses, jax.device_get(trainer.state.params)


def single_device(**overrides):
    return tiny_config(**{"topology.preset": "cpu_single", "topology.devices_per_node": 1,
                          "parallel.dp": 1, **overrides})


@pytest.fixture(scope="module")
def reference():
    """Three steps on one device: the numbers every sharded layout must reproduce (per
    n_kv_heads, run when a test first asks)."""
    runs = {}

    def steps(kv):
        if kv not in runs:
            runs[kv] = run_steps(single_device(**{"model.n_kv_heads": kv}))[1:]
        return runs[kv]
    return steps


@pytest.mark.parametrize("dp, tp, kv, topology", [
    (4, 2, 2, {}),  # default cpu_hybrid: 2 clusters x 2 nodes x 2 devices
    pytest.param(2, 4, 4, {"topology.nodes": 1, "topology.devices_per_node": 4},
                 marks=pytest.mark.slow),
])
def test_sharded_steps_equal_single_device(reference, dp, tp, kv, topology):
    config = tiny_config(**{"parallel.dp": dp, "parallel.tp": tp, "model.n_kv_heads": kv,
                            **topology})
    trainer, losses, params = run_steps(config)
    assert dict(trainer.mesh.shape)["tp"] == tp
    ref_losses, ref_params = reference(kv)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6),
                 params, ref_params)
    # The parameters really are split: a TP-sharded kernel holds 1/tp of its heads per device.
    q = trainer.state.params["layers"]["block"]["attn"]["query"]
    assert q.addressable_shards[0].data.shape[2] == 4 // tp


def test_microbatch_accumulation_equals_one_big_batch():
    _, l1, p1 = run_steps(single_device(), steps=2)
    _, l4, p4 = run_steps(single_device(**{"train.microbatches": 4}), steps=2)
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6), p4, p1)


def test_loss_decreases_on_synthetic_data(tmp_path):
    config = tiny_config(**{"train.steps": 40, "train.warmup_steps": 4, "train.lr": 1e-2,
                            "train.log_every": 10, "workdir": str(tmp_path)})
    summary = Trainer(config, quiet=True).train()
    assert summary["final_loss"] < 0.5 * summary["first_loss"]
    rows = read_metrics(summary["metrics"])
    assert [r["step"] for r in rows] == [1, 10, 20, 30, 40]
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "mfu"} <= set(rows[-1])
    assert rows[-1]["lr"] < rows[1]["lr"]  # cosine decay
    plan = json.load(open(os.path.join(tmp_path, "plan.json")))
    assert (plan["pp"], plan["dp"], plan["tp"]) == (1, 8, 1)


def test_evaluation_and_saves_start_after_the_step_has_computed(tmp_path):
    """Eval and checkpoint time is kept out of tokens/s; the step's own (asynchronously
    dispatched) compute must not leak into it, so both start on a finished state."""
    config = tiny_config(**{"train.steps": 4, "eval.every": 2, "checkpoint.every": 2,
                            "workdir": str(tmp_path)})
    trainer = Trainer(config, quiet=True)
    ready_at = []

    def ready() -> bool:
        return all(x.is_ready() for x in jax.tree.leaves(trainer.state))

    eval_loss, save = trainer.eval_loss, trainer.save
    trainer.eval_loss = lambda: (ready_at.append(("eval", ready())), eval_loss())[1]
    trainer.save = lambda **kw: (ready_at.append(("save", ready())), save(**kw))[1]
    summary = trainer.train()
    assert ready_at == [("eval", True), ("save", True)] * 2
    assert summary["tokens_per_s"] > 0


def test_train_step_reduces_gradients_over_dp_inside_the_step():
    trainer = Trainer(tiny_config(**{"parallel.dp": 4, "parallel.tp": 2}), quiet=True)
    hlo = trainer.compiled_step().as_text()
    assert "all-reduce" in hlo


def test_a_hook_added_from_python_runs_at_its_interval_and_sees_the_metrics(tmp_path):
    config = tiny_config(**{"train.steps": 6, "train.log_every": 3, "eval.every": 3,
                            "checkpoint.every": 0, "workdir": str(tmp_path)})
    trainer = Trainer(config, quiet=True)
    seen = []
    trainer.add_hook(lambda info: seen.append((info.step, dict(info.metrics))), every=2)
    trainer.train()
    assert [s for s, _ in seen] == [2, 4, 6]
    assert all(np.isfinite(m["loss"]) and "grad_norm" in m and "lr" in m for _, m in seen)
    # At step 6 the standard hooks ran first: the hook sees their eval loss and timing.
    assert {"eval_loss", "step_s", "tokens_per_s"} <= set(seen[-1][1])
    rows = {r["step"]: r for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl"))}
    assert seen[-1][1]["loss"] == rows[6]["loss"]


def test_a_trainer_runs_on_the_parts_it_is_given_and_builds_none_itself(tmp_path, monkeypatch):
    """TrainerParts.from_config builds the validated config, topology, plan, tokenizer, model,
    optimizer, runtime, executor, attention kernel and memory check; Trainer(parts) only runs
    them (nothing of train.py's builders is called again), and its checkpointer is a hook."""
    from hetjax import train
    from hetjax.errors import HetjaxError
    from hetjax.hooks import Checkpointing

    parts = train.TrainerParts.from_config(tiny_config(**{
        "train.steps": 2, "checkpoint.every": 2, "checkpoint.async_save": False,
        "workdir": str(tmp_path)}))

    def built_again(*args, **kwargs):
        raise AssertionError("Trainer(parts) built a part")

    for name in ("make_executor", "plan_job", "tokenizer_from_config", "make_optimizer",
                 "runtime_from_environ", "check_memory", "choose_local"):
        monkeypatch.setattr(train, name, built_again)
    monkeypatch.setattr(train.hconfig, "validate", built_again)
    trainer = train.Trainer(parts, quiet=True)
    assert (trainer.executor, trainer.plan, trainer.model_cfg) == \
        (parts.executor, parts.plan, parts.model_cfg)
    saved = []
    monkeypatch.setattr(Checkpointing, "__call__",
                        lambda self, info, call=Checkpointing.__call__: (saved.append(info.step),
                                                                         call(self, info)))
    summary = trainer.train()
    assert np.isfinite(summary["final_loss"]) and saved == [2]
    assert trainer.checkpointer.steps() == [2]
    with pytest.raises(HetjaxError, match="the parts hold the topology and the plan"):
        train.Trainer(parts, plan=parts.plan)


def test_the_loss_plot_title_names_the_model_and_plan_not_a_temporary_directory(tmp_path):
    workdir = tmp_path / "hetjax-quickstart-x1y2z3"
    trainer = Trainer(tiny_config(**{"workdir": str(workdir)}), quiet=True)
    title = trainer._plot_title(resumed=10)
    assert "x1y2z3" not in title and "hetjax-quickstart" not in title
    assert f"parameters on {trainer.topology.name}: pp=1 dp=8 tp=1 since step 10" in title


def test_iter_steps_yields_every_step_and_builds_nothing_before_it_is_needed():
    trainer = Trainer(tiny_config(**{"train.steps": 3}), quiet=True)
    assert trainer._state is None and trainer._data is None  # nothing compiled or opened yet
    steps = [(info.step, info.first, info.last) for info in trainer.iter_steps()]
    assert steps == [(1, True, False), (2, False, False), (3, False, True)]
    assert int(trainer.state.step) == 3


@pytest.mark.slow  # ~27 s of CPU: three trainers, a tfds corpus
def test_document_masks_reach_the_sharded_step(tmp_path):
    """data.document_mask on a packed text corpus: the sharded step's loss (dp 4 x tp 2, two
    micro-batches) and the SPMD pipeline's (pp 2 x dp 4) are the single-device masked loss of
    the same batch, which differs from the unmasked one; the description names the attention
    kernel; the MPMD executor refuses the switch."""
    from hetjax.errors import ConfigError
    from hetjax.layers import Transformer, cross_entropy

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"{i}.txt").write_text(f"document {i} " * (2 + i % 5))
    config = tiny_config(**{"data.source": "files", "data.path": str(corpus),
                            "data.dir": str(tmp_path / "tfds"), "data.eval_fraction": 0.0,
                            "data.document_mask": True, "train.microbatches": 2,
                            "parallel.dp": 4, "parallel.tp": 2, "workdir": str(tmp_path)})
    trainer = Trainer(config, quiet=True)
    batch = trainer.data.batch(0)
    assert batch["segment_ids"].max() > 1  # rows hold several documents
    params = jax.device_get(trainer.params)
    loss = float(trainer.step(batch)["loss"])

    model = Transformer(trainer.model_cfg)

    def plain(seg):
        return float(cross_entropy(model.apply({"params": params}, batch["inputs"], seg),
                                   batch["targets"]))

    np.testing.assert_allclose(loss, plain(batch["segment_ids"]), rtol=1e-5)
    assert abs(plain(None) - loss) > 1e-4
    assert "attention: xla (auto on cpu), document masks" in trainer.describe()
    config.parallel.pp, config.parallel.dp, config.parallel.tp = 2, 0, 1
    pipeline = Trainer(config, quiet=True)
    assert pipeline.pipeline is not None
    np.testing.assert_allclose(float(pipeline.step(batch)["loss"]), plain(batch["segment_ids"]),
                               rtol=1e-5)
    config.pipeline.executor = "mpmd"
    with pytest.raises(ConfigError, match="data.document_mask"):
        Trainer(config, quiet=True)


@pytest.mark.slow  # ~20 s of CPU: two sharded trainers (test_model checks the numerics fast)
def test_chunked_cross_entropy_gives_the_same_steps():
    """model.loss_chunk_tokens: the sharded step (dp 4 x tp 2) with the cross-entropy in chunks
    (here 24 tokens of a device's 2 x 16) matches the plain step's losses and parameters."""
    layout = {"parallel.dp": 4, "parallel.tp": 2}
    _, plain, p1 = run_steps(tiny_config(**layout), steps=2)
    _, chunked, p2 = run_steps(tiny_config(**layout, **{"model.loss_chunk_tokens": 24}), steps=2)
    np.testing.assert_allclose(chunked, plain, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6), p2, p1)


def test_the_summary_shows_paths_under_the_working_directory_relative(tmp_path, monkeypatch):
    from hetjax.train import summary_rows

    monkeypatch.chdir(tmp_path)
    s = {"complete": True, "message": "done", "workdir": str(tmp_path / "runs" / "default"),
         "first_loss": 5.9, "final_loss": 1.7, "metrics": str(tmp_path / "runs" / "default" /
                                                             "metrics.jsonl"),
         "plot": "/elsewhere/loss.png"}
    rows = dict(summary_rows(s))
    assert rows["workdir"] == os.path.join("runs", "default")
    assert rows["metrics"] == os.path.join("runs", "default", "metrics.jsonl")
    assert rows["loss curve"] == "/elsewhere/loss.png"  # outside: as it is
    assert s["metrics"].startswith(str(tmp_path))  # the summary itself keeps absolute paths

"""Checkpoints: exact resume (losses, parameters, data order), restore under other plans,
retention (latest K + best by eval loss), and crash safety under SIGKILL mid-save."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, tiny_config
from hetjax import checkpoint as hckpt
from hetjax.errors import HetjaxError
from hetjax.metrics import read_metrics
from hetjax.train import Trainer

CORPUS = os.path.join(os.path.dirname(json.__file__), "*.py")  # a small real text corpus
SAVE_PLAN = {"parallel.dp": 2, "parallel.tp": 4}
# Two clusters x one node x four devices: room for tp = 4 inside a node.
TOPOLOGY = {"topology.nodes": 1, "topology.devices_per_node": 4}


def config(workdir, data_dir, plan=SAVE_PLAN, **overrides):
    return tiny_config(**{
        "data.source": "files", "data.path": CORPUS, "data.dir": str(data_dir),
        "model.n_kv_heads": 4, "train.steps": 20, "train.log_every": 1,
        "checkpoint.every": 5, "workdir": str(workdir), **TOPOLOGY, **plan, **overrides})


def losses(workdir):
    return {r["step"]: r["loss"] for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))}


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A straight 20-step run, and a run stopped after step 10 (its checkpoint kept)."""
    root = tmp_path_factory.mktemp("runs")
    straight = Trainer(config(root / "straight", root / "tfds"), quiet=True)
    straight.train()
    half = Trainer(config(root / "half", root / "tfds"), quiet=True)
    half.train(steps=10)
    return {"root": root, "losses": losses(root / "straight"),
            "params": host(straight.state.params), "half": root / "half",
            "half_state": host(half.state)}


def copy_run(runs, name):
    dst = runs["root"] / name
    shutil.copytree(runs["half"], dst)
    return dst


def test_resume_continues_exactly_like_an_uninterrupted_run(runs):
    workdir = copy_run(runs, "resumed")
    assert hckpt.Checkpointer(str(workdir / "checkpoints"), every=5).steps() == [5, 10]
    trainer = Trainer(config(workdir, runs["root"] / "tfds"), quiet=True)
    summary = trainer.train()
    assert summary["resumed_from"] == 10
    # Steps 11-20 saw the same batches in the same order and did the same arithmetic.
    assert losses(workdir) == runs["losses"] and sorted(losses(workdir)) == list(range(1, 21))
    jax.tree.map(np.testing.assert_array_equal, host(trainer.state.params), runs["params"])
    rows = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    assert all(r["input_wait_s"] >= 0 for r in rows) and summary["input_wait_s"] >= 0
    assert "20" in summary["checkpoints"]


@pytest.mark.parametrize("plan", [pytest.param({"parallel.dp": 8, "parallel.tp": 1},
                                               marks=pytest.mark.slow),
                                  {"parallel.dp": 4, "parallel.tp": 2}],
                         ids=["dp8", "dp4xtp2"])
def test_checkpoint_restores_under_another_plan_and_training_continues(runs, plan):
    workdir = copy_run(runs, "plan-" + "-".join(map(str, plan.values())))
    trainer = Trainer(config(workdir, runs["root"] / "tfds", plan=plan), quiet=True)
    assert trainer.restore() == 10
    # Exactly the saved numbers, placed directly in this plan's shardings.
    jax.tree.map(np.testing.assert_array_equal, host(trainer.state), runs["half_state"])
    for leaf, sharding in zip(jax.tree.leaves(trainer.state),
                              jax.tree.leaves(trainer.state_sharding)):
        assert leaf.sharding == sharding
    q = trainer.state.params["layers"]["block"]["attn"]["query"]
    assert q.addressable_shards[0].data.shape[2] == 4 // plan["parallel.tp"]
    trainer.train()
    got, ref = losses(workdir), runs["losses"]
    np.testing.assert_allclose([got[s] for s in range(11, 21)], [ref[s] for s in range(11, 21)],
                               rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6),
                 host(trainer.state.params), runs["params"])


PP_SAVE = {"parallel.pp": 2, "pipeline.stage_layers": (3, 1), "parallel.dp": 2,
           "parallel.tp": 2, "zero.preset": "zero1"}


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory):
    """One 20-step run under PP_SAVE, its checkpoints and state at step 10 kept aside on the
    way (one run and one compile for both splits below: the suite's time)."""
    root = tmp_path_factory.mktemp("pp_runs")
    trainer = Trainer(pp_config(root / "straight", root, PP_SAVE), quiet=True)
    trainer.train(steps=10)
    saved = host(trainer.layout().to_natural(trainer.state))
    shutil.copytree(root / "straight" / "checkpoints", root / "half" / "checkpoints")
    trainer.train()  # steps 11-20, as one uninterrupted run
    return {"root": root, "saved": saved, "losses": losses(root / "straight")}


def pp_config(workdir, root, plan):
    return config(workdir, root / "tfds", plan=plan, **{"model.n_layers": 4})


@pytest.mark.parametrize("plan", [
    pytest.param({"parallel.pp": 1, "parallel.dp": 8, "parallel.tp": 1}, marks=pytest.mark.slow),
    pytest.param({"parallel.pp": 4, "pipeline.stage_layers": (1, 1, 1, 1), "parallel.dp": 2,
                  "parallel.tp": 1}, marks=pytest.mark.slow)], ids=["pp1-dp8", "pp4-even"])
def test_pipeline_checkpoint_restores_under_another_split(pp_runs, plan):
    root = pp_runs["root"]
    other = root / ("other-" + "-".join(map(str, plan.values())))
    shutil.copytree(root / "half", other)
    trainer = Trainer(pp_config(other, root, plan), quiet=True)
    assert trainer.restore() == 10
    jax.tree.map(np.testing.assert_array_equal,
                 host(trainer.layout().to_natural(trainer.state)), pp_runs["saved"])
    trainer.train()
    got, ref = losses(other), pp_runs["losses"]
    assert sorted(ref) == list(range(1, 21))
    np.testing.assert_allclose([got[s] for s in range(11, 21)], [ref[s] for s in range(11, 21)],
                               rtol=1e-5)


def test_restoring_with_other_data_settings_is_a_clear_error(runs):
    workdir = copy_run(runs, "other-data")
    trainer = Trainer(config(workdir, runs["root"] / "tfds", **{"train.seed": 7}), quiet=True)
    with pytest.raises(HetjaxError, match="written for other data.*same data"):
        trainer.restore()


def abstract(state):
    return hckpt.NaturalLayout(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))


def test_a_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    state = {"w": jax.numpy.ones(3)}
    ckpt = hckpt.Checkpointer(str(tmp_path / "ck"), every=1)
    ckpt.save(1, state, abstract(state), {"next_index": 1}, {})
    ckpt.wait()
    for other in ({"w": jax.numpy.ones(4)}, {"v": jax.numpy.ones(3)}):
        with pytest.raises(HetjaxError, match="checkpoint 1 in .* does not fit this model.*"
                           "resume with the model config it was written with"):
            ckpt.restore(abstract(other))


def test_retention_keeps_the_latest_k_and_the_best_by_eval_loss(tmp_path):
    state = {"w": jax.numpy.arange(4.0)}
    layout = abstract(state)
    ckpt = hckpt.Checkpointer(str(tmp_path / "ck"), every=5, keep=2, keep_best=1)
    for step, loss in zip(range(5, 35, 5), [3.0, 1.0, 4.0, 5.0, 6.0, 7.0]):
        assert ckpt.should_save(step) and not ckpt.should_save(step + 1)
        ckpt.save(step, state, layout, {"next_index": step}, {"step": step}, eval_loss=loss)
    ckpt.wait()
    assert ckpt.steps() == [10, 25, 30]  # the best (loss 1.0) and the latest two
    restored = ckpt.restore(layout, 10)
    assert restored.data_state == {"next_index": 10} and restored.meta == {"step": 10}
    np.testing.assert_array_equal(restored.state["w"], np.arange(4.0))


def test_an_interrupted_save_is_ignored_and_cleaned_up(tmp_path):
    state = {"w": jax.numpy.ones(3)}
    layout = abstract(state)
    ckpt = hckpt.Checkpointer(str(tmp_path / "ck"), every=5)
    ckpt.save(5, state, layout, {"next_index": 5}, {})
    ckpt.close()
    # What a save killed before its commit leaves behind: a temporary directory.
    partial = tmp_path / "ck" / "10.orbax-checkpoint-tmp"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "junk").write_text("half written")
    again = hckpt.Checkpointer(str(tmp_path / "ck"), every=5)
    assert again.latest_step() == 5  # the half-written step is no checkpoint
    # orbax deletes it before the next save, which then writes step 10 afresh.
    again.save(10, state, layout, {"next_index": 10}, {})
    again.wait()
    assert again.steps() == [5, 10] and not partial.exists()
    assert not (tmp_path / "ck" / "10" / "state" / "junk").exists()
    assert again.restore(layout).data_state == {"next_index": 10}


@pytest.mark.slow
def test_sigkill_during_an_async_save_loses_nothing_but_that_save(tmp_path):
    workdir, data_dir = tmp_path / "run", tmp_path / "tfds"
    overrides = {"data.source": "files", "data.path": CORPUS, "data.dir": str(data_dir),
                 "model.n_kv_heads": 4, "train.steps": 20, "train.log_every": 1,
                 "checkpoint.every": 5, "workdir": str(workdir), **TOPOLOGY, **SAVE_PLAN}
    cfg_file = tmp_path / "crash_config.py"
    cfg_file.write_text(
        f"import sys\nsys.path.insert(0, {os.path.join(REPO, 'tests')!r})\n"
        f"from conftest import tiny_config\n\n\ndef get_config():\n"
        f"    return tiny_config(**{overrides!r})\n")
    # every save is held open 5 s: the test needs only the moment to read one line and kill
    # (the hold of step 5 delays step 10's save, the suite's time)
    env = dict(os.environ, PYTHONPATH=REPO, **{hckpt.HOLD_ENV: "5"})
    cmd = [sys.executable, "-m", "hetjax", "train", f"--config={cfg_file}"]
    with open(tmp_path / "first.out", "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=REPO)
        try:
            # Every save is held open (written, not yet committed): kill the process while
            # the save of step 10 is held, after step 5's was committed.
            for line in proc.stderr:
                if "holding the save of step 10" in line:
                    proc.send_signal(signal.SIGKILL)
                    break
            else:
                pytest.fail(f"no save of step 10 started; exit code {proc.wait()}")
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ckdir = workdir / "checkpoints"
    assert glob.glob(str(ckdir / "10.orbax-checkpoint-tmp*")) and (ckdir / "5").is_dir()
    assert not (ckdir / "10").exists()

    env.pop(hckpt.HOLD_ENV)
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from checkpoint 5" in second.stdout
    reference = tmp_path / "reference"
    ref_cfg = tiny_config(**{**overrides, "workdir": str(reference)})
    Trainer(ref_cfg, quiet=True).train()
    got = read_metrics(workdir / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, 21))  # each step once
    assert {r["step"]: r["loss"] for r in got} == losses(reference)
    assert sorted(os.listdir(ckdir)) == ["10", "15", "20", "tokenizer"]  # + the run's tokenizer


def test_the_tokenizer_is_saved_with_the_checkpoints_and_a_resume_can_use_it(tmp_path):
    from test_tokenizer import write_tiktoken

    from hetjax.tokenizer import load_tokenizer

    tok_file = write_tiktoken(tmp_path / "tok.tiktoken")
    cfg = tiny_config(**{"data.tokenizer": str(tok_file), "checkpoint.async_save": False,
                         "workdir": str(tmp_path / "run"), "topology.preset": "cpu_single",
                         "topology.devices_per_node": 1, "parallel.dp": 1})
    first = Trainer(cfg, quiet=True)
    assert first.save(wait=True) == 0  # the initial state: no step needs compiling
    saved = tmp_path / "run" / "checkpoints" / "tokenizer"
    assert load_tokenizer(str(saved)).fingerprint == first.tokenizer.fingerprint
    assert first.tokenizer.fingerprint.endswith("+bos")  # tiktoken files add BOS (Llama-3)
    os.remove(tok_file)  # the original is gone: the checkpoint's copy is all there is
    cfg.data.tokenizer = str(saved)
    again = Trainer(cfg, quiet=True)
    assert again.restore() == 0  # same data spec: the same tokenizer, BOS included
    assert first.checkpointer.steps() == [0]  # the tokenizer directory is not a step

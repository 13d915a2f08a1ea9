"""Never lose a run: a non-finite step is skipped and never saved, a diverging run stops, a corrupt
checkpoint is set aside, SIGTERM / SIGINT save and exit with their own codes, a full disk is one
error -- and every way a run stops resumes to the losses of an uninterrupted run
(docs/reliability.md). One compiled tiny trainer (`trainer`) serves the tests, reset by `fresh`.

`NEVER_LOSE` is the table docs/reliability.md shows; `cd tests && python test_never_lose.py`
prints it. The same promise across processes is tested in test_train_process.py (a killed
`hetjax train`) and test_launch_recovery.py (a launched job).
"""

import os
import shutil
import signal

import pytest

from conftest import REPO, tiny_config


# --- a run never goes on with, or saves, non-finite values -----------------------------------
@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """One compiled tiny trainer (untied embeddings, so one poisoned embedding row makes only
    the batches holding that token non-finite), reset between tests by `fresh`."""
    from hetjax.train import Trainer

    c = tiny_config(**{"model.tie_embeddings": False, "checkpoint.every": 2,
                       "checkpoint.async_save": False, "train.steps": 4, "train.log_every": 1,
                       "train.warmup_steps": 0})
    return Trainer(c, workdir=str(tmp_path_factory.mktemp("run")), quiet=True)


def fresh(trainer, workdir, **config):
    """The trainer as if new in `workdir` (same compiled executor): initial state, data from
    the start, no checkpointer yet."""
    for key, value in config.items():
        *section, field = key.split(".")
        (trainer.config[section[0]] if section else trainer.config)[field] = value
    trainer.workdir = str(workdir)
    trainer.state = trainer.init_state()
    if trainer._checkpointer is not None:
        trainer._checkpointer.close()
    trainer._data = trainer._checkpointer = None
    return trainer


def poison(trainer, rows):
    """NaN in the embedding rows `rows` of the trainer's state."""
    import jax
    import jax.numpy as jnp

    p = trainer.state.params
    emb = p["embedder"]["embedding"]
    emb = jax.device_put(emb.at[rows].set(jnp.nan), emb.sharding)
    trainer.state = trainer.state.replace(params={**p, "embedder": {"embedding": emb}})


def test_a_non_finite_step_is_skipped_and_training_goes_on(trainer, tmp_path):
    import jax
    import numpy as np

    fresh(trainer, tmp_path)
    token = 7
    poison(trainer, token)
    batch = next(trainer.data)
    good = {k: np.where(v == token, token + 1, v) for k, v in batch.items()}
    bad = {k: v.copy() for k, v in good.items()}
    bad["inputs"][0, 0] = token
    before = jax.device_get(trainer.state.params)
    m = jax.device_get(trainer.step(bad))
    assert np.isnan(m["loss"]) and np.isnan(m["grad_norm"])
    after = jax.device_get(trainer.state)
    assert int(after.step) == 1  # the batch is consumed, the update is not applied
    jax.tree.map(np.testing.assert_array_equal, after.params, before)
    m = jax.device_get(trainer.step(good))
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
    assert not np.array_equal(jax.device_get(trainer.state.params["lm_head"]["kernel"]),
                              before["lm_head"]["kernel"])


@pytest.mark.slow  # the rule itself is checked in the default tier by test_a_non_finite_step_is_skipped_and_training_goes_on
def test_the_mpmd_executor_skips_a_non_finite_step_on_every_stage():
    import jax
    import numpy as np

    from hetjax.train import Trainer

    c = tiny_config(**{"model.d_model": 32, "model.d_ff": 64, "model.tie_embeddings": False,
                       "parallel.pp": 2, "parallel.dp": 4, "parallel.tp": 1,
                       "pipeline.stage_layers": (1, 1), "pipeline.executor": "mpmd",
                       "pipeline.microbatches": 1, "train.batch_size": 4,
                       "train.warmup_steps": 0})
    trainer = Trainer(c, quiet=True)
    token = 5
    natural = trainer.params
    emb = natural["embedder"]["embedding"]
    trainer.state = trainer.executor.from_natural_params(
        {**natural, "embedder": {"embedding": emb.at[token].set(np.nan)}})
    batch = next(trainer.data)
    good = {k: np.where(v == token, token + 1, v) for k, v in batch.items()}
    bad = {k: v.copy() for k, v in good.items()}
    bad["inputs"][0, 0] = token
    before = jax.device_get(trainer.params)
    m = jax.device_get(trainer.step(bad))
    assert np.isnan(m["loss"]) and np.isnan(m["grad_norm"])
    assert int(trainer.state.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.params), before)
    m = jax.device_get(trainer.step(good))
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
    after = jax.device_get(trainer.params)
    up = [x["layers"]["block"]["mlp"]["up"]["kernel"] for x in (before, after)]
    for layer in (0, 1):  # the layer of each stage trained again
        assert not np.array_equal(up[0][layer], up[1][layer])


def test_max_bad_steps_in_a_row_stop_the_run(trainer, tmp_path, capsys):
    from hetjax.errors import HetjaxError

    fresh(trainer, tmp_path, **{"train.max_bad_steps": 2, "checkpoint.every": 0})
    poison(trainer, slice(None))  # every batch is non-finite
    try:
        with pytest.raises(HetjaxError) as e:
            trainer.train()
    finally:
        fresh(trainer, tmp_path, **{"train.max_bad_steps": 3, "checkpoint.every": 2})
    assert str(e.value) == (
        "train.max_bad_steps: 2 steps in a row (1-2) had a non-finite loss or gradient norm; "
        f"training stopped, nothing of them was saved (checkpoints in {tmp_path}/checkpoints); "
        "fix: lower train.lr (= 0.003) or train.grad_clip (= 1), check model.vocab_size and the "
        "data, then rerun to resume from the latest checkpoint")
    assert capsys.readouterr().err.splitlines() == [
        "hetjax: step 1: loss nan, grad_norm nan: update skipped (1 in a row, "
        "train.max_bad_steps = 2)",
        "hetjax: step 2: loss nan, grad_norm nan: update skipped (2 in a row, "
        "train.max_bad_steps = 2)"]


def test_a_checkpoint_never_holds_a_non_finite_value(trainer, tmp_path):
    from hetjax.errors import HetjaxError

    fresh(trainer, tmp_path)
    trainer.save(wait=True)  # a good one first
    poison(trainer, 3)
    with pytest.raises(HetjaxError) as e:
        trainer.save(wait=True)
    assert str(e.value) == (
        "checkpoint 0: refusing to save a state with NaN/Inf values in params/embedder/embedding;"
        f" the latest good checkpoint in {tmp_path}/checkpoints is kept; fix: rerun to resume "
        "from it, with a lower train.lr")
    assert trainer.checkpointer.steps() == [0]


# --- corrupt checkpoints are set aside, the run resumes from the newest good one ---------------
@pytest.fixture(scope="module")
def saved_run(trainer, tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4, and its losses."""
    from hetjax.metrics import read_metrics

    workdir = tmp_path_factory.mktemp("saved")
    fresh(trainer, workdir).train()
    losses = [r["loss"] for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))]
    return str(workdir), losses


def _largest_array_file(step_dir):
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state"))
             for f in fs if os.sep + "d" + os.sep in os.path.join(r, f)]
    return max(files, key=os.path.getsize)


def _truncate(path, size=None):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2 if size is None else size)


# (what is broken, how, the step set aside, the part of the report in parentheses)
CORRUPTIONS = [
    ("a truncated array file", lambda d: _truncate(_largest_array_file(d + "/4")), 4,
     "Exception: Encountered error while reading array index: "),
    ("a truncated metadata file", lambda d: _truncate(d + "/4/state/_METADATA", 100), 4,
     "JSONDecodeError: "),
    ("a garbled meta item", lambda d: open(d + "/4/meta/metadata", "w").write("{bad"), 4,
     "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 "
     "(char 1)"),
    ("a junk step directory", lambda d: (os.makedirs(d + "/6"), open(d + "/6/x", "w").write(
        "junk")), 6, "KeyError: 'Item \"data\" was not found in the checkpoint. Available "
     "items: []'"),
]


@pytest.mark.parametrize("what,corrupt,step,detail", CORRUPTIONS,
                         ids=[c[0] for c in CORRUPTIONS])
def test_a_corrupt_checkpoint_is_set_aside_and_the_newest_good_one_restored(
        trainer, saved_run, tmp_path, capsys, what, corrupt, step, detail):
    import jax
    import numpy as np

    src, _ = saved_run
    shutil.copytree(os.path.join(src, "checkpoints"), tmp_path / "checkpoints")
    ckpt = str(tmp_path / "checkpoints")
    corrupt(ckpt)
    fresh(trainer, tmp_path)
    newest_good = 4 if step == 6 else 2
    assert trainer.restore() == newest_good
    err = capsys.readouterr().err.strip()
    prefix = f"hetjax: checkpoint {step} in {ckpt} cannot be read ({detail}"
    suffix = f"); moved aside to {step}.corrupt, trying the previous one ({newest_good})"
    assert err.startswith(prefix) and err.endswith(suffix) and "\n" not in err, err
    assert os.path.isdir(os.path.join(ckpt, f"{step}.corrupt"))
    assert trainer.checkpointer.steps() == ([2, 4] if step == 6 else [2])
    assert int(trainer.state.step) == newest_good
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(trainer.params)))


def test_a_checkpoint_of_another_model_is_an_error_and_stays_in_place(trainer, saved_run,
                                                                       tmp_path):
    import jax
    import jax.numpy as jnp

    from hetjax.errors import HetjaxError

    src, _ = saved_run
    ckpt = str(tmp_path / "checkpoints")
    shutil.copytree(os.path.join(src, "checkpoints"), ckpt)
    fresh(trainer, tmp_path)
    layout = trainer.layout()
    target = layout.natural_target()
    other = jax.ShapeDtypeStruct((7,), jnp.float32, sharding=target.step.sharding)
    layout.natural_target = lambda: target.replace(step=other)
    with pytest.raises(HetjaxError) as e:
        trainer.checkpointer.restore(layout)
    # found in the checkpoint's metadata, before orbax starts reading arrays (whose reads in
    # flight printed a traceback each after the error)
    assert str(e.value) == (
        f"checkpoint 4 in {ckpt} does not fit this model and optimizer (step: stored (), this "
        "model (7,)); resume with the model config it was written with (see its meta/ item) or "
        "use another workdir")
    assert trainer.checkpointer.steps() == [2, 4]


# --- preemption: SIGTERM saves the current step and exits with its own code -------------------
def test_sigterm_saves_the_current_step_and_the_rerun_continues_identically(trainer, saved_run,
                                                                           tmp_path):
    from hetjax.errors import Preempted
    from hetjax.metrics import read_metrics

    _, reference = saved_run
    fresh(trainer, tmp_path)
    # The signal arrives during step 3 as from a scheduler; checkpoints are every 2 steps.
    hook = trainer.add_hook(lambda info: os.kill(os.getpid(), signal.SIGTERM)
                            if info.step == 3 else None)
    try:
        with pytest.raises(Preempted) as e:
            trainer.train()
    finally:
        trainer.hooks.remove(hook)
    assert str(e.value) == (
        f"preempted (SIGTERM) after step 3: saved checkpoint 3 in {tmp_path}/checkpoints; "
        "rerun the same command to resume (exit code 75)")
    assert trainer.checkpointer.steps() == [2, 3]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back
    summary = fresh(trainer, tmp_path, tensorboard=True).train()
    trainer.config.tensorboard = False
    assert summary["resumed_from"] == 3
    rows = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["loss"] for r in rows] == reference
    # TensorBoard holds each step once, with the metrics file's values.
    assert tensorboard_scalars(tmp_path / "tensorboard", "train/loss") == \
        [(r["step"], pytest.approx(r["loss"])) for r in rows]


def tensorboard_scalars(tb_dir, tag):
    """(step, value) of `tag` in every event file under `tb_dir` (TFRecord framing)."""
    import struct

    from tensorboardX.proto import event_pb2

    out = []
    for name in sorted(os.listdir(tb_dir)):
        data = open(os.path.join(tb_dir, name), "rb").read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 16 + n
            out += [(event.step, v.simple_value) for v in event.summary.value if v.tag == tag]
    return sorted(out)


# --- never lose a run: every way a run stops resumes to the losses of an uninterrupted run ----
def _losses(workdir):
    from hetjax.metrics import read_metrics

    rows = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # each step once
    return [r["loss"] for r in rows]


def _stop_at(trainer, step, *signals):
    """A hook that sends `signals` to this process after `step`, as a scheduler or a user."""
    return trainer.add_hook(lambda info: [os.kill(os.getpid(), s) for s in signals]
                            if info.step == step else None)


def _train_expecting(trainer, error, hook=None):
    try:
        with pytest.raises(error) as e:
            trainer.train()
    finally:
        if hook is not None:
            trainer.hooks.remove(hook)
    return str(e.value)


@pytest.mark.slow  # (the SIGTERM save itself is the default tier's, with periodic checkpoints)
def test_sigterm_without_periodic_checkpoints_resumes_from_its_save(trainer, saved_run, tmp_path):
    from hetjax.errors import Preempted

    _, reference = saved_run
    fresh(trainer, tmp_path, **{"checkpoint.every": 0})
    try:
        message = _train_expecting(trainer, Preempted, _stop_at(trainer, 2, signal.SIGTERM))
        assert message.startswith("preempted (SIGTERM) after step 2: saved checkpoint 2 in ")
        summary = fresh(trainer, tmp_path, **{"checkpoint.every": 0}).train()
    finally:
        fresh(trainer, tmp_path, **{"checkpoint.every": 2})
    assert summary["resumed_from"] == 2
    assert _losses(tmp_path) == reference


def test_sigint_saves_the_current_step_and_exits_130(trainer, saved_run, tmp_path):
    from hetjax.errors import Interrupted

    _, reference = saved_run
    fresh(trainer, tmp_path)
    message = _train_expecting(trainer, Interrupted, _stop_at(trainer, 3, signal.SIGINT))
    assert message == (f"interrupted (SIGINT) after step 3: saved checkpoint 3 in "
                       f"{tmp_path}/checkpoints; rerun the same command to resume (exit code 130)")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    assert fresh(trainer, tmp_path).train()["resumed_from"] == 3
    assert _losses(tmp_path) == reference


def test_a_second_sigint_stops_at_once_and_names_the_lost_steps(trainer, saved_run, tmp_path):
    from hetjax.errors import Interrupted

    _, reference = saved_run
    fresh(trainer, tmp_path)
    hook = _stop_at(trainer, 3, signal.SIGINT, signal.SIGINT)
    message = _train_expecting(trainer, Interrupted, hook)
    assert message == ("interrupted (second SIGINT) after step 3, without saving: steps 3-3 are "
                       "lost; rerun the same command to resume from checkpoint 2 (exit code 130)")
    assert trainer.checkpointer.steps() == [2]
    assert not os.path.exists(tmp_path / "hetjax.lock")  # released however the run ends
    assert fresh(trainer, tmp_path).train()["resumed_from"] == 2
    assert _losses(tmp_path) == reference


@pytest.mark.parametrize("where", [pytest.param("metrics", marks=pytest.mark.slow), "checkpoint"])
def test_a_full_disk_is_one_error_and_the_rerun_loses_nothing(trainer, saved_run, tmp_path,
                                                              monkeypatch, where):
    """ENOSPC while writing a metrics row or a checkpoint (the writer patched to fail as on a
    full disk): one error naming the path and the kept checkpoint; the rerun resumes."""
    import errno

    from hetjax import checkpoint as hckpt
    from hetjax import metrics as hmetrics
    from hetjax.errors import HetjaxError

    _, reference = saved_run
    fresh(trainer, tmp_path)
    cls, name = ((hmetrics.MetricsWriter, "write") if where == "metrics"
                 else (hckpt.Checkpointer, "save"))
    real = getattr(cls, name)
    path = str(tmp_path / ("metrics.jsonl" if where == "metrics" else "checkpoints/4"))

    def full(self, step, *args, **kw):
        if step == (3 if where == "metrics" else 4):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(self, step, *args, **kw)

    monkeypatch.setattr(cls, name, full)
    message = _train_expecting(trainer, HetjaxError)
    assert message == (
        f"training stopped: {path}: No space left on device; fix: free space on the disk "
        f"holding {path} (or choose a path on another disk); then rerun the same command to "
        f"resume (checkpoint 2 in {tmp_path}/checkpoints is kept)")
    monkeypatch.setattr(cls, name, real)
    assert fresh(trainer, tmp_path).train()["resumed_from"] == 2
    assert _losses(tmp_path) == reference


@pytest.mark.root
@pytest.mark.slow  # the patched variant above runs in the default tier
def test_a_really_full_disk_is_one_error_and_the_rerun_loses_nothing(trainer, saved_run,
                                                                     tmp_path):
    """The same on a real full disk: the workdir is a small tmpfs, and after step 3 a file takes
    every free byte of it (root: mount). The write that fails is the library's own (a metrics
    row, orbax's checkpoint files); one line names the path, the earlier checkpoint is kept, and
    once space is freed the rerun loses nothing."""
    import subprocess

    from hetjax.errors import HetjaxError

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    _, reference = saved_run
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode:  # root without the right to mount (a container)
        pytest.skip(f"could not mount a tmpfs: {mounted.stderr.strip()}")
    try:
        fresh(trainer, disk)

        def fill(info):
            if info.step == 3:
                free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
                fd = os.open(disk / "filler", os.O_CREAT | os.O_WRONLY)
                os.posix_fallocate(fd, 0, free)
                os.close(fd)
                assert os.statvfs(disk).f_bavail == 0

        message = _train_expecting(trainer, HetjaxError, trainer.add_hook(fill))
        assert message.startswith("training stopped: ") and message.count("\n") == 0, message
        assert "No space left on device; fix: free space on the disk holding " in message
        assert message.endswith(f"(checkpoint 2 in {disk}/checkpoints is kept)"), message
        os.remove(disk / "filler")
        assert fresh(trainer, disk).train()["resumed_from"] == 2
        assert _losses(disk) == reference
    finally:
        fresh(trainer, tmp_path)  # nothing of the trainer holds a file on the tmpfs
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_torn_last_metrics_line_is_repaired_on_resume(trainer, saved_run, tmp_path, capsys):
    _, reference = saved_run
    fresh(trainer, tmp_path)
    trainer.train(steps=2)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "time": 17')  # killed mid-write
    summary = fresh(trainer, tmp_path).train()
    assert summary["resumed_from"] == 2
    assert capsys.readouterr().err == \
        f"hetjax: {tmp_path}/metrics.jsonl: repaired a torn last line\n"
    assert _losses(tmp_path) == reference


def test_rows_of_a_run_that_left_no_checkpoint_are_not_kept_twice(trainer, saved_run, tmp_path,
                                                                  capsys):
    _, reference = saved_run
    fresh(trainer, tmp_path, **{"checkpoint.every": 0})
    try:
        trainer.train(steps=3)  # then lost: no checkpoint
        fresh(trainer, tmp_path, **{"checkpoint.every": 0}).train()
    finally:
        fresh(trainer, tmp_path, **{"checkpoint.every": 2})
    assert capsys.readouterr().err == (
        f"hetjax: {tmp_path}/metrics.jsonl: dropped 3 rows after step 0 (not in a checkpoint; "
        "trained again now)\n")
    assert _losses(tmp_path) == reference


def test_a_diverging_run_stops_and_saves_nothing_of_it(trainer, tmp_path):
    """A loss far above the run's start (parameters blown up by a hook, as a too-large
    learning rate would) stops the run with an error; no checkpoint of it is written."""
    import jax

    from hetjax.errors import HetjaxError

    fresh(trainer, tmp_path, **{"checkpoint.every": 1})
    step = trainer.step

    def blow_up_in_step_2(*args):  # inside the step, as a DiLoCo outer step would
        metrics = step(*args)
        if int(trainer.state.step) == 2:
            trainer.state = trainer.state.replace(params=jax.tree.map(
                lambda x: x * 30.0, trainer.state.params))
        return metrics

    trainer.step = blow_up_in_step_2
    try:
        message = _train_expecting(trainer, HetjaxError)
        saved = trainer.checkpointer.steps()
    finally:
        del trainer.step
        fresh(trainer, tmp_path, **{"checkpoint.every": 2})
    assert message.startswith("train.max_loss_ratio: the run diverged: step 3's loss "), message
    assert message.endswith(
        f"(limit 4x); training stopped, checkpoint 2, whose parameters gave this loss, was "
        f"removed; nothing after the latest checkpoint was saved (checkpoints in {tmp_path}/"
        "checkpoints); fix: lower train.lr (= 0.003) or train.grad_clip (= 1), then rerun to "
        "resume from the latest checkpoint")
    assert saved == [1]


# (diloco.outer_lr, the error's words between "training stopped, " and the fix)
OUTER_BLOWUPS = [
    (1e30, "train.max_bad_steps: 3 steps in a row (3-5) had a non-finite loss or gradient norm;"
           " training stopped, checkpoint 2, whose parameters gave them, was removed; nothing of"
           " them was saved"),
    pytest.param(1000.0, "train.max_loss_ratio: the run diverged: step 3's loss {loss} is "
                 "{ratio}x its first loss {first} (limit 4x); training stopped, checkpoint 2, "
                 "whose parameters gave this loss, was removed; nothing after the latest "
                 "checkpoint was saved", marks=pytest.mark.slow)]


@pytest.mark.slow  # DiLoCo sites; test_a_diverging_run_stops... is the default tier's
@pytest.mark.parametrize("outer_lr, stopped", OUTER_BLOWUPS, ids=["non-finite", "diverged"])
def test_a_diloco_outer_lr_that_blows_up_is_blamed_and_leaves_no_checkpoint(tmp_path, outer_lr,
                                                                           stopped):
    """One-process DiLoCo, 2 sites, an exchange and a checkpoint every 2 steps: the outer step
    of step 2 blows the parameters up (to Inf-producing: every later update is skipped; or to a
    finite loss 30x the first). The run stops naming diloco.outer_lr, not train.lr, and no
    checkpoint of the blown-up parameters is left (checkpoint 2 was written after the outer
    step; step 4's, whose update was skipped, is not written)."""
    from hetjax.errors import HetjaxError
    from hetjax.metrics import read_metrics
    from hetjax.train import Trainer

    cfg = tiny_config(**{"topology.nodes": 1, "topology.devices_per_node": 2,
                         "diloco.inner_steps": 2, "diloco.outer_lr": outer_lr,
                         "train.batch_size": 8, "checkpoint.every": 2,
                         "checkpoint.async_save": False, "train.steps": 8,
                         "train.log_every": 1, "workdir": str(tmp_path)})
    trainer = Trainer(cfg, quiet=True)
    with pytest.raises(HetjaxError) as e:
        trainer.train()
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    loss, first = rows[2]["loss"], rows[0]["loss"]
    assert str(e.value) == stopped.format(loss=f"{loss:.4g}", ratio=f"{loss / first:.1f}",
                                          first=f"{first:.4g}") + (
        f" (checkpoints in {tmp_path}/checkpoints); fix: lower diloco.outer_lr (= {outer_lr:g})"
        " or diloco.outer_momentum (= 0.9): it came right after the outer step of step 2, then"
        " rerun to resume from the latest checkpoint")
    assert trainer.checkpointer.steps() == []


# (how the run stopped, what hetjax does, the test): the table "Never lose a run" in
# docs/reliability.md (`python tests/test_never_lose.py` prints it). Each test ends with a
# run whose losses equal an uninterrupted run's.
NEVER_LOSE = [
    ("SIGTERM, any `checkpoint.every` (also 0)",
     "saves the current step, exit 75; the rerun restores whatever checkpoint the directory "
     "holds", "test_sigterm_without_periodic_checkpoints_resumes_from_its_save"),
    ("SIGINT (Ctrl-C)",
     "the same, as `interrupted (SIGINT) after step N: saved checkpoint N ...`, exit 130",
     "test_sigint_saves_the_current_step_and_exits_130"),
    ("a second Ctrl-C",
     "stops at once without saving and names the lost steps: `interrupted (second SIGINT) "
     "after step 3, without saving: steps 3-3 are lost; rerun the same command to resume from "
     "checkpoint 2 (exit code 130)`",
     "test_a_second_sigint_stops_at_once_and_names_the_lost_steps"),
    ("Ctrl-C or SIGTERM at `hetjax launch`, or SIGTERM to every worker (a scheduler's "
     "preemption; several processes)",
     "the launcher writes a stop line on every worker's stdin (ssh carries it too), or each "
     "worker hears the signal itself; the workers agree on a step, each saves it (`[p0] hetjax: "
     "interrupted (SIGINT) after step 4: saved checkpoint 4 in ...`) and exits 130 (75 for "
     "SIGTERM), and so does the launcher, which waits for them rather than stopping them; a "
     "second Ctrl-C stops them at once",
     "test_ctrl_c_to_a_launch_saves_every_worker_and_the_rerun_loses_nothing"),
    ("SIGKILL",
     "nothing runs; the rerun takes the stale workdir lock over, cuts metrics.jsonl back to the "
     "checkpoint and trains on",
     "test_sigkill_then_rerun_takes_over_the_stale_lock_and_loses_nothing"),
    ("a full disk (ENOSPC writing a metrics row or a checkpoint)",
     "one line, `training stopped: <path>: No space left on device; fix: free space on the disk "
     "holding <path> (or choose a path on another disk); then rerun the same command to resume "
     "(checkpoint 2 in ... is kept)`; a save still in flight is drained without a second "
     "traceback (also on a real full tmpfs: test_a_really_full_disk_is_one_error_and_the_rerun_"
     "loses_nothing, root, slow)", "test_a_full_disk_is_one_error_and_the_rerun_loses_nothing"),
    ("killed while writing a metrics row",
     "the torn last line is dropped on resume (`repaired a torn last line`)",
     "test_a_torn_last_metrics_line_is_repaired_on_resume"),
]


def never_lose_table() -> str:
    rows = ["| how the run stopped | what hetjax does | test |", "|---|---|---|"]
    import test_launch_recovery
    import test_train_process

    tests = {**vars(test_launch_recovery), **vars(test_train_process), **globals()}
    for how, what, test in NEVER_LOSE:
        marks = getattr(tests[test], "pytestmark", [])
        cases = [len(m.args[1]) for m in marks if m.name == "parametrize"]
        note = (f" ({cases[0]} cases)" if cases else "") + (
            " (slow)" if any(m.name == "slow" for m in marks) else "")
        rows.append(f"| {how} | {what} | {test}{note} |")
    return "\n".join(rows)


def test_the_never_lose_table_in_the_docs_is_generated_from_its_tests():
    with open(os.path.join(REPO, "docs", "reliability.md")) as f:
        assert never_lose_table() in f.read()  # and every test it names exists


if __name__ == "__main__":
    print(never_lose_table())

"""`hetjax train` as a process: one run per workdir (the lock names its holder; a stale one is
taken over), SIGTERM to the process exits 75 with a checkpoint, and a SIGKILL's rerun loses
nothing (docs/reliability.md).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from test_never_lose import _losses


# --- one run per workdir ------------------------------------------------------------------------
def test_a_workdir_in_use_is_refused_naming_its_holder(tmp_path):
    import socket

    from hetjax.errors import HetjaxError
    from hetjax.lock import WorkdirLock

    holder = subprocess.Popen(["sleep", "60"])
    try:
        with open(tmp_path / "hetjax.lock", "w") as f:
            json.dump({"host": socket.gethostname(), "pid": holder.pid, "started":
                       "2026-01-01 10:00:00 UTC", "command": "hetjax train"}, f)
        with pytest.raises(HetjaxError) as e:
            WorkdirLock(str(tmp_path)).acquire()
        assert str(e.value) == (
            f"{tmp_path} is in use: a hetjax run is running there (pid {holder.pid} on "
            f"{socket.gethostname()}, started 2026-01-01 10:00:00 UTC: hetjax train); fix: wait "
            f"for it to end, use another --config.workdir, or, if that run is gone, delete "
            f"{tmp_path}/hetjax.lock")
    finally:
        holder.kill()
        holder.wait()


def test_a_stale_workdir_lock_is_taken_over_and_released(tmp_path, capsys):
    import socket

    from hetjax.lock import WorkdirLock

    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid is free now
    with open(tmp_path / "hetjax.lock", "w") as f:
        json.dump({"host": socket.gethostname(), "pid": gone.pid, "started": "then"}, f)
    with WorkdirLock(str(tmp_path)) as lock:
        assert lock.holder()["pid"] == os.getpid()
    assert capsys.readouterr().err == (
        f"hetjax: {tmp_path}/hetjax.lock: removing the stale lock of a run that is gone "
        f"(pid {gone.pid} on {socket.gethostname()}, started then: ?)\n")
    assert not os.path.exists(tmp_path / "hetjax.lock")


TINY_CLI = ["--config.model.d_model=64", "--config.model.n_layers=2", "--config.model.d_ff=128",
            "--config.model.max_seq_len=64", "--config.train.seq_len=16",
            "--config.train.batch_size=16", "--config.train.progress=False",
            "--config.data.source=synthetic", "--config.tensorboard=False",
            "--config.train.log_every=1", "--config.eval.every=0"]


@pytest.mark.slow
def test_sigterm_to_hetjax_train_exits_75_with_a_checkpoint(tmp_path):
    from hetjax.metrics import read_metrics

    metrics = tmp_path / "metrics.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetjax", "train", *TINY_CLI, "--config.train.steps=100000",
         "--config.checkpoint.every=100000", f"--config.workdir={tmp_path}"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(read_metrics(str(metrics))) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=300)
    finally:
        proc.kill()
    last = proc.stderr.read().strip().splitlines()[-1]
    step = int(last.split("after step ")[1].split(":")[0])
    assert rc == 75, last
    assert last == (f"hetjax: preempted (SIGTERM) after step {step}: saved checkpoint {step} in "
                    f"{tmp_path}/checkpoints; rerun the same command to resume (exit code 75)")
    assert os.path.isdir(tmp_path / "checkpoints" / str(step))


@pytest.mark.slow
def test_sigkill_then_rerun_takes_over_the_stale_lock_and_loses_nothing(tmp_path):
    """`hetjax train` killed with SIGKILL (no handler runs: the lock stays, metrics.jsonl
    holds steps past the latest checkpoint); the rerun takes the stale lock over, cuts the
    metrics back and ends with an uninterrupted run's losses."""
    from hetjax.metrics import read_metrics

    def train(workdir, **popen):
        return subprocess.Popen(
            [sys.executable, "-m", "hetjax", "train", *TINY_CLI, "--config.train.steps=6",
             "--config.checkpoint.every=2", "--config.checkpoint.async_save=False",
             f"--config.workdir={workdir}"], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)

    reference = train(tmp_path / "reference")
    assert reference.wait(timeout=600) == 0, reference.stderr.read()
    workdir = tmp_path / "killed"
    metrics = workdir / "metrics.jsonl"
    proc = train(workdir)
    try:
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(read_metrics(str(metrics))) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        proc.kill()
    finally:
        proc.kill()
        proc.wait()
    assert os.path.exists(workdir / "hetjax.lock")
    rerun = train(workdir)
    assert rerun.wait(timeout=600) == 0
    err = rerun.stderr.read()
    assert f"hetjax: {workdir}/hetjax.lock: removing the stale lock of a run that is gone " \
        f"(pid {proc.pid} on " in err, err
    assert _losses(workdir) == _losses(tmp_path / "reference")
    assert not os.path.exists(workdir / "hetjax.lock")

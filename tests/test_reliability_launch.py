"""A worker of a launched job killed with SIGKILL: the launcher names it before anything else,
the survivors' tracebacks (their collectives broke off with "Connection reset by peer") are
not forwarded, and a survivor stuck in a collective, where its signal handlers cannot run,
stops at once rather than after the launcher's grace period."""

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO
from hetjax import supervise

# A survivor: it reads the launcher's stop lines as a worker does, its traceback reaches the
# launcher just before the peer's death does, and it then sits where no SIGTERM handler runs
# (SIGTERM ignored, as a main thread blocked in a gloo collective never runs the handler).
SURVIVOR = """
import signal, sys, time
from hetjax import stopping
stopping.listen()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.stderr.write('''Traceback (most recent call last):
  File "hetjax/train.py", line 1, in step
jax.errors.JaxRuntimeError: INTERNAL: Gloo collective permute failed: Connection reset by peer
--------------------
For simplicity, JAX has removed its internal frames from the traceback.
''')
sys.stderr.flush()
open(sys.argv[1], "w").close()  # the peer dies now: the traceback arrived just before
time.sleep(120)
"""


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_a_killed_worker_is_named_first_and_a_stuck_survivor_stops_at_once(tmp_path):
    """(before: the survivor's traceback came first, and it ran on until the SIGKILL after
    --grace)"""
    out = io.StringIO()
    env = {**os.environ, "PYTHONPATH": REPO}
    ready = str(tmp_path / "ready")
    start = time.monotonic()
    rc = supervise.run([
        ("p0", (sys.executable, "-c", SURVIVOR, ready), env),
        ("p1", (sys.executable, "-c", "import os, sys, time\n"
                "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
                "os.kill(os.getpid(), 9)", ready), env),
    ], grace=8, out=out)
    text = out.getvalue()
    assert rc == 137, text
    assert time.monotonic() - start < 8, text  # never waited out the grace period
    assert "Traceback" not in text and "Connection reset" not in text, text
    assert re.search(r"hetjax launch: p1 \(pid \d+\) was killed by SIGKILL; stopping p0\n", text)
    assert "still running" not in text and "sending SIGKILL" not in text, text
    assert "hetjax launch: hid the traceback of p0: its collective broke off when p1 failed " \
           "(--verbose shows it)" in text
    assert text.rstrip().endswith("hetjax launch: failed: p1 was killed by SIGKILL first")


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_the_failed_workers_own_traceback_is_shown_before_the_launchers_line():
    out = io.StringIO()
    rc = supervise.run([
        ("p0", (sys.executable, "-c", "import time; time.sleep(60)"), None),
        ("p1", (sys.executable, "-c", "raise ValueError('bad batch')"), None),
    ], grace=2, out=out)
    text = out.getvalue()
    assert rc == 1, text
    lines = text.splitlines()
    tb = lines.index("[p1] Traceback (most recent call last):")
    error = lines.index("[p1] ValueError: bad batch")  # its last line, then the launcher's
    assert tb < error and lines[error + 1].startswith("hetjax launch: p1 (pid "), text


LAUNCH_TINY = ["--config.model.d_model=32", "--config.model.n_layers=2",
               "--config.model.d_ff=64", "--config.model.max_seq_len=64",
               "--config.train.seq_len=16", "--config.train.batch_size=16",
               "--config.train.steps=100000", "--config.train.log_every=1",
               "--config.train.progress=False", "--config.data.source=synthetic",
               "--config.tensorboard=False", "--config.parallel.pp=1", "--config.parallel.dp=0",
               "--config.parallel.tp=1", "--config.train.microbatches=1",
               "--config.eval.every=0"]


@pytest.mark.slow
def test_sigkill_of_a_launched_worker_ends_the_job_cleanly_and_promptly(tmp_path):
    """`hetjax launch --local 2`, p1 SIGKILLed after step 3 was logged: the launcher's line
    is the first about it, no traceback of p0 is forwarded, and p0 (in a gloo collective with
    the dead p1) is gone well inside --grace 20 (before: 10 s of ignored SIGTERM, then SIGKILL)."""
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetjax", "launch", "--local", "2", "--grace", "20", "--timeout",
         "300", *LAUNCH_TINY, f"--config.workdir={workdir}"], cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            rows = workdir / "metrics.jsonl"
            if rows.exists() and len(rows.read_text().splitlines()) >= 3:
                break
            time.sleep(0.5)
        p1 = int(next(line for line in lines if "started p1" in line).split("pid ")[1][:-2])
        os.killpg(p1, signal.SIGKILL)
        killed = time.monotonic()
        rc = proc.wait(timeout=120)
        took = time.monotonic() - killed
    finally:
        proc.kill()
    reader.join(timeout=5)
    text = "".join(lines)
    assert rc == 137, text[-4000:]
    after = text.split("was killed by SIGKILL; stopping p0")
    assert len(after) == 2, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    assert "still running" not in after[1], text[-4000:]
    assert took < 15, (took, text[-4000:])

"""The launcher's supervisor (`hetjax.supervise`): it stops every child when one fails and
returns the first failure, prefixes and filters their output, and leaves no orphan behind
(the heartbeat and stop-line tests are in test_launch_recovery.py)."""

import io
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO
from hetjax import supervise
from test_launch import worker_env


def _python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


# JAX (imported by other tests in this process) warns about any fork; the launcher process
# itself never imports JAX, and its children exec right after the fork.
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_supervisor_stops_everyone_and_returns_the_first_failure():
    out = io.StringIO()
    start = time.monotonic()
    rc = supervise.run([
        ("p0", _python("import time; time.sleep(120)"), None),
        # Ignores SIGTERM, like a worker stuck in a collective: needs the SIGKILL.
        ("p1", _python("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                       "print('ready', flush=True); time.sleep(120)"), None),
        ("p2", _python("import time; print('bye', flush=True); time.sleep(1); raise "
                       "SystemExit(3)"), None),
    ], grace=2, out=out)
    text = out.getvalue()
    assert rc == 3, text
    assert time.monotonic() - start < 30
    assert "[p2] bye" in text and "[p1] ready" in text
    assert re.search(r"p2 \(pid \d+\) exited with code 3; stopping p0, p1", text)
    assert "p1 still running 2 s after SIGTERM; sending SIGKILL" in text
    assert "failed: p2 exited with code 3 first" in text
    assert supervise.run([("ok", _python("pass"), None)], grace=1, out=io.StringIO()) == 0
    slow = io.StringIO()
    assert supervise.run([("p0", _python("import time; time.sleep(60)"), None)], grace=1,
                      timeout=1, out=slow) == 124
    assert "ran longer than --timeout 1 s" in slow.getvalue()


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_gloo_connection_lines_are_hidden_even_interleaved_and_counted_truly():
    """gloo's per-rank lines arrive cut and mixed from its threads; every line made only of
    them is hidden, the count says how many lines that was, --verbose shows them, and a line
    with anything else in it is kept."""
    garbled = [
        "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks "
        "is : 1",
        "[Gloo] Rank [Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected "
        "peer ranks is : 1",
        "0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
        "[Gloo] Rank ",
    ]
    kept = "step 1: loss 5.0 (Rank 0 is ready)"
    code = ("import sys\n" + "".join(f"print({line!r}, file=sys.stderr, flush=True)\n"
                                     for line in garbled) + f"print({kept!r}, flush=True)\n")
    quiet, loud = io.StringIO(), io.StringIO()
    assert supervise.run([("p0", _python(code), None)], grace=1, out=quiet) == 0
    assert supervise.run([("p0", _python(code), None)], grace=1, out=loud, verbose=True) == 0
    assert "Gloo" not in quiet.getvalue() and "peer ranks" not in quiet.getvalue()
    assert f"[p0] {kept}" in quiet.getvalue()
    assert f"hid {len(garbled)} gloo connection lines (--verbose shows them)" in quiet.getvalue()
    assert loud.getvalue().count("[p0] ") == len(garbled) + 1 and "hid " not in loud.getvalue()


def test_children_die_with_a_killed_launcher(tmp_path):
    """SIGKILL to the launcher leaves no orphan: its children get SIGKILL too."""
    pidfile = tmp_path / "child.pid"
    code = ("import sys; from hetjax import supervise; supervise.run([('p0', (sys.executable, '-c', "
            f"\"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
            "time.sleep(120)\"), None)], grace=1)")
    launcher = subprocess.Popen([sys.executable, "-c", code], env=worker_env(), cwd=REPO,
                                stdout=subprocess.DEVNULL)
    child = None
    try:
        deadline = time.monotonic() + 30
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        child = int(pidfile.read_text())
        launcher.kill()
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{child}")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if child and os.path.exists(f"/proc/{child}"):  # only when the test failed
            os.kill(child, 9)


def test_children_start_without_a_preexec_fn(monkeypatch):
    """A preexec_fn forces a full fork() of the launcher, which failed with ENOMEM in CI when the
    launcher was a large JAX process (a pytest worker); without one Python uses vfork()."""
    from hetjax import supervise

    seen = []
    popen = subprocess.Popen

    def spy(*args, **kwargs):
        seen.append(kwargs.get("preexec_fn"))
        return popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spy)
    assert supervise.run([("p0", (sys.executable, "-c", "pass"), None)], grace=1) == 0
    assert seen == [None]

"""A launched job recovers: `hetjax launch --max-restarts` restarts a failed job, `--elastic`
drops the failed host and re-plans, a hung worker is named (not the healthy peer that noticed),
the workers agree on the step to stop at, and Ctrl-C or SIGTERM to the launcher saves every
worker so the rerun loses nothing (docs/reliability.md, docs/launch.md).
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO


# --- hetjax launch --max-restarts ---------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_launch_restarts_a_failed_job_up_to_max_restarts(tmp_path):
    import io

    from hetjax import supervise

    marker = tmp_path / "attempts"
    # p1 dies by SIGKILL on the first two attempts (like a lost worker), then succeeds.
    code = (f"import os, pathlib; p = pathlib.Path({str(marker)!r}); n = len(p.read_text()) "
            "if p.exists() else 0; p.write_text('x' * (n + 1)); "
            "os.kill(os.getpid(), 9) if n < 2 else None")
    children = lambda _: [("p0", (sys.executable, "-c", "pass"), None),  # noqa: E731
                        ("p1", (sys.executable, "-c", code), None)]
    out = io.StringIO()
    assert supervise.run_with_restarts(children, grace=1, max_restarts=2, out=out) == 0
    assert marker.read_text() == "xxx"
    restarts = [line for line in out.getvalue().splitlines() if "restarting" in line]
    assert restarts == [
        f"hetjax launch: restarting the job ({k} of --max-restarts 2) after exit code 137; it "
        "resumes from its latest checkpoint" for k in (1, 2)]
    marker.unlink()
    assert supervise.run_with_restarts(children, grace=1, max_restarts=1, out=io.StringIO()) == 137
    # A user error (exit 2) or a preemption (75) is not retried.
    for rc in (2, 75):
        out = io.StringIO()
        once = lambda _, rc=rc: [  # noqa: E731
            ("p0", (sys.executable, "-c", f"raise SystemExit({rc})"), None)]
        assert supervise.run_with_restarts(once, grace=1, max_restarts=3, out=out) == rc
        assert "restarting" not in out.getvalue()


def test_an_elastic_restart_drops_the_failed_host_and_re_plans(tmp_path, capsys):
    from hetjax import config as hconfig
    from hetjax import launch

    argv = ["--local", "4", "--max-restarts", "1", "--elastic", "--config.train.batch_size=24",
            f"--config.workdir={tmp_path}"]
    args, config_args = launch.parser().parse_known_args(argv)
    cfg = hconfig.load_config(None, config_args)
    workers = launch.elastic_workers(cfg, args, config_args, ["p2"])
    assert len(workers) == 3
    topology = hconfig.build_topology(cfg).without_nodes([2])
    assert [(c.name, c.nodes) for c in topology.clusters] == [("ib", 2), ("roce", 1)]
    with open(tmp_path / "elastic_topology.json") as f:
        assert f.read() == topology.to_json(indent=1)
    assert f"--config.topology.file={tmp_path}/elastic_topology.json" in workers[0].argv
    out = capsys.readouterr().out
    assert out.startswith("hetjax launch: --elastic: dropped p2; re-planned on 6 devices:\n")
    import re

    pp, dp, tp = map(int, re.search(r"plan \(planner\): pp=(\d+) dp=(\d+) tp=(\d+)", out).groups())
    assert pp * dp * tp == 6
    # A second failure (p0 of the three) leaves the roce node alone with its cluster.
    assert len(launch.elastic_workers(cfg, args, config_args, ["p2", "p0"])) == 2


# --- a hung worker is named, not the healthy peer that noticed -------------------------------
def _beating_children(tmp_path):
    """Two children that beat like workers (`start_heartbeat`) and wait; each writes its pid."""
    code = ("import os, sys, time; from hetjax.worker import start_heartbeat; start_heartbeat(); "
            f"open(os.path.join({str(tmp_path)!r}, sys.argv[1] + '.pid'), 'w')"
            ".write(str(os.getpid())); time.sleep(120)")
    env = {**os.environ, "PYTHONPATH": REPO, "HETJAX_HEARTBEAT": "1"}
    return [(name, (sys.executable, "-c", code, name), env) for name in ("p0", "p1")]


def _launch_in_thread(tmp_path, **kw):
    import io
    import threading

    from hetjax import supervise

    out, failed, result = io.StringIO(), [], []
    thread = threading.Thread(target=lambda: result.append(supervise.run(
        _beating_children(tmp_path), grace=1, out=out, failed=failed, **kw)))
    thread.start()
    deadline = time.monotonic() + 120
    pids = {}
    while len(pids) < 2:
        assert time.monotonic() < deadline, out.getvalue()
        for name in ("p0", "p1"):
            path = tmp_path / f"{name}.pid"
            if path.exists() and path.read_text():
                pids[name] = int(path.read_text())
        time.sleep(0.2)
    return thread, out, failed, result, pids


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_a_stopped_worker_is_blamed_not_the_peer_that_aborted(tmp_path):
    """`kill -STOP` p1; p0 then aborts (as JAX's heartbeat check does in the healthy
    coordinator): the launcher names p1, so --elastic drops p1's host."""
    thread, out, failed, result, pids = _launch_in_thread(tmp_path)
    os.kill(pids["p1"], signal.SIGSTOP)
    time.sleep(6)  # > STALLED_AFTER_S: p1's heartbeat is stale, p0's fresh
    os.kill(pids["p0"], signal.SIGABRT)
    thread.join(timeout=60)
    log = out.getvalue()
    assert result == [1] and failed == ["p1"], log
    assert "hetjax launch: failed: p1 stopped making progress first" in log
    stop = [line for line in log.splitlines() if "stopped making progress (no heartbeat" in line]
    assert len(stop) == 1 and stop[0].startswith(
        f"hetjax launch: p1 (pid {pids['p1']}) stopped making progress (no heartbeat for "), log
    assert stop[0].endswith(", then p0 was killed by SIGABRT; stopping p1"), log


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_a_stopped_worker_stops_the_job_after_the_heartbeat_timeout(tmp_path):
    thread, out, failed, result, pids = _launch_in_thread(tmp_path, hang_timeout=5)
    os.kill(pids["p1"], signal.SIGSTOP)
    thread.join(timeout=60)
    log = out.getvalue()
    assert result == [1] and failed == ["p1"], log
    assert f"hetjax launch: p1 (pid {pids['p1']}) stopped making progress: no heartbeat for " \
        in log and "(--heartbeat-timeout 5); stopping p0, p1" in log, log


def test_heartbeats_of_srun_tasks_are_read_from_their_labels():
    """srun carries every task's output in one stream, each line after its `--label`: the
    launcher takes each task's heartbeat from it, names the task that stopped beating (p1),
    and joins again a line a heartbeat cut before its newline."""
    import io

    from hetjax import supervise

    code = ("import sys, time\n"
            "w = sys.stderr.write\n"
            "w('0: training' + '\\n'); w('0: cut <hetjax heartbeat>' + '\\n'); w('0: ' + '\\n')\n"
            "for i in range(60):\n"
            "    w('0: <hetjax heartbeat>\\n' + ('1: <hetjax heartbeat>\\n' if i < 2 else ''))\n"
            "    sys.stderr.flush(); time.sleep(0.5)\n")
    out, failed = io.StringIO(), []
    rc = supervise.run([("srun", (sys.executable, "-c", code), None)], grace=1, out=out,
                    failed=failed, hang_timeout=3, labelled=True)
    log = out.getvalue()
    assert rc == 1 and failed == ["p1"], log
    assert "hetjax launch: p1 (srun task 1) stopped making progress: no heartbeat for " in log
    assert "[srun] 0: training\n[srun] 0: cut \n" in log and "heartbeat>" not in log, log


class _FakeKeyValueStore:
    """jax.distributed's key-value client as `hetjax.stopping` uses it, in memory."""

    def __init__(self):
        import threading

        self.values, self.changed = {}, threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.changed:
            assert allow_overwrite or key not in self.values, key
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_in_ms / 1e3):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]


def _stop_flags(monkeypatch, n: int, answering: int, start: int):
    """`answering` StopFlags of an `n`-process job at step `start`, on one fake store."""
    import jax
    from jax._src import distributed

    from hetjax import stopping

    store = _FakeKeyValueStore()
    monkeypatch.setattr(distributed.global_state, "client", store)
    monkeypatch.setattr(jax, "process_count", lambda: n)
    flags = []
    for me in range(answering):
        monkeypatch.setattr(jax, "process_index", lambda me=me: me)
        stopping._generation[0] = 0  # each process counts its own train() calls
        flags.append(stopping.StopFlag(start))
    return flags


def test_the_processes_agree_on_the_step_after_the_furthest_one(monkeypatch):
    """Process 1 hears the stop (the launcher's line) while process 0 is a step ahead: both
    stop at the step after the furthest process's, so neither has passed it."""
    flags = _stop_flags(monkeypatch, n=2, answering=2, start=5)
    try:
        assert not flags[0].due(7) and not flags[1].due(6)
        flags[1].request("SIGINT")
        deadline = time.monotonic() + 10
        while not all(flag.stop_step for flag in flags):  # the daemon threads answer
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert [flag.stop_step for flag in flags] == [8, 8]
        assert not flags[1].due(7) and flags[1].due(8) and flags[0].due(8)
        assert flags[0].signal == flags[1].signal == "SIGINT"
    finally:
        for flag in reversed(flags):  # each put back the handler the one before it set
            flag.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_process_that_never_answers_ends_the_wait_with_no_agreement(monkeypatch):
    from hetjax.stopping import NoAgreement

    monkeypatch.setenv("HETJAX_HEARTBEAT_TIMEOUT", "1")
    flags = _stop_flags(monkeypatch, n=3, answering=2, start=0)  # process 2 is stopped
    try:
        flags[0].request("SIGINT")
        deadline = time.monotonic() + 10
        with pytest.raises(NoAgreement, match="not every process answered the stop request "
                                              "within 1 s"):
            for step in range(1, 10**6):  # until its daemon thread has heard the request
                assert not flags[1].due(step) and time.monotonic() < deadline
                time.sleep(0.01)
    finally:
        for flag in reversed(flags):  # each put back the handler the one before it set
            flag.restore()


@pytest.mark.parametrize("sig, word, rc", [(signal.SIGINT, "interrupted", 130),
                                           (signal.SIGTERM, "preempted", 75)],
                         ids=["SIGINT", "SIGTERM"])
def test_the_launcher_passes_ctrl_c_and_sigterm_on_as_a_stop_line(tmp_path, sig, word, rc):
    """`supervise.run` in its own process, two children that answer the stop line as workers do
    (save, exit 130 for Ctrl-C, 75 for SIGTERM): the launcher tells both, waits for them and
    exits with their code; nothing is counted as a failure."""
    import threading

    child = ("import sys; print('ready', flush=True); line = sys.stdin.readline(); "
             "print('got', line.strip(), flush=True); "
             "raise SystemExit(75 if 'SIGTERM' in line else 130)")
    code = ("import sys; from hetjax import supervise; sys.exit(supervise.run([(n, (sys.executable, "
            f"'-c', {child!r}), None) for n in ('p0', 'p1')], grace=5))")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": REPO}, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(launcher.stdout.readline, "")))
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while sum(line.endswith("] ready\n") for line in lines) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, lines
            time.sleep(0.05)
        launcher.send_signal(sig)
        assert launcher.wait(timeout=60) == rc, lines
    finally:
        launcher.kill()
        reader.join()
    how = "interrupted" if sig == signal.SIGINT else "preempted (SIGTERM)"
    assert f"hetjax launch: {how}: asking p0, p1 to save the step they agree on and stop" \
        in "".join(lines)
    assert sorted(line for line in lines if "] got " in line) == [
        f"[p{i}] got hetjax: stop {sig.name}\n" for i in (0, 1)]
    assert lines[-1] == (f"hetjax launch: {word}; the workers stopped as they said above; rerun "
                         "the same command to resume\n")
    assert not any("failed" in line for line in lines)


def _launched(args: list[str], cwd=REPO, path: str | None = None):
    """`hetjax launch *args` in the background: (process, its output lines so far)."""
    import threading

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO
    if path:
        env["PATH"] = path + os.pathsep + env["PATH"]
    proc = subprocess.Popen([sys.executable, "-m", "hetjax", "launch", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                     daemon=True).start()
    return proc, lines


def _wait_for_rows(proc, lines, metrics, n: int, timeout: float = 300) -> None:
    from hetjax.metrics import read_metrics

    deadline = time.monotonic() + timeout
    while not (metrics.exists() and len(read_metrics(str(metrics))) >= n):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.1)


# The launched jobs' model: tiny, on the default topology's 8 CPU devices (2 processes x 4).
LAUNCH_TINY = ["--config.model.d_model=32", "--config.model.n_layers=2",
               "--config.model.n_heads=4", "--config.model.n_kv_heads=2",
               "--config.model.d_ff=64", "--config.model.max_seq_len=64",
               "--config.train.seq_len=16", "--config.train.batch_size=16",
               "--config.train.warmup_steps=1", "--config.train.log_every=1",
               "--config.train.progress=False", "--config.data.source=synthetic",
               "--config.tensorboard=False", "--config.parallel.pp=1", "--config.parallel.dp=0",
               "--config.parallel.tp=1", "--config.train.microbatches=1", "--config.eval.every=0"]


FAKE_SSH = """#!/bin/sh
# A stand-in for ssh: run the remote command (the last argument) on this machine.
for last; do :; done
exec sh -c "$last"
"""


@pytest.mark.slow
def test_a_worker_stopped_over_ssh_is_named_and_dropped_by_elastic(tmp_path):
    """`hetjax launch --hostfile` through an ssh on PATH that runs the command here; after
    training has begun, `kill -STOP` p1 (its whole remote session, as a frozen host). The
    launcher reads the heartbeats from ssh's stderr, names p1 (not p0, whose JAX heartbeat
    check aborts it), and --elastic restarts without p1's host; the run completes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1\nlocalhost\n")
    workdir = tmp_path / "run"
    from test_launch import free_port

    proc, lines = _launched(
        ["--hostfile", str(hosts), "--port", str(free_port()), "--max-restarts", "1",
         "--elastic", "--heartbeat-timeout", "10", "--grace", "2", "--timeout", "400",
         *LAUNCH_TINY, "--config.train.steps=24", "--config.checkpoint.every=2",
         f"--config.workdir={workdir}"], path=str(bin_dir))
    try:
        _wait_for_rows(proc, lines, workdir / "metrics.jsonl", 2)
        started = next(line for line in lines if line.startswith("hetjax launch: started p1 "))
        p1 = int(started.split("(pid ")[1].rstrip(")\n"))
        os.killpg(p1, signal.SIGSTOP)  # ssh and the worker it runs: that host froze
        rc = proc.wait(timeout=500)
    finally:
        proc.kill()
    log = "".join(lines)
    assert rc == 0, log[-6000:]
    assert f"hetjax launch: p1 (pid {p1}) stopped making progress" in log, log[-6000:]
    assert "hetjax launch: failed: p1 stopped making progress first" in log
    assert "hetjax launch: --elastic: dropped p1; re-planned on 4 devices" in log
    assert "dropped p0" not in log and "failed: p0" not in log
    from hetjax.metrics import read_metrics

    assert [r["step"] for r in read_metrics(str(workdir / "metrics.jsonl"))] == list(
        range(1, 25))


@pytest.mark.slow
@pytest.mark.parametrize("target, sig", [("launcher", signal.SIGINT), ("workers", signal.SIGTERM)],
                         ids=["ctrl-c-to-the-launcher", "sigterm-to-every-worker"])
def test_ctrl_c_to_a_launch_saves_every_worker_and_the_rerun_loses_nothing(tmp_path, target,
                                                                           sig):
    """SIGINT to `hetjax launch --local 2` (what Ctrl-C sends it), or SIGTERM to both workers
    themselves (what a scheduler sends every task when it preempts the job): both workers agree
    on a step, save it and exit (130, 75; with `checkpoint.every=0`, nothing else is saved);
    the rerun resumes from it, and the losses equal an uninterrupted run's."""
    import re

    from hetjax.metrics import read_metrics

    args = ["--local", "2", "--timeout", "400", *LAUNCH_TINY, "--config.train.steps=12",
            "--config.checkpoint.every=0"]
    reference, lines = _launched([*args, f"--config.workdir={tmp_path / 'reference'}"])
    assert reference.wait(timeout=500) == 0, "".join(lines)
    workdir = tmp_path / "run"
    proc, lines = _launched([*args, f"--config.workdir={workdir}"])
    try:
        _wait_for_rows(proc, lines, workdir / "metrics.jsonl", 2)
        if target == "launcher":
            proc.send_signal(sig)
        else:
            for pid in re.findall(r"hetjax launch: started p\d \(pid (\d+)\)", "".join(lines)):
                os.kill(int(pid), sig)
        rc = proc.wait(timeout=300)
    finally:
        proc.kill()
    log = "".join(lines)
    assert rc == (130 if sig == signal.SIGINT else 75), log[-6000:]
    how = "interrupted (SIGINT)" if sig == signal.SIGINT else "preempted (SIGTERM)"
    saved = [line for line in lines if f"hetjax: {how} after step " in line]
    assert len(saved) == 2, log[-6000:]  # both workers
    step = int(saved[0].split("after step ")[1].split(":")[0])
    assert all(f"saved checkpoint {step} in {workdir}/checkpoints" in line for line in saved)
    assert step < 12 and sorted(os.listdir(workdir / "checkpoints")) == [str(step), "tokenizer"]
    if target == "launcher":
        assert "hetjax launch: interrupted: asking p0, p1 to save the step they agree on" in log
    else:
        assert re.search(r"hetjax launch: p[01] was preempted \(SIGTERM\) and saved", log), log
        assert "failed" not in log and "restarting" not in log
    rerun, lines = _launched([*args, f"--config.workdir={workdir}"])
    assert rerun.wait(timeout=500) == 0, "".join(lines)
    assert any(f"resumed from checkpoint {step}" in line for line in lines), "".join(lines)
    ours = [r["loss"] for r in read_metrics(str(workdir / "metrics.jsonl"))]
    want = [r["loss"] for r in read_metrics(str(tmp_path / "reference" / "metrics.jsonl"))]
    assert len(ours) == 12 and ours == pytest.approx(want, rel=1e-6)

"""The launcher's supervisor: runs the processes `hetjax launch` planned and watches them.

Each line a process prints (stdout and stderr read apart, so a library's C++ log line never
lands inside a Python one) is prefixed with its id; third-party noise (gloo's per-rank
connection lines, `is_noise`) is hidden unless `--verbose`; when one process fails, the others
get SIGTERM and, after `--grace` seconds, SIGKILL (a peer may sit in a collective with the dead
one forever); the exit code is the first failure's. `run_with_restarts` then starts the job
again (it resumes from its checkpoint) up to `--max-restarts` times.

Which process failed is decided by progress, not by the first exit code: each worker writes a
heartbeat line (`hetjax.worker.HEARTBEAT`) to its stderr every second, and the supervisor takes
it out of the output it already reads -- through the pipe of a local worker, ssh's
stdout/stderr of a remote one, or srun's `--label`led stream (the label names the task). A
worker that stops stops beating; its healthy peers keep beating while they wait for it in a
collective, until JAX's own heartbeat check aborts one of them. The supervisor blames the
worker whose heartbeat stopped -- also when a peer's abort is the first exit -- and stops the
job itself once a heartbeat is `--heartbeat-timeout` seconds old, so `--elastic` drops the host
that hung, not the coordinator that noticed.

Ctrl-C (SIGINT) or SIGTERM to the launcher reaches every worker as a stop line on its stdin
(what ssh and srun forward); the workers agree on a step to stop at (`hetjax.stopping`), each
saves it, and the launcher waits for them (a second signal stops them at once). SIGTERM sent
to the workers themselves -- a scheduler preempting or cancelling the job signals every task --
does the same: the first worker to exit 75 (or 130) after saving tells the launcher that the
job is stopping, and it waits for the others to save the same step instead of stopping them.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

from hetjax import stopping
from hetjax.errors import HetjaxError
from hetjax.worker import HEARTBEAT, HEARTBEAT_DONE


_HEARTBEAT_RE = re.compile(f"{re.escape(HEARTBEAT_DONE)}|{re.escape(HEARTBEAT)}")
# srun --label puts the task number before each line of a task's output.
_SRUN_LABEL = re.compile(r"^\s*(\d+): ")
# A heartbeat this old means the worker has stopped (a live one beats every second).
STALLED_AFTER_S = 4.0
# Children start through this small exec wrapper rather than a `preexec_fn`: a `preexec_fn`
# forces a real fork() of the launcher, which fails with ENOMEM when the launcher is a large
# JAX process (a notebook, a pytest worker) on a machine without much free memory; without it
# Python uses vfork(). The wrapper asks for SIGKILL when its parent dies (kept across exec),
# then checks the parent is still the launcher (it may have died before prctl ran).
_ORPHAN_GUARD = ("import ctypes, os, sys\n"
                 "ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
                 "if os.getppid() != int(sys.argv[1]): sys.exit(137)\n"
                 "try: os.execvp(sys.argv[2], sys.argv[2:])\n"
                 "except OSError as e: sys.exit(f'could not start {sys.argv[2]!r}: {e.strerror}')\n")


def _guarded(argv: tuple[str, ...]) -> tuple[str, ...]:
    """`argv` run so that it gets SIGKILL if the launcher dies, so nothing is orphaned."""
    if not sys.platform.startswith("linux"):
        return argv
    return (sys.executable, "-S", "-c", _ORPHAN_GUARD, str(os.getpid()), *argv)


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _how(rc: int) -> str:
    if rc < 0:
        return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with code {rc}"


# Worker output lines hidden unless --verbose: third-party logs that say nothing the launcher
# does not. gloo prints "[Gloo] Rank N is connected to M peer ranks. Expected number of
# connected peer ranks is : M" once per rank, from several threads without a lock, so its
# messages arrive cut and interleaved ("[Gloo] Rank [Gloo] Rank 1 is connected ..."): a line
# is gloo's when nothing is left of it once these pieces are taken out.
GLOO_PIECES = re.compile(r"\[Gloo\] Rank|\d+ is connected to \d+ peer ranks|"
                         r"Expected number of connected peer ranks is\s*:\s*\d+")


def is_noise(text: str) -> bool:
    """A worker output line (without its [pN] prefix) made only of gloo's connection lines."""
    return bool(GLOO_PIECES.search(text)) and not GLOO_PIECES.sub("", text).strip(" .\t")


def run(children: list[tuple[str, tuple[str, ...], dict[str, str] | None]], grace: float,
        timeout: float = 0, out=None, failed: list | None = None,
        verbose: bool = False, hang_timeout: float = 0, labelled: bool = False,
        stop_line: bool = True) -> int:
    """Start `children` ((name, argv, env)), prefix each line of their output with their name
    (gloo noise, `is_noise`, hidden unless `verbose`), and stop them all when one fails
    (SIGTERM, then SIGKILL after `grace` s), when a worker's heartbeat is `hang_timeout` s old
    (0: never) or after `timeout` s (0: no limit). `labelled`: the one child is srun, whose
    output lines begin with the task's `--label`; task N is the worker pN. Returns 0, or the
    exit code of the first failure (128 + signal; 1 for a hang), whose name is appended to
    `failed`: the worker whose heartbeat stopped, when one did, rather than the peer that exited
    first. With `stop_line` (training workers), Ctrl-C (KeyboardInterrupt) or SIGTERM sends each
    child `STOP_LINE` and the signal's name on its stdin (the workers save an agreed step and
    exit 130, or 75) and waits for them; a second signal (or the first, without `stop_line`)
    stops them at once. A worker's traceback is shown TRACEBACK_HOLD_S late, and not at all when
    another worker's failure stops the job meanwhile (said in one line); the survivors of a
    failure get `STOP_LINE FAILED` before SIGTERM, which ends them even inside a collective."""
    out = out or sys.stdout
    children = list(children)
    lock = threading.Lock()
    hidden = [0]
    last_beat: dict[str, float] = {}  # worker -> time.monotonic() of its latest heartbeat
    finished: set[str] = set()  # workers that said they exit normally
    owner: dict[str, int] = {}  # worker -> the child whose output carries its heartbeat

    # A worker's traceback is held for TRACEBACK_HOLD_S before it is shown: when a peer died
    # (SIGKILL, a crash), the survivors' collectives break off with "Connection reset by peer"
    # tracebacks that often arrive before the launcher sees the death. Held, they are dropped
    # once the peer is named, and only the failed worker's own traceback is shown.
    held: dict[str, dict] = {}  # stream -> {"child", "since", "lines"} of a traceback held
    dropped: set[str] = set()  # workers whose tracebacks were hidden behind a peer's failure

    def say(line: str, worker: bool = False, child: int | None = None, key: str = "") -> None:
        text = line.split("] ", 1)[-1]
        if worker and not verbose and is_noise(text):
            hidden[0] += 1
            return
        with lock:
            if worker and not verbose and child is not None:
                if key in held:
                    held[key]["lines"].append(line)
                    return
                if text.startswith("Traceback (most recent call last):"):
                    held[key] = {"child": child, "since": time.monotonic(), "lines": [line]}
                    return
            out.write(line + "\n")
            out.flush()

    def release(cause: int | None = None, force: bool = False) -> None:
        """Show the held tracebacks that are due (or all, `force`), except, once child `cause`
        has failed, those of the other children: their collectives only lost it."""
        now = time.monotonic()
        with lock:
            for key, h in list(held.items()):
                if cause is not None and h["child"] != cause:
                    dropped.add(names[h["child"]])
                elif cause is None and not force and now - h["since"] < TRACEBACK_HOLD_S:
                    continue
                else:
                    out.write("".join(line + "\n" for line in h["lines"]))
                    out.flush()
                del held[key]

    def beat(child: int, worker: str, done: bool) -> None:
        with lock:
            owner[worker] = child
            if done:
                finished.add(worker)
            else:
                last_beat[worker] = time.monotonic()

    names = [name for name, _, _ in children]
    procs: list[subprocess.Popen] = []
    try:
        for name, argv, env in children:
            procs.append(subprocess.Popen(
                _guarded(argv), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True))
            say(f"hetjax launch: started {name} (pid {procs[-1].pid})")
    except OSError as e:
        _stop(procs, grace)
        raise HetjaxError(f"could not start {children[len(procs)][1][0]!r}: {e.strerror}") from None
    # Threads start only after every fork: forking while other threads run is unsafe.
    exits: queue.Queue = queue.Queue()
    pumps = [threading.Thread(target=_pump, args=(
        stream, f"[{n}] ", lambda line, worker=False, i=i, k=f"{i}{k}": say(line, worker, i, k),
        lambda w, d, i=i: beat(i, w, d), labelled, n), daemon=True)
        for i, (n, p) in enumerate(zip(names, procs))
        for k, stream in (("out", p.stdout), ("err", p.stderr))]
    for i, p in enumerate(procs):
        threading.Thread(target=lambda i, p: exits.put((i, p.wait())), args=(i, p),
                         daemon=True).start()
    for pump in pumps:
        pump.start()

    running = set(range(len(procs)))
    failure = None  # (name or None for the timeout, exit code, how) of the first failure
    kill_at = float("inf")
    stopping_on = None  # "SIGINT"/"SIGTERM" once passed on: the workers save and stop
    passed_on = False  # this launcher got Ctrl-C or SIGTERM and passed it on (a second one kills)
    stopped: list[str] = []  # the workers that then saved and stopped

    def stalled(exited: int = -1) -> tuple[str, float] | None:
        """The worker whose heartbeat is oldest, if older than STALLED_AFTER_S: of the running
        children's workers (and of those `exited` carried, other than itself: srun's tasks)."""
        now = time.monotonic()
        with lock:
            ages = [(now - t, w) for w, t in last_beat.items() if w not in finished
                    and (owner[w] in running or owner[w] == exited)
                    and (exited < 0 or w != names[exited])]
        age, w = max(ages, default=(0.0, ""))
        return (w, age) if age > STALLED_AFTER_S else None

    def where(worker: str) -> str:
        j = owner[worker]
        return f"srun task {worker[1:]}" if worker != names[j] else f"pid {procs[j].pid}"
    end = time.monotonic() + timeout if timeout else float("inf")

    def cause_of(failure) -> int | None:
        """The child whose failure stops the job (None: the launcher's own --timeout)."""
        name = failure[0]
        return names.index(name) if name in names else owner.get(name)

    def stop_all(reason: str) -> None:
        nonlocal kill_at
        if failure is not None and failure[0] is not None:
            release(cause_of(failure))  # the failed worker's traceback, before the reason
        rest = ", ".join(names[j] for j in sorted(running))
        say(f"hetjax launch: {reason}" + (f"; stopping {rest}" if rest else ""))
        if failure is not None and failure[0] is not None and stop_line:
            # A peer is gone: nothing can be saved together, and a survivor may sit in a
            # collective with it where a signal handler cannot run; the line (read by a
            # thread) stops it at once.
            for j in running:
                _tell(procs[j], f"{STOP_LINE} {FAILED}")
        _signal([procs[j] for j in running], signal.SIGTERM)
        kill_at = time.monotonic() + grace

    previous = (signal.signal(signal.SIGTERM, _terminate)  # stop the children, like Ctrl-C
                if threading.current_thread() is threading.main_thread() else None)
    try:
        while running:
            try:
                try:
                    i, rc = exits.get(timeout=0.2)
                except queue.Empty:
                    pass
                else:
                    running.discard(i)
                    if stopping_on and rc in (75, 130):  # saved and stopped, as asked
                        stopped.append(names[i])
                    elif rc in (75, 130) and stop_line and failure is None:
                        # Signalled itself (a scheduler preempting the job sends SIGTERM to
                        # every task): the workers agree on a step and save it, as on a stop
                        # line from here, so wait for the others rather than stop them.
                        stopping_on = "SIGTERM" if rc == 75 else "SIGINT"
                        stopped.append(names[i])
                        rest = ", ".join(names[j] for j in sorted(running))
                        say(f"hetjax launch: {names[i]} "
                            f"{'was preempted (SIGTERM)' if rc == 75 else 'was interrupted'} and "
                            "saved" + (f"; waiting for {rest} to save the same step" if rest else ""))
                    elif rc != 0 and failure is None:
                        hung = stalled(exited=i)
                        if hung is not None:  # a peer it waited for stopped first: blame it
                            w, age = hung
                            failure = (w, 1, "stopped making progress")
                            stop_all(f"{w} ({where(w)}) stopped making progress (no heartbeat "
                                     f"for {age:.0f} s), then {names[i]} {_how(rc)}")
                        else:
                            failure = (names[i], rc, _how(rc))
                            stop_all(f"{names[i]} (pid {procs[i].pid}) {_how(rc)}")
                if failure is None and hang_timeout:
                    hung = stalled()
                    if hung is not None and hung[1] > hang_timeout:
                        w, age = hung
                        failure = (w, 1, "stopped making progress")
                        stop_all(f"{w} ({where(w)}) stopped making progress: no heartbeat for "
                                 f"{age:.0f} s (--heartbeat-timeout {hang_timeout:g})")
                if failure is None and time.monotonic() > end:
                    failure = (None, 124, "")
                    stop_all(f"the job ran longer than --timeout {timeout:g} s")
                release(cause_of(failure) if failure is not None and failure[0] is not None
                        else None)
                if running and time.monotonic() > kill_at:
                    say(f"hetjax launch: {', '.join(names[j] for j in sorted(running))} still "
                        f"running {grace:g} s after SIGTERM; sending SIGKILL")
                    _signal([procs[j] for j in running], signal.SIGKILL)
                    kill_at = float("inf")
            except KeyboardInterrupt as e:
                if passed_on or failure is not None or not stop_line:
                    raise  # a second signal: the finally stops them at once
                passed_on = True
                if stopping_on:  # the workers, signalled too, are saving already
                    continue
                stopping_on = "SIGTERM" if isinstance(e, _Terminated) else "SIGINT"
                rest = ", ".join(names[j] for j in sorted(running))
                how = "interrupted" if stopping_on == "SIGINT" else "preempted (SIGTERM)"
                say(f"hetjax launch: {how}: asking {rest} to save the step they agree on "
                    f"and stop ({'Ctrl-C' if stopping_on == 'SIGINT' else 'SIGTERM'} again "
                    "stops them at once, losing the steps since the latest checkpoint)")
                for j in running:
                    _tell(procs[j], f"{STOP_LINE} {stopping_on}")
    finally:
        if running:  # interrupted again, SIGTERM to the launcher: take the children along
            _stop([procs[j] for j in running], grace)
        for t in pumps:
            t.join(timeout=5)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        release(cause_of(failure) if failure is not None and failure[0] is not None else None,
                force=True)
    if dropped:
        say(f"hetjax launch: hid the traceback of {', '.join(sorted(dropped))}: its collective "
            f"broke off when {failure[0]} failed (--verbose shows it)")
    if hidden[0]:
        say(f"hetjax launch: hid {hidden[0]} gloo connection lines (--verbose shows them)")
    if failure is None:
        if stopping_on and stopped:  # (the job may have completed before the stop step)
            say(f"hetjax launch: {'interrupted' if stopping_on == 'SIGINT' else 'preempted'}; "
                "the workers stopped as they said above; rerun the same command to resume")
            return 130 if stopping_on == "SIGINT" else 75
        return 0
    name, rc, how = failure
    if name is not None:
        say(f"hetjax launch: failed: {name} {how} first")
        if failed is not None:
            failed.append(name)
    return _exit_code(rc)


# Exit codes a restart cannot help: success, a user error (exit 2), a preemption the worker
# saved for (75: the scheduler wants the job gone), the --timeout, an interrupt.
NO_RESTART = (0, 2, 75, 124, 130)


def run_with_restarts(make_children, grace: float, timeout: float = 0, max_restarts: int = 0,
                      out=None, verbose: bool = False, hang_timeout: float = 0,
                      labelled: bool = False, stop_line: bool = True) -> int:
    """`run` the children `make_children(failed)` returns; after a failure, start them afresh
    up to `max_restarts` times (workers resume from the job's latest checkpoint). `failed` lists
    the names of the processes that failed first in earlier attempts. Returns the last
    attempt's exit code."""
    out = out or sys.stdout
    failed: list[str] = []
    for attempt in range(max_restarts + 1):
        rc = run(make_children(failed), grace, timeout, out, failed, verbose, hang_timeout,
                 labelled, stop_line)
        if rc in NO_RESTART or attempt == max_restarts:
            return rc
        out.write(f"hetjax launch: restarting the job ({attempt + 1} of --max-restarts "
                  f"{max_restarts}) after exit code {rc}; it resumes from its latest "
                  "checkpoint\n")
        out.flush()
    return rc


class _Terminated(KeyboardInterrupt):
    """SIGTERM to the launcher: stop the children now (a scheduler wants the job gone)."""


def _terminate(signum, frame):
    raise _Terminated


# What the launcher writes on a worker's stdin on Ctrl-C (over ssh too; should only one worker
# read it, as under `srun --input=0`, the workers' agreement tells the others).
STOP_LINE = stopping.STOP_LINE
FAILED = stopping.FAILED
# How long a worker's traceback waits before it is shown (a peer's death is seen within 0.2 s).
TRACEBACK_HOLD_S = 1.0


def _tell(proc: subprocess.Popen, line: str) -> None:
    try:
        proc.stdin.write((line + "\n").encode())
        proc.stdin.flush()
    except (OSError, ValueError):  # it has exited (a broken pipe) or closed its stdin
        pass


def _pump(stream, prefix: str, say, beat, labelled: bool = False, name: str = "") -> None:
    """One prefixed line per line of `stream`; of a line redrawn with carriage returns (a
    progress bar), its last state. Heartbeat lines are taken out and reported as
    `beat(worker, done)`: the worker is `name`, or with `labelled` (srun) p<its task label>."""
    cut: dict[str, str] = {}  # label -> text a heartbeat landed after, before its newline
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\r\n").rsplit("\r", 1)[-1]
        label, m = "", _SRUN_LABEL.match(line) if labelled else None
        if m:
            label, line = m.group(0), line[m.end():]
        h = _HEARTBEAT_RE.search(line)
        if h:
            beat(f"p{int(m.group(1))}" if m else name, h.group(0) == HEARTBEAT_DONE)
            if h.start():  # it cut a line: the rest of that line is the next line
                cut[label] = cut.get(label, "") + line[:h.start()]
            continue
        say(prefix + label + cut.pop(label, "") + line, worker=True)
    stream.close()


def _signal(procs, sig) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, sig)  # the child leads its own session: take its children too
        except ProcessLookupError:
            pass


def _stop(procs, grace: float) -> None:
    """SIGTERM, wait up to `grace` s, then SIGKILL whatever still runs."""
    alive = [p for p in procs if p.poll() is None]
    _signal(alive, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    _signal([p for p in alive if p.poll() is None], signal.SIGKILL)
    for p in alive:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # stuck in the kernel; nothing more we can do
            pass

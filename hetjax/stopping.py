"""Stopping a training run on request, at a step every process of the job agrees on.

A stop is requested by SIGTERM or SIGINT to the process (the handlers run in its main
thread), or by `STOP_LINE` on its stdin: what `hetjax launch` writes to every worker when it
gets Ctrl-C or SIGTERM (over ssh too; a daemon thread reads it). A single process saves the
step in flight and stops. The processes of a multi-process job must stop at the same step -- a
checkpoint save is collective -- so they agree through jax.distributed's key-value store: the
process that hears the request publishes it; each process's daemon thread, waiting on that
key, answers with the step its loop last reached; the stop step is the largest answer + 1. No
loop can be past it: from its next step boundary on, a loop that knows of the request waits
there for the stop step. All waiting happens in daemon threads or at a step boundary, never
inside a step, so no process needs a peer blocked in a collective to agree. A peer that never
answers (stopped, dead) ends the wait after `HETJAX_HEARTBEAT_TIMEOUT` s; the run then stops
without saving and says which steps are lost. SIGTERM to the workers themselves (what a
scheduler sends every task when it preempts or cancels a job) is handled the same way. When a
worker of the job dies, the launcher first writes `STOP_LINE FAILED` on the others' stdin: a
survivor's main thread may sit in a collective with the dead peer, where no signal handler
runs until the collective times out, so the stop-line thread ends the process at once
(`EXIT_PEER_FAILED`); nothing could be saved together anyway. A job of several JAX worlds (MPMD across clusters) has one key-value store per
world, so it cannot agree: it stops at once, without saving, and says which steps are lost.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from hetjax.distributed import DEFAULT_HEARTBEAT_TIMEOUT, ENV_HEARTBEAT_TIMEOUT
from hetjax.parallel.nic import ENV_WORLDS

# One line on a worker's stdin: stop like Ctrl-C (or, followed by " SIGTERM", like SIGTERM;
# followed by FAILED: a peer died, so nothing can be saved together: exit now).
STOP_LINE = "hetjax: stop"
FAILED = "FAILED"
EXIT_PEER_FAILED = 143  # as SIGTERM's default action would have ended it
POLL_MS = 250  # how long a daemon thread's key-value read waits before it looks again

_lock = threading.Lock()
_active: list["StopFlag"] = []
_pending: list[str] = []  # a request heard before a run's flag existed (during compilation)
_generation = [0]  # one key-value namespace per train() call (the same count in every process)


def request(signame: str) -> None:
    """Ask the running training loop (or the next one) to save and stop, as `signame` would."""
    with _lock:
        flags = list(_active)
        if not flags:
            _pending.append(signame)
    for flag in flags:
        flag.request(signame)


def listen(stream=None) -> threading.Thread:
    """Read `stream` (default stdin) in a daemon thread; `STOP_LINE` requests a stop (SIGINT)."""
    stream = stream if stream is not None else sys.stdin

    def read():
        try:
            for line in stream:  # "hetjax: stop", "hetjax: stop SIGTERM" or "... FAILED"
                words = line.split()
                if " ".join(words[:2]) == STOP_LINE and words[2:3] == [FAILED]:
                    # The main thread may sit in a collective with the dead peer, where no
                    # signal handler runs until it times out: this thread ends the process.
                    os._exit(EXIT_PEER_FAILED)
                if " ".join(words[:2]) == STOP_LINE:
                    request(words[2] if len(words) > 2 else "SIGINT")
        except (OSError, ValueError):
            pass  # stdin closed: nothing more will come

    thread = threading.Thread(target=read, name="hetjax-stop-line", daemon=True)
    thread.start()
    return thread


class NoAgreement(Exception):
    """A peer did not answer the stop request in time: the run cannot save together."""


class StopFlag(threading.Event):
    """Set when a stop was requested while `train()` runs (`signal` names how). The loop asks
    `due(step)` at each step boundary; `restore()` puts the signal handlers back and ends the
    agreement thread. The first SIGINT puts the previous SIGINT handler back, so a second
    Ctrl-C interrupts at once."""

    def __init__(self, start: int = 0):
        import jax

        super().__init__()
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}
        self._multi = jax.process_count() > 1
        self._lock = threading.Lock()
        self._current = start  # the step this process's loop last reached
        self._heard = False  # the job's stop request is known here
        self._stop_at: int | None = None
        self._agreed = threading.Event()
        self._closed = threading.Event()
        self._thread = None
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:  # e.g. SIGINT under nohup
                    self._previous[sig] = signal.signal(sig, self._handle)
        if self._multi:
            from jax._src import distributed

            self._client = distributed.global_state.client
            self._n, self._me = jax.process_count(), jax.process_index()
            with _lock:
                _generation[0] += 1
                self._prefix = f"hetjax/stop/{_generation[0]}"
            self._thread = threading.Thread(target=self._agree, name="hetjax-stop-agreement",
                                            daemon=True)
            self._thread.start()
        with _lock:
            _active.append(self)
            pending, _pending[:] = list(_pending), []
        for name in pending:
            self.request(name)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and signal.SIGINT in self._previous:
            signal.signal(signal.SIGINT, self._previous[signal.SIGINT])
        self.request(signal.Signals(signum).name)

    def request(self, signame: str) -> None:
        with self._lock:
            if self.signal is None:
                self.signal = signame
        self.set()
        if self._multi:  # tell the other processes (a second request overwrites: same meaning)
            try:
                self._client.key_value_set(f"{self._prefix}/request", signame,
                                           allow_overwrite=True)
            except Exception:  # noqa: BLE001 - the coordinator is gone: the job is ending
                pass

    def _get(self, key: str) -> str | None:
        """The value of `key` once it is set; None when the flag was closed first."""
        while not self._closed.is_set():
            try:
                return self._client.blocking_key_value_get(key, POLL_MS)
            except Exception:  # noqa: BLE001 - not set yet (DEADLINE_EXCEEDED): look again
                continue
        return None

    def _agree(self) -> None:
        name = self._get(f"{self._prefix}/request")
        if name is None:
            return
        with self._lock:
            self._heard = True
            self.signal = self.signal or name
            mine = self._current
        self.set()
        try:
            self._client.key_value_set(f"{self._prefix}/step/{self._me}", str(mine))
        except Exception:  # noqa: BLE001
            return
        steps = []
        for p in range(self._n):
            value = self._get(f"{self._prefix}/step/{p}")
            if value is None:
                return
            steps.append(int(value))
        self._stop_at = max(steps) + 1
        self._agreed.set()

    @property
    def stop_step(self) -> int | None:
        """The step the job's processes agreed to stop at (None: no agreement yet)."""
        return self._stop_at if self._agreed.is_set() else None

    def due(self, step: int) -> bool:
        """Called at each step boundary: True when this process should save `step` and stop.
        Raises `NoAgreement` when the job's processes could not agree in time."""
        if not self._multi:
            return self.is_set()
        if self.is_set() and int(os.environ.get(ENV_WORLDS, "1")) > 1:
            raise NoAgreement("the worlds of a multi-world job share no key-value store to "
                              "agree on a step")
        with self._lock:
            self._current = step
            heard = self._heard
        if not heard:
            return False
        timeout = float(os.environ.get(ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT))
        if not self._agreed.wait(timeout):
            raise NoAgreement(f"not every process answered the stop request within "
                              f"{timeout:g} s ({ENV_HEARTBEAT_TIMEOUT})")
        return step >= self._stop_at

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        self._closed.set()
        with _lock:
            if self in _active:
                _active.remove(self)
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_MS / 1e3 + 1)

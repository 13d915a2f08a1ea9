"""The workdir lock: one training run writes a workdir at a time.

`<workdir>/hetjax.lock` names its holder (host, pid, the process's start time, the command).
It is created atomically (`O_EXCL`) when `train()` starts and removed when it ends, however it
ends short of SIGKILL. A lock left by a run that died on this host (its pid is gone, or now
belongs to a process started at another time) is stale: it is taken over with one line saying
so. A lock held by a live process, or by another host (whose processes this one cannot see),
stops the second run with one error naming the holder and the fix -- two runs in one workdir
would interleave their metrics and race for the same checkpoint steps.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from hetjax.errors import HetjaxError

LOCK_NAME = "hetjax.lock"


def _process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22): a pid
    reused by a later process has another start time. None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return start is None or _process_start(pid) in (None, start)


class WorkdirLock:
    """`with WorkdirLock(workdir):` holds the lock for the block (see the module docstring)."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_NAME)
        self.held = False

    def holder(self) -> dict | None:
        """The lock file's contents (None if there is no lock; {} if it is unreadable)."""
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def acquire(self) -> None:
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "process_start": _process_start(os.getpid()),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        for _ in range(3):  # a stale lock removed, then retry (another run may race us)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._check_stale(self.holder())
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise HetjaxError(f"{self.path}: could not take the workdir lock (another run keeps "
                          "taking it); fix: use another --config.workdir")

    def _check_stale(self, h: dict | None) -> None:
        """Remove the lock if its holder is gone; raise if it may still be running."""
        if h is None:  # released between our open and our read
            return
        who = (f"pid {h.get('pid')} on {h.get('host')}, started {h.get('started')}: "
               f"{h.get('command', '?')}") if h else "an unreadable lock file"
        same_host = h.get("host") == socket.gethostname()
        pid = h.get("pid")
        if same_host and isinstance(pid, int) and not _alive(pid, h.get("process_start")):
            print(f"hetjax: {self.path}: removing the stale lock of a run that is gone ({who})",
                  file=sys.stderr, flush=True)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            return
        where = "is running" if same_host else "may be running (another host: cannot check)"
        raise HetjaxError(
            f"{os.path.dirname(self.path)} is in use: a hetjax run {where} there ({who}); "
            f"fix: wait for it to end, use another --config.workdir, or, if that run is "
            f"gone, delete {self.path}")

    def release(self) -> None:
        if self.held:
            self.held = False
            h = self.holder()
            if h and h.get("pid") == os.getpid() and h.get("host") == socket.gethostname():
                os.unlink(self.path)

    def __enter__(self) -> "WorkdirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

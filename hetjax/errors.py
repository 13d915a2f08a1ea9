"""The errors hetjax raises for mistakes a user can make.

Every user-facing failure (bad config, impossible layout, missing data, a topology larger than
the machine) is a `HetjaxError` whose message says what was wrong and what to change, so the
CLI can print it without a traceback.
"""

from __future__ import annotations


class HetjaxError(Exception):
    """A problem the user can fix; the message says how."""


class ConfigError(HetjaxError):
    """A config field has a value hetjax cannot use.

    The message names the field (as it is spelled on the command line), the value, why it
    is wrong and the fix.
    """

    def __init__(self, field: str, problem: str, fix: str):
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"config.{field}: {problem}\n  fix: {fix}")


class TopologyError(HetjaxError):
    """A topology is malformed or does not fit the devices that exist."""


class TopologyValueError(TopologyError):
    """One value of a topology is wrong. `where` names it (a topology file's JSON path, such as
    `clusters[1].accelerator`, or a data class's field, `ethernet link bandwidth_gbps`),
    `problem` says what is wrong and `fix` what to write instead; the message is one line.
    An empty `where` is the file as a whole (not JSON, too large).
    `field` is the data class field a hardware check refused, so a reader can put the file's
    JSON path in front of it."""

    def __init__(self, where: str, problem: str, fix: str, field: str = ""):
        self.where, self.problem, self.fix, self.field = where, problem, fix, field
        super().__init__(f"{where + ': ' if where else ''}{problem}; fix: {fix}")


class PlanError(HetjaxError):
    """No layout satisfies the request; the message names the binding constraint."""


class Preempted(HetjaxError):
    """The run was asked to stop (SIGTERM) and saved a checkpoint of its current step; rerunning
    the same command resumes from it. The CLI exits with `EXIT_CODE` (EX_TEMPFAIL: try again),
    so a scheduler or `hetjax launch` can tell it from a failure."""

    EXIT_CODE = 75


class Interrupted(Preempted):
    """The user pressed Ctrl-C (SIGINT): the run saved its current step (or, at a second
    Ctrl-C, says which steps are lost). Exit code 130, as a shell reports an interrupted
    command."""

    EXIT_CODE = 130


def os_error_message(e: OSError, fix: str = "") -> str:
    """One line for an OSError on a path: the path, what the system said, and the fix (a full
    disk and a read-only file system get their own)."""
    import errno

    where = e.filename if e.filename is not None else "a file"
    what = e.strerror or str(e)
    if e.errno == errno.ENOSPC or e.errno == errno.EDQUOT:
        fix = f"free space on the disk holding {where} (or choose a path on another disk)" + \
            (f"; {fix}" if fix else "")
    elif e.errno == errno.EROFS or e.errno == errno.EACCES or e.errno == errno.EPERM:
        fix = fix or "choose a path you can write, or fix its permissions"
    elif e.errno == errno.EISDIR:
        fix = fix or "give a file name, not a directory"
    return f"{where}: {what}" + (f"; fix: {fix}" if fix else "")

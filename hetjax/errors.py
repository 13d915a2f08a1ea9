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


class PlanError(HetjaxError):
    """No layout satisfies the request; the message names the binding constraint."""


class Preempted(HetjaxError):
    """The run was asked to stop (SIGTERM) and saved a checkpoint of its current step; rerunning
    the same command resumes from it. The CLI exits with `EXIT_CODE` (EX_TEMPFAIL: try again),
    so a scheduler or `hetjax launch` can tell it from a failure."""

    EXIT_CODE = 75

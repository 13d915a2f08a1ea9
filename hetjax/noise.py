"""Third-party output a run hides unless asked for (`--verbose`): tfds's banners and progress
bars while it prepares a corpus ("Downloading and preparing dataset Unknown size ..." for files
that are already on disk, "Generating splits...", "Shuffling ..."), and the warnings tfds and
etils log through absl about their own bookkeeping ("Variant folder ... has no
dataset_info.json" for a corpus not yet prepared). None of it says anything hetjax does not
say itself in one line; an error is never hidden. gloo's connection lines in launched workers'
output are the launcher's to hide (`hetjax.supervise.is_noise`).

The switch is the environment variable HETJAX_VERBOSE, so a process that `hetjax launch`
starts with `--verbose` inherits it, and a Python user can set it before training.
"""

from __future__ import annotations

import contextlib
import logging
import os

ENV_VERBOSE = "HETJAX_VERBOSE"

# Where the absl records to hide come from: tfds and the etils helpers it uses.
QUIET_PACKAGES = ("tensorflow_datasets", "etils")


def verbose() -> bool:
    """True when third-party noise should be shown (HETJAX_VERBOSE set to anything but 0)."""
    return os.environ.get(ENV_VERBOSE, "") not in ("", "0")


def set_verbose(on: bool) -> None:
    """Show (True) or hide third-party noise in this process and the processes it starts."""
    os.environ[ENV_VERBOSE] = "1" if on else "0"


def _from_quiet_package(record: logging.LogRecord) -> bool:
    path = record.pathname.replace(os.sep, "/")
    return any(f"/{p}/" in path for p in QUIET_PACKAGES)


class _HideLibraryBookkeeping(logging.Filter):
    """Drops absl records below ERROR that tfds or etils log, unless `verbose()`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (verbose() or record.levelno >= logging.ERROR
                or not _from_quiet_package(record))


_FILTER = _HideLibraryBookkeeping()


def install() -> None:
    """Attach the absl filter (once; the filter itself reads HETJAX_VERBOSE at each record)."""
    absl = logging.getLogger("absl")
    if _FILTER not in absl.filters:
        absl.addFilter(_FILTER)


@contextlib.contextmanager
def quiet_absl():
    """absl warnings off for the block (errors still show): orbax's about a reader's
    bookkeeping -- a step's metadata file one level up, a read-only directory -- which a
    restore, an export or a reader opening a checkpoint meets every time."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)


@contextlib.contextmanager
def quiet_tfds_progress():
    """tfds's tqdm progress bars off for the block, unless `verbose()`; as they were after it."""
    if verbose():
        yield
        return
    from tensorflow_datasets.core.utils import tqdm_utils

    was = getattr(tqdm_utils, "_active", True)  # tfds keeps the switch there (no getter)
    tqdm_utils.display_progress_bar(False)
    try:
        yield
    finally:
        tqdm_utils.display_progress_bar(was)


__all__ = ["ENV_VERBOSE", "install", "quiet_absl", "quiet_tfds_progress", "set_verbose", "verbose"]

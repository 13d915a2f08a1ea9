"""Where a name read from a file may point, and how hetjax writes a file it names itself.

Two rules keep what hetjax reads and writes inside the directories a user named. A file name
read from a file (a safetensors index's shards, a saved tokenizer's descriptor) is taken only
when it names a file inside that file's directory (`inside`): no absolute path, no '..', no
link leading out. And a file hetjax writes into a directory (an export, a tokenizer copy) is
written to a fresh temporary file beside it and renamed over the name (`replace_file`), so a
symbolic link already at that name is replaced, never followed to a file elsewhere; a file
appended to or cut in place (the metrics file) is refused when it is a link (`open_in_place`).
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable

from hetjax.errors import HetjaxError


def inside(directory: str, name, named_in: str, fix: str) -> str:
    """`directory`/`name` for a file name read from `named_in`; a HetjaxError (ending in
    `fix`) unless it is a relative name of a file inside `directory`, links resolved."""
    ok = isinstance(name, str) and name and not os.path.isabs(name)
    path = os.path.join(directory, name) if ok else ""
    real_dir = os.path.realpath(directory)
    if not ok or os.path.commonpath([real_dir, os.path.realpath(path)]) != real_dir:
        raise HetjaxError(f"{named_in}: names the file {name!r}, which is not inside "
                          f"{directory}; {fix}")
    return path


def replace_file(path: str, write: Callable, mode: str = "wb") -> None:
    """Write `path` through `write(file object)`: into a new temporary file in its directory,
    then renamed over `path`, so readers never see it half-written and a link at `path` is
    replaced rather than written through."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                               prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def open_in_place(path: str, mode: str):
    """`open(path, mode)` for a file hetjax appends to or cuts in place (mode "a" or "r+b"),
    refusing a symbolic link at `path` (OSError ELOOP naming it) rather than writing through
    it to a file elsewhere."""
    import errno

    flags = {"a": os.O_WRONLY | os.O_APPEND | os.O_CREAT, "r+b": os.O_RDWR}[mode]
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "is a symbolic link, which hetjax does not write "
                          "through", path) from None
        raise
    return os.fdopen(fd, mode, buffering=1) if mode == "a" else os.fdopen(fd, mode)


def copy_file(src: str, dst: str) -> None:
    """`src` copied to `dst` as `replace_file` writes (a link at `dst` is replaced)."""
    import shutil

    with open(src, "rb") as f:
        replace_file(dst, lambda out: shutil.copyfileobj(f, out))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

"""Command-line pieces that both `hetjax <command>` (cli.py) and `hetjax launch` (launch.py)
read: the default job file, the option splitter, and `hetjax calibrate`'s own flags (which
`hetjax launch --command=calibrate` passes on to its workers). A leaf below both entry points,
so neither imports the other."""

from __future__ import annotations

import os

from hetjax.errors import HetjaxError

# hetjax calibrate's own flags (hetjax launch --command=calibrate passes them to its workers)
CALIBRATE_OPTIONS = ("out", "plot", "profile", "batches", "seq_lens", "sizes", "repeats",
                     "min_sample")
CALIBRATE_FLAGS = ("--quick",)  # and its switches


def take_options(argv: list[str], names: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """Pull `--name=VALUE` / `--name VALUE` options (names without dashes) out of argv."""
    opts, rest, i = {}, [], 0
    while i < len(argv):
        a = argv[i]
        name = a[2:].split("=", 1)[0] if a.startswith("--") else None
        if name in names:
            if "=" in a:
                opts[name] = a.split("=", 1)[1]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                opts[name] = argv[i + 1]
                i += 1
            else:
                raise HetjaxError(f"--{name} needs a value, e.g. --{name}=out.{name}")
            i += 1
            continue
        rest.append(a)
        i += 1
    return opts, rest


def default_job_path() -> str | None:
    """configs/default.py of this checkout: the job `hetjax train` runs without --config (the
    README's default job); None when hetjax is installed without the repository's configs."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "configs", "default.py")
    return path if os.path.isfile(path) else None


__all__ = ["CALIBRATE_FLAGS", "CALIBRATE_OPTIONS", "default_job_path", "take_options"]

"""Command-line pieces that both `hetjax <command>` (cli.py) and `hetjax launch` (launch.py)
read: the default job file, the options parser, and `hetjax calibrate`'s own flags (which
`hetjax launch --command=calibrate` passes on to its workers). A leaf below both entry points,
so neither imports the other.

One way to declare a command's options: `argparse` -- `hetjax launch` and `hetjax testbed`
build a parser; the other commands name their few options to `take_options`, which builds one
and leaves every other argument (the `--config=FILE` and `--config.SECTION.FIELD=VALUE`
overrides, which `hetjax.config.load_config` reads as ml_collections' config flags, and the
command's switches) in order for the command. The scripts under scripts/ use argparse too."""

from __future__ import annotations

import argparse
import os

from hetjax.errors import HetjaxError

# hetjax calibrate's own flags (hetjax launch --command=calibrate passes them to its workers)
CALIBRATE_OPTIONS = ("out", "plot", "profile", "batches", "seq_lens", "sizes", "repeats",
                     "min_sample")
CALIBRATE_FLAGS = ("--quick",)  # and its switches


def take_options(argv: list[str], names: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """Pull `--name=VALUE` / `--name VALUE` options (names without dashes; the last one given
    wins) out of argv with an argparse parser; returns them and the other arguments, in order."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for name in names:
        parser.add_argument(f"--{name}")
    try:
        opts, rest = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:  # a value-taking option without its value
        name = (e.argument_name or "").lstrip("-").split("/")[0]
        raise HetjaxError(f"--{name} needs a value, e.g. --{name}=out.{name}") from None
    return {k: v for k, v in vars(opts).items() if v is not None}, rest


def default_job_path() -> str | None:
    """configs/default.py of this checkout: the job `hetjax train` runs without --config (the
    README's default job); None when hetjax is installed without the repository's configs."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "configs", "default.py")
    return path if os.path.isfile(path) else None


__all__ = ["CALIBRATE_FLAGS", "CALIBRATE_OPTIONS", "default_job_path", "take_options"]

"""A trained run opened for inference: its checkpoint restored into a pp = 1 layout, for text
generation (`hetjax sample`, `Trainer.generate`) and for the loss of a checkpoint on a dataset
(`hetjax eval`).

`open_checkpoint(workdir)` rebuilds the run's config from the checkpoint's `meta` item (the
config it was trained with), applies the caller's overrides (data fields for `eval`), keeps
the run's tensor parallelism and replaces any pipeline by pp = 1 -- the checkpoint layout is
plan-independent (hetjax/checkpoint.py), so the parameters load straight into the new
shardings -- and returns a `Trainer` holding the restored state. Nothing here imports JAX until
a Trainer is built, so the CLI can size the simulated devices first (`saved_config`).
"""

from __future__ import annotations

import json
import math
import os

from hetjax import config as hconfig
from hetjax.errors import HetjaxError
from hetjax.noise import quiet_absl


def checkpoint_dir(path: str) -> str:
    """The checkpoints directory of a run: `<workdir>/checkpoints`, or `path` itself when it
    holds the step directories."""
    path = os.path.expanduser(path)
    inner = os.path.join(path, "checkpoints")
    if os.path.isdir(inner):
        return inner
    if os.path.isdir(path) and any(d.isdigit() for d in os.listdir(path)):
        return path
    raise HetjaxError(f"--checkpoint={path}: no checkpoints there (neither {inner} nor step "
                      "directories); give the workdir of a run that saved one, e.g. "
                      "'hetjax train --config.workdir=runs/x' then --checkpoint=runs/x")


def saved_steps(directory: str) -> list[int]:
    """Steps whose save completed (orbax renames a step into place when it is whole)."""
    return sorted(int(d) for d in os.listdir(directory)
                  if d.isdigit() and os.path.isfile(os.path.join(directory, d, "meta", "metadata")))


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def saved_config(path: str, overrides=(), step: int | None = None):
    """(config, step): the config checkpoint `step` (default the latest) of the run at `path`
    was trained with, with `--config.x.y=v` overrides and a pp = 1 layout."""
    directory = checkpoint_dir(path)
    steps = saved_steps(directory)
    if not steps:
        raise HetjaxError(f"--checkpoint={path}: {directory} holds no complete checkpoint; "
                          "train longer than checkpoint.every steps, or until the run ends")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise HetjaxError(f"--step={step}: no such checkpoint in {directory}; it holds steps "
                          f"{', '.join(map(str, steps))}")
    with open(os.path.join(directory, str(step), "meta", "metadata")) as f:
        saved = json.load(f)["config"]
    base = hconfig.base_config()

    def put(node, values):
        for k, v in values.items():
            if k not in node:  # a field this version no longer has
                continue
            if hasattr(node[k], "items") and isinstance(v, dict):
                put(node[k], v)
            else:
                node[k] = _tuples(v)

    put(base, saved)
    # One program over the run's devices: the run's tp, no pipeline (pp > 1 checkpoints load
    # into this layout), the rest data parallel; inference steps are not accumulated.
    base.parallel.pp, base.parallel.dp = 1, 0
    base.parallel.stage_dp = base.parallel.stage_tp = ()  # one stage: the run's tp
    base.pipeline.stage_layers, base.pipeline.microbatches = (), 0
    base.train.microbatches = 1
    base.diloco.inner_steps = 0
    base.checkpoint.dir = directory
    cfg = hconfig.load_config(None, list(overrides), base=base)
    hconfig.validate(cfg, reading=True)  # the checkpoint may be on a read-only copy
    return cfg, step


def open_checkpoint(path: str, overrides=(), step: int | None = None, config=None):
    """A Trainer holding checkpoint `step` (default the latest) of the run at `path`, under a
    pp = 1 plan (see `saved_config`; pass its result as `config` to avoid reading it twice)."""
    from hetjax import checkpoint as hckpt
    from hetjax.train import Trainer

    cfg, step = config if config is not None else saved_config(path, overrides, step)
    trainer = Trainer.from_config(cfg, workdir=os.path.expanduser(path), quiet=True,
                                  reading=True)
    layout = trainer.layout()
    # A reader: it never removes the files of a run that may still be saving. orbax warns
    # (through absl) that a reader's directory is read-only, which is the point here.
    with quiet_absl():
        r = hckpt.Checkpointer(cfg.checkpoint.dir, every=1, writer=False).restore(layout, step)
    trainer.state = r.state
    return trainer


def evaluate(trainer) -> dict[str, float]:
    """Loss and perplexity of the trainer's parameters on its eval split (eval.batches fixed
    global batches: the numbers training reports as eval_loss)."""
    loss = trainer.eval_loss()
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}

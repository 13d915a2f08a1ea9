"""Checkpoints: orbax, asynchronous and atomic, in a layout that does not depend on the plan.

A checkpoint step holds three items: `state` (the TrainState — step, parameters, optimizer
state — in the *natural* layout: block parameters stacked on a leading `n_layers` axis in global
layer order, optimizer moments mirroring them, scalars as they are), `data` (the data loader's
grain state) and `meta` (config, plan, data spec, RNG seed, as JSON).

A `Layout` converts between the trainer's state and the natural layout. With the layouts that
exist today (pp = 1, any dp / tp / ZeRO sharding) the trainer's state already is natural and
`NaturalLayout` is the identity; only the shardings differ between plans. Restoring reads each
array straight into the target plan's shardings (orbax with `jax.ShapeDtypeStruct(...,
sharding=...)` targets), so no device ever holds more than its own shards. A pipeline layout
(stage-stacked `[pp, max_layers, ...]` parameters) plugs in by implementing the same three
methods.

orbax writes a step into a temporary directory and renames it into place when every item is
complete, so a save that is interrupted (crash, SIGKILL) never replaces a good checkpoint; its
leftover temporary directory is removed when the next run opens the directory. A save refuses
a state holding NaN/Inf; a restore that fails to read a checkpoint sets it aside
(`<step>.corrupt`) and falls back to the next older one. A checkpoint of another model is
refused from its metadata, before any array is read.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import orbax.checkpoint as ocp

from hetjax.errors import HetjaxError

# Test-only: seconds to hold every save open after its files are written and before orbax
# commits it (renames it into place), so a test can kill the process mid-save for certain.
HOLD_ENV = "HETJAX_TEST_HOLD_SAVE_S"
# tensorstore reports a failed write (a full disk, a read-only file system) as a ValueError
# whose text carries the system's error code; orbax raises it from its writer threads.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def storage_error(e: BaseException, directory: str) -> OSError | None:
    """The OSError a failed checkpoint write stands for (on `directory`, the disk the user
    chose), or None when `e` is not one."""
    if isinstance(e, OSError):  # orbax's writer threads raise some without the file's name
        return e if e.filename is not None else OSError(e.errno, e.strerror or str(e), directory)
    m = _OS_ERROR_CODE.search(str(e))
    if not m:
        return None
    code = int(m.group(1))
    return OSError(code, os.strerror(code), directory)


class _StorageErrorEcho(logging.Filter):
    """Drops the log records orbax's writer threads and asyncio's unretrieved tasks print for a
    failed checkpoint write (one per thread and array, ~730 lines for a small model): the
    Checkpointer raises it once, as an OSError the run reports in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        return not _OS_ERROR_CODE.search(text)


_ECHO_FILTER = _StorageErrorEcho()


def _quiet_storage_echoes() -> None:
    for name in ("absl", "asyncio"):
        log = logging.getLogger(name)
        if _ECHO_FILTER not in log.filters:
            log.addFilter(_ECHO_FILTER)
    if not getattr(sys.excepthook, "hetjax_closed_loop", False):
        sys.excepthook = _closed_loop_quiet(sys.excepthook)


def _closed_loop_quiet(hook):
    """`hook` without the 'Event loop is closed' reports tensorstore prints (through
    sys.excepthook) for each write still in flight when orbax's save failed and closed its
    event loop: the failure itself is reported once."""
    def excepthook(kind, value, tb):
        if kind is RuntimeError and str(value) == "Event loop is closed":
            return
        hook(kind, value, tb)

    excepthook.hetjax_closed_loop = True
    return excepthook


class Layout(Protocol):
    """How a trainer's state maps to and from the natural, plan-independent layout."""

    def to_natural(self, state): ...

    def natural_target(self):
        """The natural state as `jax.ShapeDtypeStruct`s carrying this plan's shardings."""

    def from_natural(self, natural): ...


class NaturalLayout:
    """A trainer whose state is already in the natural layout (all of today's plans)."""

    def __init__(self, abstract_state):
        self.abstract_state = abstract_state

    def to_natural(self, state):
        return state

    def natural_target(self):
        return self.abstract_state

    def from_natural(self, natural):
        return natural


def abstract_with_shardings(tree, shardings):
    """`jax.ShapeDtypeStruct`s of `tree`'s leaves placed with `shardings` (a matching tree)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def nonfinite_leaves(tree) -> list[str]:
    """Paths of the floating-point leaves of `tree` holding a NaN or Inf."""
    import jax.numpy as jnp

    # One compiled check per set of devices (an MPMD state lives on several sub-meshes), not
    # one per leaf: a save must not wait for dozens of compilations.
    groups: dict[Any, list] = collections.defaultdict(list)
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            devices = frozenset(x.sharding.device_set) if hasattr(x, "sharding") else frozenset()
            groups[devices].append((path, x))
    bad = []
    for leaves in groups.values():
        finite = _all_finite([x for _, x in leaves])
        bad += [jax.tree_util.keystr(path, simple=True, separator="/")
                for (path, _), ok in zip(leaves, jax.device_get(finite)) if not ok]
    return sorted(bad)


@jax.jit
def _all_finite(xs):
    import jax.numpy as jnp

    return [jnp.isfinite(x).all() for x in xs]


# What orbax says when a checkpoint reads fine but has another model's shapes or structure.
_MISMATCH = ("is not compatible with the stored shape", "tree structures do not match"
)


def _key(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


class _Unreadable(Exception):
    """A checkpoint that fails to read back (the message says what failed)."""


def _first_sentence(e: Exception) -> str:
    text = " ".join(str(e).split()).split(" See full TensorStore details")[0]
    return f"{type(e).__name__}: {text[:200]}"


@dataclass
class Restored:
    step: int
    state: Any  # in the trainer's layout and shardings
    data_state: dict
    meta: dict


class Checkpointer:
    """Saves every `every` steps into `directory`, keeping the latest `keep` (and the
    `keep_best` with the lowest eval loss)."""

    def __init__(self, directory: str, every: int, keep: int = 3, keep_best: int = 0,
                 async_save: bool = True, writer: bool = True):
        self.directory = os.path.abspath(directory)
        self.every = every
        # A reader (a multi-world job's worlds but the first) writes nothing: its save only
        # sends its part of the state to the writer (`Layout.to_natural`), and it restores the
        # step the writer chose (`Layout.agree_step`).
        self.writer = writer
        self._manager = None
        if not writer:
            return
        policies = [ocp.checkpoint_managers.LatestN(keep)]
        if keep_best:
            # BestN keeps the last n after sorting; reverse=True sorts descending, so the
            # lowest losses are kept.
            policies.append(ocp.checkpoint_managers.BestN(
                get_metric_fn=lambda m: m["eval_loss"], reverse=True, n=keep_best,
                keep_checkpoints_without_metrics=False))
        hold = float(os.environ.get(HOLD_ENV, "0") or 0)
        # Steps of the saves started and not yet committed, oldest first: orbax commits them
        # in order, one at a time.
        self._in_flight = collections.deque()
        options = ocp.CheckpointManagerOptions(
            # Every `every` steps, and when JAX signals a preemption (multi-host runs); not
            # orbax's default extra save at the first step.
            save_decision_policy=ocp.checkpoint_managers.AnySavePolicy([
                ocp.checkpoint_managers.FixedIntervalPolicy(max(every, 1)),
                ocp.checkpoint_managers.PreemptionCheckpointingPolicy()]),
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(
                post_finalization_callback=(lambda: self._hold(hold)) if hold else None))
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    @property
    def manager(self) -> ocp.CheckpointManager:
        if self._manager is None:  # a reader opens the directory once the writer made it
            self._manager = ocp.CheckpointManager(
                self.directory, options=ocp.CheckpointManagerOptions(read_only=True))
        return self._manager

    def _hold(self, seconds: float) -> None:
        # orbax runs this after writing and before renaming the step into place.
        print(f"hetjax: {HOLD_ENV}: holding the save of step {self._in_flight.popleft()} open "
              f"for {seconds:g} s", file=sys.stderr, flush=True)
        time.sleep(seconds)

    def should_save(self, step: int) -> bool:
        if not self.writer:  # the writer's interval policy (a reader cannot see its saves)
            return self.every > 0 and step % self.every == 0
        return self.every > 0 and self.manager.should_save(step)

    def save(self, step: int, state, layout: Layout, data_state: dict, meta: dict, *,
             eval_loss: float | None = None) -> None:
        """Start saving `step` (returns while an async save writes in the background).

        Refuses (HetjaxError) a state holding a NaN or Inf: a checkpoint is always one a run
        can resume from. A step already checkpointed is not written again."""
        natural = layout.to_natural(state)
        if not self.writer:
            return
        bad = nonfinite_leaves(natural)
        if bad:
            raise HetjaxError(
                f"checkpoint {step}: refusing to save a state with NaN/Inf values in "
                f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}; the latest good "
                f"checkpoint in {self.directory} is kept; fix: rerun to resume from it, with a "
                "lower train.lr")
        if step in self.steps():
            return
        self._in_flight.append(step)
        args = ocp.args.Composite(state=ocp.args.StandardSave(natural),
                                  data=ocp.args.JsonSave(data_state),
                                  meta=ocp.args.JsonSave(meta))
        metrics = {"eval_loss": float(eval_loss)} if eval_loss is not None else None
        _quiet_storage_echoes()
        try:  # (waits for the previous save first, whose failure surfaces here)
            self.manager.save(step, args=args, metrics=metrics, force=True)
        except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
            err = storage_error(e, self.directory)
            if err is None:
                raise
            raise err from None

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def steps(self) -> list[int]:
        if not self.writer:
            if not os.path.isdir(self.directory):
                return []
            self.manager.reload()
        return sorted(self.manager.all_steps())

    def restore(self, layout: Layout, step: int | None = None) -> Restored | None:
        """Restore `step` (default: the newest checkpoint that reads back whole) into
        `layout`'s shardings; None if the directory holds no readable checkpoint.

        Without `step`, a checkpoint that fails to read (a truncated or garbled file, a junk
        step directory, NaN/Inf values) is reported in one line, renamed to `<step>.corrupt`
        and the next older one is tried. A checkpoint that reads but does not fit this model
        is the user's to resolve: that is an error, and nothing is moved.

        With a layout that has `agree_step` (a multi-world job), the writer restores as above
        and tells the readers the step; a reader restores exactly that step."""
        agree = getattr(layout, "agree_step", None)
        if not self.writer:
            step = agree(None) if agree is not None else step
            if step is None:
                return None
            self.manager.reload()
            try:
                return self._restore(layout, step)
            except _Unreadable as e:
                raise HetjaxError(f"checkpoint {step} in {self.directory}, which the writing "
                                  f"world restored, cannot be read here ({e})") from None
        r = self._restore_newest(layout, step)
        if agree is not None:
            agree(r.step if r is not None else None)
        return r

    def _restore_newest(self, layout: Layout, step: int | None) -> Restored | None:
        if step is not None:
            return self._restore(layout, step)
        candidates = sorted(self.manager.all_steps(), reverse=True)
        for i, candidate in enumerate(candidates):
            try:
                return self._restore(layout, candidate)
            except _Unreadable as e:
                self._set_aside(candidate, str(e), candidates[i + 1] if i + 1 < len(candidates)
                                else None)
        return None

    def _stored_shapes(self, step: int) -> dict[str, tuple] | None:
        """The array shapes checkpoint `step` holds, from its metadata alone (None if that
        cannot be read: the restore itself then says what is wrong)."""
        from hetjax.noise import quiet_absl

        # orbax warns that the item directory has no step metadata file (it is one level up)
        try:
            with quiet_absl():
                md = ocp.StandardCheckpointer().metadata(
                    os.path.join(self.directory, str(step), "state"))
            tree = getattr(md, "item_metadata", md)  # a StepMetadata in newer orbax
            return {_key(path): tuple(m.shape)
                    for path, m in jax.tree_util.tree_leaves_with_path(tree)}
        except Exception:  # noqa: BLE001 - orbax raises many kinds; the restore reports them
            return None

    def _check_shapes(self, step: int, target) -> None:
        """Refuse a checkpoint of another model before any array is read: orbax's reads that
        are in flight when one fails print a traceback each after our error."""
        stored = self._stored_shapes(step)
        if not stored:
            return
        wanted = {_key(path): tuple(x.shape)
                  for path, x in jax.tree_util.tree_leaves_with_path(target)}
        bad = [f"{k}: stored {stored[k]}, this model {wanted[k]}" for k in wanted
               if k in stored and stored[k] != wanted[k]]
        if bad:
            raise HetjaxError(
                f"checkpoint {step} in {self.directory} does not fit this model and optimizer "
                f"({'; '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}); resume with the "
                "model config it was written with (see its meta/ item) or use another workdir")

    def _restore(self, layout: Layout, step: int) -> Restored:
        target = layout.natural_target()
        self._check_shapes(step, target)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                  data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
        try:
            r = self.manager.restore(step, args=args)
        except Exception as e:  # orbax and tensorstore raise many kinds; sorted out below
            detail = " ".join(str(e).split())
            if not any(m in detail for m in _MISMATCH):
                raise _Unreadable(_first_sentence(e)) from None
            raise HetjaxError(
                f"checkpoint {step} in {self.directory} does not fit this model and optimizer "
                f"({type(e).__name__}: {detail[:300]}); resume with the model config it was "
                f"written with (see its meta/ item) or use another workdir") from None
        if r.data is None or r.meta is None:
            raise _Unreadable("its data or meta item is missing")
        bad = nonfinite_leaves(r.state)
        if bad:
            raise _Unreadable(f"it holds NaN/Inf values in {', '.join(bad[:3])}")
        return Restored(step, layout.from_natural(r.state), dict(r.data), dict(r.meta))

    def _set_aside(self, step: int, what: str, previous: int | None) -> None:
        """Rename an unreadable checkpoint to `<step>.corrupt` (kept for a post-mortem, out of
        orbax's sight) and tell the user in one line what comes next: the `previous`
        checkpoint, or (None) a start from step 0."""
        src = os.path.join(self.directory, str(step))
        dst = src + ".corrupt"
        n = 1
        while os.path.exists(dst):
            n += 1
            dst = f"{src}.corrupt{n}"
        if jax.process_index() == 0:
            os.rename(src, dst)
            print(f"hetjax: checkpoint {step} in {self.directory} cannot be read ({what}); "
                  f"moved aside to {os.path.basename(dst)}, "
                  + (f"trying the previous one ({previous})" if previous is not None else
                     "and there is no earlier checkpoint: starting from step 0"),
                  file=sys.stderr, flush=True)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"hetjax_set_aside_{step}")
        self.manager.reload()

    def wait(self) -> None:
        """Block until an asynchronous save in flight is committed."""
        if self._manager is not None:
            try:
                self._manager.wait_until_finished()
            except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
                err = storage_error(e, self.directory)
                if err is None:
                    raise
                raise err from None

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()

"""A layout: a Plan before its layer split, what the cost model's per-layer stage costs depend on.

`Layout` is the Plan itself with `stage_layers` left empty (keyword-only, default ()): its fields
are the Plan's, so a field the Plan gains is a field of every layout; the Plan's checks run when
a layout becomes a Plan. The search prices
layouts (`CostModel.stage_costs`), the partition chooses the split, `with_plan` fixes it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Sequence

import numpy as np

from hetjax.core.plan import Plan
from hetjax.errors import PlanError

# Fields of a Plan that are not the layout: the split the partition chooses and the
# predictions the cost model fills in.
_NOT_LAYOUT = ("stage_layers", "predicted")


@dataclass(frozen=True)
class Layout(Plan):
    """A Plan without its layer split (`stage_layers` empty)."""

    stage_layers: tuple[int, ...] = field(default=(), kw_only=True)

    def __post_init__(self):
        # Not the Plan's checks: the search builds layouts from checked degrees and orders and
        # copies each for every micro-batch count, schedule and ZeRO point (checking that a
        # 4,096-device order is a permutation each time took a third of its time); the Plan
        # that `with_plan` makes is checked.
        if self.stage_layers:
            raise PlanError(f"a Layout has no layer split (stage_layers = {self.stage_layers}); "
                            "give the split to with_plan")
        if not self.device_order:
            object.__setattr__(self, "device_order", tuple(range(self.num_devices)))

    @staticmethod
    def of(plan: Plan) -> "Layout":
        """The layout of `plan` (its fields, less the split and the predictions)."""
        return Layout(**{f.name: getattr(plan, f.name) for f in fields(Plan)
                         if f.init and f.name not in _NOT_LAYOUT})

    @property
    def folded(self) -> bool:
        return self.placement == "folded" and self.pp > 1

    @functools.cached_property
    def _mesh(self) -> np.ndarray:
        # by the order's identity first: layouts copied from one another share its tuple,
        # and hashing thousands of ranks for _mesh_of's cache cost more than the copy
        key = (id(self.device_order), self.pp, self.dp, self.tp)
        got = _RECENT.get(key)
        if got is None or got[0] is not self.device_order:
            if len(_RECENT) >= 512:
                _RECENT.clear()
            got = _RECENT[key] = (self.device_order,
                                  _mesh_of(self.device_order, self.pp, self.dp, self.tp))
        return got[1]

    def mesh(self) -> np.ndarray:
        """[pp, dp, tp] ranks (read-only; built once: the search asks for it often)."""
        return self._mesh

    def tokens_per_device(self) -> float:
        """Tokens one device processes per micro-batch."""
        return self.global_batch / self.microbatches / self.dp * self.seq_len

    def with_plan(self, stage_layers: Sequence[int], **kw) -> Plan:
        """The Plan of this layout with `stage_layers` layers per stage."""
        kw = {"device_order": tuple(map(int, self.device_order)), **kw}
        return Plan(**{f.name: getattr(self, f.name) for f in fields(Plan)
                       if f.init and f.name not in _NOT_LAYOUT and f.name not in kw},
                    stage_layers=tuple(stage_layers), **kw)


# (id(order), pp, dp, tp) -> (the order, its mesh): the order is kept, so its id is not reused
_RECENT: dict[tuple, tuple[tuple[int, ...], np.ndarray]] = {}


@functools.lru_cache(maxsize=512)
def _mesh_of(device_order: tuple[int, ...], pp: int, dp: int, tp: int) -> np.ndarray:
    """[pp, dp, tp] ranks, read-only and shared: the search copies a layout for every
    micro-batch count, schedule and ZeRO point, and converting thousands of ranks each time
    cost more than hashing them."""
    mesh = np.array(device_order, dtype=np.int64).reshape(pp, dp, tp)
    mesh.flags.writeable = False  # shared by every caller
    return mesh


__all__ = ["Layout"]

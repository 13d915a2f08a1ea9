"""The plausibility guard: what a set of compute and link rates was fitted on (a `FitRange`:
model sizes, device counts, fabrics, accelerator kinds, the MFU the fitted runs reached), and
how far a prediction lies outside it (`plausibility_lines`, which `hetjax plan` prints).
The published runs (hetjax/planner/reference_runs.py) and a calibration file
(hetjax/planner/calibrate.py) each state their range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hetjax.core.topology import Topology

if TYPE_CHECKING:
    from hetjax.core.model_config import ModelConfig

# A prediction this many times beyond the fitted model sizes or device counts is flagged.
EXTRAPOLATION_FACTOR = 10.0


@dataclass(frozen=True)
class FitRange:
    """What a set of compute / link rates was fitted on: model sizes (parameters), device
    counts, fabrics (link kinds), accelerator kinds, and the MFU the fitted runs reached
    (None when measured by `hetjax calibrate`, which runs no whole step)."""

    source: str
    params: tuple[float, float]
    devices: tuple[int, int]
    fabrics: tuple[str, ...]
    accelerators: tuple[str, ...]
    mfu: tuple[float, float] | None = None


def link_kinds(topology: Topology) -> tuple[str, ...]:
    kinds = {k for c in topology.clusters for k in (c.nic.kind, c.intra_node.kind)
             if not (k == c.nic.kind and c.nodes == 1)}
    if len(topology.clusters) > 1:
        kinds |= {cl.link.kind for cl in topology.cluster_links}
        if topology.inter_cluster is not None:
            kinds.add(topology.inter_cluster.kind)
    return tuple(sorted(kinds))


def _span(lo: float, hi: float, fmt) -> str:
    return fmt(lo) if lo == hi else f"{fmt(lo)}-{fmt(hi)}"


def _params(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e8 else f"{n / 1e6:.3g}M"


def plausibility_lines(mfu: float, model: "ModelConfig", topology: Topology,
                       fit: FitRange) -> list[str]:
    """The predicted MFU beside the range its rates were fitted on, and one warning naming
    every way the plan extrapolates far outside it (model size or device count beyond
    EXTRAPOLATION_FACTOR, a fabric or accelerator never fitted, an MFU far from the fitted)."""
    fitted = [f"{_span(*fit.params, _params)} parameters",
              f"{_span(*fit.devices, lambda n: f'{n:,}')} devices",
              "/".join(fit.fabrics), "/".join(fit.accelerators)]
    if fit.mfu is not None:
        fitted.insert(0, f"{_span(fit.mfu[0] * 100, fit.mfu[1] * 100, lambda x: f'{x:.0f}')}% MFU")
    lines = [f"predicted MFU {mfu:.1%}; the compute and link rates were fitted on "
             f"{fit.source}: {', '.join(fitted)}"]
    far, f = [], EXTRAPOLATION_FACTOR
    n, d = model.num_params, topology.num_devices
    if not fit.params[0] / f <= n <= fit.params[1] * f:
        far.append(f"a model of {_params(n)} parameters")
    if not fit.devices[0] / f <= d <= fit.devices[1] * f:
        far.append(f"{d:,} devices")
    fabrics = sorted(set(link_kinds(topology)) - set(fit.fabrics))
    if fabrics:
        far.append(f"fabric {'/'.join(fabrics)} never fitted")
    accs = sorted({c.accelerator.name for c in topology.clusters} - set(fit.accelerators))
    if accs:
        far.append(f"accelerator {'/'.join(accs)} never fitted")
    if fit.mfu is not None and not fit.mfu[0] / 2 <= mfu <= min(1.0, fit.mfu[1] * 1.5):
        far.append(f"an MFU of {mfu:.1%}")
    if far:
        lines.append(f"warning: this prediction extrapolates far outside that fit: "
                     f"{'; '.join(far)} -- measure these devices with 'hetjax calibrate' "
                     "and plan with --config.planner.calibration=FILE")
    return lines


__all__ = ["FitRange", "plausibility_lines", "link_kinds", "EXTRAPOLATION_FACTOR"]

"""A band, not a point: how far a prediction may be off, from what priced it.

A step time predicted from a measured compute profile inherits the measurements' spread and
grows with how far the profile was extrapolated (per doubling beyond the measured sizes or TP
degrees); one predicted by the flat model (no profile) carries the flat model's error on
measured runs it was not fitted on. Memory predicted by the fitted terms carries their error
against XLA's `memory_analysis()` grid; measured peak bytes their spread. The relative parts
add in quadrature: `step_band(...)` and `memory_band(...)` return the relative half-width.
"""

from __future__ import annotations

import math

# The flat model's mean |error| on held-out measured steps: docs/results/predict.md, "emulated
# cluster" rows of scripts/bench_predict.py priced without a profile.
FLAT_STEP_ERROR = 0.25
# How much a profile's answer loses per doubling of the distance beyond what was measured:
# the held-out extrapolation rows of scripts/bench_predict.py (a size predicted from the
# sizes below it) were off by about this much per doubling.
PER_DOUBLING = 0.10
# The fitted memory terms against XLA's memory_analysis() (tests/test_memory.py: within 10%).
MEMORY_TERMS_ERROR = 0.10


def step_band(source: str, spread: float, distance: float) -> float:
    """Relative half-width of a predicted step: the flat model's error when the flat model
    priced any stage's compute, else the profile's spread; both plus the extrapolation."""
    base = FLAT_STEP_ERROR if "flat" in source else 0.0
    far = PER_DOUBLING * math.log2(max(distance, 1.0))
    return math.sqrt(base ** 2 + spread ** 2 + far ** 2)


def memory_band(measured: bool, spread: float = 0.0) -> float:
    """Relative half-width of predicted memory: the fitted terms' error, or a measured
    profile's spread."""
    return spread if measured else MEMORY_TERMS_ERROR


__all__ = ["step_band", "memory_band", "FLAT_STEP_ERROR", "PER_DOUBLING", "MEMORY_TERMS_ERROR"]

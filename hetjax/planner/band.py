"""A band, not a point: how far a prediction may be off, from what priced it.

A step time predicted from a measured compute profile carries the error such predictions made
on measured steps they were not fitted on, the measurements' spread, and grows with how far the
profile was extrapolated (per doubling beyond the measured sizes or TP degrees); one predicted
by the flat model (no profile) carries the flat model's error on measured runs it was not
fitted on. Memory predicted by the fitted terms carries their error against XLA's
`memory_analysis()` grid; measured peak bytes their spread. Each constant below is a
measurement of scripts/bench/predict.py. The relative parts add in quadrature: `step_band(...)`
and `memory_band(...)` return the relative half-width.
"""

from __future__ import annotations

import math

# The flat model's mean |error| on measured runs none of its constants was fitted on:
# Megatron-LM's Table 1 priced flat (efficiency 0.72, fitted on Holmes), 35% (worst 64%).
FLAT_STEP_ERROR = 0.35
# Steps priced from a measured profile: the emulated cluster's runs priced from their
# calibration file's profile, mean |error| 11% (docs/results/predict.md).
PROFILE_STEP_ERROR = 0.11
# How much a profile's answer loses per doubling of the distance beyond what was measured:
# the smallest and largest measured size of each piece in the kept calibration files, read
# from the other sizes one doubling away, were off by 12% on average (docs/results/
# predict.md, "profile, a size held out").
PER_DOUBLING = 0.12
# The fitted memory terms against XLA's memory_analysis() (tests/test_memory.py: within 10%).
MEMORY_TERMS_ERROR = 0.10


def step_band(source: str, spread: float, distance: float) -> float:
    """Relative half-width of a predicted step: the flat model's error when the flat model
    priced any stage's compute, else a profile's; plus the spread and the extrapolation."""
    base = FLAT_STEP_ERROR if "flat" in source else PROFILE_STEP_ERROR
    far = PER_DOUBLING * math.log2(max(distance, 1.0))
    return math.sqrt(base ** 2 + spread ** 2 + far ** 2)


def memory_band(measured: bool, spread: float = 0.0) -> float:
    """Relative half-width of predicted memory: the fitted terms' error, or a measured
    profile's spread."""
    return spread if measured else MEMORY_TERMS_ERROR


__all__ = ["step_band", "memory_band", "FLAT_STEP_ERROR", "PROFILE_STEP_ERROR", "PER_DOUBLING",
           "MEMORY_TERMS_ERROR"]

"""Scoring predictions against measurements: relative and absolute errors, and whether the
predictions rank the runs as the measurements do (Spearman's and Kendall's rank correlations).
The benches that hold the cost model against measured runs report these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hetjax.errors import PlanError


def _ranks(x: Sequence[float]) -> np.ndarray:
    """Ranks from 1, ties sharing their mean rank."""
    x = np.asarray(x, float)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        ranks[x == v] = ranks[x == v].mean()
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties averaged)."""
    ra, rb = _ranks(a), _ranks(b)
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b: (concordant - discordant) pairs over the pairs not tied, with ties
    in either sequence corrected for."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    i, j = np.triu_indices(len(a), k=1)
    da, db = np.sign(a[i] - a[j]), np.sign(b[i] - b[j])
    n_a, n_b = np.count_nonzero(da), np.count_nonzero(db)
    if n_a == 0 or n_b == 0:
        return float("nan")
    return float(np.sum(da * db) / np.sqrt(n_a * n_b))


@dataclass(frozen=True)
class PredictionErrors:
    """How well predicted step times match measured ones."""

    n: int
    mae_s: float  # mean absolute error, seconds
    mean_relative: float  # mean |predicted - measured| / measured
    spearman: float
    kendall: float


def prediction_errors(predicted: Sequence[float], measured: Sequence[float]) -> PredictionErrors:
    p, m = np.asarray(predicted, float), np.asarray(measured, float)
    if len(p) != len(m) or not len(p):
        raise PlanError(f"need as many predictions as measurements, got {len(p)} and {len(m)}")
    return PredictionErrors(len(p), float(np.mean(np.abs(p - m))),
                            float(np.mean(np.abs(p - m) / m)), spearman(p, m), kendall_tau(p, m))


__all__ = ["spearman", "kendall_tau", "PredictionErrors", "prediction_errors"]

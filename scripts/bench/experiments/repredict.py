"""Saved bench runs priced again: every configuration of one or more results files
(`runs/bench_hetnet.json`, `runs/bench_hetaccel.json`) predicted with other calibration files,
and how far the same layout measured from one run to the next.

    python scripts/bench/repredict.py RUN.json [RUN2.json ...] [--calibration FILE ...]

It separates the two sources of a prediction error that one accuracy table mixes: the
calibration's (another file measured on the same cluster predicts the same run better or
worse) and the run's (the same layout, measured again on a quiet machine, moved by as much).
Without --calibration each run's own file is used (the bench keeps a copy beside its
results: `<results>.calibration.json`). Predictions are `hetjax plan`'s, as in the benches
(`harness.predict_case`); nothing is trained.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

import numpy as np

from hetjax.errors import HetjaxError
from .harness import (Case, Workload, fmt, kept_calibration_path,
                                        predict_case, table)
from hetjax.core.plan import Plan
from hetjax.planner.scoring import prediction_errors


def experiment_cases(record: dict) -> dict[str, Case]:
    """The configurations of the bench that wrote `record`, by name (their topologies and
    extra flags; the layouts come from the record)."""
    from . import hetaccel, hetnet

    work, cpus = Workload(**record["workload"]), record["cpus"]
    command = record.get("command", "")
    # scripts/bench/NAME.py (runs before the scripts were grouped: scripts/bench_NAME.py)
    for name, cases in (("hetaccel", hetaccel.hetaccel_cases), ("hetnet", hetnet.nic_cases)):
        if f"bench/{name}.py" in command or f"bench_{name}.py" in command:
            return {c.name: c for c in cases(work, cpus)}
    raise HetjaxError(f"results file written by {command!r}, not by scripts/bench/hetnet.py "
                      "or scripts/bench/hetaccel.py; give one of their --json files")


@dataclass
class Run:
    """One results file: its measured rows (name -> (plan, mean seconds per step))."""

    path: str
    record: dict
    rows: dict[str, tuple[Plan, float]]

    @staticmethod
    def load(path: str) -> "Run":
        try:
            with open(path) as f:
                record = json.load(f)
            if "compute" in record and "cases" not in record:
                raise HetjaxError(f"{path!r} is a calibration file, not a bench's results; "
                                  "give it with --calibration FILE")
            rows = {c["name"]: (Plan.from_dict(c["plan"]), float(c["mean_s"]))
                    for c in record["cases"] if c.get("plan") and c.get("mean_s")}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HetjaxError(f"cannot read the bench results {path!r} ({type(e).__name__}: "
                              f"{e}); give a file a bench wrote with --json") from None
        return Run(path, record, rows)

    def own_calibration(self) -> str | None:
        """The calibration file this run was predicted with, if it still exists: the copy
        kept beside the results, else the path the run recorded."""
        for path in (kept_calibration_path(self.path), self.record.get("calibration")):
            if path and os.path.exists(path):
                return path
        return None


def layout_key(plan: Plan) -> str:
    """A layout's identity across runs: the plan without what was predicted for it."""
    d = plan.to_dict()
    return json.dumps({k: v for k, v in d.items() if k not in ("predicted", "source")},
                      sort_keys=True, default=str)


def run_to_run(runs: list[Run]) -> list[tuple[str, list[float | None], float | None]]:
    """Per configuration: each run's measured s/step (None where it did not run) and, when
    every run ran the same layout, the largest over the smallest (else None)."""
    out = []
    for name in dict.fromkeys(n for r in runs for n in r.rows):
        got = [r.rows.get(name) for r in runs]
        seconds = [g[1] for g in got if g]
        same = len(seconds) == len(runs) > 1 and len({layout_key(g[0]) for g in got}) == 1
        out.append((name, [g[1] if g else None for g in got],
                    max(seconds) / min(seconds) if same else None))
    return out


def repredict(runs: list[Run], calibrations: list[str]) -> list[dict]:
    """Every run's rows priced with every calibration file: one dict per (run, file) with
    the predictions, mean absolute relative error and Spearman against that run."""
    out = []
    for run in runs:
        cases = experiment_cases(run.record)
        work = Workload(**run.record["workload"])
        for cal in calibrations or [run.own_calibration()]:
            if cal is None:
                raise HetjaxError(f"{run.path}'s calibration file is gone; give one with "
                                  "--calibration FILE")
            names = [n for n in run.rows if n in cases]
            predicted = [predict_case(run.rows[n][0], cases[n].topology, work, cal,
                                      cases[n].extra).step_time for n in names]
            measured = [run.rows[n][1] for n in names]
            err = prediction_errors(predicted, measured)
            out.append({"run": run.path, "calibration": cal, "names": names,
                        "predicted": predicted, "measured": measured,
                        "mae": err.mean_relative, "spearman": err.spearman})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("runs", nargs="+", metavar="RUN.json", help="results files of a bench")
    ap.add_argument("--calibration", action="append", default=[], metavar="FILE",
                    help="a calibration file to price every run with (repeatable; default: "
                         "each run's own)")
    args = ap.parse_args(argv)
    runs = [Run.load(p) for p in args.runs]
    for c in args.calibration:
        if not os.path.exists(c):
            raise HetjaxError(f"--calibration {c!r} does not exist; give a file "
                              "`hetjax calibrate` wrote")
    if len(runs) > 1:
        spread = run_to_run(runs)
        print("## The same configuration, measured in each run (s/step)\n")
        print(table(["configuration", *[r.path for r in runs],
                     "largest / smallest"],
                    [[name, *[fmt(t, ".3f") for t in seconds],
                      fmt(ratio, ".3f") if ratio else "different layouts"]
                     for name, seconds, ratio in spread]))
        ratios = [ratio for _, _, ratio in spread if ratio]
        if ratios:
            print(f"\nthe same layout in every run: {len(ratios)} configurations, largest / "
                  f"smallest {min(ratios):.3f} to {max(ratios):.3f} (mean {np.mean(ratios):.3f})")
    results = repredict(runs, args.calibration)
    print("\n## Every run priced with every calibration file\n")
    rows = []
    for res in results:
        errors = " ".join(f"{p / m - 1:+.0%}" for p, m in zip(res["predicted"], res["measured"]))
        rows.append([res["run"], res["calibration"], f"{res['mae']:.1%}",
                     f"{res['spearman']:.2f}", errors])
    print(table(["run", "calibration", "mean abs. error", "Spearman",
                 "error per row (run's order)"], rows))
    return 0


__all__ = ["Run", "repredict", "run_to_run", "experiment_cases",
           "layout_key", "main"]

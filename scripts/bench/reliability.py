"""Crash and restart, measured: `hetjax launch --local 4 --max-restarts 1` with one worker killed
by SIGKILL mid-run finishes with the losses of an uninterrupted run (docs/reliability.md).

    PYTHONPATH=. python scripts/bench/reliability.py [--steps 40] [--kill-after 12] [--elastic]
    python scripts/bench/reliability.py --smoke   # --steps 7 --kill-after 6 (the suite runs it)

Runs the tiny job twice in temporary workdirs: once undisturbed, once killing process p2 with
SIGKILL after step `--kill-after` has been logged; prints both loss lists, the restart lines of
the launcher and whether the losses match (rtol 1e-6). With --elastic the restart drops p2's
host and re-plans on the 6 devices left (batch 24, so dp = 6 fits): losses up to the restored
checkpoint must match, later ones continue from it under the new plan (reported, not
required to be bit-equal: the data-parallel reduction order changes). Takes a few minutes on
2 cores.

--smoke is the same two launches, shorter: 7 steps, p2 killed after step 6, the restart
resuming from the checkpoint of step 5 (under a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = {"model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
        "model.d_ff": 64, "model.max_seq_len": 64, "train.seq_len": 16, "train.batch_size": 16,
        "train.warmup_steps": 1, "train.log_every": 1, "train.progress": False,
        "data.source": "synthetic", "tensorboard": False, "checkpoint.every": 5,
        "checkpoint.async_save": False}


def losses(workdir: str) -> dict[int, float]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return {r["step"]: r["loss"] for r in rows}


def launch(workdir: str, steps: int, kill_after: int | None, elastic: bool
           ) -> tuple[int, str, float]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = REPO
    cfg = {**TINY, "train.steps": steps, "workdir": workdir,
           **({"train.batch_size": 24} if elastic else {})}
    cmd = [sys.executable, "-m", "hetjax", "launch", "--local", "4", "--grace", "5",
           "--max-restarts", "1", *(["--elastic"] if elastic else []),
           *[f"--config.{k}={v}" for k, v in cfg.items()]]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    if kill_after is not None:
        while max(losses(workdir), default=0) < kill_after and proc.poll() is None:
            time.sleep(0.2)
        pid = int(re.search(r"started p2 \(pid (\d+)\)", "".join(lines))[1])
        os.kill(pid, 9)
        print(f"killed p2 (pid {pid}) after step {max(losses(workdir))} was logged", flush=True)
    rc = proc.wait()
    reader.join(timeout=10)
    return rc, "".join(lines), time.monotonic() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-after", type=int, default=12)
    ap.add_argument("--elastic", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="shorter: --steps 7 --kill-after 6 (a checkpoint every 5 steps)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.kill_after = 7, 6
    with tempfile.TemporaryDirectory() as tmp:
        ref_dir, crash_dir = os.path.join(tmp, "ref"), os.path.join(tmp, "crash")
        rc_ref, _, t_ref = launch(ref_dir, args.steps, None, args.elastic)
        rc, out, t = launch(crash_dir, args.steps, args.kill_after, args.elastic)
        ref, got = losses(ref_dir), losses(crash_dir)
        print(f"uninterrupted: exit {rc_ref}, {t_ref:.0f} s, losses {len(ref)} steps")
        print(f"killed + restarted: exit {rc}, {t:.0f} s, losses {len(got)} steps")
        shown, resumed = False, 0
        for line in out.splitlines():
            if "--elastic" in line:
                shown = True  # the re-plan: print it whole, up to the first worker line
            elif shown and line.startswith("hetjax launch: started"):
                shown = False
            if shown or "hetjax launch:" in line and ("restart" in line or "killed" in line or
                                                      "failed" in line) or "resumed from" in line:
                print("  " + line)
            if "resumed from checkpoint" in line:
                resumed = int(line.split("resumed from checkpoint ")[1].split()[0])
        upto = resumed if args.elastic else max(ref, default=0)
        same = sorted(ref) == sorted(got) and all(
            abs(ref[k] - got[k]) <= 1e-6 * abs(ref[k]) for k in ref if k <= upto)
        print(f"losses equal (rtol 1e-6) up to step {upto}: {same}")
        if args.elastic:
            later = [abs(ref[k] - got[k]) / abs(ref[k]) for k in ref if k > upto and k in got]
            print(f"after the re-planned restart: max relative difference {max(later):.2e} "
                  f"over {len(later)} steps")
        print("step  uninterrupted  restarted")
        for k in sorted(ref):
            print(f"{k:>4}  {ref[k]:.6f}      {got.get(k, float('nan')):.6f}")
        return 0 if rc_ref == 0 and rc == 0 and same else 1


if __name__ == "__main__":
    sys.exit(main())

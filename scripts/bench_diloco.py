"""DiLoCo (H inner steps a round) against synchronous data parallelism across 3 sites joined by
a slow link: loss after the same tokens, tokens/s, bytes per step crossing the sites.

    python scripts/bench_diloco.py                       # 300 steps, H = 50, 5 Mbit/s, 20 ms
    python scripts/bench_diloco.py --steps 600 --mbps 5 --codec int8 --codec none

What is measured and what is modelled (one process, 3 sites of 2 simulated CPU devices):
- loss: measured. Both runs train the same model on the same token stream of the default
  corpus (data.source=stdlib) for the same number of steps (so the same tokens); "eval" is the
  held-out loss of the final parameters (DiLoCo: the outer parameters after the last round).
- compute: measured, the steady wall time per step of each run in this process (DiLoCo's three
  sites run one after another here, so its compute is over-counted against three machines).
- communication: modelled, not measured. The inter-site time per step comes from
  hetjax/planner/diloco.py (ring all-reduce over the slowest inter-site link, alpha-beta) for
  the bytes each run really produces (sync: the fp32 gradient every step; DiLoCo: the encoded
  pseudo-gradients the executor exchanged, counted as they were sent). The emulated testbed
  (hetjax/testbed.py) is not used: the DiLoCo executor runs in one process for now.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=6").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def three_sites(mbps: float, ms: float):
    from hetjax.topology import Link, Topology, make_cluster

    wan = Link("ethernet", mbps / 1000, ms * 1e3)
    return Topology(name=f"three_sites_{mbps:g}mbps",
                    clusters=tuple(make_cluster(s, 1, 2, "cpu", "infiniband")
                                   for s in ("ohio", "tokyo", "london")),
                    inter_cluster=wan)


def run(label, overrides, args, topology):
    from hetjax.config import load_config
    from hetjax.train import Trainer

    base = [f"--config.train.steps={args.steps}", f"--config.train.batch_size={args.batch}",
            f"--config.train.seq_len={args.seq_len}", "--config.checkpoint.every=0",
            f"--config.eval.every={args.steps}", "--config.eval.batches=8",
            "--config.tensorboard=False", "--config.train.progress=False",
            f"--config.workdir={args.workdir}/{label.replace(' ', '_')}"]
    cfg = load_config(None, base + [f"--config.{k}={v}" for k, v in overrides.items()])
    tr = Trainer(cfg, topology=topology, quiet=True)
    losses, times = [], []
    t = [time.perf_counter()]

    def record(info):
        losses.append(info.metrics["loss"])
        now = time.perf_counter()
        times.append(now - t[0])
        t[0] = now

    tr.add_hook(record, every=1)
    t0 = time.perf_counter()
    summary = tr.train()
    wall = time.perf_counter() - t0
    steady = statistics.median(times[5:])  # after compilation; exchanges included on average
    mean_steady = sum(times[5:]) / len(times[5:])
    ex = tr.executor
    return {"label": label, "final_loss": statistics.mean(losses[-10:]),
            "eval_loss": summary["eval_loss"], "step_s_median": steady,
            "step_s_mean": mean_steady, "wall_s": wall,
            "tokens_per_step": tr.tokens_per_step, "num_params": tr.model_cfg.num_params,
            "exchanges": getattr(ex, "exchanges", None),
            "wire_bytes": getattr(ex, "bytes_sent", None)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--H", type=int, default=50)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--mbps", type=float, default=5.0)
    ap.add_argument("--ms", type=float, default=20.0)
    ap.add_argument("--codec", action="append", default=None)
    ap.add_argument("--workdir", default="runs/bench_diloco")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    codecs = args.codec or ["none", "int8"]

    from hetjax.planner.cost import ring_time
    from hetjax.planner.diloco import site_clusters, slowest_site_link

    topology = three_sites(args.mbps, args.ms)
    sites = site_clusters(topology)
    n, link = len(sites), slowest_site_link(topology, sites)
    results = [run("synchronous DP", {}, args, topology)]
    for codec in codecs:
        results.append(run(f"DiLoCo H={args.H} {codec}",
                           {"diloco.inner_steps": args.H, "diloco.codec": codec}, args, topology))
    ring = 2 * (n - 1) / n  # what a ring all-reduce sends from each site, per byte reduced
    rows = []
    for r in results:
        if r["exchanges"] is None:  # synchronous: the fp32 gradient every step
            per_exchange, every = 4.0 * r["num_params"], 1
        else:
            per_exchange, every = r["wire_bytes"] / (n * r["exchanges"]), args.H
        comm = ring_time("all_reduce", per_exchange, n, link) / every
        compute = r["step_s_mean"]
        r.update(bytes_per_step_site=ring * per_exchange / every, comm_s=comm,
                 modelled_step_s=compute + comm,
                 tokens_per_s=r["tokens_per_step"] / (compute + comm))
        rows.append(r)
    sync = rows[0]
    print(f"3 sites x 2 CPU devices, link {args.mbps:g} Mbit/s {args.ms:g} ms between sites, "
          f"{sync['num_params'] / 1e6:.2f}M parameters, {args.steps} steps x "
          f"{sync['tokens_per_step']} tokens")
    head = ("run", "loss (last 10)", "eval loss", "vs sync", "compute/step", "comm/step",
            "tokens/s", "speed-up", "bytes/step/site")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join([
            r["label"], f"{r['final_loss']:.4f}", f"{r['eval_loss']:.4f}",
            f"{(r['eval_loss'] / sync['eval_loss'] - 1) * 100:+.1f}%",
            f"{r['step_s_mean'] * 1e3:.1f} ms (measured)", f"{r['comm_s'] * 1e3:.1f} ms (model)",
            f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / sync['tokens_per_s']:.1f}x",
            f"{r['bytes_per_step_site'] / 1e3:,.1f} kB"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

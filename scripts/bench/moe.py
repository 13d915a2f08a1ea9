"""Mixture-of-Experts beside the dense model of equal active parameters: step time, compiled
FLOPs against 6 x active parameters x tokens, and parameters, on CPU devices.

    python scripts/bench/moe.py                  # d_model 256, 4 layers, 8 experts, top-2
    python scripts/bench/moe.py --steps 10 --batch 16 --seq 256
    python scripts/bench/moe.py --smoke          # seconds: a tiny shape, one timed step

Rows: the dense model (SwiGLU of width d_ff); the MoE model with E experts of width d_ff / k,
top-k, so a token passes the same FFN parameters, with each dispatch (dense, dropless,
capacity at factor 1.0 and 1.25) on one device; and dropless with expert parallelism over 4
simulated devices (one program, the all-to-alls on fixed buffers). "FLOPs / 6NT" is XLA's
compiled FLOPs of the step over 6 x active parameters x tokens (attention's QK^T and AV and
the optimizer update are the rest), read from the row's one-layer twin: XLA's cost analysis
counts a loop's body once, and the layers are a loop. Step time is the median of --steps
steps after a warm-up; on shared CPU cores it measures contention as much as anything. XLA's
CPU backend runs `ragged_dot` (dropless) densely, every row through every expert's weights,
so dropless costs E times the feed-forward's active FLOPs here; on GPUs it is a grouped
matmul.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

ROWS = [  # (label, model overrides, devices)
    ("dense", {}, 1),
    ("MoE, dense dispatch", {"model.moe_dispatch": "dense"}, 1),
    ("MoE, dropless", {"model.moe_dispatch": "dropless"}, 1),
    ("MoE, capacity 1.0", {"model.moe_dispatch": "capacity", "model.moe_capacity_factor": 1.0},
     1),
    ("MoE, capacity 1.25", {"model.moe_dispatch": "capacity",
                            "model.moe_capacity_factor": 1.25}, 1),
    ("MoE, dropless, EP 4", {"model.moe_dispatch": "dropless", "parallel.ep": 4}, 4),
]


def config(args, overrides: dict, devices: int, workdir: str, layers: int = 0):
    from hetjax.config import base_config

    c = base_config()
    m = c.model
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads = args.d_model, layers or args.layers, 4, 4
    m.d_ff, m.vocab_size, m.max_seq_len = args.d_ff, 512, args.seq
    m.dtype, m.remat = "float32", "none"
    if overrides:  # the MoE model: E experts of d_ff / k, top-k
        m.n_experts, m.experts_per_token = args.experts, args.k
        m.moe_d_ff = args.d_ff // args.k
    c.topology.preset, c.topology.devices_per_node = "cpu_single", devices
    c.parallel.pp, c.parallel.dp, c.parallel.tp = 1, devices, 1
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    t = c.train
    t.batch_size, t.seq_len, t.steps, t.microbatches = args.batch, args.seq, 1, 1
    t.progress, t.warmup_steps = False, 1
    c.data.source = "synthetic"
    c.eval.every = c.checkpoint.every = 0
    c.tensorboard = False
    c.workdir = workdir
    return c


def flops_ratio(args, overrides: dict, devices: int) -> float:
    """Compiled FLOPs of the one-layer twin's step over its 6 x active parameters x tokens."""
    from hetjax.train import Trainer

    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config(args, overrides, devices, workdir, layers=1), quiet=True)
        cost = trainer.executor.compiled_step(trainer.state).cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        m = trainer.executor.model_cfg
        return float(cost["flops"]) / (6.0 * m.active_params * args.batch * args.seq)


def measure(args, overrides: dict, devices: int) -> dict:
    import jax

    from hetjax.train import Trainer

    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config(args, overrides, devices, workdir), quiet=True)
        jax.block_until_ready(trainer.step()["loss"])  # compile and warm up
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            jax.block_until_ready(trainer.step()["loss"])
            times.append(time.perf_counter() - t)
        m = trainer.executor.model_cfg
        return {"step_s": statistics.median(times), "params": m.num_params,
                "active": m.active_params, "flops_ratio": flops_ratio(args, overrides, devices)}


def table(rows: list[tuple[str, dict]], args) -> str:
    tokens = args.batch * args.seq
    lines = [f"d_model {args.d_model}, {args.layers} layers, d_ff {args.d_ff}; MoE: "
             f"{args.experts} experts of {args.d_ff // args.k}, top-{args.k}; batch "
             f"{args.batch} x {args.seq} tokens, float32, median of {args.steps} steps",
             "| model | parameters | active | step | tokens/s | FLOPs / 6NT |",
             "|---|---|---|---|---|---|"]
    for label, r in rows:
        lines.append(f"| {label} | {r['params'] / 1e6:.2f} M | {r['active'] / 1e6:.2f} M | "
                     f"{r['step_s'] * 1e3:.0f} ms | {tokens / r['step_s']:,.0f} | "
                     f"{r['flops_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shape, one timed step")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.d_model, args.layers, args.d_ff, args.batch, args.seq, args.steps = (
            32, 2, 64, 4, 16, 1)
    rows = []
    for label, overrides, devices in ROWS:
        rows.append((label, measure(args, overrides, devices)))
        print(f"  {label}: {rows[-1][1]['step_s'] * 1e3:.0f} ms", flush=True)
    print(table(rows, args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

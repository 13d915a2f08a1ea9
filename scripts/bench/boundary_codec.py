"""The loss effect of int8 pipeline boundaries (`pipeline.boundary_codec`) over a longer run.

Two worlds (threads of this process, a real bridge each, the MPMD executor across them, as in
tests/test_bridge.py) train the same tiny pipeline on the default corpus (data.source=stdlib,
byte tokenizer) with uncompressed and with int8 boundaries (activations and, with error
feedback, their gradients); the same batches, seed and schedule. Prints the training loss
(mean of windows) and the held-out loss at the end for both.

    nice -n 19 python scripts/bench/boundary_codec.py --steps 300
    python scripts/bench/boundary_codec.py --smoke     # seconds (the suite runs it)

--smoke: the same two runs (both worlds, both codecs, the same table) for 2 steps on a smaller
model and synthetic data, one held-out batch, the workdir under --workdir (default: a
temporary directory).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


# --smoke: after the run's own settings
SMOKE = {"model.d_model": 32, "model.d_ff": 64, "train.seq_len": 16, "train.batch_size": 8,
         "data.source": "synthetic"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--window", type=int, default=50, help="steps averaged per loss column")
    ap.add_argument("--workdir", default="",
                    help="the trainer's workdir (default: /tmp/bench_boundary; with --smoke a "
                         "temporary directory)")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: 2 steps of a smaller model on synthetic data")
    args = ap.parse_args(argv)
    if not args.smoke:
        return bench(args, args.workdir or "/tmp/bench_boundary", {})
    args.steps, args.eval_batches, args.window = 2, 1, 1
    with tempfile.TemporaryDirectory() as tmp:
        return bench(args, args.workdir or tmp, SMOKE)


def bench(args, workdir: str, extra: dict) -> int:
    """Train both codecs on the same batches; print the table."""
    import numpy as np

    from hetjax.config import load_config
    from hetjax.distributed import free_port
    from hetjax.planner.worlds import plan_worlds
    from hetjax.train import Trainer
    from hetjax.parallel.bridge import Bridge
    from hetjax.parallel.mpmd_worlds import WorldsExecutor

    over = {"model.d_model": 64, "model.d_ff": 128, "model.n_layers": 4, "model.n_heads": 4,
            "model.n_kv_heads": 2, "model.max_seq_len": 64, "train.seq_len": 64,
            "parallel.pp": 2, "parallel.dp": 4, "parallel.tp": 1,
            "pipeline.stage_layers": (2, 2), "pipeline.schedule": "1f1b",
            "pipeline.microbatches": 2, "pipeline.executor": "mpmd", "train.batch_size": 16,
            "train.steps": args.steps, "checkpoint.every": 0, "eval.every": 0,
            "tensorboard": False, "train.progress": False, "workdir": workdir, **extra}
    cfg = load_config(None, [f"--config.{k}={v}" for k, v in over.items()])
    trainer = Trainer(cfg, quiet=True)
    batches = [next(trainer.data) for _ in range(args.steps)]
    evals = trainer._open_eval_data()
    held_out = [next(evals) for _ in range(args.eval_batches)]
    plan, topo = trainer.plan, trainer.topology
    worlds = plan_worlds(plan, topo)
    assert len(worlds) == 2, worlds
    owner = {r: w.index for w in worlds for r in w.ranks}
    devices = topo.jax_devices()

    def train(codec):
        addresses = [f"127.0.0.1:{free_port()}" for _ in worlds]
        out, errors = {}, []

        def run(w):
            try:
                bridge = Bridge(w.index, addresses, "transfer", timeout_s=120, codec=codec)
                ex = WorldsExecutor(plan, topo, trainer.model_cfg, trainer.tx,
                                    trainer.schedule, cfg.train.grad_clip, worlds, w.index,
                                    owner, bridge, devices=[devices[r] for r in w.ranks])
                st, losses = ex.init_state(cfg.train.seed), []
                for batch in batches:
                    st, metrics = ex.step(st, ex.put_batch(batch))
                    losses.append(float(metrics["loss"]))
                ev = float(np.mean([ex.eval_loss(st, b) for b in held_out]))
                ex.finish()
                bridge.close()
                out[w.index] = (losses, ev, dict(bridge.bytes_by_kind))
            except Exception as e:  # reported below
                errors.append(e)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=run, args=(w,)) for w in worlds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out[0][0], out[0][1], out[1][2], time.perf_counter() - t0

    rows = {c: train(c) for c in ("none", "int8")}
    w = args.window
    spans = [(a, min(a + w, args.steps)) for a in range(0, args.steps, w)]
    print(f"{trainer.model_cfg.num_params / 1e6:.3f}M parameters, pp 2 (2 worlds) x dp 4, "
          f"{cfg.train.batch_size} x {cfg.train.seq_len} tokens a step, {args.steps} steps, "
          "default corpus")
    print("boundaries | " + " | ".join(f"loss {a + 1}-{b}" for a, b in spans) +
          " | held-out loss | vs none | activation bytes received | wall")
    base = rows["none"][1]
    for c, (losses, ev, got, wall) in rows.items():
        print(f"{c} | " + " | ".join(f"{np.mean(losses[a:b]):.4f}" for a, b in spans) +
              f" | {ev:.4f} | {(ev / base - 1) * 100:+.2f}% | "
              f"{got.get('activation', 0) / 1e6:.2f} MB | {wall:.0f} s")
    diff = np.abs(np.array(rows["int8"][0]) - np.array(rows["none"][0])) / np.array(
        rows["none"][0])
    print(f"per-step training loss, int8 vs none: max relative difference {diff.max():.2e}, "
          f"mean {diff.mean():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

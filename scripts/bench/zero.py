"""ZeRO / AMSP points side by side: per-device bytes of P, G and OS, the collective bytes of one
compiled step, and step time, on 8 simulated CPU devices; then the same bytes for a 7B model
on 1,024 abstract devices (nothing allocated).

    python scripts/bench/zero.py                 # default model, 8 devices, all points
    python scripts/bench/zero.py --steps 10 --config.model.d_model=256

    python scripts/bench/zero.py --pp 2 --skip-7b  # only the pp = 2 points
    python scripts/bench/zero.py --smoke         # seconds: tiny model, 1 step, a point per table

The pp = 2 rows run ZeRO inside each pipeline stage (docs/zero.md): bytes are a stage's, and
"in the loop" is the tick loop's B branch, counted once per micro-batch.

Bytes are per device as hetjax stores them (fp32 parameters, fp32 gradient accumulator, fp32
Adam mu and nu), and in bytes per model parameter (Φ = parameter count; tp splits too). P and
OS are read from the state's shards, G from the G spec (tests/test_zero.py reads it from the
compiled loop's carry).
"collectives" is the sum of V (all-gather result, reduce-scatter operand, all-reduce buffer)
times executions per step over the data-parallel axes, read from the compiled program, with
the part inside the micro-batch loop (the G-group reduce-scatters); "predicted" is
hetjax/planner/zero_factors.py `expected_collectives` for the point; "sent" is what one device sends
under the ring model. Step time is the median of --steps steps after a warm-up step; on shared CPU
cores it measures contention as much as anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

POINTS = [  # (label, config overrides)
    ("ddp", {"zero.preset": "ddp"}),
    ("zero1", {"zero.preset": "zero1"}),
    ("zero2", {"zero.preset": "zero2"}),
    ("zero3", {"zero.preset": "zero3"}),
    ("mics", {"zero.preset": "mics"}),
    ("custom 2/2/8", {"zero.preset": "custom", "zero.s_p": 2, "zero.s_g": 2, "zero.s_os": 8}),
    ("custom, dp=4 tp=2", {"zero.preset": "custom", "zero.s_p": 2, "zero.s_g": 4,
                          "zero.s_os": 4, "parallel.dp": 4, "parallel.tp": 2}),
]


# pp = 2: ZeRO inside each stage. Holmes' layout (one stage per cluster of 2 nodes x 2
# devices, dp = 2 in a cluster, tp = 2 in a node, default model's 4 layers split 3 / 1), and
# dp = 4 with tp = 1 on cpu_hybrid for a point with both ZeRO sub-axes of size 2.
HOLMES = {"topology.preset": "holmes_hybrid", "topology.nodes": 2,
          "topology.devices_per_node": 2, "parallel.pp": 2, "parallel.dp": 2,
          "parallel.tp": 2, "pipeline.stage_layers": (3, 1)}
PP_POINTS = [(label, {**HOLMES, **point}) for label, point in POINTS[:4]] + [
    ("custom, dp=4 tp=1", {"parallel.pp": 2, "parallel.dp": 4, "pipeline.stage_layers": (3, 1),
                           "zero.preset": "custom", "zero.s_p": 2, "zero.s_g": 2,
                           "zero.s_os": 4}),
]

# --smoke: a model small enough that each point compiles and steps in a second or two, and 2
# micro-batches (the accumulation loop stays, half the unrolled ticks of the pp = 2 program).
SMOKE_MODEL = ["--config.model.d_model=32", "--config.model.d_ff=64", "--config.model.n_heads=4",
               "--config.model.n_kv_heads=2", "--config.train.seq_len=16",
               "--config.train.batch_size=16", "--config.model.max_seq_len=64",
               "--config.train.microbatches=2"]
# one point a table: zero3 at pp = 1, and at pp = 2 the dp = 4, tp = 1 point (both ZeRO
# sub-axes; a third cheaper to compile than Holmes' tp = 2 layout)
SMOKE_POINTS, SMOKE_PP_POINTS = [POINTS[3]], [PP_POINTS[4]]


def _flag(v) -> str:
    return f"[{','.join(map(str, v))}]" if isinstance(v, tuple) else str(v)


def _mib(b: float) -> str:
    return f"{b / 2**20:,.3f}"


def bench_point(config, steps: int) -> dict:
    import jax

    from hetjax.planner import zero_factors as zr
    from hetjax.train import Trainer
    from hetjax.core import hlo
    from hetjax.parallel import zero_sharding as zero
    from hetjax.parallel.mesh import DP_AXES

    trainer = Trainer(config, quiet=True)
    z, zs, mesh = trainer.plan.zero, trainer.zero_specs, trainer.mesh
    # The state is built here, outside any trace (Trainer.state enters the mesh's context).
    abstract = jax.eval_shape(lambda p: p, trainer.state.params)
    compiled = trainer.compiled_step()
    ops = hlo.collectives(compiled.as_text(), mesh.shape)
    if trainer.pipeline:  # the tick loop's B branch runs once per micro-batch
        ops = hlo.with_branch_runs(ops, trainer.pipeline.program.ticks,
                                   trainer.plan.microbatches, DP_AXES)
    dp_ops = [c for c in ops if not c.scalar and set(c.axes) <= set(DP_AXES)]
    split, replicated = zero.split_bytes(abstract, zs, mesh)
    predicted = zr.expected_collectives(z, trainer.plan.dp, trainer.plan.microbatches, split,
                                          replicated)
    times = []
    for i in range(steps + 1):
        batch = trainer.put_batch(next(trainer.data))
        t0 = time.perf_counter()
        trainer.state, metrics = compiled(trainer.state, batch)
        jax.block_until_ready(metrics["loss"])
        if i:  # the first call pays for warm-up
            times.append(time.perf_counter() - t0)
    def on_device_0(tree):  # bytes of the non-scalar arrays one device holds
        return sum(s.data.nbytes for a in jax.tree.leaves(tree) if a.ndim
                   for s in a.addressable_shards if s.device == jax.devices()[0])

    return {
        "factors": (z.s_p, z.s_g, z.s_os), "phi": trainer.model_cfg.num_params,
        "P": on_device_0(trainer.state.params),
        "G": zero.shard_bytes(abstract, zs.g, mesh),
        "OS": on_device_0(trainer.state.opt_state),
        "coll": sum(c.nbytes * c.count for c in dp_ops),
        "predicted": sum(c.nbytes * c.count for c in predicted),
        "sent": sum(c.traffic * c.count for c in dp_ops),
        "in_loop": sum(c.nbytes * c.count for c in dp_ops if c.loop_depth),
        "step_ms": 1e3 * statistics.median(times),
    }


def table_8_devices(overrides: list[str], steps: int, points=POINTS) -> str:
    from hetjax.config import load_config

    rows = ["| point | s_p/s_g/s_os | P / device | G / device | OS / device | collectives "
            "/ step | predicted | sent / device | step |",
            "|---|---|---|---|---|---|---|---|---|"]
    for label, point in points:
        c = load_config(None, [*overrides, *(f"--config.{k}={_flag(v)}"
                                             for k, v in point.items())])
        r = bench_point(c, steps)
        rows.append(
            f"| {label} | {'/'.join(map(str, r['factors']))} "
            f"| {_mib(r['P'])} MiB ({r['P'] / r['phi']:.2f}Φ) "
            f"| {_mib(r['G'])} MiB ({r['G'] / r['phi']:.2f}Φ) "
            f"| {_mib(r['OS'])} MiB ({r['OS'] / r['phi']:.2f}Φ) "
            f"| {_mib(r['coll'])} MiB ({_mib(r['in_loop'])} in the loop) "
            f"| {_mib(r['predicted'])} MiB | {_mib(r['sent'])} MiB "
            f"| {r['step_ms']:.0f} ms |")
    return "\n".join(rows)


def table_7b(microbatches: int = 8) -> str:
    import jax
    import jax.numpy as jnp

    import flax.linen as nn
    from hetjax.core import topology as topo
    from hetjax.config import base_config
    from hetjax.core.plan import Plan, ZeroFactors
    from hetjax.planner import zero_factors as zr
    from hetjax.train import make_optimizer, opt_state_specs
    from hetjax.layers import ModelConfig, Transformer
    from hetjax.parallel import sharding as shd
    from hetjax.parallel import zero_sharding as zero

    cfg = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                      d_ff=11008, tie_embeddings=False)
    t = topo.preset("holmes_infiniband", nodes=128, devices_per_node=8)
    plan = Plan(pp=1, dp=1024, tp=1, stage_layers=(32,), microbatches=microbatches,
                global_batch=1024, seq_len=2048)
    boxed = jax.eval_shape(Transformer(cfg).init, jax.random.key(0),
                           jnp.zeros((1, 8), jnp.int32))["params"]
    params = nn.unbox(boxed)
    tx, _ = make_optimizer(base_config().train)
    opt = jax.eval_shape(tx.init, params)
    k = zr.node_local_factor(zr.replica_nodes(plan, t))
    points = [zr.named(p, plan.dp, k) for p in zr.NAMED]
    points.append(ZeroFactors(8, 8, 64, "custom"))
    rows = [f"| point | s_p/s_g/s_os | P / device | G / device | OS / device | predicted "
            f"collectives / step (M={microbatches}) |", "|---|---|---|---|---|---|"]
    for z in points:
        zr.check_factors(z, plan, t)
        p = dataclasses.replace(plan, zero=z)
        mesh = zero.abstract_mesh(p)
        zs = zero.zero_specs(params, shd.param_specs(boxed), shd.logical_specs(boxed), z)
        os_specs = opt_state_specs(tx, opt, zs.os)
        os_bytes = sum(zero.shard_bytes(a, s, mesh) for a, s in zip(
            jax.tree.leaves(opt), jax.tree.leaves(os_specs, is_leaf=lambda x: isinstance(
                x, jax.sharding.PartitionSpec))) if a.ndim)
        split, replicated = zero.split_bytes(params, zs, mesh)
        pred = sum(c.nbytes * c.count for c in zr.expected_collectives(
            z, plan.dp, microbatches, split, replicated))
        gib = lambda b: f"{b / 2**30:,.3f} GiB"  # noqa: E731
        rows.append(f"| {z.name} | {z.s_p}/{z.s_g}/{z.s_os} "
                    f"| {gib(zero.shard_bytes(params, zs.p, mesh))} "
                    f"| {gib(zero.shard_bytes(params, zs.g, mesh))} | {gib(os_bytes)} "
                    f"| {gib(pred)} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps per point")
    ap.add_argument("--skip-7b", action="store_true", help="no 7B table")
    ap.add_argument("--pp", choices=("1", "2", "both"), default="both",
                    help="8-device tables: pp = 1, pp = 2 (ZeRO inside stages), or both")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: a tiny model, one step, one point in each table (the suite "
                         "runs it)")
    args, overrides = ap.parse_known_args(argv)
    defaults = ["--config.data.source=synthetic", "--config.train.microbatches=4",
                "--config.train.progress=False", "--config.tensorboard=False"]
    points, pp_points = POINTS, PP_POINTS
    if args.smoke:
        overrides = [*SMOKE_MODEL, *overrides]
        args.steps, points, pp_points = 1, SMOKE_POINTS, SMOKE_PP_POINTS
    print("8 simulated devices (cpu_hybrid: 2 clusters x 2 nodes x 2 devices), "
          f"{' '.join(defaults[1:2] + overrides) or 'default model'}")
    if args.pp != "2":
        print(table_8_devices(defaults + overrides, args.steps, points))
    if args.pp != "1":
        print("\npp = 2, ZeRO inside each stage (bytes per device are a stage's, padded slots "
              "included; Φ counts the whole model)")
        print(table_8_devices(defaults + overrides, args.steps, pp_points))
    if not args.skip_7b:
        print("\nLLaMA-7B (Φ = 6.74e9) on 1,024 abstract devices (128 nodes x 8), dp = 1024")
        print(table_7b())
    return 0


if __name__ == "__main__":
    sys.exit(main())

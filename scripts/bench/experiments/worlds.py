"""One JAX world per cluster, checked: an MPMD job run as several worlds (a `jax.distributed`
job each, gloo inside, the bridge between) against the same plan in one process.

    python -m scripts.bench.experiments.worlds check [--steps 10] [--die p3:4] [--config.x=y ...]

`check` starts the worlds locally with `hetjax.launch` (one coordinator per world, the bridge
environment), each process running `worker`, and one `reference` process with all devices
running the single-world `MpmdExecutor`; both print their per-step losses, which must agree.
`--die pN:S` makes process N kill itself (SIGKILL) before step S, to time how fast the launcher
stops every world. The batches are random tokens from a fixed seed, the same in every process.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np

# Workers and the reference run this file by path, so that they start from any directory.
THIS_FILE = os.path.abspath(__file__)

DEFAULTS = [  # a tiny fp32 model on cpu_hybrid (two clusters x 2 nodes x 2 CPU devices)
    "--config.topology.preset=cpu_hybrid", "--config.model.d_model=32",
    "--config.model.d_ff=64", "--config.model.n_layers=4", "--config.model.n_heads=4",
    "--config.model.n_kv_heads=2", "--config.model.max_seq_len=64", "--config.train.seq_len=16",
    "--config.parallel.pp=2", "--config.parallel.dp=2", "--config.parallel.tp=2",
    "--config.pipeline.executor=mpmd", "--config.pipeline.stage_layers=(1,3)",
    "--config.pipeline.microbatches=4", "--config.train.batch_size=16",
    "--config.data.source=synthetic", "--config.train.lr=3e-3", "--config.train.warmup_steps=2",
]
ENV_DIE = "HETJAX_CHECK_DIE"  # "N:S": process N kills itself before step S


def build(overrides):
    """Config -> (config, topology, plan, model config, optimizer, lr schedule)."""
    from hetjax import config as hconfig
    from hetjax.data import padded_vocab
    from hetjax.planner import plan_from_config
    from hetjax.tokenizer import load_tokenizer
    from hetjax.train import make_optimizer
    from hetjax.layers import ModelConfig

    cfg = hconfig.load_config(None, [*DEFAULTS, *overrides])
    hconfig.validate(cfg)
    topology = hconfig.build_topology(cfg)
    plan = plan_from_config(cfg, topology)
    model_cfg = ModelConfig.from_config(cfg.model, padded_vocab(
        load_tokenizer(cfg.data.tokenizer).vocab_size))
    tx, schedule = make_optimizer(cfg.train)
    return cfg, topology, plan, model_cfg, tx, schedule


def batches(plan, vocab: int, steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tokens = rng.integers(0, vocab, (plan.global_batch, plan.seq_len + 1), dtype=np.int32)
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _scalar(x) -> float:
    return float(np.asarray(x.addressable_shards[0].data))


def reference(overrides, steps: int) -> list[float]:
    """The losses of the plan in one process (the single-world MPMD executor)."""
    from hetjax.parallel.mpmd import MpmdExecutor

    cfg, topology, plan, model_cfg, tx, schedule = build(overrides)
    ex = MpmdExecutor(plan, topology, model_cfg, tx, schedule, cfg.train.grad_clip)
    state, losses = ex.init_state(cfg.train.seed), []
    for batch in batches(plan, model_cfg.vocab_size, steps):
        state, metrics = ex.step(state, ex.put_batch(batch))
        losses.append(_scalar(metrics["loss"]))
    return losses


def worker(overrides, steps: int) -> list[float]:
    """One process of one world: join the world, build its stages, train over the bridge."""
    from hetjax.distributed import WorkerSpec, initialize, process_slots
    from hetjax.planner.worlds import plan_worlds
    from hetjax.parallel.bridge import ENV_BRIDGE_HOSTS, bridge_from_environ
    from hetjax.parallel.mpmd_worlds import WorldsExecutor
    from hetjax.parallel.nic import ENV_WORLD

    cfg, topology, plan, model_cfg, tx, schedule = build(overrides)
    spec = WorkerSpec.from_environ()
    initialize(spec, f"world-{os.environ[ENV_WORLD]}")
    slots = process_slots(topology, len(os.environ[ENV_BRIDGE_HOSTS].split(",")))
    worlds = plan_worlds(plan, topology, slots)
    owner = {r: slot.index for slot in slots for r in slot.ranks}
    bridge = bridge_from_environ()
    ex = WorldsExecutor(plan, topology, model_cfg, tx, schedule, cfg.train.grad_clip, worlds,
                        int(os.environ[ENV_WORLD]), owner, bridge)
    die = os.environ.get(ENV_DIE, "")
    state, losses = ex.init_state(cfg.train.seed), []
    for step, batch in enumerate(batches(plan, model_cfg.vocab_size, steps)):
        if die == f"{bridge.rank}:{step}":
            print(f"process {bridge.rank} kills itself before step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        state, metrics = ex.step(state, ex.put_batch(batch))
        losses.append(_scalar(metrics["loss"]))
    ex.finish()
    print(f"BRIDGE received {json.dumps(bridge.bytes_by_kind)} bytes in {steps} steps from "
          f"processes {sorted(bridge.bytes_received)}", flush=True)
    bridge.close()
    return losses


def launch_worlds(overrides, steps: int, processes: int = 4, die: str = "",
                  timeout: float = 600) -> tuple[int, str, float]:
    """Start the worlds locally under the launcher's supervision; (exit code, output,
    seconds)."""
    from types import SimpleNamespace

    from hetjax.launch import plan_workers
    from hetjax.supervise import run
    from hetjax.parallel import nic

    cfg, topology, plan, *_ = build(overrides)
    args = SimpleNamespace(local=processes, hostfile=None, port=0, coordinator=None,
                           init_timeout=120, heartbeat_timeout=20, nic_policy="cluster",
                           python=sys.executable, chdir=os.getcwd(), command="train")
    children = []
    for w in plan_workers(cfg, topology, plan, args, []):
        env = nic.merge_environment(os.environ, w.env, override=True)
        if die:
            env[ENV_DIE] = die
        argv = (sys.executable, "-u", THIS_FILE, "worker",
                "--steps", str(steps), *overrides)
        children.append((f"p{w.index}/world{w.env[nic.ENV_WORLD]}", argv, env))
    out = _Stamped()
    rc = run(children, grace=5.0, timeout=timeout, out=out)
    return rc, out.getvalue(), time.perf_counter() - out.t0


class _Stamped(io.StringIO):
    """The launcher's output with each line's seconds since the start ('  12.34s ...')."""

    def __init__(self):
        super().__init__()
        self.t0 = time.perf_counter()

    def write(self, text: str) -> int:
        return super().write(f"{time.perf_counter() - self.t0:8.2f}s {text}")


def stop_seconds(output: str) -> float:
    """Seconds from a process's self-kill line to the launcher's last line."""
    stamps = [(float(m.group(1)), m.group(2)) for m in
              re.finditer(r"^\s*([0-9.]+)s (.*)$", output, re.M)]
    died = next(t for t, line in stamps if "kills itself" in line)
    return stamps[-1][0] - died


def reference_in_subprocess(overrides, steps: int) -> list[float]:
    """`reference` in a fresh process with the plan's device count (before jax starts)."""
    _, topology, *_ = build(overrides)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={topology.num_devices}"}
    res = subprocess.run([sys.executable, "-u", THIS_FILE, "reference",
                          "--steps", str(steps), *overrides], env=env, capture_output=True,
                         text=True)
    if res.returncode:
        raise RuntimeError(f"the reference run failed:\n{res.stdout[-2000:]}{res.stderr[-4000:]}")
    return _losses(res.stdout)


def activation_bytes(overrides) -> int:
    """Bytes of one step's boundary activations (every micro-batch), one way."""
    cfg, topology, plan, model_cfg, *_ = build(overrides)
    return plan.global_batch * plan.seq_len * model_cfg.d_model * 4


def _losses(text: str) -> list[float]:
    m = re.search(r"LOSSES (\[.*\])", text)
    if not m:
        raise RuntimeError(f"no LOSSES line in:\n{text[-4000:]}")
    return json.loads(m.group(1))


def world_losses(output: str) -> dict[str, list[float]]:
    """Each process's losses from the launcher's output ('[name] LOSSES [...]' lines)."""
    return {m.group(1): json.loads(m.group(2))
            for m in re.finditer(r"\[(\S+)\] LOSSES (\[.*\])$", output, re.M)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.experiments.worlds")
    p.add_argument("mode", choices=("check", "worker", "reference"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="2 steps (the check in seconds)")
    p.add_argument("--die", default="", help="N:S -- process N kills itself before step S")
    args, overrides = p.parse_known_args(argv)
    if args.smoke:
        args.steps = 2
    if args.mode == "worker":
        print("LOSSES " + json.dumps(worker(overrides, args.steps)), flush=True)
        return 0
    if args.mode == "reference":
        print("LOSSES " + json.dumps(reference(overrides, args.steps)), flush=True)
        return 0
    rc, out, seconds = launch_worlds(overrides, args.steps, die=args.die.lstrip("p"))
    print(out, end="")
    if args.die:
        print(f"worlds stopped with exit code {rc}, {stop_seconds(out):.1f} s after the "
              f"process died ({seconds:.1f} s in all)")
        return 0 if rc else 1
    if rc:
        return rc
    ref = reference_in_subprocess(overrides, args.steps)
    got = world_losses(out)
    print(f"reference (one process): {ref}")
    worst = 0.0
    for name, losses in sorted(got.items()):
        diff = float(np.max(np.abs(np.asarray(losses) - np.asarray(ref)) / np.abs(ref)))
        worst = max(worst, diff)
        print(f"{name}: max relative difference {diff:.2e}")
    print(f"{len(got)} processes, {args.steps} steps: worst relative difference {worst:.2e}")
    received: dict[str, int] = {}
    for m in re.finditer(r"BRIDGE received (\{.*\}) bytes", out):
        for kind, n in json.loads(m.group(1)).items():
            received[kind] = received.get(kind, 0) + n
    per_step = {k: v // args.steps for k, v in sorted(received.items())}
    act = activation_bytes(overrides)
    print(f"bridge bytes per step between the worlds, by kind: {per_step}; activations and "
          f"their gradients: {per_step.get('activation', 0) + per_step.get('gradient', 0):,} "
          f"(the boundary activations of a step are {act:,} bytes each way)")
    return 0 if worst < 1e-5 and len(got) == 4 else 1


if __name__ == "__main__":
    sys.exit(main())

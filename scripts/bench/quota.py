"""How faithfully a CPU cap emulates a slower accelerator, and how much a capped process's
speed moves from one process (and one hour) to the next.

    sudo python scripts/bench/quota.py                  # 3 rounds, about 3 min
    sudo python scripts/bench/quota.py --rounds 5 --samples 30
    python scripts/bench/quota.py --smoke                # seconds, no root (the suite runs it)

On the heterogeneous testbed (bench_hetaccel's: `cpu` hosts 0.4 CPU, `cpu_half` hosts 0.2),
every host runs a fresh process per round, all at once, that times bench_hetaccel's decoder
block as the pipelines run it (recompute "full", one device's micro-batch) -- forward, then
backward -- for --samples samples of --sample seconds, and reports per call its wall time,
the CPU time the process used (all threads), and wall x cap / CPU: 1.00 when the cap turns CPU
time into wall time exactly. The spread of the backward's wall time over processes of one
kind is what a calibration (another set of processes, earlier) cannot know about the
processes of a later training run (docs/testbed.md, "How reproducible a run is").

--smoke times the same block (`measure`, what each host's process runs) in this process, 2
samples of 10 ms, and prints its row of the table as an uncapped host (cap 1). It leaves out
what needs root: the testbed's hosts, their CPU caps and the fresh process per host and round.
"""

import argparse
import json
import os
import subprocess
import sys
import time

if __package__:  # python -m scripts.bench.quota, or imported by the suite
    from .experiments import harness, hetaccel
else:  # python scripts/bench/quota.py: Python puts scripts/bench/ first on sys.path
    from experiments import harness, hetaccel


def worker(samples: int, sample_s: float) -> None:
    """In one emulated host: time the staged block's forward and backward; print JSON."""
    print("RESULT " + json.dumps(measure(samples, sample_s)), flush=True)


def measure(samples: int, sample_s: float) -> dict:
    """Wall and CPU ms per call of the staged block's forward and backward, and the samples."""
    import jax
    import jax.numpy as jnp

    WORKLOAD = hetaccel.WORKLOAD
    from hetjax.layers.block import DecoderBlock
    from hetjax.parallel.residuals import layer_fn, pullback, vjp_stash

    model = WORKLOAD.model()
    dtype = jnp.dtype(model.dtype)
    params = DecoderBlock(model).init(jax.random.PRNGKey(0),
                                      jnp.zeros((1, 8, model.d_model), dtype))["params"]
    fn, spec = layer_fn(model, "full"), {}

    def forward(p, x):
        out, kept, spec["r"] = vjp_stash(fn, p, x)
        return out, kept

    run_f = jax.jit(forward)
    run_b = jax.jit(lambda p, kept, dy: pullback(spec["r"], p, kept)(dy))
    micro = WORKLOAD.batch // WORKLOAD.microbatches // 2  # one device's micro-batch (dp = 2)
    x = jnp.ones((micro, WORKLOAD.seq_len, model.d_model), dtype)
    out, kept = run_f(params, x)
    result = {}
    for name, f, args in (("forward", run_f, (params, x)), ("backward", run_b, (params, kept, out))):
        jax.block_until_ready(f(*args))  # compile, warm up
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        calls = max(1, int(sample_s / (time.perf_counter() - t0)) + 1)
        walls = []
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(samples):
            t0 = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(f(*args))
            walls.append((time.perf_counter() - t0) / calls)
        n = samples * calls
        result[name] = {"wall_ms": (time.perf_counter() - w0) / n * 1e3,
                        "cpu_ms": (time.process_time() - c0) / n * 1e3,
                        "sample_ms": [round(w * 1e3, 1) for w in walls]}
    return result


HEADER = ["round", "host", "kind", "cap (CPUs)", "fwd wall", "fwd CPU", "fwd wall x cap / CPU",
          "bwd wall", "bwd CPU", "bwd wall x cap / CPU", "bwd samples (first 8)"]


def row(r: int, host: str, kind: str, cap: float, res: dict) -> list[str]:
    """A table row of `HEADER` for one process's `measure` result under a cap of `cap` CPUs."""
    f, b = res["forward"], res["backward"]
    return [str(r), host, kind, f"{cap:g}", f"{f['wall_ms']:.1f}", f"{f['cpu_ms']:.2f}",
            f"{f['wall_ms'] * cap / f['cpu_ms']:.2f}", f"{b['wall_ms']:.1f}",
            f"{b['cpu_ms']:.2f}", f"{b['wall_ms'] * cap / b['cpu_ms']:.2f}",
            " ".join(f"{s:.0f}" for s in b["sample_ms"][:8])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per host")
    ap.add_argument("--samples", type=int, default=16, help="samples per process and program")
    ap.add_argument("--sample", type=float, default=0.5, help="seconds per sample (at least)")
    ap.add_argument("--cpus", type=float, default=0.4, help="CPU cap of a `cpu` host")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds, no root: time the block in this process, one table row")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.samples, args.sample)
        return 0
    import numpy as np

    load_line, table = harness.load_line, harness.table
    if args.smoke:
        print(table(HEADER, [row(0, "this process", "cpu", 1.0, measure(2, 0.01))]))
        return 0
    caps = hetaccel.caps
    from hetjax.testbed import Testbed
    from hetjax.core.topology import preset

    het = preset("testbed_hetaccel")
    cap = caps(het, args.cpus)
    rows, by_kind = [], {}
    print(f"bench_quota: {load_line()} at the start", flush=True)
    with Testbed(het, cpus=cap) as tb:
        for r in range(args.rounds):
            procs = [tb.run(h, [sys.executable, os.path.abspath(__file__), "--worker",
                                "--samples", str(args.samples), "--sample", str(args.sample)],
                            env={"JAX_PLATFORMS": "cpu"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for h in tb.hosts]
            for h, p in zip(tb.hosts, procs):
                out, _ = p.communicate(timeout=1200)
                lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
                if p.returncode or not lines:
                    print(f"host {h.name} failed (exit {p.returncode}):\n{out[-2000:]}")
                    return 1
                res = json.loads(lines[-1][len("RESULT "):])
                kind = het.clusters[h.cluster].accelerator.name
                b = res["backward"]
                by_kind.setdefault(kind, []).append(b["wall_ms"])
                rows.append(row(r, h.name, kind, cap[het.clusters[h.cluster].name], res))
                print(f"  round {r} {h.name}: backward {b['wall_ms']:.1f} ms wall, "
                      f"{b['cpu_ms']:.2f} ms CPU", flush=True)
    print("\n## Per call, one fresh process per host and round (ms)\n")
    print(table(HEADER, rows))
    print("\nbackward wall time over the processes of a kind: " + "; ".join(
        f"{k} {min(v):.1f} to {max(v):.1f} ms (largest / smallest {max(v) / min(v):.3f}, "
        f"sd / mean {np.std(v) / np.mean(v):.1%})" for k, v in by_kind.items()))
    print(f"{load_line()} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())

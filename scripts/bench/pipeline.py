"""Pipeline benchmarks on simulated CPU devices: activation memory of GPipe vs 1F1B, uneven
compute per stage, and the schedule timeline plots.

    python scripts/bench/pipeline.py memory     # temp memory of the compiled step, M = 4..32
    python scripts/bench/pipeline.py compute    # stage time vs active layers, one program
    python scripts/bench/pipeline.py time       # modelled step time of both schedules
    python scripts/bench/pipeline.py plots      # docs/img/gpipe.png, docs/img/1f1b.png
    python scripts/bench/pipeline.py mpmd-memory  # per-stage state bytes, split [7, 1]
    python scripts/bench/pipeline.py mpmd-time  # MPMD task times -> asynchronous step time
    python scripts/bench/pipeline.py remat      # SPMD pipeline FLOPs and memory per model.remat
    python scripts/bench/pipeline.py folded     # modelled step time, looped vs folded placement
    python scripts/bench/pipeline.py folded-memory  # compiled temp memory, looped vs folded
    python scripts/bench/pipeline.py --smoke    # tiny versions of time, compute, plots (seconds)
    python scripts/bench/pipeline.py            # all but folded and folded-memory

Numbers come from the compiled programs (`memory_analysis()`) and from wall-clock timing of
the executor's own stage code; timings on a shared CPU are noisy, so each is the best of
several runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


from hetjax.cli import ensure_cpu_devices  # noqa: E402

ensure_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hetjax.config import load_config  # noqa: E402
from hetjax.train import Trainer  # noqa: E402
from hetjax.core import schedules as sch  # noqa: E402
from hetjax.core.timeline import plot_timeline, timeline  # noqa: E402
from hetjax.planner.lockstep import folded_lockstep_time, lockstep_time  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLMES_MINI = os.path.join(REPO, "configs", "holmes_mini.py")
MIB = 2 ** 20


def holmes_trainer(*overrides: str) -> Trainer:
    config = load_config(HOLMES_MINI, ["--config.train.progress=False",
                                       "--config.tensorboard=False",
                                       "--config.data.source=synthetic", *overrides])
    return Trainer(config, quiet=True)


def memory(microbatches=(4, 8, 16, 32), per_microbatch: int = 4) -> None:
    """Temp memory of the whole compiled train step on configs/holmes_mini.py (pp=2, dp=2,
    tp=2), micro-batch size fixed, so GPipe's kept inputs grow with M and those of 1F1B and
    strands do not."""
    print(f"## Activation memory: configs/holmes_mini.py, micro-batch {per_microbatch} sequences "
          f"x 128 tokens (2 per device), temp bytes per device of the compiled train step")
    print()
    print("| micro-batches M | GPipe temp (MiB) | 1F1B temp (MiB) | strands temp (MiB) | "
          "GPipe stash slots | 1F1B stash slots | strands stash slots |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for m in microbatches:
        row = [str(m)]
        kept = []
        for schedule in ("gpipe", "1f1b", "strands"):
            trainer = holmes_trainer(f"--config.pipeline.schedule={schedule}",
                                     f"--config.pipeline.microbatches={m}",
                                     f"--config.train.batch_size={per_microbatch * m}")
            stats = trainer.compiled_step().memory_analysis()
            row.append(f"{stats.temp_size_in_bytes / MIB:.2f}")
            kept.append(str(trainer.pipeline.program.stash_slots))
        print("| " + " | ".join(row + kept) + " |", flush=True)
    print()


def _best_times(fn, variants: dict, repeats: int = 9) -> dict:
    """Best wall time of fn(*args) for each variant; rounds go over all variants in turn, so a
    burst of load on the shared machine does not land on one variant only."""
    for args in variants.values():
        jax.block_until_ready(fn(*args))
    best = {k: float("inf") for k in variants}
    for _ in range(repeats):
        for k, args in variants.items():
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            best[k] = min(best[k], time.perf_counter() - t)
    return best


def compute(max_layers: int = 8) -> None:
    """One stage with `max_layers` layer slots running its F and B of one micro-batch with the
    executor's own code (`Pipeline.layers_forward` / `layers_backward`), compiled once and timed
    with 1..max_layers active layers: time follows the active layers, not the slots."""
    trainer = holmes_trainer(f"--config.model.n_layers={max_layers + 1}",
                             f"--config.pipeline.stage_layers=({max_layers},1)",
                             "--config.model.d_model=256", "--config.model.d_ff=768")
    pipe = trainer.pipeline
    blocks = jax.tree.map(lambda a: np.asarray(a)[0],
                          jax.device_get(trainer.state.params["layers"]["block"]))
    x = jax.random.normal(jax.random.key(0), (2, 128, 256), jnp.float32)
    blocks, x = jax.device_put((blocks, x), jax.devices()[0])

    stash = pipe.new_stash(blocks, x.shape, x.dtype, max_layers)

    @jax.jit
    def forward_backward(blocks, x, n_layers):
        y, kept = pipe.layers_forward(blocks, x, n_layers, stash)
        return pipe.layers_backward(blocks, kept, y, n_layers,
                                    jax.tree.map(jnp.zeros_like, blocks))

    print(f"## Uneven compute: one stage program with {max_layers} layer slots (d_model 256, "
          f"2 x 128 tokens), F + B of one micro-batch, best of 9 on one CPU device")
    print()
    print("| active layers n | time (ms) | time / time(n = max) | n / max |")
    print("|---:|---:|---:|---:|")
    times = _best_times(forward_backward, {n: (blocks, x, jnp.int32(n))
                                           for n in range(1, max_layers + 1)})
    for n, t in times.items():
        print(f"| {n} | {t * 1e3:.1f} | {t / times[max_layers]:.2f} | "
              f"{n / max_layers:.2f} |", flush=True)
    print()


def step_time(split=(4, 3), microbatches=(4, 8, 16, 32)) -> None:
    """Step time of both schedules in units of one layer's forward, for the holmes_mini split:
    F = layers, B = 3 x layers (two forwards of backward plus the recompute). `lockstep_time`
    is how the SPMD executor runs the grid, `timeline` an asynchronous (MPMD) pipeline."""
    fwd = [float(n) for n in split]
    bwd = [3.0 * n for n in split]
    print(f"## Modelled step time, stages of {list(split)} layers, F = n, B = 3n "
          f"(one layer forward = 1)")
    print()
    print("| micro-batches M | GPipe (executor) | 1F1B (executor) | strands (executor) | "
          "1F1B asynchronous | 1F1B / GPipe | strands / GPipe |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for m in microbatches:
        g = lockstep_time(sch.make_schedule("gpipe", len(split), m), fwd, bwd)
        o = lockstep_time(sch.make_schedule("1f1b", len(split), m), fwd, bwd)
        d = lockstep_time(sch.make_schedule("strands", len(split), m), fwd, bwd)
        a = max(e.end for e in timeline(sch.make_schedule("1f1b", len(split), m), fwd, bwd))
        print(f"| {m} | {g:.0f} | {o:.0f} | {d:.0f} | {a:.0f} | {o / g:.2f} | {d / g:.2f} |")
    print()


def plots(outdir: str = os.path.join(REPO, "docs", "img"), stages: int = 4,
          microbatches: int = 8) -> None:
    """Timelines of every registered schedule, forward 1 and backward 2 time units per stage."""
    os.makedirs(outdir, exist_ok=True)
    for name in sch.SCHEDULES:
        s = sch.make_schedule(name, stages, microbatches)
        events = timeline(s, [1.0] * stages, [2.0] * stages)
        held = ", ".join(f"{s.activation_share(st):g}" for st in range(stages))
        path = plot_timeline(events, os.path.join(outdir, f"{name}.png"),
                                 title=f"{name}: {stages} stages, {microbatches} micro-batches, "
                                       f"B = 2F; micro-batches held per stage: {held}",
                                 time_unit="one stage's forward = 1")
        print(f"wrote {os.path.relpath(path, REPO)}")


def _state_bytes(tree, device) -> int:
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
               if s.device == device)


def mpmd_memory(split=(7, 1)) -> None:
    """Parameter + optimizer-state bytes per device of each stage, split [7, 1] of an 8-layer
    model (holmes_mini's layout otherwise): the SPMD executor pads both stages to 7 layer
    slots, the MPMD executor holds only each stage's own layers. Also the argument bytes of
    each MPMD stage's compiled update program (`memory_analysis()`)."""
    rows = []
    for executor in ("spmd", "mpmd"):
        trainer = holmes_trainer("--config.model.n_layers=8",
                                 f"--config.pipeline.stage_layers={tuple(split)}",
                                 f"--config.pipeline.executor={executor}")
        if executor == "spmd":
            stage_devices = [trainer.mesh.devices[s].flat[0] for s in range(len(split))]
            per = [_state_bytes((trainer.state.params, trainer.state.opt_state), d)
                   for d in stage_devices]
            compiled = ["-"] * len(split)
        else:
            ex, state = trainer.executor, trainer.state
            per = [_state_bytes((st_state.params, st_state.opt_state), st.mesh.devices.flat[0])
                   for st, st_state in zip(ex.stages, state.stages)]
            compiled = []
            for st, st_state in zip(ex.stages, state.stages):
                with st.context():
                    c = st.update.lower(st_state, st_state.params, jnp.float32(1.0)).compile()
                compiled.append(f"{c.memory_analysis().argument_size_in_bytes / MIB:.3f}")
        for s, n in enumerate(split):
            rows.append([executor, str(s), str(n), f"{per[s] / MIB:.3f}",
                         f"{per[s] / per[0]:.3f}", compiled[s]])
    print(f"## Per-stage memory: 8-layer holmes_mini model split {list(split)}, pp2 dp2 tp2, "
          "parameters + AdamW moments per device")
    print()
    print("| executor | stage | layers | params + optimizer (MiB) | / stage 0 | "
          "update program arguments (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()


def _task_times(schedule: str, microbatches: int, repeats: int) -> dict:
    """Best-of-`repeats` median seconds of each (stage, task kind) of the MPMD executor
    running `schedule` on holmes_mini (d_model 256)."""
    trainer = holmes_trainer("--config.pipeline.executor=mpmd",
                             f"--config.pipeline.schedule={schedule}",
                             f"--config.pipeline.microbatches={microbatches}",
                             f"--config.train.batch_size={4 * microbatches}",
                             "--config.model.d_model=256", "--config.model.d_ff=768")
    ex = trainer.executor
    batch = trainer.put_batch(next(trainer.data))
    times: dict = {}
    for r in range(repeats + 1):  # the first round compiles
        sample: dict = {}
        jax.block_until_ready(ex.stage_loss_and_grads(trainer.state, batch, sample))
        if r:
            for k, v in sample.items():
                times.setdefault(k, []).append(float(np.median(v)))
    return {k: min(v) for k, v in times.items()}


def mpmd_time(split=(4, 3), microbatches=8, repeats=3) -> None:
    """Each schedule's MPMD tasks timed task by task on holmes_mini (its split, d_model 256),
    then played on the asynchronous timeline: the step time the stages would take running in
    parallel (one process here runs them one after another; the emulated cluster runs them
    apart). The bubble played from measured times is printed beside the schedule's formula."""
    pp = len(split)
    rows, task_rows = [], []
    for name in sch.SCHEDULES:
        t = _task_times(name, microbatches, repeats)
        schedule = sch.make_schedule(name, pp, microbatches)
        v = schedule.virtual  # a chunk task does 1 / v of the stage's work
        fwd = [v * t[s, "F"] for s in range(pp)]
        if schedule.splits_backward:
            bwd = [v * (t[s, "I"] + t[s, "W"]) for s in range(pp)]
            share = sum(t[s, "W"] for s in range(pp)) / sum(t[s, "I"] + t[s, "W"]
                                                         for s in range(pp))
        else:
            bwd, share = [v * t[s, "B"] for s in range(pp)], 0.5
        events = timeline(schedule, fwd, bwd, weight_share=share)
        step = max(e.end for e in events)
        busy = sum(e.end - e.start for e in events)
        f, b = float(np.mean(fwd)), float(np.mean(bwd))
        rows.append((name, step, 1 - busy / (pp * step), schedule.bubble(f, b)))
        task_rows += [(name, s, split[s], fwd[s], bwd[s]) for s in range(pp)]
    print(f"## MPMD task times, holmes_mini (layers {list(split)}, d_model 256, "
          f"{microbatches} micro-batches of 4 x 128 tokens), best of {repeats}")
    print()
    print("| schedule | stage | layers | F per micro-batch (ms) | B per micro-batch (ms) |")
    print("|---|---:|---:|---:|---:|")
    for name, s, n, fw, bw in task_rows:
        print(f"| {name} | {s} | {n} | {fw * 1e3:.1f} | {bw * 1e3:.1f} |")
    print()
    print("Asynchronous step time played from these task times (transfers free on one host), "
          "and the bubble its formula predicts with the mean stage times:")
    print()
    print("| schedule | step (ms) | bubble played | bubble by formula | vs GPipe | vs 1F1B |")
    print("|---|---:|---:|---:|---:|---:|")
    steps = {r[0]: r[1] for r in rows}
    for name, step, bubble, formula in rows:
        print(f"| {name} | {step * 1e3:.1f} | {bubble:.1%} | {formula:.1%} | "
              f"{step / steps['gpipe']:.3f} | {step / steps['1f1b']:.3f} |")
    print()


def remat(schedules=("gpipe", "1f1b"), microbatches: int = 8) -> None:
    """The SPMD pipeline's compiled train step per recompute policy on configs/holmes_mini.py:
    FLOPs (`cost_analysis()`, per device) and temp memory (`memory_analysis()`)."""
    print(f"## Recompute in the SPMD pipeline: configs/holmes_mini.py, M = {microbatches}, "
          f"compiled train step per device")
    print()
    print("| schedule | model.remat | GFLOP | vs full | temp (MiB) | vs full |")
    print("|---|---|---:|---:|---:|---:|")
    for schedule in schedules:
        rows = {}
        for policy in ("full", "dots", "none", "auto"):
            trainer = holmes_trainer(f"--config.pipeline.schedule={schedule}",
                                     f"--config.pipeline.microbatches={microbatches}",
                                     f"--config.train.batch_size={4 * microbatches}",
                                     f"--config.model.remat={policy}")
            compiled = trainer.compiled_step()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            rows[policy] = (cost["flops"], compiled.memory_analysis().temp_size_in_bytes)
            f, t = rows[policy]
            f0, t0 = rows["full"]
            print(f"| {schedule} | {policy} | {f / 1e9:.3f} | {f / f0:.3f} | {t / MIB:.2f} | "
                  f"{t / t0:.2f} |", flush=True)
    print()


def folded(split=(4, 3), microbatches=(4, 8, 16, 32)) -> None:
    """Step time of each grid schedule looped and folded, in units of one layer's forward for
    the holmes_mini split (F = n, B = 3 n per device): lockstep as the SPMD executor runs it
    (`lockstep.lockstep_time` against `folded_lockstep_time` on the 2 pp stage grid, each
    device's down chunk ceil(n / 2) of its layers) and asynchronous as the MPMD executor runs
    it (`timeline` of the schedule against that of `schedules.folded`)."""
    p = len(split)
    fwd = [float(n) for n in split]
    bwd = [3.0 * n for n in split]
    share = [((n + 1) // 2) / n for n in split]
    print(f"## Modelled step time, looped vs folded placement, devices of {list(split)} layers, "
          f"F = n, B = 3n (one layer forward = 1)")
    print()
    print("| schedule | M | lockstep looped | lockstep folded | asynchronous looped | "
          "asynchronous folded |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in ("gpipe", "1f1b", "strands"):
        for m in microbatches:
            lo = lockstep_time(sch.make_schedule(name, p, m), fwd, bwd)
            fo = folded_lockstep_time(sch.make_schedule(name, 2 * p, m), fwd, bwd,
                                          down_share=share)
            la = max(e.end for e in timeline(sch.make_schedule(name, p, m), fwd, bwd))
            fa = max(e.end for e in timeline(sch.folded(name, p, m), fwd, bwd))
            print(f"| {name} | {m} | {lo:.0f} | {fo:.0f} | {la:.0f} | {fa:.0f} |")
    print()


def folded_memory(microbatches=(4, 8), per_microbatch: int = 4) -> None:
    """Temp memory of the compiled train step on configs/holmes_mini.py, looped against folded,
    for 1F1B and strands (the folded executor sizes each chunk's stash for the virtual grid's
    largest stage, see docs/pipeline.md)."""
    print("## Temp memory per device of the compiled step (MiB), looped vs folded, "
          "configs/holmes_mini.py")
    print()
    print("| micro-batches M | 1F1B looped | 1F1B folded | strands looped | strands folded |")
    print("|---:|---:|---:|---:|---:|")
    for m in microbatches:
        row = [str(m)]
        for schedule in ("1f1b", "strands"):
            for placement in ("looped", "folded"):
                trainer = holmes_trainer(f"--config.pipeline.schedule={schedule}",
                                         f"--config.pipeline.placement={placement}",
                                         f"--config.pipeline.microbatches={m}",
                                         f"--config.train.batch_size={per_microbatch * m}")
                stats = trainer.compiled_step().memory_analysis()
                row.append(f"{stats.temp_size_in_bytes / MIB:.2f}")
        print("| " + " | ".join(row) + " |", flush=True)
    print()


def smoke(outdir: str | None = None) -> None:
    """Every kind of section at tiny sizes, in seconds (tests/test_scripts.py runs it): the
    modelled times, the compute table with 2 layer slots, the plots into a temporary folder."""
    import tempfile

    step_time(split=(2, 1), microbatches=(4,))
    compute(max_layers=2)
    with tempfile.TemporaryDirectory() as tmp:
        plots(outdir or tmp, stages=2, microbatches=2)


SECTIONS = {"memory": memory, "compute": compute, "time": step_time, "plots": plots,
            "mpmd-memory": mpmd_memory, "mpmd-time": mpmd_time, "remat": remat,
            "folded": folded, "folded-memory": folded_memory}
DEFAULT = ["memory", "compute", "time", "plots", "mpmd-memory", "mpmd-time", "remat"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("sections", nargs="*", metavar="SECTION",
                    help=f"what to run: {', '.join(SECTIONS)} (default: {', '.join(DEFAULT)})")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny versions of time, compute and plots, in seconds")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    unknown = [w for w in args.sections if w not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.smoke:
        smoke()
        return 0
    for w in args.sections or DEFAULT:
        SECTIONS[w]()
    return 0


if __name__ == "__main__":
    sys.exit(main())

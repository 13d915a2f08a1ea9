"""The cost model against everything measurable here: predicted against measured step time and
peak memory, with the mean and worst error per source.

    python scripts/bench/predict.py                 # every source (a few minutes)
    python scripts/bench/predict.py --smoke         # seconds: a row or two of each source
    python scripts/bench/predict.py --sources emulated,amsp --json runs/predict.json

Sources, and which of their rows fitted a constant (those are listed, never scored as
validation):
- emulated cluster: the testbed's heterogeneous-accelerator runs kept in docs/results
  (bench_hetaccel_*.json, each priced with the calibration file kept beside it, as `hetjax
  plan` prices it); the calibration measures kernels and links, never a step: every row is
  held out;
- XLA memory_analysis(): compiled train steps of the tiny model on CPU, predicted per-device
  bytes against XLA's argument + output + temp - alias; the activation terms were fitted on
  data-parallel float32 steps at one layout (hetjax/planner/memory.py), so the rows here are
  the other layouts, dtypes and ZeRO points;
- profile, a size held out: each kept calibration file's compute profile read at a measured
  micro-batch size from its other sizes (what the band's per-doubling term rests on);
- published tables: Megatron-LM's Table 1 (TFLOP/s per GPU; rows 1.7B and 310.1B fitted the
  per-kind rates, the other eight held out; and every row priced by the flat model, whose
  efficiency was fitted on Holmes: what the band of a flat prediction rests on), AMSP's MFU at
  1,024 GPUs (held out), Holmes' Table 1 (samples/s; all three rows fitted the flat efficiency
  and the fabric efficiencies: shown, not scored);
- one H200: the peak memory of a TinyLlama-shaped step recorded on the GPU (tests/
  test_memory.py; remat 'none' set the GPU score factor, 'dots' and 'full' held out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import numpy as np  # noqa: E402

if __package__:  # python -m scripts.bench.predict
    from .experiments.harness import check_outputs, table
    from .experiments.repredict import Run, repredict
else:  # python scripts/bench/predict.py: Python puts scripts/bench/ first on sys.path
    from experiments.harness import check_outputs, table
    from experiments.repredict import Run, repredict

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "docs", "results")
HETACCEL_RUNS = ("bench_hetaccel_0705.json", "bench_hetaccel_0927.json")


@dataclass
class Row:
    source: str
    name: str
    what: str  # "step s", "GiB", "TFLOP/s", "MFU", "samples/s"
    predicted: float
    measured: float
    fitted: bool = False  # this row fitted a constant: shown, not scored

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1


# --- the sources --------------------------------------------------------------------------------
def emulated_cluster(smoke: bool) -> list[Row]:
    rows = []
    for name in HETACCEL_RUNS[:1] if smoke else HETACCEL_RUNS:
        run = Run.load(os.path.join(RESULTS, name))
        if smoke:
            run.rows = dict(list(run.rows.items())[:2])
        cal = os.path.join(RESULTS, name.replace(".json", ".calibration.json"))
        (res,) = repredict([run], [cal])
        for n, p, m in zip(res["names"], res["predicted"], res["measured"]):
            rows.append(Row("emulated cluster", f"{name[:-5]}: {n}", "step s", p, m))
    return rows


# XLA memory_analysis() points: (remat, dtype, dp, tp, zero, extra); none of them is the
# fitted layout (float32, ddp, dp = 2, tp = 1, pp = 1).
MEMORY_POINTS = [
    ("none", "bfloat16", 2, 1, "ddp", {}),
    ("dots", "float32", 2, 1, "zero3", {}),
    ("full", "bfloat16", 2, 1, "zero3", {}),
    ("none", "float32", 1, 2, "ddp", {}),
    ("dots", "bfloat16", 1, 2, "ddp", {}),
    ("full", "float32", 2, 1, "zero1", {}),
    ("none", "float32", 4, 2, "zero1", {"train.batch_size": 16}),
]


def xla_memory(smoke: bool) -> list[Row]:
    from hetjax.config import base_config
    from hetjax.planner.config_plan import predict_for_config
    from hetjax.train import Trainer

    rows = []
    for remat, dtype, dp, tp, zero, extra in MEMORY_POINTS[:1] if smoke else MEMORY_POINTS:
        c = base_config()  # tests/test_memory.py's tiny model at 8 x 128 tokens
        for key, value in {
                "model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4,
                "model.n_kv_heads": 2, "model.d_ff": 128, "model.remat": remat,
                "model.dtype": dtype, "model.max_seq_len": 256, "parallel.pp": 1,
                "parallel.dp": dp, "parallel.tp": tp, "zero.preset": zero,
                "topology.preset": "cpu_single", "topology.devices_per_node": dp * tp,
                "train.seq_len": 128, "train.batch_size": 8, "train.progress": False,
                "data.source": "synthetic", "tensorboard": False, **extra}.items():
            node = c
            *parents, leaf = key.split(".")
            for part in parents:
                node = node[part]
            node[leaf] = value
        trainer = Trainer(c, quiet=True)
        ma = trainer.compiled_step().memory_analysis()
        measured = (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
                    - ma.alias_size_in_bytes)
        predicted = max(predict_for_config(c, trainer.plan, trainer.topology).stage_memory)
        name = f"{remat} {dtype} dp={dp} tp={tp} {zero}" + "".join(
            f" {k.split('.')[1]}={v}" for k, v in extra.items())
        rows.append(Row("XLA memory_analysis()", name, "GiB", predicted / 2**30,
                        measured / 2**30))
    return rows


def megatron(smoke: bool) -> list[Row]:
    from hetjax.planner import reference_runs as ref

    return [Row("Megatron-LM Table 1", r.name, "TFLOP/s", ref.predicted_tflops(r),
                r.tflops_per_gpu, fitted=r.name in ref.FITTED_ROWS)
            for r in (ref.MEGATRON_TABLE1[:2] if smoke else ref.MEGATRON_TABLE1)]


def megatron_flat(smoke: bool) -> list[Row]:
    """The flat model (one efficiency, fitted on Holmes) on Megatron's table: none of its
    constants was fitted on these rows."""
    from hetjax.planner import reference_runs as ref
    from hetjax.planner.cost import CostOptions

    flat = CostOptions(executor="megatron")
    return [Row("Megatron-LM Table 1, flat model", r.name, "TFLOP/s",
                ref.predicted_tflops(r, flat), r.tflops_per_gpu)
            for r in (ref.MEGATRON_TABLE1[:2] if smoke else ref.MEGATRON_TABLE1)]


def profile_sizes(smoke: bool) -> list[Row]:
    """Each calibration file's profile read at a measured size from its other sizes (the
    smallest and the largest of each piece held out in turn): the extrapolation's error."""
    import dataclasses
    import glob

    from hetjax.planner.calibrate import load_calibration

    rows = []
    files = sorted(glob.glob(os.path.join(RESULTS, "*calibration*.json")))
    for path in files[:1] if smoke else files:
        prof = load_calibration(path).profile()
        groups: dict[tuple, list] = {}
        for r in prof.rows:
            groups.setdefault((r.accelerator, r.piece, r.tp, r.seq_len, r.recompute,
                               r.pipelined), []).append(r)
        for key, mine in groups.items():
            sizes = sorted({r.tokens for r in mine})
            for held in ((sizes[0], sizes[-1]) if len(sizes) > 1 else ()):
                rest = dataclasses.replace(prof, rows=tuple(
                    r for r in prof.rows if not (r in mine and r.tokens == held)))
                e = rest.lookup(key[0], key[1], key[2], held, key[3], key[4], key[5])
                true = next(r for r in mine if r.tokens == held)
                name = (f"{os.path.basename(path)[:-5]}: {key[1]} {key[4]}"
                        f"{' pipelined' if key[5] else ''} {held} tokens (x{e.distance:.3g})")
                rows.append(Row("profile, a size held out", name, "fwd + bwd s",
                                e.fwd_s + e.bwd_s, true.fwd_s + true.bwd_s))
    return rows


def amsp(smoke: bool) -> list[Row]:
    from hetjax.planner import reference_runs as ref

    return [Row("AMSP, 1,024 A800", f"LLaMA {name}", "MFU",
                ref.amsp_plan(name).predicted["mfu"], ref.AMSP_MFU)
            for name in (ref.AMSP_REPORTED[:1] if smoke else ref.AMSP_REPORTED)]


def holmes(smoke: bool) -> list[Row]:
    from hetjax.planner import reference_runs as ref
    from hetjax.planner.cost import CostOptions

    return [Row("Holmes Table 1", m.name, "samples/s",
                ref.predicted_samples_per_s(m, CostOptions()), m.samples_per_s, fitted=True)
            for m in ref.holmes_table1()[:1 if smoke else None]]


# tests/test_memory.py's record of one H200 (jax 0.11.2): a TinyLlama-shaped step at 4 x 2048,
# bf16 compute, fp32 parameters, XLA attention; 'none' asked for 144 GiB and did not run.
H200_MEASURED_GIB = {"none": 144.0, "dots": 28.5, "full": 23.7}
H200_FITTED = ("none",)  # set memory.GPU_KEPT_SCORE_FACTOR


def one_h200(smoke: bool) -> list[Row]:
    from hetjax.config import apply_model_source, base_config
    from hetjax.core.catalogue import ACCELERATORS, LINKS, make_cluster
    from hetjax.core.hardware import Topology
    from hetjax.planner import plan_from_config
    from hetjax.planner.config_plan import predict_for_config

    topo = Topology(name="one_h200", clusters=(make_cluster(
        "gpu", 1, 1, ACCELERATORS["h200"], "infiniband", intra="nvlink"),),
        inter_cluster=LINKS["ethernet"])
    rows = []
    for remat, gib in list(H200_MEASURED_GIB.items())[1:2] if smoke else \
            H200_MEASURED_GIB.items():
        c = base_config()
        c.model.preset = "tinyllama_1b"
        apply_model_source(c)
        c.model.dtype, c.model.param_dtype, c.model.remat, c.model.attention = (
            "bfloat16", "float32", remat, "xla")
        c.parallel.pp = c.parallel.dp = c.parallel.tp = 1
        c.train.batch_size, c.train.seq_len, c.train.microbatches = 4, 2048, 1
        c.data.source = "synthetic"
        (need,) = predict_for_config(c, plan_from_config(c, topo), topo).stage_memory
        rows.append(Row("one H200 (recorded)", f"TinyLlama 4 x 2048 remat {remat}", "GiB",
                        need / 2**30, gib, fitted=remat in H200_FITTED))
    return rows


SOURCES = {"emulated": emulated_cluster, "profile": profile_sizes, "memory": xla_memory,
           "megatron": megatron, "megatron_flat": megatron_flat, "amsp": amsp,
           "holmes": holmes, "h200": one_h200}


# --- the tables -----------------------------------------------------------------------------------
def summary(rows: list[Row]) -> list[list[str]]:
    out = []
    for source in dict.fromkeys(r.source for r in rows):
        mine = [r for r in rows if r.source == source]
        scored = [abs(r.error) for r in mine if not r.fitted]
        fitted = [r.name for r in mine if r.fitted]
        out.append([source, mine[0].what, str(len(scored)),
                    f"{np.mean(scored):.1%}" if scored else "-",
                    f"{max(scored):.1%}" if scored else "-",
                    ", ".join(fitted) if fitted else "none"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--smoke", action="store_true",
                    help="a row or two of each source, in seconds (the suite runs it)")
    ap.add_argument("--sources", default=",".join(SOURCES),
                    help=f"comma-separated, of {', '.join(SOURCES)} (default: all)")
    ap.add_argument("--json", default="", help="write the rows here")
    args = ap.parse_args(argv)
    check_outputs("bench_predict", results={"json": args.json})
    names = [n for n in args.sources.split(",") if n]
    unknown = sorted(set(names) - set(SOURCES))
    if unknown:
        ap.error(f"--sources: unknown {', '.join(unknown)}; choose from {', '.join(SOURCES)}")
    rows = [r for n in names for r in SOURCES[n](args.smoke)]
    print("## Per source: mean and worst |predicted / measured - 1| over the held-out rows\n")
    print(table(["source", "quantity", "held-out rows", "mean error", "worst error",
                 "rows that fitted a constant (not scored)"], summary(rows)))
    print("\n## Every row\n")
    print(table(["source", "row", "quantity", "predicted", "measured", "error", ""],
                [[r.source, r.name, r.what, f"{r.predicted:.4g}", f"{r.measured:.4g}",
                  f"{r.error:+.1%}", "fitted" if r.fitted else ""] for r in rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

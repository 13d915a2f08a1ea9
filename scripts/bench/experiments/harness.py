"""The harness the testbed experiments share (scripts/bench/experiments/hetnet.py, hetaccel.py;
docs/testbed.md): what is trained (`Workload`), calibrating the cost model on the emulated
cluster the way a user calibrates theirs (`calibrate_testbed`: `hetjax calibrate` under
`hetjax launch` on every emulated host), one configuration's run (`Case`, `run_case`; SPMD, or
MPMD with one JAX world per cluster and the bridge on the shaped inter-cluster link) with the
prediction `hetjax plan` makes for it from that calibration file, the CPU watch that repeats
runs disturbed by other processes, and the tables, plot and JSON record of the results. Needs
root only when a Testbed is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import os
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from hetjax import linkcheck
from hetjax.errors import HetjaxError
from hetjax.core.plan import Plan
from hetjax.planner.scoring import prediction_errors
from hetjax.testbed import DEFAULT_SCALE, Testbed
from hetjax.core.topology import Topology

# The checkout the benches write their plots (docs/img) and results (runs/) into.
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
OTHERS_LIMIT = 0.3  # CPUs other processes may use during a timed run before it is repeated
QUIET_WAIT_S = 900  # how long to wait for a quiet machine at most


# --- what is trained ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """The model and batch every configuration trains (data.source=synthetic)."""

    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 768
    seq_len: int = 64
    batch: int = 16  # global, sequences
    microbatches: int = 4
    steps: int = 10
    schedule: str = "1f1b"

    def config_args(self, n_layers: int | None = None) -> list[str]:
        """`--config` flags for the model, batch and run length (no layout, no topology)."""
        flags = {"model.d_model": self.d_model, "model.n_layers": n_layers or self.n_layers,
                 "model.n_heads": self.n_heads, "model.n_kv_heads": self.n_heads,
                 "model.d_ff": self.d_ff, "model.max_seq_len": self.seq_len,
                 "train.seq_len": self.seq_len, "train.batch_size": self.batch,
                 "train.microbatches": self.microbatches, "pipeline.schedule": self.schedule,
                 "train.steps": self.steps, "train.log_every": 1, "train.progress": False,
                 "data.source": "synthetic", "tensorboard": False, "checkpoint.every": 0,
                 "eval.every": 0}  # workers without --config run the default job: no evals
        return [f"--config.{k}={v}" for k, v in flags.items()]

    def config(self, extra: list[str] = ()):
        """The config the workers load (with `extra` --config flags)."""
        from hetjax.config import load_config

        return load_config(None, [*self.config_args(), *extra])

    def model(self):
        """The ModelConfig the workers build (the planner's view of it)."""
        from hetjax.planner import model_from_config

        return model_from_config(self.config())

    def describe(self) -> str:
        m = self.model()
        return (f"model: d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, d_ff "
                f"{m.d_ff}, vocab {m.vocab_size}: {m.num_params / 1e6:.2f}M parameters "
                f"({m.layer_params * 4 / 1e6:.2f} MB of fp32 gradients per layer); batch "
                f"{self.batch} x {self.seq_len} tokens in {self.microbatches} micro-batches, "
                f"{self.schedule}; {self.steps} steps, the first 2 not timed")


def layout_args(plan: Plan) -> list[str]:
    """`--config` flags that make the trainer build `plan`'s layout in rank order (the
    device order is realised by which host each process runs on, see `host_order`), with its
    schedule, pipeline executor and recompute policy: the planner's choice when it made one
    (Plan.remat), else, on the MPMD executor, every layer recomputed (model.remat=full) as the
    SPMD executor does -- the same compute, only the executor differs. Put these after
    `Workload.config_args` (later flags win)."""
    args = [f"--config.parallel.pp={plan.pp}", f"--config.parallel.dp={plan.dp}",
            f"--config.parallel.tp={plan.tp}",
            f"--config.pipeline.stage_layers=[{','.join(map(str, plan.stage_layers))}]",
            f"--config.pipeline.schedule={plan.schedule}",
            f"--config.train.microbatches={plan.microbatches}"]
    if plan.executor == "mpmd" and plan.pp > 1:
        # launch.plan_workers then starts one JAX world per cluster (hetjax.planner.worlds)
        # when the stages sit on different fabrics or kinds, the bridge between them.
        args += ["--config.pipeline.executor=mpmd", "--config.model.remat=full"]
    if plan.remat:  # what the plan was priced with is what runs
        args.append(f"--config.model.remat={plan.remat}")
    return args


def host_order(tb: Testbed, plan: Plan) -> list[str]:
    """Process i runs on the host of rank plan.device_order[i]: the trainer lays out ranks in
    order, so mesh position i lands on that host (one device per host)."""
    if any(c.devices_per_node != 1 for c in tb.topology.clusters) or plan.tp != 1:
        raise HetjaxError("placing a plan by host order needs one device per host and tp = 1")
    return [tb.hosts[r].name for r in plan.device_order]


# --- calibration: hetjax calibrate on the testbed ------------------------------------------------
CALIBRATION_LAYOUT = ["--config.parallel.pp=2", "--config.parallel.dp=2",
                      "--config.parallel.tp=1", "--config.pipeline.executor=spmd"]


def write_topology(topology: Topology, workdir: str) -> str:
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "topology.json")
    with open(path, "w") as f:
        f.write(topology.to_json())
    return path


def calibrate_testbed(tb: Testbed, work: Workload, workdir: str, log,
                      timeout: float = 1800) -> str:
    """Calibrate the cost model on the testbed as a user calibrates a cluster: `hetjax
    calibrate` under `hetjax launch`, one process per emulated host under its CPU cap, the
    workload's model at one device's micro-batch sizes. Returns the calibration file's path
    (for `--config.planner.calibration`); the measured-vs-modelled tables go to the log file."""
    out = os.path.join(workdir, "calibration.json")
    micro = work.batch // work.microbatches
    batches = sorted({max(1, micro // 4), max(1, micro // 2), micro})
    args = [*work.config_args(), f"--config.topology.file={write_topology(tb.topology, workdir)}",
            *CALIBRATION_LAYOUT, f"--config.workdir={workdir}", f"--out={out}",
            f"--batches={','.join(map(str, batches))}", f"--seq_lens={work.seq_len}"]
    t0 = time.monotonic()
    p = tb.launch(args, timeout=timeout, launch_flags=["--command=calibrate"],
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text, _ = p.communicate(timeout=timeout + 30)
    with open(os.path.join(workdir, "calibrate.log"), "w") as f:
        f.write(text)
    if p.returncode != 0 or not os.path.exists(out):
        raise HetjaxError(f"hetjax calibrate on the testbed failed (exit {p.returncode}); "
                          f"see {workdir}/calibrate.log:\n{text[-2000:]}")
    log(f"  calibrated in {time.monotonic() - t0:.0f} s: {out}")
    return out


def predict_case(plan: Plan, topology: Topology, work: Workload, calibration: str,
                 extra: tuple[str, ...] = (), **overrides):
    """What `hetjax plan --config.planner.calibration=FILE` predicts for this layout on this
    topology (hetjax.planner.config_plan.predict_for_config; `extra`: more --config flags,
    `overrides`: CostOptions)."""
    from hetjax.planner.config_plan import predict_for_config

    cfg = work.config([f"--config.planner.calibration={calibration}", *layout_args(plan),
                       *extra])
    return predict_for_config(cfg, plan, topology, **overrides)


# --- one configuration ----------------------------------------------------------------------------
@dataclass
class Case:
    """One run: a topology, a layout (a Plan, device order included) and CPU caps."""

    name: str
    topology: Topology
    plan: Plan | None
    cpus: dict[str, float] | float | None  # CPU cap per host (Testbed's `cpus`)
    # Chooses the plan (given the topology and the calibration file) when `plan` is None.
    choose: Callable[[Topology, str], Plan] | None = None
    # The pipeline executor the run uses (it replaces the plan's): "spmd" or "mpmd" (one JAX
    # world per cluster when the stages sit on different fabrics or kinds).
    executor: str = "spmd"
    # --config flags the run and its prediction add (e.g. pipeline.boundary_codec=int8)
    extra: tuple[str, ...] = ()
    # filled in by run_case
    step_s: list[float] = field(default_factory=list)
    predicted_s: float | None = None  # as `hetjax plan` with the calibration file prices it
    predicted_lockstep_s: float | None = None
    bubble: float | None = None  # predicted share of stage time not computing
    cpu_use: tuple[float, float] | None = None  # CPUs (ours, others) on average during the run
    caps_cpus: float = 0.0  # sum of the hosts' CPU caps
    attempts: int = 0
    traffic: dict[str, float] = field(default_factory=dict)  # MiB per step by link class
    links: list = field(default_factory=list)  # linkcheck.LinkMeasurement
    dp_links: str = ""
    pp_links: str = ""
    wall_s: float = 0.0
    error: str = ""

    @property
    def mean_s(self) -> float | None:
        return statistics.mean(self.step_s) if self.step_s else None

    @property
    def sd_s(self) -> float:
        return statistics.stdev(self.step_s) if len(self.step_s) > 1 else 0.0

    def tokens_per_s(self) -> float | None:
        return self.plan.global_batch * self.plan.seq_len / self.mean_s if self.step_s else None


def placement(topology: Topology, plan: Plan) -> tuple[str, str]:
    """The link kinds the plan's DP groups and PP neighbours cross (from the topology)."""
    mesh = plan.mesh_ranks()
    dp = sorted({topology.group_link(g).kind for g in plan.dp_groups()}) if plan.dp > 1 else []
    pp = sorted({topology.link(int(a), int(b)).kind for s in range(plan.pp - 1)
                 for a, b in zip(mesh[s].ravel(), mesh[s + 1].ravel())})
    return "/".join(dp) or "-", "/".join(pp) or "-"


def run_case(case: Case, work: Workload, workdir: str, scale: float, calibration: str,
             timeout: float, log, retries: int = 2) -> Case:
    """Build the case's testbed, measure its links, (plan,) train, predict from the
    calibration file `calibration`; errors are
    recorded in the case, not raised. A run during which other processes used more than
    OTHERS_LIMIT CPUs is repeated (up to `retries` times) once the machine is quiet."""
    for attempt in range(retries + 1):
        case.attempts = attempt + 1
        _attempt(case, work, workdir, scale, calibration, timeout, log)
        others = case.cpu_use[1] if case.cpu_use else 0.0
        if others <= OTHERS_LIMIT or attempt == retries:
            break
        log(f"  other processes used {others:.2f} CPUs during that run; repeating it")
        wait_for_quiet(log)
    return case


def _attempt(case: Case, work: Workload, workdir: str, scale: float, calibration: str,
             timeout: float, log) -> None:
    case.error, case.step_s, case.cpu_use = "", [], None
    topo_path = write_topology(case.topology, workdir)
    try:
        if case.choose is not None:
            case.plan = case.choose(case.topology, calibration)
        case.plan = dataclasses.replace(case.plan, executor=case.executor)
        with Testbed(case.topology, scale=scale, cpus=case.cpus) as tb:
            case.links = tb.measure_links(seconds=0.5)
            case.dp_links, case.pp_links = placement(case.topology, case.plan)
            args = [*work.config_args(), f"--config.topology.file={topo_path}",
                    *layout_args(case.plan), *case.extra]
            case.caps_cpus = sum(tb.cpus.get(h.cluster, 0.0) for h in tb.hosts)
            watch = CpuWatch()
            run = tb.train(args, os.path.join(workdir, "run"), host_order(tb, case.plan),
                           timeout=timeout)
            case.cpu_use = watch.stop()
            case.wall_s = run.seconds
            with open(os.path.join(workdir, "output.log"), "w") as f:
                f.write(run.output)
            if not run.ok:
                case.error = f"run failed (exit {run.returncode}):\n{run.error()}"
            case.step_s = run.step_times()
            steps = max(1, len(run.metrics))
            case.traffic = {k: v / 2**20 / steps
                            for k, v in linkcheck.traffic_by_link(tb, run.traffic).items()}
    except HetjaxError as e:
        case.error = case.error or str(e)
        return
    try:
        pred = predict_case(case.plan, case.topology, work, calibration, case.extra)
        case.predicted_s, case.bubble = pred.step_time, pred.bubble
        case.predicted_lockstep_s = predict_case(case.plan, case.topology, work, calibration,
                                                 case.extra, lockstep=True).step_time
    except HetjaxError as e:
        case.error = case.error or f"prediction failed: {e}"
    log(f"  {case.name}: " + (f"{case.mean_s:.3f} s/step measured, {case.predicted_s:.3f} s "
                              f"predicted, {case.wall_s:.0f} s wall"
                              if case.step_s and case.predicted_s else f"FAILED {case.error}"))


# --- reporting ------------------------------------------------------------------------------------
def table(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table (also readable as plain text)."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def link_table(cases: list[Case]) -> str:
    rows, seen = [], set()
    for c in cases:
        for m in c.links:
            key = (c.topology.name, m.label)
            if key in seen:
                continue
            seen.add(key)
            rows.append([c.topology.name, f"{m.label} ({m.link.kind})",
                         f"{m.configured_bps / 1e6:.1f}", f"{m.measured_bps / 1e6:.1f}",
                         f"{m.ratio:.2f}", f"{m.rtt_s / 2 * 1e6:.0f}"])
    return table(["topology", "link class", "configured Mbit/s", "measured Mbit/s", "ratio",
                  "RTT/2 us"], rows)


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def accuracy_table(cases: list[Case]) -> str:
    ok = [c for c in cases if c.step_s and c.predicted_s]
    rows = [[c.name, fmt(c.mean_s, ".3f"), fmt(c.predicted_s, ".3f"),
             f"{(c.predicted_s - c.mean_s) / c.mean_s:+.0%}",
             fmt(c.predicted_lockstep_s, ".3f"),
             f"{(c.predicted_lockstep_s - c.mean_s) / c.mean_s:+.0%}"] for c in ok]
    text = table(["configuration", "measured s/step", "predicted s/step", "error",
                  "predicted in lockstep", "error"], rows)
    groups = [("predicted", "predicted_s", ok),
              ("in lockstep", "predicted_lockstep_s", ok)]
    executors = sorted({c.executor for c in ok})
    if len(executors) > 1:  # each executor's rows on their own too
        groups += [(f"predicted, {x.upper()} rows", "predicted_s",
                    [c for c in ok if c.executor == x]) for x in executors]
    for what, key, rows in groups:
        if len(rows) >= 2:
            e = prediction_errors([getattr(c, key) for c in rows], [c.mean_s for c in rows])
            text += (f"\n{what}: mean absolute error {e.mae_s:.3f} s ({e.mean_relative:.0%} "
                     f"of the measured step on average) over {e.n} configurations; rank "
                     f"agreement: Spearman {e.spearman:.2f}, Kendall tau-b {e.kendall:.2f}")
    return text


ACCURACY_NOTE = """
"predicted" is what `hetjax plan --config.planner.calibration=FILE` predicts for the layout,
FILE being what `hetjax calibrate` measured on this testbed (one process per emulated host).
Measured across gloo processes, whose sends do not wait for the receiver, the calibration
prices the pipeline's stages on the asynchronous timeline, as one worker per host runs them
and as the MPMD executor always runs (its rows' two predictions are the same); "in lockstep"
prices the tick grid as one process runs it (every tick as long as its slowest stage; what
`hetjax train` on one machine's simulated devices does). Without a pipeline both are the
same."""


CPUS_HEADER = "CPUs: ours / others / caps"
CPUS_NOTE = f"""
CPUs: averages over the run of what our processes used (workers, launcher, link checks), what
everything else used (other processes, the kernel's network work), and the sum of the
emulated hosts' caps. A run during which the others used more than {OTHERS_LIMIT:g} CPUs is
repeated once the machine is quiet (up to twice; "run N" marks a repeat)."""

def failures(cases: list[Case]) -> str:
    bad = [c for c in cases if c.error]
    return "\n".join(f"FAILED {c.name}: {c.error}" for c in bad)


def bar_plot(path: str, title: str, labels: list[str], measured: list[float | None],
             predicted: list[float | None], ylabel: str, hline: tuple[float, str] | None = None,
             notes: list[str] | None = None,
             levels: Sequence[tuple[float, str, int, int]] = ()) -> str:
    """Bars of the measured values with the predicted ones as markers. `hline` (value, label):
    a reference across every bar; `levels` (value, label, first bar, last bar): references
    over some bars only. Their labels go in the legend, never over a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(labels)), 4.2))
    xs = range(len(labels))
    ax.bar(xs, [m or 0 for m in measured], color="#4C72B0", label="measured")
    pts = [(x, p) for x, p in zip(xs, predicted) if p]
    if pts:
        ax.scatter(*zip(*pts), marker="D", color="#DD8452", zorder=3, label="predicted")
    for x, m, n in zip(xs, measured, notes or [""] * len(labels)):
        ax.annotate(n if m else "failed", (x, m or 0), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points", zorder=5,  # over the levels
                    bbox=dict(facecolor="white", edgecolor="none", pad=0.5) if n or not m
                    else None)
    if hline:
        ax.axhline(hline[0], color="gray", ls="--", lw=1, label=hline[1])
    for (value, label, first, last), style in zip(levels, ("--", ":", "-.")):
        ax.hlines(value, first - 0.45, last + 0.45, colors="black", linestyles=style, lw=1.2,
                  label=label, zorder=4)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    # headroom above the tallest bar and its label for the legend
    ax.set_ylim(0, max(m or 0 for m in [*measured, *predicted]) * 1.35)
    ax.legend(fontsize=8, loc="upper right", ncol=2 + bool(hline) + len(levels))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def machine_busy_s() -> float:
    """CPU-seconds the whole machine has been busy so far (/proc/stat; not idle or iowait)."""
    with open("/proc/stat") as f:
        v = [float(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU-seconds of this process and its waited-for children (the launcher, and through it
    the workers, which exec down the rsh / nsenter / sh chain and are waited for in turn)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuWatch:
    """Average CPUs used by us and by everything else (other processes, the kernel's network
    work) between construction and `stop()`: timings are only meaningful when the others
    stay near zero."""

    def __init__(self):
        self.t0, self.busy0, self.own0 = time.monotonic(), machine_busy_s(), own_cpu_s()

    def stop(self) -> tuple[float, float]:
        wall = max(time.monotonic() - self.t0, 1e-3)
        ours = (own_cpu_s() - self.own0) / wall
        return ours, max(0.0, (machine_busy_s() - self.busy0) / wall - ours)


_BUSY_OK = False


def bench_args(argv, name: str, doc: str, steps: int, cpus_help: str,
               timeout: float, replot: bool = False) -> argparse.Namespace:
    """The flags both testbed benches take (`name`: bench_hetnet or bench_hetaccel), parsed;
    --busy-ok takes effect here. `replot`: the bench can redraw its plot from its JSON."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--steps", type=int, default=steps, help="steps per run (first 2 not timed)")
    ap.add_argument("--cpus", type=float, default=0.4, help=cpus_help)
    ap.add_argument("--scale", type=float, default=DEFAULT_SCALE, help="link rate factor")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "img", f"{name}.png"))
    ap.add_argument("--json", default=os.path.join(REPO, "runs", f"{name}.json"))
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), name))
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds per training run")
    ap.add_argument("--only", metavar="TEXT", action="append",
                    help="run only the configurations whose name contains TEXT (repeatable; "
                         "case insensitive; spmd / mpmd select by executor), e.g. --only mpmd")
    ap.add_argument("--busy-ok", action="store_true",
                    help="do not wait for a quiet machine nor repeat disturbed runs (a quick "
                         "functional look; timings then carry the machine's load)")
    if replot:
        ap.add_argument("--replot", metavar="JSON",
                        help="draw --out again from a results file this bench wrote; run nothing")
    args = ap.parse_args(argv)
    check_outputs(name, plots={"out": args.out}, results={"json": args.json})
    if args.busy_ok:
        allow_busy()
    return args


def check_outputs(prog: str, plots: dict[str, str] = {}, results: dict[str, str] = {}) -> None:
    """Every file a bench writes, checked before its work (as the hetjax commands check
    theirs, `hetjax.cli.check_output_path`): `plots` and `results` map a flag to its path
    (empty: not written). A missing directory is created (the bench would create it to write);
    a directory given as the file, an unwritable place, a plot in a format matplotlib does not
    write or results not ending in .json end the bench at once with one line."""
    from hetjax.cli import PLOT_FORMATS, check_output_path

    try:
        for paths, formats, kind in ((plots, PLOT_FORMATS, "a plot"),
                                     (results, ("json",), "results")):
            for flag, path in paths.items():
                if not path:
                    continue
                where = os.path.dirname(os.path.abspath(path))
                if not os.path.exists(where):
                    os.makedirs(where, exist_ok=True)
                check_output_path(flag, path, formats, kind=kind)
    except (HetjaxError, OSError) as e:
        raise SystemExit(f"{prog}: error: {e}") from None


def allow_busy() -> None:
    """For a quick look on a busy machine (the benches' --busy-ok): never wait for a quiet
    machine and never repeat a run; the timings then carry the load (the CPU column shows
    it)."""
    global OTHERS_LIMIT, _BUSY_OK
    OTHERS_LIMIT, _BUSY_OK = float("inf"), True


def wait_for_quiet(log, limit: float = OTHERS_LIMIT, max_wait: float = QUIET_WAIT_S) -> None:
    """Wait (up to max_wait s) until other processes use less than `limit` CPUs over 10 s."""
    if _BUSY_OK:
        return
    end = time.monotonic() + max_wait
    while True:
        watch = CpuWatch()
        time.sleep(10)
        others = watch.stop()[1]
        if others < limit:
            return
        if time.monotonic() > end:
            log(f"WARNING: other processes still use {others:.2f} CPUs; timings will show it")
            return
        log(f"waiting for a quiet machine: other processes use {others:.2f} CPUs "
            f"({load_line()})")


def start(name: str) -> Callable[[str], None]:
    """A logger that stamps each line with the seconds since now; logs the machine's load and
    waits for it to be quiet before returning."""
    t0 = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f} s] {msg}", flush=True)

    log(f"{name}: {load_line()}")
    wait_for_quiet(log)
    return log


def load_line() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def kept_calibration_path(results_path: str) -> str:
    """Where a bench keeps the calibration file it used, beside its results JSON (the
    workdir's copy is overwritten by the next run; scripts/bench/repredict.py reads this one)."""
    return os.path.splitext(results_path)[0] + ".calibration.json"


def save_json(path: str, payload: dict) -> None:
    """The results JSON; the calibration file it names is copied beside it and the copy
    recorded, so the run can be priced again later."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if payload.get("calibration") and os.path.exists(payload["calibration"]):
        kept = kept_calibration_path(path)
        shutil.copyfile(payload["calibration"], kept)
        payload = {**payload, "calibration": kept}
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def case_record(c: Case) -> dict:
    return {"name": c.name, "topology": c.topology.name, "executor": c.executor,
            "plan": c.plan.to_dict() if c.plan else None,
            "step_s": c.step_s, "mean_s": c.mean_s, "predicted_s": c.predicted_s,
            "predicted_lockstep_s": c.predicted_lockstep_s,
            "bubble_predicted": c.bubble,
            "cpus_ours_others": c.cpu_use, "caps_cpus": c.caps_cpus, "attempts": c.attempts,
            "traffic_mib_per_step": c.traffic, "dp_links": c.dp_links, "pp_links": c.pp_links,
            "links": [dataclasses.asdict(m) for m in c.links], "wall_s": c.wall_s,
            "error": c.error}


def select(cases: list[Case], only: Sequence[str] | None) -> list[Case]:
    """The cases whose name contains one of the strings `only` (case insensitive; "spmd" /
    "mpmd" also match by executor); all cases when `only` is empty."""
    words = [w.strip().lower() for w in (only or ()) if w.strip()]
    if not words:
        return cases
    chosen = [c for c in cases if any(w in c.name.lower() or w == c.executor for w in words)]
    if not chosen:
        raise HetjaxError(f"--only {' '.join(only)!r} matches none of the configurations "
                          f"{[c.name for c in cases]}; give part of a name, or spmd / mpmd")
    return chosen


def bridge_bytes(plan: Plan, work: Workload) -> dict[str, float]:
    """Bytes per step the MPMD executor moves over the bridge between two worlds, by kind
    (parallel/mpmd_worlds.py), for a pp = 2, tp = 1 plan whose stages are two worlds of
    single-device processes: every boundary activation and its gradient once; the tied
    embedding's gradient once each way, each replica pulling 1 / dp of its rows (when they
    divide; the receiving world gathers the rest on its own link)."""
    m = work.model()
    act = plan.global_batch * plan.seq_len * m.d_model * 4
    split = 1 if m.vocab_size % plan.dp == 0 else plan.dp
    emb = m.embed_params * 4 * split * 2 if m.tie_embeddings else 0
    return {"activations": float(act), "activation gradients": float(act),
            "tied embedding gradient": float(emb)}


# --- the experiment -------------------------------------------------------------------------------
def cpus_text(c: Case) -> str:
    """CPUs used during the run by us and by everything else, and the hosts' caps."""
    if c.cpu_use is None:
        return "-"
    retried = f" (run {c.attempts})" if c.attempts > 1 else ""
    return f"{c.cpu_use[0]:.2f} / {c.cpu_use[1]:.2f} / {c.caps_cpus:.2f}{retried}"

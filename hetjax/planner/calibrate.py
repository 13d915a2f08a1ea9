"""Calibrating the cost model: on measured throughputs (Holmes' Table 1), on the testbed, and
from `hetjax calibrate`'s measurements of a job's devices (the calibration file).

The cost model's one free compute parameter is the efficiency factor (fraction of peak a
layer reaches). `fit_efficiency` finds the value at which the model's predicted throughput of
a measured run equals the measurement (the prediction falls monotonically as efficiency
drops, so bisection). `holmes_table1` gives Holmes' three homogeneous runs (GPT 3.6B on 32
A100, InfiniBand / RoCE / Ethernet) as Measurements, to fit on one row and predict the others
(`scripts/bench/planner.py calibrate`); `fit_fabrics` fits one NIC efficiency per fabric
with the compute efficiency (the catalogue's defaults in hetjax.core.topology.LINKS).

`Calibration` holds what `hetjax calibrate` (hetjax/measure.py) measured -- the model's
block, head and optimizer update per accelerator kind, collectives per link class -- fits a `ComputeCurve` per kind and
a `LinkFit` per link class and operation (`options()`), compares measured with modelled
times (`describe`, `plot_calibration`) and is the JSON file `planner.calibration` names.
The testbed's benches (scripts/bench/het*.py) calibrate with it like a user would, and
`prediction_errors` (with `spearman`, `kendall_tau`) scores predicted against measured steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from hetjax.errors import PlanError
from hetjax.core.plan import Plan
from hetjax.planner import compute as ck
from hetjax.planner.cost import (DEFAULT_EFFICIENCY, ComputeCurve, CostModel, CostOptions,
                                 LinkFit)
from hetjax.planner.zero_factors import named
from hetjax.core.topology import Topology, preset

if TYPE_CHECKING:
    from hetjax.core.model_config import ModelConfig


@dataclass(frozen=True)
class Measurement:
    """A measured run: the layout, where it ran, the system that ran it (a cost-model
    executor) and its throughput in sequences per second."""

    name: str
    topology: Topology
    model: "ModelConfig"
    plan: Plan
    samples_per_s: float
    executor: str = "hetjax"


def predicted_samples_per_s(m: Measurement, options: CostOptions) -> float:
    options = dataclasses.replace(options, executor=m.executor)
    pred = CostModel(m.topology, m.model, options).predict(m.plan)
    return m.plan.global_batch / pred.step_time


def _solve(rate, target: float, lo: float, hi: float, what: str, tolerance: float) -> float:
    """Bisection for x in [lo, hi] with rate(x) = target, rate increasing in x."""
    if not rate(lo) <= target <= rate(hi):
        raise PlanError(f"no {what} in [{lo:g}, {hi:g}] makes the cost model predict "
                        f"{target:.4g} samples/s (it predicts {rate(lo):.4g} .. {rate(hi):.4g})")
    while hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) < target else (lo, mid)
    return (lo + hi) / 2


def fit_efficiency(m: Measurement, options: CostOptions | None = None,
                   tolerance: float = 1e-6) -> float:
    """The efficiency at which the cost model predicts the measured throughput."""
    options = options or CostOptions()
    return _solve(lambda eff: predicted_samples_per_s(
        m, dataclasses.replace(options, efficiency=eff)), m.samples_per_s, 1e-3, 1.0,
        "efficiency", tolerance)


def with_nic_bandwidth(topology: Topology, gbps: float) -> Topology:
    """The topology with every cluster's inter-node NIC achieving `gbps`."""
    return dataclasses.replace(topology, clusters=tuple(
        dataclasses.replace(c, nic=dataclasses.replace(c.nic, bandwidth_gbps=gbps,
                                                       efficiency=1.0))
        for c in topology.clusters))


def with_nic_efficiency(topology: Topology, efficiency: float) -> Topology:
    """The topology with every cluster's inter-node NIC at `efficiency` of its nominal rate."""
    return dataclasses.replace(topology, clusters=tuple(
        dataclasses.replace(c, nic=dataclasses.replace(c.nic, efficiency=efficiency))
        for c in topology.clusters))


def nominal_links(topology: Topology) -> Topology:
    """The topology with every link at its nominal bandwidth (efficiency 1)."""
    def nominal(lk):
        return None if lk is None else dataclasses.replace(lk, efficiency=1.0)

    return dataclasses.replace(
        topology,
        clusters=tuple(dataclasses.replace(c, nic=nominal(c.nic), intra_node=nominal(
            c.intra_node)) for c in topology.clusters),
        inter_cluster=nominal(topology.inter_cluster),
        cluster_links=tuple(dataclasses.replace(cl, link=nominal(cl.link))
                            for cl in topology.cluster_links))


def fit_nic_efficiency(m: Measurement, options: CostOptions | None = None,
                       tolerance: float = 1e-6) -> float:
    """The NIC efficiency (achieved / nominal bandwidth) at which the cost model predicts
    the measured throughput, given the compute efficiency of `options`."""
    options = options or CostOptions()
    return _solve(lambda eff: predicted_samples_per_s(
        dataclasses.replace(m, topology=with_nic_efficiency(m.topology, eff)), options),
        m.samples_per_s, 1e-3, 1.0, "NIC efficiency", tolerance)


@dataclass(frozen=True)
class FabricFit:
    """Holmes Table 1 fitted: one compute efficiency and one NIC efficiency per fabric."""

    compute_efficiency: float
    fabric_efficiency: dict[str, float]
    anchor: str  # the fabric taken at its nominal rate


def fit_fabrics(rows: Sequence[Measurement] | None = None) -> FabricFit:
    """Fit Table 1's three rows with four unknowns (compute efficiency and three fabric
    efficiencies): the rows fix the fabric efficiencies only relative to the compute
    efficiency, so take the smallest compute efficiency at which no fabric beats its nominal
    rate -- the one that puts the best fabric (here Ethernet, whose row implies a rate just
    above its nominal 25 Gb/s at the InfiniBand-fitted compute efficiency) at efficiency 1 --
    then fit each fabric's NIC efficiency at that compute efficiency."""
    rows = list(rows or holmes_table1(nominal=True))
    fits = {m.name: fit_efficiency(m) for m in rows}
    anchor = max(fits, key=fits.get)  # its nominal rate asks the most of compute
    options = CostOptions(efficiency=fits[anchor])
    effs = {m.name: 1.0 if m.name == anchor else fit_nic_efficiency(m, options) for m in rows}
    return FabricFit(fits[anchor], effs, anchor)


def fit_nic_bandwidth(m: Measurement, options: CostOptions | None = None,
                      tolerance: float = 1e-6) -> float:
    """The NIC bandwidth (Gb/s) at which the cost model predicts the measured throughput:
    the link's effective speed for this workload, given the compute efficiency."""
    options = options or CostOptions()
    return _solve(lambda gbps: predicted_samples_per_s(
        dataclasses.replace(m, topology=with_nic_bandwidth(m.topology, gbps)), options),
        m.samples_per_s, 0.01, 1e4, "NIC bandwidth", tolerance)


def holmes_model() -> "ModelConfig":
    """Holmes' GPT 3.6B (hidden 3072, 30 layers, 32 heads, GPT-2 vocabulary) with a SwiGLU MLP
    of the same size (d_ff = 8/3 h) and full activation recompute, in bf16."""
    from hetjax.core.model_config import ModelConfig

    return ModelConfig(vocab_size=50257, d_model=3072, n_layers=30, n_heads=32, n_kv_heads=32,
                       d_ff=8192, max_seq_len=2048, remat="full", dtype="bfloat16",
                       param_dtype="bfloat16")


# Holmes Table 1: samples per second of GPT 3.6B on 4 nodes x 8 A100 (PP 2, TP 1, DP 16,
# global batch 768, sequence 2048).
HOLMES_TABLE1 = {"infiniband": 99.23, "roce": 80.54, "ethernet": 61.32}


def holmes_table1(microbatch_per_replica: int = 1, nominal: bool = False) -> list[Measurement]:
    """The three rows as Measurements. Holmes runs Megatron-LM (1F1B, a ZeRO-1 style
    distributed optimizer); the micro-batch size is not reported (1 sequence per replica is
    assumed, so M = 768 / 16 = 48). The links are the catalogue's (with its fabric
    efficiencies), or at their nominal rates with `nominal`."""
    model = holmes_model()
    dp = 16
    plan = Plan(pp=2, dp=dp, tp=1, stage_layers=(15, 15),
                microbatches=768 // (dp * microbatch_per_replica), global_batch=768,
                seq_len=2048, schedule="1f1b", zero=named("zero1", dp, 8))
    def topology(nic):
        t = preset(f"holmes_{nic}")
        return nominal_links(t) if nominal else t

    return [Measurement(nic, topology(nic), model, plan, rate, executor="megatron")
            for nic, rate in HOLMES_TABLE1.items()]


# --- scoring predictions ------------------------------------------------------------------------
def _ranks(x: Sequence[float]) -> np.ndarray:
    """Ranks from 1, ties sharing their mean rank."""
    x = np.asarray(x, float)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        ranks[x == v] = ranks[x == v].mean()
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties averaged)."""
    ra, rb = _ranks(a), _ranks(b)
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def kendall_tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's tau-b: (concordant - discordant) pairs over the pairs not tied, with ties
    in either sequence corrected for."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    i, j = np.triu_indices(len(a), k=1)
    da, db = np.sign(a[i] - a[j]), np.sign(b[i] - b[j])
    n_a, n_b = np.count_nonzero(da), np.count_nonzero(db)
    if n_a == 0 or n_b == 0:
        return float("nan")
    return float(np.sum(da * db) / np.sqrt(n_a * n_b))


@dataclass(frozen=True)
class PredictionErrors:
    """How well predicted step times match measured ones."""

    n: int
    mae_s: float  # mean absolute error, seconds
    mean_relative: float  # mean |predicted - measured| / measured
    spearman: float
    kendall: float


def prediction_errors(predicted: Sequence[float], measured: Sequence[float]) -> PredictionErrors:
    p, m = np.asarray(predicted, float), np.asarray(measured, float)
    if len(p) != len(m) or not len(p):
        raise PlanError(f"need as many predictions as measurements, got {len(p)} and {len(m)}")
    return PredictionErrors(len(p), float(np.mean(np.abs(p - m))),
                            float(np.mean(np.abs(p - m) / m)), spearman(p, m), kendall_tau(p, m))


# --- a calibration file: what `hetjax calibrate` measured on a job's devices --------------------
OPS_MEASURED = ("all_reduce", "reduce_scatter", "all_gather", "p2p")
KIND_PARTS = ("matmul", "memory")  # and "attention:<impl>"
STAGED = "staged:"  # prefix of the compute parts measured as the pipelines run a block
CALIBRATION_VERSION = 1


@dataclass(frozen=True)
class ComputeRow:
    """One measurement on one device of `kind` (peak `peak_tflops`). Part "block": one decoder
    block, "head": the embedding, final norm, head and loss together -- seconds of the forward
    and of the pure backward (forward + backward less forward) of a micro-batch of `batch`
    sequences of `seq_len` tokens; "staged:<policy>": one block as the pipelines run it under
    that recompute policy, forward and backward each its own program (the backward's seconds
    include its recompute). Part "update": one optimizer update of `params`
    parameters in `fwd_s` seconds. The per-kind parts (hetjax/planner/compute.py): "matmul",
    one n x n x n matmul (batch = seq_len = n) of `params` FLOPs in `fwd_s`;
    "attention:<impl>", causal attention of the model's heads, forward and pure backward,
    `params` its forward FLOPs over the full square; "memory", a stream moving `params`
    bytes in `fwd_s`."""

    kind: str
    batch: int
    seq_len: int
    fwd_s: float
    bwd_s: float
    peak_tflops: float = 0.0
    part: str = "block"
    params: int = 0


@dataclass(frozen=True)
class LinkRow:
    """Seconds of collective `op` over concurrent rank `groups`, `nbytes` each (all-gather:
    the gathered size; point-to-point: a ring shift inside each group, nbytes per device)."""

    op: str
    nbytes: int
    groups: tuple[tuple[int, ...], ...]
    seconds: float

    def pairs(self) -> np.ndarray:
        """The (sender, receiver) pairs of a point-to-point ring shift."""
        g = np.asarray(self.groups)
        return np.stack([g, np.roll(g, -1, axis=1)], axis=-1).reshape(-1, 2)


@dataclass(frozen=True)
class Calibration:
    """Measurements of one job: compute per accelerator kind, collectives per link class, on
    `topology` with `model`'s block. `options()` turns them into cost options: a
    `ComputeCurve` per kind and a `LinkFit` per (link kind, operation)."""

    topology: Topology
    model: "ModelConfig"
    compute: tuple[ComputeRow, ...]
    links: tuple[LinkRow, ...]
    processes: int = 1  # of the job that measured
    # "gloo" / "mpi": CPU processes joined by that library, whose sends do not wait for the
    # receiver; else the platform ("cpu" in one process, "gpu": NCCL)
    collectives: str = ""

    # --- fits --------------------------------------------------------------------------------
    def rows(self, part: str) -> list[ComputeRow]:
        return [r for r in self.compute if r.part == part]

    def curves(self, part: str = "block") -> dict[str, ComputeCurve]:
        """Per accelerator kind, the efficiency curve of `part` ("block" or "head")."""
        out = {}
        for kind in sorted({r.kind for r in self.rows(part)}):
            rows = [r for r in self.rows(part) if r.kind == kind]
            flops = [self.kernel_flops(r) for r in rows]
            peak = [r.peak_tflops * 1e12 for r in rows]
            out[kind] = ComputeCurve(
                tuple(flops), tuple(f / (r.fwd_s * pk) for f, r, pk in zip(flops, rows, peak)),
                tuple(2 * f / (r.bwd_s * pk) for f, r, pk in zip(flops, rows, peak)))
        return out

    def kernel_flops(self, r: ComputeRow) -> float:
        """The part's forward FLOPs on one device's micro-batch (the curve's size axis)."""
        per_token = (self.model.head_flops() if r.part == "head"
                     else self.model.layer_flops(r.seq_len))
        return per_token * r.batch * r.seq_len

    def staged_curves(self) -> dict[str, dict[str, ComputeCurve]]:
        """Per recompute policy, per accelerator kind, the curve of the block as the pipelines
        run it (rows of part "staged:<policy>"; its backward's efficiency counts the
        recompute as time, not FLOPs)."""
        parts = sorted({r.part for r in self.compute if r.part.startswith(STAGED)})
        return {part[len(STAGED):]: self.curves(part) for part in parts}

    def kernel_rates(self) -> dict[str, ck.KernelRates]:
        """Per accelerator kind with per-kind rows: the measured matmul curve, memory
        bandwidth, fused-attention efficiencies and XLA attention's softmax passes (solved
        from its measured forward), over compute.FITTED's other rates."""
        out = {}
        accs = {c.accelerator.name: c.accelerator for c in self.topology.clusters}
        for kind in sorted({r.kind for r in self.rows("matmul")}):
            mm = [r for r in self.rows("matmul") if r.kind == kind]
            peak = mm[0].peak_tflops * 1e12
            rates = dataclasses.replace(ck.FITTED, matmul_curve=ck.SizeCurve(
                tuple(float(r.params) for r in mm),
                tuple(r.params / (r.fwd_s * peak) for r in mm)))
            mem = [r.params / r.fwd_s for r in self.rows("memory") if r.kind == kind]
            if mem:
                rates = dataclasses.replace(rates, memory_bytes_per_s=float(np.mean(mem)))
            flash = dict(rates.flash)
            for r in self.compute:
                impl = r.part.split(":", 1)[1] if r.part.startswith("attention:") else ""
                if r.kind != kind or not impl:
                    continue
                if impl in ck.FLASH:  # the causal half, forward
                    flash[impl] = min(1.0, r.params / 2 / (r.fwd_s * peak))
                elif impl == "xla" and kind in accs:
                    mm_s, scores = ck.xla_attention_parts(
                        self.model.n_heads, self.model.head_dim, r.batch * r.seq_len,
                        r.seq_len, rates, peak)
                    passes = (r.fwd_s - mm_s) * rates.bandwidth(accs[kind]) / (scores * 4)
                    rates = dataclasses.replace(rates, softmax_passes=max(0.5, passes))
            out[kind] = dataclasses.replace(rates, flash=flash)
        return out

    def update_rates(self) -> dict[str, float]:
        """Per accelerator kind, seconds of the optimizer update per parameter."""
        return {r.kind: r.fwd_s / r.params for r in self.rows("update") if r.params}

    @property
    def asynchronous_sends(self) -> bool:
        """Measured on CPU processes joined by gloo or MPI, whose point-to-point sends do not
        wait for the receiver: a pipeline's stages drift apart (the asynchronous timeline)."""
        return self.processes > 1 and self.collectives in ("gloo", "mpi")

    def link_class(self, r: LinkRow, cm: CostModel | None = None) -> str:
        cm = cm or CostModel(self.topology, self.model)
        groups = r.pairs() if r.op == "p2p" else np.asarray(r.groups)
        return min(cm.group_links(groups), key=lambda lk: lk.bandwidth_gbps).kind

    def link_fits(self) -> dict[str, dict[str, LinkFit]]:
        """Per link class and operation, the alpha-beta fit (least squares, latency >= 0) of
        the flat ring, steps(p) a + flows steps(p) / p S / B (point-to-point: a + flows S / B),
        flows being the groups that share a NIC as the cost model counts them."""
        cm = CostModel(self.topology, self.model)
        samples: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for r in self.links:
            groups = r.pairs() if r.op == "p2p" else np.asarray(r.groups)
            flows = cm.nic_flows(groups)
            p = groups.shape[1]
            if r.op == "p2p":
                lat, byte = 1.0, flows * r.nbytes
            else:
                steps = 2 * (p - 1) if r.op == "all_reduce" else p - 1
                lat, byte = float(steps), flows * steps / p * r.nbytes
            samples.setdefault((self.link_class(r, cm), r.op), []).append((lat, byte, r.seconds))
        out: dict[str, dict[str, LinkFit]] = {}
        for (kind, op), rows in sorted(samples.items()):
            out.setdefault(kind, {})[op] = _alpha_beta(np.asarray(rows))
        return out

    def options(self, base: CostOptions | None = None) -> CostOptions:
        """`base` (default CostOptions()) with this calibration's curves, link fits and update
        rates. Measured across gloo / MPI processes, the pipeline runs asynchronously, the
        collectives are those libraries' rings, not NCCL's algorithms (the fits are of the flat
        ring, which then prices them), and they hide behind no compute."""
        # ... and a collective inside a program does not overlap its compute there: on the
        # emulated cluster the MPMD stage program that ran a last backward (~25 ms) and the
        # gradient all-reduce (~200 ms) took their sum (train.profile_steps' trace).
        extra = (dict(lockstep=False, collectives="ring", overlap=0.0)
                 if self.asynchronous_sends else {})
        # The per-kind rates are always loaded; they price compute when the base asks for it
        # (planner.compute=kinds). Flat pricing keeps the block's own measured curve, which
        # for this very model is the closer measurement (the testbed's benches rest on it).
        rates = self.kernel_rates()
        if rates:
            extra.update(kernel_rates=rates)
        return dataclasses.replace(base or CostOptions(), curves=self.curves(),
                                   head_curves=self.curves("head"),
                                   staged_curves=self.staged_curves(),
                                   update_s_per_param=self.update_rates(),
                                   link_fits=self.link_fits(), **extra)

    # --- measured against modelled ------------------------------------------------------------
    def compute_table(self) -> list[dict]:
        """Per block and head row: measured seconds, the calibrated model's with that row left
        out of its curve (so the check is not circular; with one row, the row itself), and
        the nominal model's (peak x efficiency)."""
        nominal = CostModel(self.topology, self.model)
        accs = {c.accelerator.name: c.accelerator for c in self.topology.clusters}
        out = []
        for i, r in enumerate(self.compute):
            if r.part == "update" or r.part in KIND_PARTS or r.part.startswith("attention:"):
                continue
            others = tuple(o for j, o in enumerate(self.compute)
                           if j != i and o.kind == r.kind and o.part == r.part)
            held_out = dataclasses.replace(self, compute=others or (r,))
            calibrated = CostModel(self.topology, self.model, CostOptions(
                curves=held_out.curves(), head_curves=held_out.curves("head"),
                staged_curves=held_out.staged_curves()))
            tok = r.batch * r.seq_len
            row = {"kind": r.kind, "part": r.part, "batch": r.batch, "seq_len": r.seq_len,
                   "fwd_s": r.fwd_s, "bwd_s": r.bwd_s}
            staged = r.part.startswith(STAGED)
            policy = r.part[len(STAGED):] if staged else "none"
            for name, cm in (("model", calibrated), ("nominal", nominal)):
                f, b = (cm.head_seconds_per_token(accs[r.kind], tok) if r.part == "head" else
                        cm.layer_seconds_per_token(accs[r.kind], r.seq_len, policy, tok,
                                                   staged=staged))
                row[f"{name}_fwd_s"], row[f"{name}_bwd_s"] = f * tok, b * tok
            out.append(row)
        return out

    def link_table(self) -> list[dict]:
        """Per collective row: its link class, measured, calibrated and nominal seconds."""
        calibrated = CostModel(self.topology, self.model, self.options())
        nominal = CostModel(self.topology, self.model)
        out = []
        for r in self.links:
            row = {"class": self.link_class(r, nominal), "op": r.op,
                   "group": len(r.groups[0]), "groups": len(r.groups), "nbytes": r.nbytes,
                   "seconds": r.seconds}
            for name, cm in (("model", calibrated), ("nominal", nominal)):
                row[f"{name}_s"] = (cm.transfer(r.nbytes, r.pairs())[0] if r.op == "p2p"
                                    else cm.collective(r.op, r.nbytes, np.asarray(r.groups)))
            out.append(row)
        return out

    def describe(self) -> str:
        """The measurements against the calibrated model (and the nominal one), as tables."""
        lines = [f"compute: one {self.model.d_model}-wide block, the embedding + head + "
                 "loss, and the block as the pipelines run it (staged, per recompute policy), "
                 "per device (ms per micro-batch; model = the curve of the other rows, "
                 f"interpolated; nominal = peak x {DEFAULT_EFFICIENCY})",
                 f"  {'kind':<10}{'part':<14}{'batch':>6}{'seq':>6}{'fwd':>9}{'model':>9}"
                 f"{'nominal':>9}{'bwd':>9}{'model':>9}{'nominal':>9}"]
        for r in self.compute_table():
            lines.append(f"  {r['kind']:<10}{r['part']:<14}{r['batch']:>6}{r['seq_len']:>6}"
                         + "".join(f"{r[k] * 1e3:>9.3f}" for k in (
                             "fwd_s", "model_fwd_s", "nominal_fwd_s", "bwd_s", "model_bwd_s",
                             "nominal_bwd_s")))
        for r in self.rows("update"):
            lines.append(f"optimizer update on {r.kind}: {r.fwd_s * 1e3:.3f} ms for {r.params:,} "
                         f"parameters ({r.fwd_s / r.params * 1e9:.3g} ns per parameter)")
        if self.asynchronous_sends:
            lines.append(f"measured across {self.processes} {self.collectives} processes: "
                         "pipelines priced asynchronously, collectives as flat rings")
        lines.append("collectives (ms; model = fitted per link class and operation, nominal "
                     "= the topology's links)")
        lines.append(f"  {'class':<12}{'op':<16}{'group':>6}{'x':>4}{'bytes':>10}"
                     f"{'measured':>10}{'model':>10}{'nominal':>10}")
        for r in self.link_table():
            lines.append(f"  {r['class']:<12}{r['op']:<16}{r['group']:>6}{r['groups']:>4}"
                         f"{r['nbytes']:>10}" + "".join(f"{r[k] * 1e3:>10.3f}" for k in (
                             "seconds", "model_s", "nominal_s")))
        lines.append("fits: " + "; ".join(
            f"{kind} {op} {f.bandwidth_gbps:.3g} Gb/s {f.latency_us:.3g} us"
            for kind, ops in self.link_fits().items() for op, f in ops.items()))
        lines += self.kinds_lines()
        errs = [abs(r["model_s"] / r["seconds"] - 1) for r in self.link_table()]
        cerrs = [abs(r[f"model_{k}_s"] / r[f"{k}_s"] - 1) for r in self.compute_table()
                 for k in ("fwd", "bwd")]
        def mean(xs):  # one device measures no collectives
            return f"{np.mean(xs):.1%}" if xs else "none measured"

        lines.append(f"mean |model / measured - 1|: compute {mean(cerrs)}, collectives "
                     f"{mean(errs)}")
        return "\n".join(lines)

    def kinds_lines(self) -> list[str]:
        """The per-kind measurements, and the model's block composed from them against the
        measured block (how far pricing by kind is from this model's own block)."""
        rates = self.kernel_rates()
        if not rates:
            return []
        accs = {c.accelerator.name: c.accelerator for c in self.topology.clusters}
        lines = ["compute by operation kind (the per-kind model: hetjax/planner/compute.py)"]
        for kind, kr in rates.items():
            mm = ", ".join(f"{r.batch}^3 {r.params / r.fwd_s / 1e12:.3g} TFLOP/s "
                           f"({r.params / (r.fwd_s * r.peak_tflops * 1e12):.0%})"
                           for r in self.rows("matmul") if r.kind == kind)
            lines.append(f"  {kind} matmuls: {mm}")
            lines.append(f"  {kind} memory-bound stream: {kr.memory_bytes_per_s / 1e9:.3g} GB/s")
            for r in self.compute:
                if r.kind == kind and r.part.startswith("attention:"):
                    lines.append(f"  {kind} {r.part} b={r.batch} s={r.seq_len}: forward "
                                 f"{r.fwd_s * 1e3:.3g} ms, backward {r.bwd_s * 1e3:.3g} ms")
            if kind in accs:
                cm = CostModel(self.topology, self.model, CostOptions(
                    compute="kinds", kernel_rates=rates, attention="xla"))
                for r in self.rows("block"):
                    if r.kind != kind:
                        continue
                    f, b = cm.layer_work(accs[kind], r.seq_len, "none", r.batch * r.seq_len)
                    lines.append(f"  {kind} block b={r.batch} s={r.seq_len} composed from the "
                                 f"kinds: forward {f.total * 1e3:.3g} ms (measured "
                                 f"{r.fwd_s * 1e3:.3g}), backward {b.total * 1e3:.3g} ms "
                                 f"(measured {r.bwd_s * 1e3:.3g})")
        return lines

    # --- the file -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"version": CALIBRATION_VERSION, "topology": self.topology.to_dict(),
                "model": dataclasses.asdict(self.model),
                "compute": [dataclasses.asdict(r) for r in self.compute],
                "links": [dataclasses.asdict(r) for r in self.links],
                "processes": self.processes, "collectives": self.collectives,
                "fitted": {"curves": {k: dataclasses.asdict(c) for k, c in self.curves().items()},
                           "link_fits": {k: {op: dataclasses.asdict(f) for op, f in v.items()}
                                         for k, v in self.link_fits().items()},
                           "kernel_rates": {k: dataclasses.asdict(r)
                                            for k, r in self.kernel_rates().items()}}}

    @staticmethod
    def from_dict(d: dict) -> "Calibration":
        from hetjax.core.model_config import ModelConfig

        try:
            if not isinstance(d, dict):
                raise TypeError(f"the file holds a JSON {type(d).__name__}, not an object")
            if d.get("version") != CALIBRATION_VERSION:
                raise KeyError(f"version {d.get('version')!r}")
            return Calibration(
                Topology.from_dict(d["topology"]), ModelConfig(**d["model"]),
                tuple(ComputeRow(**r) for r in d["compute"]),
                tuple(LinkRow(r["op"], int(r["nbytes"]), tuple(map(tuple, r["groups"])),
                              float(r["seconds"])) for r in d["links"]),
                int(d.get("processes", 1)), str(d.get("collectives", "")))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise PlanError(f"not a hetjax calibration file ({type(e).__name__}: {e}); write "
                            "one with 'hetjax calibrate'") from None


# --- the plausibility guard: how far a prediction lies from what its rates were fitted on --------
# A prediction this many times beyond the fitted model sizes or device counts is flagged.
EXTRAPOLATION_FACTOR = 10.0


@dataclass(frozen=True)
class FitRange:
    """What a set of compute / link rates was fitted on: model sizes (parameters), device
    counts, fabrics (link kinds), accelerator kinds, and the MFU the fitted runs reached
    (None when measured by `hetjax calibrate`, which runs no whole step)."""

    source: str
    params: tuple[float, float]
    devices: tuple[int, int]
    fabrics: tuple[str, ...]
    accelerators: tuple[str, ...]
    mfu: tuple[float, float] | None = None


def link_kinds(topology: Topology) -> tuple[str, ...]:
    kinds = {k for c in topology.clusters for k in (c.nic.kind, c.intra_node.kind)
             if not (k == c.nic.kind and c.nodes == 1)}
    if len(topology.clusters) > 1:
        kinds |= {cl.link.kind for cl in topology.cluster_links}
        if topology.inter_cluster is not None:
            kinds.add(topology.inter_cluster.kind)
    return tuple(sorted(kinds))


def holmes_range() -> FitRange:
    """The flat model's default efficiency and the catalogue's fabric efficiencies were fitted
    on Holmes Table 1 (GPT 3.6B on 32 A100; InfiniBand, RoCE, Ethernet)."""
    # hetjax's MFU (no recompute FLOPs): samples/s x model FLOPs per sample over 32 peaks
    model = holmes_model()
    mfu = [v * model.flops_per_token(2048) * 2048 / (32 * 312e12)
           for v in HOLMES_TABLE1.values()]
    return FitRange("Holmes Table 1 (the flat model's efficiency 0.72)",
                    (holmes_model().num_params,) * 2, (32, 32),
                    ("ethernet", "infiniband", "nvlink", "roce"), ("a100",),
                    (min(mfu), max(mfu)))


def calibration_range(cal: Calibration, path: str = "") -> FitRange:
    return FitRange(f"hetjax calibrate{' ' + path if path else ''}",
                    (cal.model.num_params,) * 2, (cal.topology.num_devices,) * 2,
                    link_kinds(cal.topology),
                    tuple(sorted({c.accelerator.name for c in cal.topology.clusters})))


def _span(lo: float, hi: float, fmt) -> str:
    return fmt(lo) if lo == hi else f"{fmt(lo)}-{fmt(hi)}"


def _params(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e8 else f"{n / 1e6:.3g}M"


def plausibility_lines(mfu: float, model: "ModelConfig", topology: Topology,
                       fit: FitRange) -> list[str]:
    """The predicted MFU beside the range its rates were fitted on, and one warning naming
    every way the plan extrapolates far outside it (model size or device count beyond
    EXTRAPOLATION_FACTOR, a fabric or accelerator never fitted, an MFU far from the fitted)."""
    fitted = [f"{_span(*fit.params, _params)} parameters",
              f"{_span(*fit.devices, lambda n: f'{n:,}')} devices",
              "/".join(fit.fabrics), "/".join(fit.accelerators)]
    if fit.mfu is not None:
        fitted.insert(0, f"{_span(fit.mfu[0] * 100, fit.mfu[1] * 100, lambda x: f'{x:.0f}')}% MFU")
    lines = [f"predicted MFU {mfu:.1%}; the compute and link rates were fitted on "
             f"{fit.source}: {', '.join(fitted)}"]
    far, f = [], EXTRAPOLATION_FACTOR
    n, d = model.num_params, topology.num_devices
    if not fit.params[0] / f <= n <= fit.params[1] * f:
        far.append(f"a model of {_params(n)} parameters")
    if not fit.devices[0] / f <= d <= fit.devices[1] * f:
        far.append(f"{d:,} devices")
    fabrics = sorted(set(link_kinds(topology)) - set(fit.fabrics))
    if fabrics:
        far.append(f"fabric {'/'.join(fabrics)} never fitted")
    accs = sorted({c.accelerator.name for c in topology.clusters} - set(fit.accelerators))
    if accs:
        far.append(f"accelerator {'/'.join(accs)} never fitted")
    if fit.mfu is not None and not fit.mfu[0] / 2 <= mfu <= min(1.0, fit.mfu[1] * 1.5):
        far.append(f"an MFU of {mfu:.1%}")
    if far:
        lines.append(f"warning: this prediction extrapolates far outside that fit: "
                     f"{'; '.join(far)} -- measure these devices with 'hetjax calibrate' "
                     "and plan with --config.planner.calibration=FILE")
    return lines


def _alpha_beta(rows: np.ndarray) -> LinkFit:
    """Least-squares latency a >= 0 and inverse bandwidth 1/B > 0 of t = lat a + byte / B."""
    lat, byte, t = rows.T
    a, inv_b = np.linalg.lstsq(np.stack([lat, byte], axis=1), t, rcond=None)[0]
    if a < 0 or inv_b <= 0:
        a = 0.0 if inv_b > 0 else max(0.0, float(np.min(t / lat)))
        rest = np.maximum(t - a * lat, 0.0)
        inv_b = max(float(byte @ rest / (byte @ byte)), 1e-18)
    return LinkFit(bandwidth_gbps=8 / inv_b / 1e9, latency_us=float(a) * 1e6)


def topology_mismatch(measured: Topology, run: Topology) -> str | None:
    """What of `run`'s hardware a calibration measured on `measured` did not measure: its
    accelerator kinds and link kinds (those fall back to nominal constants, and a file from
    another machine prices this one wrongly). None when every kind was measured."""
    def kinds(t: Topology) -> tuple[set[str], set[str]]:
        links = {c.nic.kind for c in t.clusters} | {c.intra_node.kind for c in t.clusters}
        if t.inter_cluster is not None:
            links.add(t.inter_cluster.kind)
        return {c.accelerator.name for c in t.clusters}, links

    (acc_m, links_m), (acc_r, links_r) = kinds(measured), kinds(run)
    missing = sorted(acc_r - acc_m) + sorted(links_r - links_m)
    if not missing:
        return None
    return (f"it was measured on topology {measured.name!r} ({', '.join(sorted(acc_m))}; "
            f"links {', '.join(sorted(links_m))}), which has no {', '.join(missing)} of this "
            f"run's topology {run.name!r}")


def load_calibration(path: str) -> Calibration:
    """A `hetjax calibrate` file (planner.calibration)."""
    import json

    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read the calibration file {path!r} ({e}); write one with "
                        "'hetjax calibrate'") from None
    try:
        return Calibration.from_dict(d)
    except PlanError as e:  # valid JSON of the wrong shape: name the file
        raise PlanError(f"planner.calibration: {path!r}: {e}") from None


def save_calibration(cal: Calibration, path: str) -> str:
    import json

    with open(path, "w") as f:
        json.dump(cal.to_dict(), f, indent=1)
    return path


def plot_calibration(cal: Calibration, path: str) -> str:
    """Measured (x) against modelled (y) times, log-log: compute rows (forward, backward) and
    collectives (by operation), the calibrated model filled, the nominal one hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_c, ax_l) = plt.subplots(1, 2, figsize=(11, 6))
    comp = cal.compute_table()
    for k, colour in (("fwd", "tab:blue"), ("bwd", "tab:orange")):
        x = [r[f"{k}_s"] * 1e3 for r in comp]
        ax_c.scatter(x, [r[f"model_{k}_s"] * 1e3 for r in comp], c=colour,
                     label=f"{k}, calibrated")
        ax_c.scatter(x, [r[f"nominal_{k}_s"] * 1e3 for r in comp], facecolors="none",
                     edgecolors=colour, label=f"{k}, nominal")
    links = cal.link_table()
    colours = dict(zip(OPS_MEASURED, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for op in OPS_MEASURED:
        rows = [r for r in links if r["op"] == op]
        if not rows:
            continue
        x = [r["seconds"] * 1e3 for r in rows]
        ax_l.scatter(x, [r["model_s"] * 1e3 for r in rows], c=colours[op],
                     label=f"{op}, calibrated")
        ax_l.scatter(x, [r["nominal_s"] * 1e3 for r in rows], facecolors="none",
                     edgecolors=colours[op], label=f"{op}, nominal")
    for ax, title in ((ax_c, f"one block per device ({', '.join(cal.curves())}); calibrated: "
                             "the other points' curve"),
                      (ax_l, f"collectives on {cal.topology.name}")):
        lo, hi = ax.get_xlim()[0], ax.get_xlim()[1]
        lo = min(lo, ax.get_ylim()[0])
        hi = max(hi, ax.get_ylim()[1])
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--", label="modelled = measured")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured ms")
        ax.set_ylabel("modelled ms")
        ax.set_title(title, fontsize=10)
        # below the axes: inside, it covers points (they fill the whole log-log square)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3,
                  frameon=False)
    fig.suptitle("hetjax calibrate: measured vs modelled", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["FitRange", "holmes_range", "calibration_range", "plausibility_lines", "link_kinds",
           "EXTRAPOLATION_FACTOR", "Calibration", "ComputeRow", "LinkRow", "OPS_MEASURED", "STAGED", "load_calibration",
           "save_calibration", "plot_calibration", "fit_fabrics", "FabricFit", "fit_nic_efficiency", "with_nic_efficiency",
           "nominal_links", "spearman", "kendall_tau",
           "PredictionErrors", "prediction_errors", "Measurement", "fit_efficiency",
           "fit_nic_bandwidth", "with_nic_bandwidth",
           "predicted_samples_per_s", "holmes_model",
           "holmes_table1", "HOLMES_TABLE1"]

"""Published runs the cost model is fitted on and checked against.

Holmes' Table 1 (spec/holmes.md: GPT 3.6B on 4 nodes x 8 A100, InfiniBand / RoCE / Ethernet,
Megatron-LM): the flat model's one free compute parameter is the efficiency factor (fraction
of peak a layer reaches). `fit_efficiency` finds the value at which the model's predicted
throughput of a measured run equals the measurement (the prediction falls monotonically as
efficiency drops, so bisection); `holmes_table1` gives the three rows as Measurements, to fit
on one row and predict the others (`scripts/bench/planner.py calibrate`); `fit_fabrics` fits
one NIC efficiency per fabric with the compute efficiency (the catalogue's defaults in
hetjax.core.topology.LINKS).

Megatron-LM's weak-scaling table (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC'21, arXiv 2104.04473, Table 1; the same
configurations are in Megatron-LM's README): GPT models from 1.7B parameters on 32 A100s to
1T on 3,072, vocabulary 51,200, sequence 2,048, mixed precision, activation recompute, the
interleaved pipeline schedule, on NVIDIA's Selene (DGX A100 nodes: 8 x A100 80 GB joined by
NVLink/NVSwitch, 8 x 200 Gb/s HDR InfiniBand per node). Each row's achieved TFLOP/s per GPU
counts Eq. 3 of the paper, F = 96 B s l h^2 (1 + s / 6h + V / 16 l h) per iteration
(`formulas.megatron_flops_per_step`).

Not published per row, so assumed here (and said in docs/planner.md): a micro-batch of one
sequence (m = B / d micro-batches per pipeline), two model chunks per stage for the
interleaved schedule (hetjax's registered schedule), no distributed optimizer (Megatron-LM
had none in 2021: plain data parallelism).

`fit_megatron(rows)` solves the matmul curve's two constants (`KernelRates.matmul_peak`,
`matmul_half_flops`) so that two rows are predicted exactly; every other rate keeps its
nominal value. `compute.FITTED` holds the result, used by every `compute="kinds"` cost model
that no `hetjax calibrate` file overrides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from hetjax.core.catalogue import LINKS, make_cluster
from hetjax.errors import PlanError
from hetjax.core.hardware import Link, Topology
from hetjax.core.plan import Plan
from hetjax.core.topology import preset
from hetjax.planner import compute as ck
from hetjax.planner.cost import CostModel, CostOptions
from hetjax.planner.fit_range import FitRange
from hetjax.planner.formulas import megatron_flops_per_step
from hetjax.planner.zero_factors import named

if TYPE_CHECKING:
    from hetjax.core.model_config import ModelConfig


# --- Holmes Table 1: the flat model's efficiency and the fabrics' -------------------------------
@dataclass(frozen=True)
class Measurement:
    """A measured run: the layout, where it ran, the system that ran it (a cost-model
    executor) and its throughput in sequences per second."""

    name: str
    topology: Topology
    model: "ModelConfig"
    plan: Plan
    samples_per_s: float
    executor: str = "spmd"


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


# --- Megatron-LM Table 1: the per-kind compute rates ---------------------------------------------
SEQ_LEN = 2048
VOCAB = 51200
A100_PEAK_TFLOPS = 312.0


@dataclass(frozen=True)
class MegatronRow:
    """One row of Table 1: model shape, t / p / d, global batch, and what was achieved."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # achieved teraFLOP/s per GPU
    percent_peak: int  # of the A100's 312 TFLOP/s
    petaflops: float  # aggregate

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def name(self) -> str:
        return f"{self.params_b:g}B"


# Narayanan et al., SC'21, Table 1 (arXiv 2104.04473), as published.
MEGATRON_TABLE1 = (
    MegatronRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    MegatronRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    MegatronRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    MegatronRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    MegatronRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    MegatronRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    MegatronRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    MegatronRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    MegatronRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    MegatronRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
)
# The two rows the compute rates are fitted on (the smallest and a large model: the ends of
# the matmul sizes the table spans); every other row is predicted.
FITTED_ROWS = ("1.7B", "310.1B")


def row(name: str) -> MegatronRow:
    for r in MEGATRON_TABLE1:
        if r.name == name:
            return r
    raise PlanError(f"no Megatron-LM Table 1 row {name!r}; rows: "
                    f"{', '.join(r.name for r in MEGATRON_TABLE1)}")


def selene(nodes: int) -> Topology:
    """`nodes` DGX A100 nodes of Selene: 8 A100 80 GB on NVLink/NVSwitch, and 8 HDR
    InfiniBand NICs of 200 Gb/s per node (1,600 Gb/s a node, which the cost model shares
    among the groups leaving it), at the catalogue's InfiniBand efficiency."""
    ib = LINKS["infiniband"]
    nic = Link("infiniband", 8 * 200.0, ib.latency_us, efficiency=ib.efficiency)
    return Topology(name="selene", clusters=(make_cluster("selene", nodes, 8, "a100", nic),),
                    inter_cluster=None)


def megatron_model(r: MegatronRow) -> "ModelConfig":
    """The row's GPT as a hetjax ModelConfig: multi-head attention, a gated MLP of
    d_ff = 8h / 3 (the same 12 l h^2 parameters and FLOPs as GPT's 4h GELU MLP), tied
    embeddings, full activation recompute, 16-bit compute."""
    from hetjax.core.model_config import ModelConfig

    return ModelConfig(vocab_size=VOCAB, d_model=r.hidden, n_layers=r.layers, n_heads=r.heads,
                       n_kv_heads=r.heads, d_ff=round(8 * r.hidden / 3), max_seq_len=SEQ_LEN,
                       remat="full", dtype="bfloat16", param_dtype="bfloat16")


def megatron_plan(r: MegatronRow, microbatch: int = 1) -> Plan:
    per = r.layers // r.pp
    layers = tuple(per + (1 if s < r.layers % r.pp else 0) for s in range(r.pp))
    return Plan(pp=r.pp, dp=r.dp, tp=r.tp, stage_layers=layers,
                microbatches=r.batch // (r.dp * microbatch), global_batch=r.batch,
                seq_len=SEQ_LEN, schedule="interleaved" if r.pp > 1 else "1f1b",
                zero=named("ddp", r.dp, 8))


def megatron_options(rates: ck.KernelRates | None = None, **kw) -> CostOptions:
    """The cost options of the reference predictions: Megatron's executor, compute by kind."""
    return CostOptions(executor="megatron", compute="kinds",
                       kernel_rates={"a100": rates} if rates is not None else {}, **kw)


def predicted_tflops(r: MegatronRow, options: CostOptions | None = None) -> float:
    """TFLOP/s per GPU the cost model predicts for row `r` (Eq. 3's FLOPs over the predicted
    step time), as Table 1 counts them."""
    options = options or megatron_options()
    cm = CostModel(selene(r.gpus // 8), megatron_model(r), options)
    step = cm.predict(megatron_plan(r)).step_time
    return megatron_flops_per_step(r.batch, SEQ_LEN, r.layers, r.hidden, VOCAB) / (
        step * r.gpus) / 1e12


@dataclass(frozen=True)
class RowCheck:
    name: str
    published: float
    predicted: float
    fitted: bool

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1


def check_table(options: CostOptions | None = None,
                fitted: Sequence[str] = FITTED_ROWS) -> list[RowCheck]:
    """Every row's published and predicted TFLOP/s per GPU."""
    return [RowCheck(r.name, r.tflops_per_gpu, predicted_tflops(r, options), r.name in fitted)
            for r in MEGATRON_TABLE1]


def _bisect(f, lo: float, hi: float, iters: int = 40) -> float:
    """x in [lo, hi] with f(x) = 0, f increasing."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def fit_megatron(fitted: Sequence[str] = FITTED_ROWS,
                 base: ck.KernelRates | None = None) -> ck.KernelRates:
    """The matmul curve's (peak, half size) at which two rows are predicted exactly: the
    first row (small matmuls) pins the half size given the peak, the second (large matmuls)
    the peak, solved by nested bisection."""
    a, b = (row(n) for n in fitted)
    base = base or ck.KernelRates()

    def rates(peak: float) -> ck.KernelRates:
        def small(half: float) -> float:  # decreasing in half: bisect on -half
            return predicted_tflops(a, megatron_options(
                dataclasses.replace(base, matmul_peak=peak, matmul_half_flops=half))) \
                - a.tflops_per_gpu
        half = _bisect(lambda x: -small(x), 0.0, 1e12, iters=30)
        return dataclasses.replace(base, matmul_peak=peak, matmul_half_flops=half)

    peak = _bisect(lambda p: predicted_tflops(b, megatron_options(rates(p))) - b.tflops_per_gpu,
                   0.3, 1.0, iters=20)
    return rates(peak)


def terms(r: MegatronRow, options: CostOptions | None = None) -> dict[str, float]:
    """What each term of the cost model does to row `r`'s prediction: the predicted TFLOP/s
    per GPU, and the change (fraction of it) when one term is taken away -- matmul efficiency
    by size (every matmul at the curve's large-size limit instead), the TP all-reduces (free
    links inside a node), the pipeline bubble (its share of the step), the DP overlap (none
    instead), NCCL's algorithm choice (the flat ring instead)."""
    options = options or megatron_options()
    base = predicted_tflops(r, options)
    rates = options.kernel_rates.get("a100", ck.FITTED)

    def delta(**kw) -> float:
        return predicted_tflops(r, dataclasses.replace(options, **kw)) / base - 1

    flat_size = delta(kernel_rates={"a100": dataclasses.replace(rates, matmul_half_flops=0.0)})
    cm = CostModel(selene(r.gpus // 8), megatron_model(r), options)
    plan = megatron_plan(r)
    pred = cm.predict(plan)
    fast = Link("nvlink", 1e9, 0.0)
    topo = selene(r.gpus // 8)
    free_tp = CostModel(dataclasses.replace(topo, clusters=tuple(
        dataclasses.replace(c, intra_node=fast) for c in topo.clusters)),
        megatron_model(r), options).predict(plan).step_time
    return {"tflops": base, "matmul_size": flat_size, "tp_allreduce": pred.step_time / free_tp - 1,
            "bubble": pred.bubble, "dp_overlap": delta(overlap=0.0),
            "nccl_choice": delta(collectives="ring")}


def model_flops_utilization(r: MegatronRow) -> float:
    """Row `r`'s MFU as hetjax counts it (`ModelConfig.flops_per_token`: no recompute): Table
    1's TFLOP/s count Eq. 3, which includes the recomputed forward (about 4/3 more)."""
    eq3 = megatron_flops_per_step(r.batch, SEQ_LEN, r.layers, r.hidden, VOCAB)
    model = megatron_model(r).flops_per_token(SEQ_LEN) * r.batch * SEQ_LEN
    return r.tflops_per_gpu / A100_PEAK_TFLOPS * model / eq3


def megatron_range():
    """What compute.FITTED was fitted on (the plausibility guard's range for compute "kinds"
    without a calibration file): the two fitted rows' model sizes and device counts, Selene's
    fabric, A100s; the MFU span of the whole table."""
    rows = [row(n) for n in FITTED_ROWS]
    sizes = [megatron_model(r).num_params for r in rows]
    mfu = [model_flops_utilization(r) for r in MEGATRON_TABLE1]
    return FitRange(f"Megatron-LM Table 1 rows {' and '.join(FITTED_ROWS)} (compute by kind)",
                    (min(sizes), max(sizes)), (min(r.gpus for r in rows),
                                               max(r.gpus for r in rows)),
                    ("infiniband", "nvlink"), ("a100",), (min(mfu), max(mfu)))


# --- AMSP at 1,024 A800s: ZeRO's traffic overlapped as scheduled ---------------------------------
# Reported: up to 52% MFU training LLaMA 7B and 13B on 1,024 GPUs (spec/amsp.md; the paper's
# abstract names both models), sequence 4,096, 4M tokens a step, ZeRO-only data parallelism.
AMSP_MFU = 0.52
AMSP_REPORTED = ("7B", "13B")
LLAMA = {  # d_model, layers, heads, d_ff (LLaMA-1 7B / 13B / 30B)
    "7B": (4096, 32, 32, 11008), "13B": (5120, 40, 40, 13824), "30B": (6656, 60, 52, 17920)}
# Not reported by AMSP, so assumed: 128 nodes of 8 A800 with 400 Gb/s of NIC per node (the
# 4 x 100 Gb/s per node that the same team's InternEvo -- where AMSP's sharding ships as Hybrid
# ZeRO -- reports for its 1,024-GPU scaling runs), at the catalogue's InfiniBand efficiency;
# full recompute (the table's 4,096-token sequences at one sequence per GPU).
AMSP_NIC_GBPS = 400.0


def amsp_topology(nic_gbps: float = AMSP_NIC_GBPS) -> Topology:
    ib = LINKS["infiniband"]
    nic = Link("infiniband", nic_gbps, ib.latency_us, efficiency=ib.efficiency)
    return Topology(f"amsp_a800_{nic_gbps:g}g", (make_cluster("a800", 128, 8, "a800", nic),),
                    None)


def amsp_model(name: str) -> "ModelConfig":
    from hetjax.core.model_config import ModelConfig

    d, layers, heads, ff = LLAMA[name]
    return ModelConfig(vocab_size=32000, d_model=d, n_layers=layers, n_heads=heads,
                       n_kv_heads=heads, d_ff=ff, max_seq_len=4096, remat="full",
                       dtype="bfloat16", param_dtype="bfloat16", tie_embeddings=False)


def amsp_plan(name: str, nic_gbps: float = AMSP_NIC_GBPS, zero="auto",
              options: CostOptions | None = None) -> Plan:
    """The planner's plan of AMSP's setting for LLaMA `name`: dp = 1,024 (pp = tp = 1),
    1,024 sequences of 4,096 tokens, the ZeRO point chosen (or `zero`), priced as Megatron /
    DeepSpeed run it; its `predicted` holds the MFU."""
    from hetjax.planner.search import plan

    options = options or CostOptions(executor="megatron")
    return plan(amsp_topology(nic_gbps), amsp_model(name), 1024, 4096, pp=1, tp=1, zero=zero,
                options=options).plan


def main(argv=None) -> None:
    """Print the table: published, predicted and each term's effect per row."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    names = [n for n in ap.parse_args(argv).rows.split(",") if n]
    print(f"Megatron-LM Table 1 on the cost model (executor megatron, compute by kind, fitted "
          f"on {' and '.join(FITTED_ROWS)}); columns after 'error': the change in predicted "
          "TFLOP/s when a term is taken away, and the idle share of the step (bubble + exposed sync)")
    print(f"{'row':>8} {'t':>2} {'p':>3} {'d':>3} {'published':>9} {'predicted':>9} "
          f"{'error':>6} {'by size':>8} {'TP AR':>6} {'idle':>6} {'DP ovl':>6} {'NCCL':>6}")
    for r in MEGATRON_TABLE1:
        if names and r.name not in names:
            continue
        t = terms(r)
        mark = " (fitted)" if r.name in FITTED_ROWS else ""
        print(f"{r.name:>8} {r.tp:>2} {r.pp:>3} {r.dp:>3} {r.tflops_per_gpu:>9.0f} "
              f"{t['tflops']:>9.1f} {t['tflops'] / r.tflops_per_gpu - 1:>+6.1%} "
              f"{t['matmul_size']:>+8.1%} {t['tp_allreduce']:>+6.1%} {t['bubble']:>6.1%} "
              f"{t['dp_overlap']:>+6.1%} {t['nccl_choice']:>+6.1%}{mark}")


if __name__ == "__main__":
    main()


__all__ = ["Measurement", "predicted_samples_per_s", "fit_efficiency", "fit_nic_efficiency",
           "fit_nic_bandwidth", "with_nic_bandwidth", "with_nic_efficiency", "nominal_links",
           "FabricFit", "fit_fabrics", "holmes_model", "holmes_table1", "HOLMES_TABLE1",
           "holmes_range", "AMSP_MFU", "AMSP_REPORTED", "AMSP_NIC_GBPS", "LLAMA",
           "amsp_topology", "amsp_model", "amsp_plan", "terms", "main", "megatron_range", "MegatronRow", "MEGATRON_TABLE1",
           "FITTED_ROWS", "row", "selene", "megatron_model", "megatron_plan", "megatron_options", "predicted_tflops", "RowCheck", "check_table",
           "fit_megatron", "model_flops_utilization"]

"""Calibrating the cost model on measured throughputs, and Holmes' Table 1 as the data.

The cost model's one free compute parameter is the efficiency factor (fraction of peak a
layer reaches). `fit_efficiency` finds the value at which the model's predicted throughput of
a measured run equals the measurement (the prediction falls monotonically as efficiency
drops, so bisection). `holmes_table1` gives Holmes' three homogeneous runs (GPT 3.6B on 32
A100, InfiniBand / RoCE / Ethernet) as Measurements, to fit on one row and predict the others
(`scripts/bench_planner.py calibrate`).

For the testbed (hetjax/testbed.py), the cost model is calibrated on the emulated cluster's
own measurements instead: `emulated_topology` puts the measured goodput and round trip of
every link class into the topology, `profile_from_step_times` turns single-host step times at
two or more layer counts into a per-layer `LayerProfile`, and `rank_agreement` /
`prediction_errors` score predicted against measured step times (scripts/bench_het*.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from hetjax.errors import PlanError
from hetjax.plan import Plan
from hetjax.planner.cost import CostModel, CostOptions, LayerProfile
from hetjax.planner.zero import named
from hetjax.topology import ClusterLink, Link, Topology, preset

if TYPE_CHECKING:
    from layers.config import ModelConfig


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
    from layers.config import ModelConfig

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


# --- calibrating on the testbed ------------------------------------------------------------------
def emulated_topology(topology: Topology, scale: float, links=()) -> Topology:
    """The topology as the testbed emulates it: every link at its rate times `scale`, and,
    for each measured link class (`hetjax.linkcheck.LinkMeasurement`s, labelled "ib" for a
    cluster's NIC and "ib -> roce" between two clusters), the measured goodput and half the
    measured round trip instead. The testbed does not emulate latency, so the measured one,
    not the configured one, is what its runs see."""
    names = [c.name for c in topology.clusters]
    measured = {m.label: Link(m.link.kind, m.measured_bps / 1e9, m.rtt_s / 2 * 1e6)
                for m in links}

    def scaled(lk: Link) -> Link:
        # tc shapes the nominal rate; the fabric's efficiency belongs to real hardware.
        return dataclasses.replace(lk, bandwidth_gbps=lk.bandwidth_gbps * scale, efficiency=1.0)

    clusters = tuple(dataclasses.replace(c, nic=measured.get(c.name, scaled(c.nic)))
                     for c in topology.clusters)
    pairs = []
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            if topology.has_link(a, b):
                lk = measured.get(f"{names[a]} -> {names[b]}",
                                  scaled(topology.cluster_link(a, b)))
                pairs.append(ClusterLink(names[a], names[b], lk))
    inter = scaled(topology.inter_cluster) if topology.inter_cluster is not None else None
    return dataclasses.replace(topology, name=f"{topology.name} (emulated)", clusters=clusters,
                               inter_cluster=inter, cluster_links=tuple(pairs))


def profile_from_step_times(layers: Sequence[int], step_s: Sequence[float],
                            tokens_per_step: float, bwd_per_fwd: float = 3.0,
                            head_bwd_per_fwd: float = 2.0) -> LayerProfile:
    """A per-token LayerProfile from one device's step times at several layer counts.

    The least-squares line step_s = fixed + per_layer * layers gives a layer's time (the
    slope) and the rest (the intercept: embedding, head, loss, and the optimizer's fixed
    part), each divided by the tokens one step processes. The measurement cannot split
    forward from backward; the split follows the FLOPs: a recomputed layer's backward is
    three forwards (`bwd_per_fwd`, hetjax's pipeline recomputes every layer), the head's two."""
    x, y = np.asarray(layers, float), np.asarray(step_s, float)
    if len(set(x)) < 2:
        raise PlanError(f"a layer profile needs step times at two or more layer counts, got "
                        f"layers {list(layers)}")
    per_layer, fixed = np.polyfit(x, y, 1)
    if per_layer <= 0:
        raise PlanError(f"step times {list(step_s)} at layers {list(layers)} do not grow with "
                        "the layer count; the profile runs were too noisy (a busy machine?)")
    layer_tok = float(per_layer) / tokens_per_step
    fixed_tok = max(float(fixed), 0.0) / tokens_per_step
    return LayerProfile(fwd_s=layer_tok / (1 + bwd_per_fwd),
                        bwd_s=layer_tok * bwd_per_fwd / (1 + bwd_per_fwd),
                        head_fwd_s=fixed_tok / (1 + head_bwd_per_fwd),
                        head_bwd_s=fixed_tok * head_bwd_per_fwd / (1 + head_bwd_per_fwd))


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


__all__ = ["fit_fabrics", "FabricFit", "fit_nic_efficiency", "with_nic_efficiency",
           "nominal_links", "emulated_topology", "profile_from_step_times", "spearman", "kendall_tau",
           "PredictionErrors", "prediction_errors", "Measurement", "fit_efficiency",
           "fit_nic_bandwidth", "with_nic_bandwidth",
           "predicted_samples_per_s", "holmes_model",
           "holmes_table1", "HOLMES_TABLE1"]

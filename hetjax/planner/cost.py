"""The cost model: compute, communication and memory of a layout, per pipeline stage.

One place prices everything the planner compares:
- compute per layer per accelerator kind: a measured compute profile first (per TP degree,
  micro-batch tokens and recompute policy: hetjax/planner/compute_profile.py; HetHub: profiles
  beat ratios), else FLOPs from `ModelConfig` (the one FLOPs formula) at the micro-batch's
  tokens over peak x an efficiency factor (a measured curve, or priced by operation kind:
  hetjax/planner/compute.py), the flat model, which the prediction then names; recompute per
  `model.remat`; the output projection on the last stage;
- communication through its `Network` (hetjax/planner/network.py): collectives and
  point-to-point transfers on the links the groups cross; ZeRO's collectives as this executor
  runs them (hetjax/planner/zero_factors.py);
- overlap as scheduled: ZeRO's traffic layer by layer, the gradient sync in per-layer buckets
  behind the last backward (`exposed_sync`), nothing on CPU; TP on the node's own link;
- memory per device: model states under the ZeRO factors (padded to the longest stage, as the
  executor stacks stage parameters), activations for the micro-batches the schedule keeps in
  flight, embedding / head states and the last stage's logits, and the runtime's reserve
  (hetjax/planner/memory.py) within the usable share;
- a band on each prediction (hetjax/planner/band.py).

`CostModel.stage_costs(layout)` (a `Layout`: a Plan before its layer split) returns a
`StageCost` per pipeline position whose times and memory are linear in the stage's layer count,
so the partition search can place layers exactly; `CostModel.predict(plan)` prices a finished
Plan with the event simulator.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

import numpy as np

from hetjax.errors import PlanError
from hetjax.core.plan import Plan, ZeroFactors, effective_remat, schedule_problem
from hetjax.planner import band, compute as ck, memory as mem, zero_factors as zr
from hetjax.planner.compute_profile import ComputeProfile, Estimate
from hetjax.planner.layout import Layout
from hetjax.planner.network import COLLECTIVE_MODELS, LinkFit, Network, Structures
from hetjax.planner.simulate import chain, exposed, in_flight, in_flight_folded, simulate
from hetjax.core.topology import Accelerator, Topology
from hetjax.core.registry import EXECUTORS as REGISTERED

if TYPE_CHECKING:  # layers/ imports flax; the planner must not start jax
    from hetjax.core.model_config import ModelConfig

# Fraction of peak FLOP/s a decoder layer reaches, fitted on Holmes Table 1 together with the
# fabric efficiencies of hetjax.core.topology.LINKS (reference_runs.fit_fabrics); docs/planner.md.
DEFAULT_EFFICIENCY = 0.72

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# How a pipeline (pp > 1) is executed, which changes its time and memory. The names of hetjax's
# own executors are the executor registry's (hetjax.core.registry.EXECUTORS); "megatron" is the
# papers' baseline, priced but not run:
# - "spmd": parallel/pipeline.py's shard_map executor. The tick grid runs in lockstep;
#   recompute follows model.remat ('auto': every layer recomputed) and a stage stashes each
#   layer slot's residuals (its input under 'full'), max_layers + 1 activations per micro-batch
#   in flight under 'full'; embedding, final norm
#   and head are replicated on every stage and their gradients summed around the ring of
#   stages (pp - 1 point-to-point hops); the gradient sync runs after the loop.
# - "mpmd": parallel/mpmd.py's executor, one program per stage. Stages run asynchronously,
#   recompute follows model.remat, a stage holds only its own layers (no padding), the
#   embedding lives on the first stage and the head on the last (a tied embedding's gradient is
#   exchanged point-to-point between the two), the gradient sync is fused into the stage's last
#   backward so it may overlap it; ZeRO as in parallel/zero_sharding.py (P gathered once per step).
# - "megatron": Megatron-LM as the papers ran it. Stages run asynchronously, recompute follows
#   model.remat, the embedding lives on the first stage and the head on the last (a tied
#   embedding's gradient is all-reduced between the two), the sync may overlap the backward.
PRICED_EXECUTORS = ("spmd", "mpmd", "megatron")


class _PricedAs(Mapping):
    """Each pipeline executor a Plan can name (`hetjax.core.registry.EXECUTORS`) -> the cost
    model's executor that prices it (`ExecutorKind.priced_as`: each of hetjax's executors under
    its own name), read from the registry at each use, so a registered executor is priced too."""

    def __getitem__(self, name: str) -> str:
        return REGISTERED[name].priced_as

    def __iter__(self):
        return iter(REGISTERED)

    def __len__(self) -> int:
        return len(REGISTERED)


PLAN_EXECUTORS: Mapping[str, str] = _PricedAs()


def runs_schedule(executor: str, schedule: str) -> bool:
    """Whether a pipeline executor (a Plan's or the cost model's name) can run the named
    schedule: the Plan's rule (`hetjax.core.plan.schedule_problem`) for the executor, or for a cost
    model name for every registered executor it prices."""
    names = [executor] if executor in REGISTERED else [
        k.name for k in REGISTERED.values() if k.priced_as == executor]
    return all(schedule_problem(n, schedule) is None for n in names)


@dataclass(frozen=True)
class LayerProfile:
    """Measured seconds per token of one decoder layer on one accelerator kind at tp = 1
    (backward includes any recompute), and of the output projection."""

    fwd_s: float
    bwd_s: float
    head_fwd_s: float = 0.0
    head_bwd_s: float = 0.0


@dataclass(frozen=True)
class ComputeCurve:
    """Measured fraction of peak FLOP/s one accelerator kind reaches, against the size of the
    work: the FLOPs of one kernel call (a layer's forward on one device's micro-batch, which
    grows with the matrices' sizes -- bigger models and micro-batches run closer to peak).
    Forward and (pure) backward separately; interpolated linearly in log FLOPs, held
    constant beyond the measured range (`hetjax calibrate` measures it)."""

    flops: tuple[float, ...]
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]

    def __post_init__(self):
        if not (len(self.flops) == len(self.fwd) == len(self.bwd) >= 1):
            raise PlanError(f"a compute curve needs as many efficiencies as sizes, got "
                            f"{len(self.flops)} sizes, {len(self.fwd)} / {len(self.bwd)}")
        if min(self.flops) <= 0 or min(self.fwd) <= 0 or min(self.bwd) <= 0:
            raise PlanError("a compute curve's sizes and efficiencies must be > 0")

    def efficiency(self, flops: float) -> tuple[float, float]:
        """(forward, backward) fraction of peak at a kernel of `flops` FLOPs."""
        order = np.argsort(self.flops)
        x = np.log(np.asarray(self.flops, float)[order])
        at = np.log(max(flops, 1e-30))
        return (float(np.interp(at, x, np.asarray(self.fwd, float)[order])),
                float(np.interp(at, x, np.asarray(self.bwd, float)[order])))


# How compute is priced: "flat" every FLOP at peak x one efficiency (or a measured curve per
# layer); "kinds" matmuls by size, attention per implementation and memory-bound work by
# bytes over memory bandwidth (hetjax/planner/compute.py).
COMPUTE_MODELS = ("flat", "kinds")


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the cost model.

    efficiency: fraction of peak FLOP/s a layer reaches (per accelerator kind overrides in
    `efficiency_by_kind`); profiles: measured per-layer times by accelerator name, used instead
    of FLOPs when given; curves: measured efficiency against kernel size by accelerator name
    (`ComputeCurve`), used before the flat efficiency; overlap: the share of the ZeRO and
    gradient traffic the schedule can overlap with compute that does (1: all of it, as
    scheduled -- per layer, bucketed, per executor: `exposed_sync`; 0: none, as measured
    across gloo processes); memory_fraction: share of device memory the plan may use (after
    the runtime's reserve); share_nics:
    concurrent groups leaving a node split its NIC bandwidth; executor: how the pipeline runs
    (see PRICED_EXECUTORS); lockstep: whether the SPMD executor plays its tick grid in lockstep. It
    does in one process, where every collective-permute is a rendezvous of all devices; across
    processes (gloo) a stage's sends do not wait for the receiver, so stages drift apart as in
    the asynchronous timeline -- the emulated cluster measures this (scripts/bench/hetnet.py)
    -- and the gradient sync may then overlap the last backward. collectives: "nccl" prices
    each collective with NCCL's cheapest algorithm (ring, tree, hierarchical; see
    hetjax/planner/collectives.py), "ring" with the flat alpha-beta ring; link_fits: measured
    bandwidth and latency per link kind and operation ("all_reduce", "reduce_scatter",
    "all_gather", "p2p"), used instead of the topology's links; head_curves: measured
    efficiency of the embedding, head and loss together (their time over the head's FLOPs)
    against the head's kernel size, by accelerator name; update_s_per_param: measured seconds
    of the optimizer update per parameter a device updates, by accelerator name (without it the
    update is not priced: on accelerators it is small beside a step; on CPU it is not)."""

    efficiency: float = DEFAULT_EFFICIENCY
    efficiency_by_kind: dict[str, float] = field(default_factory=dict)
    profiles: dict[str, LayerProfile] = field(default_factory=dict)
    curves: dict[str, ComputeCurve] = field(default_factory=dict)
    overlap: float = 1.0
    memory_fraction: float = 0.9
    share_nics: bool = True
    executor: str = "spmd"
    lockstep: bool = True
    collectives: str = "nccl"
    link_fits: dict[str, dict[str, LinkFit]] = field(default_factory=dict)
    head_curves: dict[str, ComputeCurve] = field(default_factory=dict)
    update_s_per_param: dict[str, float] = field(default_factory=dict)
    # Per recompute policy, by accelerator name: the block measured as the pipeline executors
    # run it (forward and backward in separate programs, the backward's recompute included in
    # its efficiency; `hetjax calibrate`'s "staged:<policy>" rows). Used for layers hetjax's
    # executors pipeline, before `curves` + the recompute's FLOPs.
    staged_curves: dict[str, dict[str, ComputeCurve]] = field(default_factory=dict)
    # pipeline.boundary_codec: "int8" sends boundaries between clusters as int8 + a float32
    # scale per row (parallel/bridge.py), 1 + 4 / row bytes a value
    boundary_codec: str = "none"
    # See COMPUTE_MODELS. kernel_rates: per accelerator name, the per-kind rates (a `hetjax
    # calibrate` file's, else compute.FITTED, Megatron-LM's published runs fitted); attention:
    # model.attention ("auto" resolves per device vendor; the megatron executor runs Megatron's
    # fused softmax).
    compute: str = "flat"
    kernel_rates: dict[str, ck.KernelRates] = field(default_factory=dict)
    attention: str = "auto"
    # A measured compute profile (hetjax/planner/compute_profile.py: per accelerator kind,
    # piece, TP degree, tokens and recompute policy): used before everything above for the
    # accelerator kinds it has rows of; its layer times include their TP collectives.
    profile: ComputeProfile | None = None
    # The runtime's reserve by accelerator name (hetjax/planner/memory.py RuntimeReserve),
    # instead of the vendor's (memory.RESERVES).
    reserve: dict[str, mem.RuntimeReserve] = field(default_factory=dict)

    def __post_init__(self):
        if self.compute not in COMPUTE_MODELS:
            raise PlanError(f"cost option compute = {self.compute!r}; choose one of "
                            f"{', '.join(COMPUTE_MODELS)}")
        if self.executor not in PRICED_EXECUTORS:
            raise PlanError(f"cost option executor = {self.executor!r}; choose one of "
                            f"{', '.join(PRICED_EXECUTORS)}")
        if self.collectives not in COLLECTIVE_MODELS:
            raise PlanError(f"cost option collectives = {self.collectives!r}; choose one of "
                            f"{', '.join(COLLECTIVE_MODELS)}")
        for name, v in (("efficiency", self.efficiency), ("overlap", self.overlap),
                        ("memory_fraction", self.memory_fraction),
                        *self.efficiency_by_kind.items()):
            lo = 0.0 if name == "overlap" else 1e-9
            if not lo <= v <= 1.0:
                raise PlanError(f"cost option {name} = {v} must lie in [{lo:g}, 1]")



@dataclass(frozen=True)
class StageCost:
    """One pipeline position's time per micro-batch, gradient sync per step and memory per
    device, each linear in the number of layers l it runs (fixed parts: embedding / head)."""

    fwd_layer: float  # seconds per layer, forward (compute + exposed TP / ZeRO traffic)
    bwd_layer: float
    fwd_fixed: float
    bwd_fixed: float
    sync_layer: float  # gradient sync per layer, once per step
    sync_fixed: float
    mem_slot: float  # model-state bytes per layer slot (every stage holds max(l) slots)
    mem_layer: float  # activation bytes per layer, for all micro-batches in flight
    mem_fixed: float
    capacity: float  # usable bytes of the stage's smallest device
    label: str = ""  # clusters / accelerator of the stage, for display
    padded: bool = True  # states priced for max(l) layer slots, or only its own (mpmd)
    update_slot: float = 0.0  # optimizer update per layer slot, once per step (after sync)
    update_fixed: float = 0.0
    # the runtime's reserve of the stage's devices: `memory` is the step's bytes, what a device
    # holds is reserve.device_bytes(memory); `capacity` is the step's share of the usable
    reserve: mem.RuntimeReserve = mem.RuntimeReserve()
    refresh_layer: float = 0.0  # ZeRO's parameter refresh after the update, per layer
    refresh_fixed: float = 0.0
    overlap: float = 0.0  # share of overlappable traffic that hides (0 on CPU)
    mem_measured: bool = False  # activations from a profile's measured bytes
    source: str = "flat"  # what priced its compute (see _Slot)
    spread: float = 0.0
    distance: float = 1.0
    # Of mem_slot and mem_fixed, the activations hetjax's SPMD pipeline stashes (per layer
    # slot, and its stage output), for messages that split memory into its kinds
    stash_slot: float = 0.0
    stash_fixed: float = 0.0
    # Of fwd_layer / bwd_layer, the communication (for the step's breakdown): the TP
    # all-reduces of the forward and of the backward, the exposed ZeRO traffic of each, and
    # the expert all-to-alls of each.
    comm_layer: tuple[float, ...] = (0.0,) * 6
    notes: tuple[str, ...] = ()  # what the profile derived, scaled or extrapolated

    def fwd(self, layers: int) -> float:
        return self.fwd_layer * layers + self.fwd_fixed

    def bwd(self, layers: int) -> float:
        return self.bwd_layer * layers + self.bwd_fixed

    def time(self, layers: int) -> float:
        """Forward + backward of one micro-batch."""
        return self.fwd(layers) + self.bwd(layers)

    def sync(self, layers: int) -> float:
        return self.sync_layer * layers + self.sync_fixed

    def refresh(self, layers: int) -> float:
        return self.refresh_layer * layers + self.refresh_fixed

    def update(self, layers: int, max_layers: int) -> float:
        """The optimizer update of the stage's parameters (every padded slot's, if padded)."""
        return self.update_slot * (max_layers if self.padded else layers) + self.update_fixed

    def memory(self, layers: int, max_layers: int) -> float:
        slots = max_layers if self.padded else layers
        return self.mem_slot * slots + self.mem_layer * layers + self.mem_fixed



class LayerFloor(NamedTuple):
    """One layer's micro-batch on a kind of stage, less its ZeRO traffic (`layer_floor`)."""

    fwd: float  # seconds: compute and TP all-reduces
    bwd: float
    fwd_compute: float  # of which compute (the window ZeRO's traffic may hide behind)
    bwd_compute: float
    stages: int  # stages of this kind
    head: float  # the head's forward and backward, where this kind of stage runs it last


@dataclass(frozen=True)
class _Slot:
    """The position-independent costs of one stage's devices (see CostModel._placed_as)."""

    fwd_layer: float
    bwd_layer: float
    sync_layer: float
    mem_slot: float  # model-state bytes per layer slot
    stash: float  # bytes per padded layer slot per micro-batch in flight (SPMD executor)
    stash_out: float  # bytes of the stage output per micro-batch in flight (SPMD executor)
    act_layer: float  # activation bytes per layer per micro-batch in flight
    mem_base: float
    head_fwd: float
    head_bwd: float
    embed_sync: float
    embed_mem: float
    head_sync: float
    head_mem: float
    logits: float
    shared_everywhere: bool  # embedding and head on every stage (SPMD executor)
    capacity: float
    reserve: mem.RuntimeReserve  # the devices' runtime reserve (see StageCost.reserve)
    label: str
    update_layer: float = 0.0  # optimizer update of one layer slot's parameter shard
    update_embed: float = 0.0
    update_head: float = 0.0
    embed_fwd: float = 0.0  # measured embedding (a profile's "embedding" rows), first stage
    embed_bwd: float = 0.0
    refresh_layer: float = 0.0  # ZeRO's parameter refresh after the update
    embed_refresh: float = 0.0
    head_refresh: float = 0.0
    # a pass's ZeRO traffic that no layer's compute hides: the first layer's gather of a
    # forward, the last reduce-scatter of a backward (the rest overlaps layer by layer)
    zero_edge_fwd: float = 0.0
    zero_edge_bwd: float = 0.0
    overlap: float = 0.0  # the share of overlappable traffic that hides on these devices
    # where the compute prices came from, the measurements' spread and how far they were
    # extrapolated (Estimate.distance; 1: inside the measured range)
    source: str = "flat"
    spread: float = 0.0
    distance: float = 1.0
    notes: tuple[str, ...] = ()  # what the profile derived, scaled or extrapolated
    mem_measured: bool = False
    comm_layer: tuple[float, ...] = (0.0,) * 6  # StageCost's


@dataclass(frozen=True)
class Prediction:
    """What a plan is predicted to do per step."""

    step_time: float
    tokens_per_s: float
    mfu: float
    bubble: float
    stage_time: tuple[float, ...]  # forward + backward of one micro-batch, per stage
    stage_idle: tuple[float, ...]
    stage_memory: tuple[float, ...]  # bytes per device
    stage_capacity: tuple[float, ...]
    sync_exposed: tuple[float, ...]
    padding_bytes: float  # memory of padded layer slots on the most padded stage
    dp_links: tuple[str, ...]  # slowest link of each stage's DP groups
    pp_links: tuple[str, ...]  # slowest link of each stage boundary
    # the band (hetjax/planner/band.py): step time +- step_band seconds, memory +- memory_band
    # of itself; what priced the compute, and the farthest extrapolation of a profile
    step_band: float = 0.0
    memory_band: float = 0.0
    compute_source: str = "flat"
    extrapolation: float = 1.0
    compute_notes: tuple[str, ...] = ()  # what a profile derived, scaled or extrapolated
    # what a device holds beyond the step's bytes (the runtime's reserve: context, collective
    # buffers, workspaces, fragmentation), and the share of device memory left free
    stage_reserve: tuple[float, ...] = ()
    memory_margin: float = 0.0

    @property
    def fits(self) -> bool:
        return all(m <= c for m, c in zip(self.stage_memory, self.stage_capacity))

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form stored in `Plan.predicted`."""
        gib = 2.0 ** 30
        return {
            "step_time_s": self.step_time, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "bubble": self.bubble, "stage_time_s": list(self.stage_time),
            "stage_idle_s": list(self.stage_idle),
            "stage_memory_gib": [m / gib for m in self.stage_memory],
            "stage_capacity_gib": [c / gib for c in self.stage_capacity],
            "sync_exposed_s": list(self.sync_exposed), "padding_gib": self.padding_bytes / gib,
            "dp_links": list(self.dp_links), "pp_links": list(self.pp_links),
            "fits": self.fits, "step_band_s": self.step_band, "memory_band": self.memory_band,
            "compute_source": self.compute_source, "extrapolation": self.extrapolation,
            "compute_notes": list(self.compute_notes),
            "stage_reserve_gib": [r / gib for r in self.stage_reserve],
            "memory_margin": self.memory_margin,
        }


@dataclass
class SharedPrices:
    """What the cost models of one search over device subsets share (`search._plan_subsets`:
    one model and one set of options on sub-topologies of one topology): the networks'
    links, structure ids and collective prices (`network.Structures`) and what is keyed on
    them alone, ZeRO's terms, the links of their groups and their collectives' times, so a
    stage the whole topology's search priced is not priced again by a subset's (its clusters
    and node pattern are the same)."""

    structures: Structures = field(default_factory=Structures)
    axis_nets: dict[tuple, tuple] = field(default_factory=dict)  # see CostModel._axis_nets
    zero: dict[tuple, zr.ZeroTimes] = field(default_factory=dict)  # see CostModel._zero
    axis_times: dict[tuple, float] = field(default_factory=dict)  # see CostModel._axis_times
    priced: tuple | None = None  # (model, options) of the cost models sharing these


class CostModel:
    """Prices layouts of `model` on `topology`; `shared`: prices shared with the cost models
    of other subsets of one topology (`SharedPrices`)."""

    def __init__(self, topology: Topology, model: "ModelConfig",
                 options: CostOptions | None = None, shared: SharedPrices | None = None):
        self.topology = topology
        self.model = model
        self.options = options or CostOptions()
        o = self.options
        shared = shared or SharedPrices()
        if shared.priced is None:
            shared.priced = (model, o)
        elif shared.priced != (model, o):
            raise PlanError("cost models that share prices must price one model with one set "
                            "of options; build this one without `shared`")
        # a profile of another model shape prices nothing of this one (a calibration file
        # measured on another model still lends its curves and links)
        self._profile = (o.profile if o.profile is not None and o.profile.mismatch(model) is None
                         else None)
        self.network = net = Network(topology, o.share_nics, o.collectives, o.link_fits,
                                     shared.structures)
        # the network's pricing, as the cost model's (the search and the calibration ask it)
        self.collective, self.collective_choice = net.collective, net.collective_choice
        self.transfer, self.group_links = net.transfer, net.group_links
        self.nic_flows, self.node_of = net.nic_flows, net.node_of
        self._cluster, self._node = net.cluster, net.node
        self._memory = np.array([topology.clusters[c].accelerator.memory_bytes
                                 for c in self._cluster])
        self._cluster_accel = [c.accelerator for c in topology.clusters]
        self.state_bytes = zr.state_bytes_for(model.param_dtype)
        self.act_bytes = _DTYPE_BYTES.get(model.dtype, 4)
        vendors = {c.accelerator.vendor for c in topology.clusters}
        platform = "cpu" if vendors == {"cpu"} else \
            "gpu" if vendors <= {"nvidia", "amd"} else "other"
        self.attention = mem.attention_implementation(model, platform)
        # ZeRO's terms by (factors, parameters, `Network.shape_id` of the DP groups), and
        # their collectives' times (zero_times): keyed on structure, so shared (SharedPrices)
        self._zero, self._axis_times = shared.zero, shared.axis_times
        self._axis_nets = shared.axis_nets  # groups over DP mesh axes (zero_times)
        self._boundaries: dict[int, tuple] = {}  # id(mesh) -> (mesh, links, times by bytes)
        self._shared: dict[tuple, tuple] = {}  # (id(mesh), folded) -> (mesh, _shared_sync)
        self._shared_floors: dict[int, tuple] = {}  # id(mesh) -> (mesh, _crossing_floor)
        self._boundary_floors: dict[int, tuple] = {}  # id(mesh) -> see boundary_floor
        self._layer_floors: dict[tuple, tuple] = {}  # see layer_floor
        self._placed: dict[tuple, StageCost] = {}  # see _placed_as
        self._slot_cache: dict[Layout, list[_Slot]] = {}
        self._slot_ids: dict[tuple, tuple] = {}  # see _slots
        self._stage_slot_cache: dict[Layout, dict[bytes, _Slot]] = {}
        self._stage_keys: dict[tuple, list[bytes]] = {}
        self._a2a: dict[tuple, tuple] = {}  # MoE exchanges by (EP groups, bytes)

    # --- compute -------------------------------------------------------------------------------
    def _rate(self, acc: Accelerator) -> float:
        eff = self.options.efficiency_by_kind.get(acc.name, self.options.efficiency)
        return acc.peak_tflops * 1e12 * eff

    def kernel_rates(self, acc: Accelerator) -> ck.KernelRates:
        """The per-kind rates of `acc` (calibrated, else the fitted defaults)."""
        return self.options.kernel_rates.get(acc.name, ck.FITTED)

    def attention_impl(self, acc: Accelerator) -> str:
        if self.options.executor == "megatron":
            return "fused_softmax"
        return ck.attention_impl(self.options.attention, acc.vendor)

    def layer_work(self, acc: Accelerator, seq_len: int, remat: str | None, tokens: float,
                   tp: int = 1) -> tuple[ck.Work, ck.Work]:
        """(forward, backward incl. recompute) of one layer on one device's `tokens` tokens,
        by kind (CostOptions.compute == "kinds")."""
        fwd, bwd = ck.layer_work(self.model, acc, self.kernel_rates(acc), tokens, seq_len, tp,
                                 self.attention_impl(acc), self.act_bytes)
        return fwd, bwd + ck.recompute_work(fwd, remat or effective_remat(self.model.remat))

    def layer_seconds_per_token(self, acc: Accelerator, seq_len: int,
                                remat: str | None = None, tokens: float | None = None,
                                staged: bool = False, tp: int = 1) -> tuple[float, float]:
        """(forward, backward) seconds per token of one layer at tp = 1 on `acc`; the backward
        includes the recompute of `remat` (default: the model's). `tokens`: tokens one kernel
        call processes (a device's micro-batch / tp), which sets the efficiency read from a
        measured `ComputeCurve`; without a curve (or tokens) peak x efficiency. `staged`: the
        layer runs in hetjax's pipeline (forward and backward in separate programs), priced
        from the measured curve of that policy when there is one (`staged_curves`). With
        compute "kinds" (and `tokens`), priced by operation kind on `tp`-way split layers;
        the result is still per token at tp = 1 (the callers divide by tp)."""
        prof = self.options.profiles.get(acc.name)
        if prof is not None:
            return prof.fwd_s, prof.bwd_s
        flops = self.model.layer_flops(seq_len)
        policy = remat or effective_remat(self.model.remat)
        measured = self.options.staged_curves.get(policy, {}).get(acc.name)
        if self.options.compute == "kinds" and tokens is not None and not (
                staged and measured is not None):
            fwd, bwd = self.layer_work(acc, seq_len, policy, tokens * tp, tp)
            return fwd.total / tokens, bwd.total / tokens
        if staged and measured is not None and tokens is not None:
            ef, eb = measured.efficiency(flops * tokens)
            peak = acc.peak_tflops * 1e12
            return flops / (peak * ef), 2 * flops / (peak * eb)
        rate_f, rate_b = self._rates(acc, None if tokens is None else flops * tokens)
        fwd = flops / rate_f
        return fwd, 2 * flops / rate_b + self._recompute_flops(seq_len, remat) / rate_f

    def head_seconds_per_token(self, acc: Accelerator, tokens: float | None = None,
                               tp: int = 1) -> tuple[float, float]:
        prof = self.options.profiles.get(acc.name)
        if prof is not None:
            return prof.head_fwd_s, prof.head_bwd_s
        flops = self.model.head_flops()
        measured = self.options.head_curves.get(acc.name)
        if self.options.compute == "kinds" and tokens is not None and measured is None:
            fwd, bwd = ck.head_work(self.model, acc, self.kernel_rates(acc), tokens * tp, tp,
                                    self.act_bytes)
            return fwd.total / tokens, bwd.total / tokens
        if measured is not None and tokens is not None:
            ef, eb = measured.efficiency(flops * tokens)
            peak = acc.peak_tflops * 1e12
            return flops / (peak * ef), 2 * flops / (peak * eb)
        rate_f, rate_b = self._rates(acc, None if tokens is None else flops * tokens)
        return flops / rate_f, 2 * flops / rate_b

    def update_seconds_per_param(self, acc: Accelerator) -> float:
        """Seconds of the optimizer update per parameter on `acc`: calibrated, else with
        compute "kinds" Adam's bytes over the memory bandwidth, else 0 (not priced)."""
        if acc.name in self.options.update_s_per_param:
            return self.options.update_s_per_param[acc.name]
        if self.options.compute == "kinds":
            return ck.update_seconds_per_param(acc, self.kernel_rates(acc))
        return 0.0

    def _rates(self, acc: Accelerator, kernel_flops: float | None) -> tuple[float, float]:
        """Achieved (forward, backward) FLOP/s of `acc` on a kernel of `kernel_flops`."""
        curve = self.options.curves.get(acc.name)
        if curve is None or kernel_flops is None:
            return self._rate(acc), self._rate(acc)
        ef, eb = curve.efficiency(kernel_flops)
        peak = acc.peak_tflops * 1e12
        return peak * ef, peak * eb

    def _recompute_flops(self, seq_len: int, remat: str | None = None) -> float:
        """Forward FLOPs per token a layer recomputes in its backward under `remat`."""
        m = self.model
        return {"full": m.layer_flops(seq_len), "dots": m.layer_flops(seq_len) -
                m.layer_flops(0)}.get(remat or effective_remat(m.remat), 0.0)

    def train_flops_per_token(self, seq_len: int) -> float:
        """Hardware FLOPs per token including recompute (Megatron's count)."""
        return (self.model.flops_per_token(seq_len) +
                self.model.n_layers * self._recompute_flops(seq_len))

    # --- communication over rank groups ----------------------------------------------------------
    @property
    def zero_style(self) -> str:
        """How ZeRO runs under this executor: 'hetjax' (parallel/zero_sharding.py, both of hetjax's
        executors: P gathered once per step and held) or 'megatron' (AMSP's per-layer terms)."""
        return "megatron" if self.options.executor == "megatron" else "hetjax"

    def zero_times(self, f: ZeroFactors, params: float, dp_groups: np.ndarray) -> zr.ZeroTimes:
        """AMSP's communication terms for `params` parameters per device of these DP groups,
        as this executor runs them (`zero_style`; cached: the same stage is priced for many
        micro-batch counts and schedules)."""
        # on the groups' structure (`Network.shape_id`), not their ranks: stages alike in
        # structure (of other layouts, or other positions) have equal terms
        gid = self.network.shape_id(dp_groups)
        key = (f.s_p, f.s_g, f.s_os, params, gid)
        if key not in self._zero:
            sb = self.state_bytes

            def over(op: str, nbytes: float, f: ZeroFactors, axes: tuple[str, ...]) -> float:
                # the groups depend on the axes' sizes and strides alone (`axis_pattern`):
                # the points of `space` share them, so their links are read once per (DP
                # groups' structure, pattern), and a collective's time once per bytes moved
                k = (gid, zr.axis_pattern(dp_groups.shape[1], f.s_os, f.s_p, axes))
                if k not in self._axis_nets:
                    groups = zr.axis_groups(dp_groups, f, axes)
                    self._axis_nets[k] = (groups.shape[1], self.network.net(groups)
                                          if groups.shape[1] > 1 else None)
                p, net = self._axis_nets[k]
                if p <= 1 or nbytes <= 0:
                    return 0.0
                # points differing in another factor run this same collective
                if (k, op, nbytes) not in self._axis_times:
                    self._axis_times[k, op, nbytes] = self.network.choice_on(net, op, nbytes, p)[0]
                return self._axis_times[k, op, nbytes]

            self._zero[key] = zr.zero_times(f, params * sb.p, params * sb.g, dp_groups,
                                            self.collective, self.zero_style, over)
        return self._zero[key]

    # --- memory ----------------------------------------------------------------------------------
    def activation_bytes_per_token(self, tp: int, seq_len: int,
                                   remat: str | None = None, cpu: bool = False) -> float:
        """Bytes one layer keeps for its backward, per token, under `remat` and the model's
        attention implementation (hetjax/planner/memory.py owns the terms). `cpu`: XLA:CPU
        keeps bf16 residuals in f32 (measured: a bf16 step's kept activations are as large as
        an f32 step's), so they take 4 bytes there whatever the dtype."""
        return mem.layer_bytes_per_token(
            self.model, seq_len, tp, remat or effective_remat(self.model.remat),
            self.attention, 4.0 if cpu else self.act_bytes, cpu=cpu)

    def runtime_reserve(self, acc: Accelerator) -> mem.RuntimeReserve:
        """The runtime's reserve on a device of `acc` (CostOptions.reserve, else the
        vendor's `memory.RESERVES`)."""
        if acc.name in self.options.reserve:
            return self.options.reserve[acc.name]
        return mem.runtime_reserve(acc.vendor)

    def temporary_bytes(self, layout: Layout, remat: str, cpu: bool = False) -> float:
        """Transient bytes per device beyond states and kept activations: the buffers of the
        layer running its backward (its recompute under 'dots' / 'full'), one micro-batch.
        (Gradients are reduced in place in their buffer, part of the G states; the logits
        and a prefetched layer are counted where they live.)"""
        return mem.transient_bytes_per_token(  # in the compute dtype, on CPU too (measured)
            self.model, layout.seq_len, layout.tp, remat, self.attention,
            self.act_bytes) * layout.tokens_per_device()

    # --- Mixture-of-Experts ------------------------------------------------------------------
    def expert_groups(self, layout: Layout, s: int) -> np.ndarray:
        """Stage s's expert-parallel groups [dp / ep x tp, ep]: ep neighbours of its
        data-parallel devices (parallel/mesh.py puts 'expert' innermost among the data axes)."""
        m = layout.mesh()[s]  # [dp, tp]
        return m.reshape(layout.dp // layout.ep, layout.ep, layout.tp).transpose(0, 2, 1
                                                                                ).reshape(-1, layout.ep)

    def expert_all_to_alls(self, layout: Layout) -> list[tuple[int, int, int]]:
        """The all-to-alls one step of an MoE model runs under expert parallelism, per device:
        (bytes V of the buffer each device sends and receives, group size ep, executions per
        step). Per MoE layer and micro-batch: dispatch and combine in the forward and their
        transposes in the backward (and the forward's again when 'full' recompute reruns it),
        each [ep, E / ep, slots, d] (`ModelConfig.all_to_all_bytes`); dropless dispatch also
        sends each expert's row count (int32 [ep, E / ep]) once per forward. What the HLO audit
        reads from the compiled step."""
        m = self.model
        if not m.is_moe or layout.ep <= 1:
            return []
        per_layer = m.n_moe_layers / layout.pp * layout.microbatches
        forwards = 2 if self.remat_of(layout) == "full" else 1
        tok = int(layout.tokens_per_device() * layout.ep)  # an EP group's rows, split by ep
        out = [(m.all_to_all_bytes(tok // layout.ep, self.act_bytes), layout.ep,
                int(per_layer * (2 * forwards + 2)))]
        if m.moe_dispatch != "capacity":
            out.append((m.n_experts * 4, layout.ep, int(per_layer * forwards)))
        return out

    def expert_exchange(self, layout: Layout, s: int) -> tuple[float, dict[str, int]]:
        """Seconds of one MoE token exchange (an all-to-all of `all_to_all_bytes`) on stage
        s's expert-parallel groups, priced on the links they cross (`Network.all_to_all`), and
        a member's peers per link kind. Zero without expert parallelism."""
        m = self.model
        if not m.is_moe or layout.ep <= 1:
            return 0.0, {}
        groups = self.expert_groups(layout, s)
        nbytes = m.all_to_all_bytes(int(layout.tokens_per_device()), self.act_bytes)
        key = (groups.shape, groups.tobytes(), nbytes)
        if key not in self._a2a:
            self._a2a[key] = self.network.all_to_all(nbytes, groups)
        return self._a2a[key]

    def layer_params_per_device(self, layout: Layout) -> float:
        """One layer's parameters a device holds: 1 / tp of each, and of an MoE layer's routed
        experts only its E / ep."""
        m = self.model
        return (m.layer_params - m.expert_params * (1 - 1 / layout.ep)) / layout.tp

    # --- stages ----------------------------------------------------------------------------------
    def _slots(self, layout: Layout) -> list["_Slot"]:
        """Costs of each mesh row's devices that do not depend on where the stage sits
        (cached: they do not depend on the schedule either). Stages of different (dp, tp)
        shapes are priced each as a stage of its own shape (`stage_view`)."""
        # by the device order's identity first: the layouts of one order's ZeRO points,
        # micro-batch counts and schedules share its tuple, and copying a layout to hash it
        # (its thousands of ranks) cost more than the lookup; the order is kept with the
        # slots, so its id is not reused while cached
        quick = (id(layout.device_order), *(getattr(layout, f) for f in _SLOT_FIELDS))
        got = self._slot_ids.get(quick)
        if got is not None and got[0] is layout.device_order:
            return got[1]
        key = dataclasses.replace(layout, schedule="")
        slots = self._slot_cache.get(key)  # (one lookup: hashing a layout reads its devices)
        if slots is None:
            slots = self._slot_cache[key] = self._price_slots(layout) if layout.uniform else [
                self._slots(self.stage_view(layout, s))[s] for s in range(layout.pp)]
        self._slot_ids[quick] = (layout.device_order, slots)
        return slots

    @staticmethod
    def stage_view(layout: Layout, s: int) -> Layout:
        """Stage s of a layout whose stages differ in (dp, tp), as a layout of pp stages of its
        shape that all hold its devices: what the stage's own costs depend on (its micro-batch
        per device, its TP and DP groups on its links), priced as the uniform stages are."""
        dp, tp = layout.stage_shape(s)
        ranks = tuple(int(r) for r in layout.stage_mesh(s).ravel())
        return dataclasses.replace(layout, dp=dp, tp=tp, stage_shapes=(),
                                   device_order=ranks * layout.pp)

    def stage_meshes(self, layout: Layout) -> list[np.ndarray]:
        """Each stage's [dp, tp] ranks."""
        if layout.uniform:
            return list(layout.mesh())
        return [layout.stage_mesh(s) for s in range(layout.pp)]

    def stage_keys(self, layout: Layout) -> list[bytes]:
        """One key per mesh row (stage) that is equal for two stages exactly when their devices
        have the same clusters in the same positions and share nodes in the same pattern: such
        stages cost the same, since nodes of one cluster are alike (cached per device order)."""
        key = (layout.device_order, layout.pp, layout.dp, layout.tp, layout.stage_shapes)
        got = self._stage_keys.get(key)  # (one lookup: hashing the order reads every rank)
        if got is not None:
            return got
        if not layout.uniform:  # each shape's own key
            got = self._stage_keys[key] = [
                bytes(np.asarray(layout.stage_shape(s), dtype=np.int64).tobytes())
                + self.stage_keys(self.stage_view(layout, s))[s] for s in range(layout.pp)]
        else:
            mesh = layout.mesh().reshape(layout.pp, -1)
            nodes = self._node[mesh]
            order = np.argsort(nodes, axis=1, kind="stable")
            ranked = np.take_along_axis(nodes, order, axis=1)
            first = np.ones_like(ranked, dtype=bool)
            first[:, 1:] = ranked[:, 1:] != ranked[:, :-1]
            labels = np.empty_like(ranked)
            np.put_along_axis(labels, order, np.cumsum(first, axis=1), axis=1)
            rows = np.stack([self._cluster[mesh], labels], axis=-1)
            got = self._stage_keys[key] = [r.tobytes() for r in rows]
        return got

    def step_floor(self, layout: Layout) -> float:
        """A step time no split, ZeRO point or stage order of `layout` beats (every candidate's
        `simulate.lower_bound` is at least this): with t (t_f) the least time any stage spends
        on one layer's micro-batch, forward and backward (forward), compute and TP
        all-reduces (`layer_floor`), the longest stage runs M micro-batches of at least
        L = ceil(N / pp) layers: t M L. Where `simulate.chain` allows fill and drain, the last
        stage, which runs at least one layer and the head (h, its least on any kind of stage)
        for M micro-batches, also waits for the N - n_last layers ahead of it and the pp - 1
        boundaries' transfers (`boundary_floor`), forward and backward:
        t (N - 1) + M (t + h) + 2 B; where it allows the fill alone, for its share f of their
        forwards: f t_f (N - 1) + M (t + h) + B. Each of these stages
        then syncs: the part of that no ZeRO point or stage order avoids is added
        (`shared_floor`). The search skips layouts whose floor cannot enter the top."""
        M, N = layout.microbatches, self.model.n_layers
        L = -(-N // layout.pp)
        times = self.layer_floor(layout)
        t = min(x.fwd + x.bwd for x in times)
        last = t * M + M * min(x.head for x in times)  # the last stage: a layer and the head
        sync = self.shared_floor(layout)
        fill, drain = chain(layout.schedule, layout.folded)
        if fill and drain:
            return max(t * M * L, t * (N - 1) + last + 2 * self.boundary_floor(layout)) + sync
        if fill:
            return max(t * M * L, min(x.fwd for x in times) * (N - 1) * fill + last
                       + self.boundary_floor(layout)) + sync
        return t * M * L + sync

    def layer_floor(self, layout: Layout) -> list["LayerFloor"]:
        """Per kind of stage (`stage_keys`, in the order of their first stage), one layer's
        micro-batch as `_price_slots` prices it, less what depends on the ZeRO point (its
        exposed traffic) and expert all-to-alls: the slowest of its accelerators, with the
        stage's TP all-reduces where the flat model priced the compute (a profile's layer
        times include them). A stage order permutes whole stages, so each stage's TP groups
        are those of the layout's own order."""
        # a layout's schedule, placement and ZeRO point change none of this, and the search
        # asks for every one of them: memoised on the rest (the device order by identity,
        # kept with the value so its id is not reused while cached)
        key = (id(layout.device_order), layout.pp, layout.dp, layout.tp, layout.stage_shapes,
               layout.microbatches, layout.global_batch, layout.seq_len, layout.remat)
        got = self._layer_floors.get(key)
        if got is None or got[0] is not layout.device_order:
            got = self._layer_floors[key] = (layout.device_order, self._layer_floor(layout))
        return got[1]

    def _layer_floor(self, layout: Layout) -> list["LayerFloor"]:
        views = [layout] if layout.uniform else [self.stage_view(layout, s)
                                                 for s in range(layout.pp)]
        out = []
        for i, v in enumerate(views):
            keys = self.stage_keys(v)
            rows = range(v.pp) if layout.uniform else [i]
            count = Counter(keys[s] for s in rows)
            remat, staged, mesh = self.remat_of(v), self.runs_staged(v), v.mesh()
            nbytes = v.tokens_per_device() * self.model.d_model * self.act_bytes
            for key, s in dict(zip((keys[s] for s in rows), rows)).items():
                tp_ar = 2 * self.collective("all_reduce", nbytes, mesh[s])
                accs = [self._cluster_accel[c] for c in np.unique(self._cluster[mesh[s].ravel()])]
                priced = [self.layer_times(a, v, remat, staged) for a in accs]
                heads = [self.piece_times(a, v, "head") for a in accs]
                out.append(LayerFloor(
                    fwd=max(f + (0.0 if e is not None else tp_ar) for f, _, e in priced),
                    bwd=max(b + (0.0 if e is not None else tp_ar) for _, b, e in priced),
                    fwd_compute=max(f for f, _, _ in priced),
                    bwd_compute=max(b for _, b, _ in priced), stages=count[key],
                    head=max(h for h, _, _ in heads) + max(h for _, h, _ in heads)))
        return out

    def boundary_floor(self, layout: Layout) -> float:
        """The least total of one micro-batch's pp - 1 boundary transfers over the stage orders
        the partition may try: with stages of one kind (equal `stage_keys`) the layout's own
        order's. With stages each inside one of at most two clusters and on nodes of their
        own, a boundary joins two stages of one cluster (a transfer like any other of that
        cluster, as the own order has them when the cluster has two stages) or crosses
        between the clusters (as the own order's crossing): pp - 1 times the least of the
        own order's boundaries. Otherwise 0 (a stage sharing a node with another may have a
        boundary that stays on the node). Stages of different shapes: 0."""
        if not layout.uniform or layout.pp == 1:
            return 0.0
        mesh = layout.mesh()
        got = self._boundary_floors.get(id(mesh))
        if got is None or got[0] is not mesh:  # (the mesh is kept, so its id is not reused)
            alike = len(set(self.stage_keys(layout))) == 1
            got = self._boundary_floors[id(mesh)] = (
                mesh, alike, alike or self._stages_apart(layout, mesh, 2), {})
        _, alike, apart, floors = got
        key = (layout.microbatches, layout.global_batch, layout.seq_len)  # the bytes moved
        if key not in floors:
            times = self.boundary_times(layout)[0] if apart else [0.0]
            floors[key] = sum(times) if alike else (layout.pp - 1) * min(times)
        return floors[key]

    def _stages_apart(self, layout: Layout, mesh: np.ndarray, clusters: int) -> bool:
        """Whether every stage lies inside one cluster, on nodes no other stage uses, and the
        stages span at most `clusters` clusters."""
        rows = mesh.reshape(layout.pp, -1)
        cl, nodes = self._cluster[rows], self._node[rows]
        return bool((cl == cl[:, :1]).all() and len(np.unique(cl[:, 0])) <= clusters
                    and sum(len(np.unique(r)) for r in nodes) == len(np.unique(nodes)))

    def shared_floor(self, layout: Layout) -> float:
        """The shared gradients' sync (`_shared_sync`) that every stage's exposed sync holds
        in every stage order the partition may try, where it is on every stage's critical
        path: hetjax's SPMD pipeline in lockstep (every stage holds the embedding and head,
        and nothing of its sync hides). With stages of one kind (equal `stage_keys`) the
        partition keeps the layout's own order: its ring exactly. With stages each inside one
        of two clusters, on nodes of their own, every order's ring crosses between the
        clusters, each device in two transfers: a crossing takes at least as long as the own
        order's crossing pairs alone (which share the nodes' NICs with fewer flows).
        Otherwise 0."""
        if not (layout.uniform and layout.pp > 1 and not layout.folded
                and self.runs_in_lockstep(layout)):
            return 0.0
        mesh = layout.mesh()
        if len(set(self.stage_keys(layout))) == 1:
            return self._shared_sync(layout, mesh)
        got = self._shared_floors.get(id(mesh))
        if got is None or got[0] is not mesh:
            got = self._shared_floors[id(mesh)] = (mesh, self._crossing_floor(layout, mesh))
        return got[1]

    def _crossing_floor(self, layout: Layout, mesh: np.ndarray) -> float:
        """`shared_floor` of stages of several kinds (see there)."""
        rows = mesh.reshape(layout.pp, -1)
        if len(np.unique(self._cluster[rows[:, 0]])) != 2 or not self._stages_apart(
                layout, mesh, 2):
            return 0.0  # (a node holding two stages may keep a transfer of the ring on it)
        ring = np.stack([rows, np.roll(rows, -1, axis=0)], axis=-1).reshape(-1, 2)
        crossing = ring[self._cluster[ring[:, 0]] != self._cluster[ring[:, 1]]]
        m, g = self.model, self.state_bytes.g
        nbytes = (m.embed_params + m.head_params) / layout.tp * g  # as _uniform_shared_sync
        return (layout.pp - 1) * self.transfer(nbytes, crossing)[0]

    def pipelined_by_spmd(self, layout: Layout) -> bool:
        """Whether the SPMD pipeline executor runs this layout (see PRICED_EXECUTORS)."""
        return self.options.executor == "spmd" and layout.pp > 1

    def runs_staged(self, layout: Layout) -> bool:
        """Whether one of hetjax's pipeline executors (SPMD or MPMD) runs this layout, each
        layer's forward and backward in separate programs (`hetjax.parallel.residuals`)."""
        return self.options.executor in ("spmd", "mpmd") and layout.pp > 1

    def remat_choices(self, pp: int) -> tuple[str, ...]:
        """The recompute policies the planner weighs for `model.remat` = 'auto' at `pp` stages
        (least memory last). hetjax's SPMD pipeline is offered 'full' alone: each tick moves a
        stash slot through the tick's `lax.switch` (read out, through the branch, written back;
        parallel/pipeline.py), about three copies of every layer slot's residuals a tick, which
        this model does not price. Under 'full' a slot is the layers' inputs and the copies
        are negligible; under 'none' it holds every intermediate, attention probabilities
        included (bench_hetaccel, 4 cpu_half stages: 7.23 s a step measured against 4.81 s
        priced, while the MPMD executor, which stashes in place, ran the same plan in 4.77 s)."""
        if self.options.executor == "spmd" and pp > 1:
            return ("full",)
        return ("none", "dots", "full")

    def remat_of(self, layout: Layout) -> str:
        """The recompute policy a layout runs with: its own (the planner's choice), else the
        model's, 'auto' resolved per executor."""
        return effective_remat(layout.remat or self.model.remat, self.pipelined_by_spmd(layout))

    def runs_in_lockstep(self, layout: Layout) -> bool:
        """Whether the pipeline's ticks are priced in lockstep (see CostOptions.lockstep)."""
        return self.pipelined_by_spmd(layout) and self.options.lockstep

    def profile_estimate(self, acc: Accelerator, layout: Layout, piece: str,
                         remat: str = "none", staged: bool = False) -> Estimate | None:
        """The compute profile read for `piece` on `acc` at this layout's TP degree, tokens
        per device and sequence length (None: no profile, or no rows of this kind)."""
        prof = self._profile
        if prof is None:
            return None
        return prof.lookup(acc.name, piece, layout.tp, layout.tokens_per_device(),
                           layout.seq_len, remat, staged)

    def layer_times(self, acc: Accelerator, layout: Layout, remat: str, staged: bool
                    ) -> tuple[float, float, Estimate | None]:
        """(forward, backward) seconds of one layer on one device of `acc` for one
        micro-batch, and the profile's estimate when a profile priced it (its times include
        the TP collectives; the flat model's do not)."""
        est = self.profile_estimate(acc, layout, "layer", remat, staged)
        if est is not None:
            return est.fwd_s, est.bwd_s, est
        tok, tp = layout.tokens_per_device(), layout.tp
        lf, lb = self.layer_seconds_per_token(acc, layout.seq_len, remat, tok / tp,
                                              staged=staged, tp=tp)
        return tok * lf / tp, tok * lb / tp, None

    def piece_times(self, acc: Accelerator, layout: Layout, piece: str
                    ) -> tuple[float, float, Estimate | None]:
        """(forward, backward) seconds of the head ("head": final norm, output projection and
        loss; without a profile the embedding's time is counted in it) or the embedding on
        one device of `acc` for one micro-batch."""
        est = self.profile_estimate(acc, layout, piece)
        if est is not None:
            return est.fwd_s, est.bwd_s, est
        if piece == "embedding":
            return 0.0, 0.0, None
        tok, tp = layout.tokens_per_device(), layout.tp
        hf, hb = self.head_seconds_per_token(acc, tok / tp, tp)
        return tok * hf / tp, tok * hb / tp, None

    def pcie_shared(self, layout: Layout, ranks: np.ndarray) -> float:
        """Seconds a stage's TP collectives wait per micro-batch and pass because its node's
        PCIe also carries the stage boundary's activations to and from the NIC: on a node
        whose devices talk over PCIe (through host memory without P2P), the NIC's traffic
        crosses the same lanes. Counted when tp > 1, pp > 1 and the stage's nodes hold no
        other stage (its boundaries leave the node): the boundary's bytes in and out of each
        device (split over tp, as sent) at the PCIe link's achieved rate."""
        if layout.tp == 1 or layout.pp == 1:
            return 0.0
        clusters = np.unique(self._cluster[ranks])
        links = [self.topology.clusters[c].intra_node for c in clusters]
        if not any(lk.kind == "pcie" for lk in links):
            return 0.0
        nodes = np.unique(self._node[ranks])
        on_nodes = np.flatnonzero(np.isin(self._node, nodes))
        if not set(on_nodes.tolist()) <= set(ranks.tolist()):
            return 0.0  # another stage shares these nodes: its boundary may stay inside
        nbytes = 2 * layout.tokens_per_device() * self.model.d_model * self.act_bytes / layout.tp
        return max(nbytes / lk.bytes_per_s for lk in links if lk.kind == "pcie")

    def _price_slots(self, layout: Layout) -> list["_Slot"]:
        m, o, sb, f = self.model, self.options, self.state_bytes, layout.zero
        zr.check(f, layout.dp)
        mesh = layout.mesh()
        tp, M, tok = layout.tp, layout.microbatches, layout.tokens_per_device()
        spmd = self.pipelined_by_spmd(layout)
        staged = self.runs_staged(layout)
        remat = self.remat_of(layout)
        zero_as = self.zero_style
        layer_p = self.layer_params_per_device(layout)
        embed_p = m.embed_params / tp
        # Megatron's last stage keeps its own copy of a tied embedding; hetjax's stages all
        # hold the embedding anyway.
        head_p = (m.head_params + (m.embed_params if m.tie_embeddings and layout.pp > 1
                                   and not spmd else 0)) / tp
        slots = []
        # stages alike in structure (stage_keys) share their slot: deep pipelines repeat a few
        # (by the layout less its devices and schedule, then by stage_key: the layout is
        # hashed once a call, not once a stage; its devices replaced by a placeholder, since
        # an empty order is filled with every rank, thousands to build and hash)
        alike = self._stage_slot_cache.setdefault(
            dataclasses.replace(layout, device_order=(-1,), schedule=""), {})
        for s, stage_key in enumerate(self.stage_keys(layout)):
            if stage_key in alike:
                slots.append(alike[stage_key])
                continue
            ranks = mesh[s].ravel()
            clusters = np.unique(self._cluster[ranks])
            accs = sorted({self._cluster_accel[c] for c in clusters}, key=lambda a: a.name)
            # each device updates its shard of the optimizer state (1 / s_os of its parameters)
            upd = max(self.update_seconds_per_param(a) for a in accs) / f.s_os
            # Megatron TP: two all-reduces of the activations in each of forward and backward
            # (a profile's layer times include them: the layer as it ran).
            tp_ar = 2 * self.collective("all_reduce", tok * m.d_model * self.act_bytes, mesh[s])
            # A stage is as slow as its slowest device.
            priced = [self.layer_times(a, layout, remat, staged) for a in accs]
            est = [e for _, _, e in priced if e is not None]
            cf = max(c for c, _, _ in priced)
            cb = max(c for _, c, _ in priced)
            lf = max(c + (0.0 if e is not None else tp_ar) for c, _, e in priced)
            lb = max(c + (0.0 if e is not None else tp_ar) for _, c, e in priced)
            shared = self.pcie_shared(layout, ranks)
            heads = [self.piece_times(a, layout, "head") for a in accs]
            embeds = [self.piece_times(a, layout, "embedding") for a in accs]
            est += [e for _, _, e in heads + embeds if e is not None]
            dp_groups = mesh[s].T  # [tp, dp]
            # Expert parallelism: parameters are reduced over the dp / ep devices holding the
            # same experts (a non-expert parameter's partial sums inside an EP group are
            # all-reduced at every micro-batch); each MoE layer exchanges tokens four times.
            ep = layout.ep
            if ep > 1:
                dp_groups = mesh[s].reshape(layout.dp // ep, ep, tp).transpose(1, 2, 0).reshape(
                    ep * tp, layout.dp // ep)
            a2a = self.expert_exchange(layout, s)[0]
            ep_ar = self.collective("all_reduce", (layer_p - m.expert_params / ep / tp)
                                    * self.state_bytes.g, self.expert_groups(layout, s)
                                    ) if ep > 1 else 0.0
            a2a_fwd, a2a_bwd = 2 * a2a, (4 if remat == "full" else 2) * a2a + ep_ar
            z, ze, zh = (self.zero_times(f, x, dp_groups) for x in (layer_p, embed_p, head_p))
            cpu = any(a.vendor == "cpu" for a in accs)  # activations in f32 (see above)
            kept = self.activation_bytes_per_token(tp, layout.seq_len, remat, cpu) * tok
            transient = self.temporary_bytes(layout, remat, cpu)
            if m.is_moe and ep > 1:  # send, receive, output and return buffers of a layer
                transient += 4 * m.all_to_all_bytes(int(tok), self.act_bytes)
            reserve = max((self.runtime_reserve(a) for a in accs),
                          key=lambda r: (r.fixed_bytes, r.fragmentation))
            measured = [e for _, _, e in priced
                        if e is not None and e.peak_bytes > 0 and e.kept_bytes > 0]
            if measured and len(measured) == len(priced):  # every device's layer measured
                kept = max(e.kept_bytes for e in measured) or kept
                transient = max(max(e.peak_bytes - e.kept_bytes, 0.0) for e in measured)
            kinds = sorted(a.name for a, (_, _, e) in zip(accs, priced) if e is None)
            source = ("profile" if not kinds else
                      "profile + flat " + "/".join(kinds) if est else "flat")
            # ZeRO's per-pass traffic as scheduled: each layer's gather is prefetched during
            # the layer before it and its gradient's reduce-scatter runs during the next
            # layer's backward, so a layer costs the longer of its compute and its traffic;
            # the first gather and the last reduce-scatter of a pass stay exposed.
            # XLA:CPU runs a program's collectives in line with its compute (measured on the
            # emulated cluster: an MPMD stage's last backward and its gradient all-reduce took
            # their sum), so on CPU nothing overlaps.
            h = 0.0 if cpu else o.overlap
            g_fwd = z.gather
            g_bwd = z.gather + z.scatter + z.accumulate * (M - 1) / M
            zero_fwd, zero_bwd = exposed(g_fwd, cf, h), exposed(g_bwd, cb, h)
            slots.append(_Slot(
                fwd_layer=lf + a2a_fwd + zero_fwd, bwd_layer=lb + a2a_bwd + zero_bwd,
                comm_layer=(lf - cf, lb - cb, zero_fwd, zero_bwd, a2a_fwd, a2a_bwd),
                zero_edge_fwd=min(h * g_fwd, cf) + shared,
                zero_edge_bwd=min(h * g_bwd, cb) + shared, overlap=h,
                sync_layer=z.sync, refresh_layer=z.refresh,
                embed_refresh=ze.refresh, head_refresh=zh.refresh,
                mem_slot=zr.step_state_bytes(layer_p, f, sb, zero_as),
                # the SPMD pipeline stashes each layer's residuals (its input under remat
                # 'full') in every padded slot, plus the stage output, and with 'full' holds one
                # layer's full activations while it recomputes.
                stash=kept if spmd else 0.0,
                stash_out=tok * m.d_model * self.act_bytes if spmd else 0.0,
                act_layer=0.0 if spmd else kept,
                # Megatron prefetches the next full layer under ZeRO-3; hetjax gathers them all
                # (in mem_slot). Temporaries: the buffers of the layer in its backward.
                mem_base=(2 * layer_p * sb.p if f.s_p > 1 and o.executor == "megatron"
                          else 0.0) + transient,
                head_fwd=max(h for h, _, _ in heads), head_bwd=max(h for _, h, _ in heads),
                embed_fwd=max(h for h, _, _ in embeds), embed_bwd=max(h for _, h, _ in embeds),
                source=source, spread=max((e.spread for e in est), default=0.0),
                mem_measured=bool(measured) and len(measured) == len(priced),
                distance=max((e.distance for e in est), default=1.0),
                notes=tuple(dict.fromkeys(n for e in est for n in e.notes)),
                embed_sync=ze.sync,
                embed_mem=zr.step_state_bytes(embed_p, f, sb, zero_as),
                head_sync=zh.sync,
                head_mem=zr.step_state_bytes(head_p, f, sb, zero_as),
                # f32 logits, log-probabilities and their gradients
                logits=tok * mem.head_bytes_per_token(m, tp, remat),
                # folded: embedding and head only on device 0 (it runs both end chunks)
                shared_everywhere=spmd and not layout.folded,
                reserve=reserve,
                capacity=reserve.usable_for_step(
                    float(self._memory[ranks].min()) * o.memory_fraction),
                label=self._label(clusters),
                update_layer=upd * layer_p, update_embed=upd * embed_p, update_head=upd * head_p))
            alike[stage_key] = slots[-1]
        return slots

    def _shared_sync(self, layout: Layout, mesh: np.ndarray) -> float:
        """Moving the shared parameters' gradients between stages: Megatron all-reduces a tied
        embedding's between the first and last stage; hetjax passes embedding and head
        gradients around the ring of stages (pp - 1 hops)."""
        m, g = self.model, self.state_bytes.g
        if layout.pp == 1 or layout.folded:  # folded: both ends on device 0, nothing moves
            return 0.0
        if layout.uniform:
            # a uniform layout's sync depends on its mesh alone, which layouts of every
            # micro-batch count, schedule and ZeRO point share (the mesh is kept with the
            # value, so its id is not reused while cached)
            got = self._shared.get(id(mesh))
            if got is None or got[0] is not mesh:
                got = self._shared[id(mesh)] = (mesh, self._uniform_shared_sync(layout, mesh))
            return got[1]
        if not m.tie_embeddings:  # (only the MPMD executor runs stages of different shapes)
            return 0.0
        first, last = (layout.stage_mesh(s).ravel() for s in (0, layout.pp - 1))
        n = max(len(first), len(last))
        pairs = np.stack([first[np.arange(n) % len(first)],
                          last[np.arange(n) % len(last)]], axis=1)
        shards = min(layout.stage_shape(0)[1], layout.stage_shape(layout.pp - 1)[1])
        return self.transfer(m.embed_params / shards * g, pairs)[0]

    def _uniform_shared_sync(self, layout: Layout, mesh: np.ndarray) -> float:
        """`_shared_sync` of a layout whose stages share one shape (pp > 1, not folded)."""
        m, tp, g = self.model, layout.tp, self.state_bytes.g
        if self.pipelined_by_spmd(layout):
            ring = np.stack([mesh.reshape(layout.pp, -1),
                             np.roll(mesh.reshape(layout.pp, -1), -1, axis=0)], axis=-1)
            nbytes = (m.embed_params + m.head_params) / tp * g
            return (layout.pp - 1) * self.transfer(nbytes, ring.reshape(-1, 2))[0]
        if not m.tie_embeddings:
            return 0.0
        pairs = np.stack([mesh[0].ravel(), mesh[-1].ravel()], axis=1)
        if self.options.executor == "mpmd":  # each side sends its gradient to the other
            return self.transfer(m.embed_params / tp * g, pairs)[0]
        return self.collective("all_reduce", m.embed_params / tp * g, pairs)

    @staticmethod
    def _positions(layout: Layout) -> list[tuple[bool, bool, float]]:
        """What a stage placed at each position depends on there: whether it runs the first
        chunk, the last, and the micro-batches it keeps in flight."""
        pp = layout.pp
        if layout.folded:  # device 0 runs the first chunk and the last (the head)
            live = in_flight_folded(layout.schedule, pp, layout.microbatches)
            return [(p == 0, p == 0, live[p]) for p in range(pp)]
        live = in_flight(layout.schedule, pp, layout.microbatches)
        return [(p == 0, p == pp - 1, live[p]) for p in range(pp)]

    def _placed_as(self, slot: "_Slot", first: bool, last: bool, live: float, shared: float
                   ) -> StageCost:
        # A placed stage depends on its slot, whether it runs the first or the last chunk, the
        # micro-batches it keeps in flight and the shared gradients' sync, nothing else of its
        # position or layout: memoised on those (most positions of a deep pipeline, and other
        # layouts' tables over the same slots, repeat them). The slots are kept in
        # _stage_slot_cache, so their ids are not reused while cached.
        key = (id(slot), first, last, live, shared)
        cost = self._placed.get(key)
        if cost is None:
            cost = self._placed[key] = self._place_new(slot, first, last, live, shared)
        return cost

    def _place_new(self, slot: "_Slot", first: bool, last: bool, live: int, shared: float
                   ) -> StageCost:
        embed = first or slot.shared_everywhere
        head = last or slot.shared_everywhere
        return StageCost(
            fwd_layer=slot.fwd_layer, bwd_layer=slot.bwd_layer,
            fwd_fixed=(slot.head_fwd if last else 0.0) + (slot.embed_fwd if first else 0.0)
            + slot.zero_edge_fwd,
            bwd_fixed=(slot.head_bwd if last else 0.0) + (slot.embed_bwd if first else 0.0)
            + slot.zero_edge_bwd,
            sync_layer=slot.sync_layer,
            sync_fixed=(slot.embed_sync if embed else 0.0) + (slot.head_sync if head else 0.0)
            + (shared if slot.shared_everywhere or first or last else 0.0),
            mem_slot=slot.mem_slot + slot.stash * live, mem_layer=slot.act_layer * live,
            stash_slot=slot.stash * live, stash_fixed=slot.stash_out * live,
            mem_fixed=slot.mem_base + slot.stash_out * live + (slot.embed_mem if embed else 0.0)
            + (slot.head_mem if head else 0.0) + (slot.logits if last else 0.0),
            capacity=slot.capacity, label=slot.label,
            padded=self.options.executor != "mpmd",
            update_slot=slot.update_layer,
            update_fixed=(slot.update_embed if embed else 0.0)
            + (slot.update_head if head else 0.0),
            refresh_layer=slot.refresh_layer, overlap=slot.overlap,
            refresh_fixed=(slot.embed_refresh if embed else 0.0)
            + (slot.head_refresh if head else 0.0),
            reserve=slot.reserve, mem_measured=slot.mem_measured, source=slot.source,
            spread=slot.spread, distance=slot.distance, notes=slot.notes,
            comm_layer=slot.comm_layer)

    @staticmethod
    def down_share(stages: Sequence[StageCost], layers: Sequence[int]) -> list[float]:
        """Folded: the part of each device's forward in its down chunk (ceil(n / 2) of its n
        layers; the head, on device 0, is in its up chunk)."""
        return [c.fwd_layer * ((n + 1) // 2) / c.fwd(n) if c.fwd(n) else 0.5
                for c, n in zip(stages, layers)]

    def stage_costs(self, layout: Layout) -> list[StageCost]:
        """Per-position costs of `layout` (position s = mesh row s)."""
        shared = self._shared_sync(layout, layout.mesh() if layout.uniform else None)
        return [self._placed_as(slot, *at, shared)
                for slot, at in zip(self._slots(layout), self._positions(layout))]

    def stage_table(self, layout: Layout) -> "StageTable":
        """table[i][p]: mesh row i's stage placed at pipeline position p (for reordering
        stages; the shared gradients' sync is priced on the layout's own order)."""
        return StageTable(self, layout, self._slots(layout), self._shared_sync(
            layout, layout.mesh() if layout.uniform else None))

    def boundary_times(self, layout: Layout) -> tuple[list[float], list[str]]:
        """Seconds to move one micro-batch's activation (or its gradient) across each stage
        boundary, and the link it crosses."""
        if not layout.uniform:
            return self._reshard_times(layout)
        mesh = layout.mesh()
        row = self.model.d_model / layout.tp
        nbytes = layout.tokens_per_device() * self.model.d_model * self.act_bytes / layout.tp
        packed = layout.tokens_per_device() * (row + 4)  # int8 codes + one fp32 scale a row
        if self._boundaries.get(id(mesh), (None,))[0] is not mesh:
            # the links of each boundary depend on the mesh alone, which layouts share (the
            # mesh is kept with them, so its id is not reused while cached), and their times
            # on the bytes moved as well (memoised per bytes: layouts of every schedule and
            # ZeRO point move the same)
            links = []
            for s in range(layout.pp - 1):
                pairs = np.stack([mesh[s].ravel(), mesh[s + 1].ravel()], axis=1)
                crosses = (self.options.boundary_codec == "int8" and bool(
                    (self._cluster[pairs[:, 0]] != self._cluster[pairs[:, 1]]).any()))
                links.append((crosses, self.network.net(pairs)))
            self._boundaries[id(mesh)] = (mesh, links, {})
        _, links, priced = self._boundaries[id(mesh)]
        if (nbytes, packed) not in priced:
            times, kinds = [], []
            for crosses, net in links:
                t, lk = self.network.transfer_on(net, packed if crosses else nbytes)
                times.append(t)
                kinds.append(lk.kind)
            priced[nbytes, packed] = (times, kinds)
        times, kinds = priced[nbytes, packed]
        return list(times), list(kinds)

    def _reshard_times(self, layout: Layout) -> tuple[list[float], list[str]]:
        """`boundary_times` between stages of different (dp, tp) shapes: a micro-batch's
        activation (B / M sequences) is cut anew for the next stage's devices, each sender
        sending its share to the receivers paired with it in turn (the more numerous side's
        devices each in one pair), all pairs at once."""
        M, d = layout.microbatches, self.model.d_model
        rows = layout.global_batch / M * layout.seq_len
        times, kinds = [], []
        for s in range(layout.pp - 1):
            a, b = (layout.stage_mesh(x).ravel() for x in (s, s + 1))
            n = max(len(a), len(b))
            pairs = np.stack([a[np.arange(n) % len(a)], b[np.arange(n) % len(b)]], axis=1)
            crosses = (self.options.boundary_codec == "int8" and bool(
                (self._cluster[pairs[:, 0]] != self._cluster[pairs[:, 1]]).any()))
            nbytes = rows * ((d + 4) if crosses else d * self.act_bytes) / n
            t, lk = self.transfer(nbytes, pairs)
            times.append(t)
            kinds.append(lk.kind)
        return times, kinds

    def dp_link_kinds(self, layout: Layout) -> list[str]:
        return [min(self.group_links(m.T), key=lambda lk: lk.bandwidth_gbps).kind
                if m.shape[0] > 1 else "-" for m in self.stage_meshes(layout)]

    def _label(self, clusters: np.ndarray) -> str:
        """The clusters (indices) and accelerators of a stage, for display."""
        names = sorted(self.topology.clusters[c].name for c in clusters)
        accs = sorted({self._cluster_accel[c].name for c in clusters})
        shown = ",".join(names[:3]) + (f",+{len(names) - 3}" if len(names) > 3 else "")
        return f"{shown} ({'/'.join(accs)})"

    # --- a whole plan ----------------------------------------------------------------------------
    def predict(self, plan: Plan, with_events: bool = False):
        """Simulated step time, throughput, MFU, bubble and memory of `plan`.

        Returns a Prediction, or (Prediction, Simulation) with `with_events`."""
        layout = Layout.of(plan)
        stages = self.stage_costs(layout)
        send, pp_links = self.boundary_times(layout)
        layers = plan.stage_layers
        fwd = [c.fwd(n) for c, n in zip(stages, layers)]
        bwd = [c.bwd(n) for c, n in zip(stages, layers)]
        sim = simulate(plan.schedule, plan.microbatches, fwd, bwd, send, send,
                       self.exposed_sync(layout, stages, layers, fwd, bwd), 0.0,
                       lockstep=self.runs_in_lockstep(layout), placement=layout.placement,
                       down_share=self.down_share(stages, layers) if layout.folded else (),
                       update=[c.update(n, max(layers)) for c, n in zip(stages, layers)],
                       events=with_events)
        tokens = plan.global_batch * plan.seq_len
        lmax = max(layers)
        step = float(sim.step_time)
        pred = Prediction(
            step_time=step, tokens_per_s=tokens / step,
            mfu=self.model.flops_per_token(plan.seq_len) * tokens / step /
            self._peak(plan.device_order),
            bubble=float(sim.bubble), stage_time=_floats(c.time(n) for c, n in zip(stages, layers)),
            stage_idle=_floats(sim.stage_idle),
            stage_memory=_floats(c.memory(n, lmax) for c, n in zip(stages, layers)),
            stage_capacity=_floats(c.capacity for c in stages),
            sync_exposed=_floats(sim.sync_exposed),
            padding_bytes=float(max(c.memory(n, lmax) - c.memory(n, n)
                                    for c, n in zip(stages, layers))),
            dp_links=tuple(self.dp_link_kinds(layout)), pp_links=tuple(pp_links),
            stage_reserve=_floats(c.reserve.device_bytes(c.memory(n, lmax)) - c.memory(n, lmax)
                                  for c, n in zip(stages, layers)),
            memory_margin=1.0 - self.options.memory_fraction, **self._band(stages, step))
        return (pred, sim) if with_events else pred

    def _peak(self, ranks: Sequence[int]) -> float:
        """The ranks' summed peak FLOP/s, added in their order."""
        return sum(self._rank_peaks[r] for r in ranks)

    @functools.cached_property
    def _rank_peaks(self) -> list[float]:
        # each rank's peak, looked up once per cost model (asking the topology for each of
        # 4,096 ranks took a tenth of a prediction)
        return [self.topology.accelerator_of(r).peak_tflops * 1e12
                for r in range(self.topology.num_devices)]

    def exposed_sync(self, layout: Layout, stages: Sequence[StageCost], layers: Sequence[int],
                     fwd: Sequence[float], bwd: Sequence[float]) -> list[float]:
        """Each stage's once-a-step ZeRO / data-parallel traffic left on the critical path.

        hetjax's SPMD executor in lockstep reduces after its loop: nothing hides. Otherwise
        the gradients are synchronised in buckets, one per layer (and one for the embedding
        and head), each as soon as the last micro-batch's backward has produced it, so all
        but the last bucket may hide behind that backward (`bwd`, up to
        CostOptions.overlap of it); the parameter refresh after the update overlaps the next
        step's first forward under Megatron-LM / AMSP (prefetched per layer), and is exposed
        under hetjax's executors (the next step's program starts after it)."""
        sync = [c.sync(n) for c, n in zip(stages, layers)]
        refresh = [c.refresh(n) for c, n in zip(stages, layers)]
        if self.runs_in_lockstep(layout):
            return [x + r for x, r in zip(sync, refresh)]
        out = []
        for c, x, r, n, f, b in zip(stages, sync, refresh, layers, fwd, bwd):
            hidden = exposed(x, b, c.overlap * n / (n + 1))
            out.append(hidden + (exposed(r, f, c.overlap) if self.options.executor == "megatron"
                                 else r))
        return out

    @staticmethod
    def _band(stages: Sequence[StageCost], step: float) -> dict[str, Any]:
        sources = sorted({c.source for c in stages})
        source = sources[0] if len(sources) == 1 else " / ".join(sources)
        distance = max(c.distance for c in stages)
        spread = max(c.spread for c in stages)
        measured = all(c.mem_measured for c in stages)
        return dict(step_band=step * band.step_band(source, spread, distance),
                    memory_band=band.memory_band(measured, spread), compute_source=source,
                    extrapolation=distance,
                    compute_notes=tuple(dict.fromkeys(n for c in stages for n in c.notes)))


# What a stage's slots depend on besides its device order: every field of the layout that
# takes part in its equality but its schedule (`CostModel._slots`)
_SLOT_FIELDS = tuple(f.name for f in dataclasses.fields(Layout)
                     if f.compare and f.name not in ("schedule", "device_order"))


class StageTable:
    """Stage costs by (mesh row, pipeline position), placed on demand: a search over stage
    orders looks at few of the pp x pp entries."""

    def __init__(self, model: CostModel, layout: Layout, slots: list[_Slot], shared: float):
        self._model, self._layout, self._slots, self._shared = model, layout, slots, shared
        self._positions = model._positions(layout)

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, slot: int) -> "_TableRow":
        return _TableRow(self, slot)

    def __iter__(self):
        return (_TableRow(self, i) for i in range(len(self)))

    @property
    def key(self) -> tuple:
        """Equal for two tables of one cost model whose every entry is equal: an entry is
        `CostModel._placed_as` of its slot object and what its position means for it (first
        or last chunk, micro-batches in flight) and the shared gradients' sync. The slots are
        kept in the cost model's caches for its life, so their ids are not reused meanwhile."""
        return tuple(map(id, self._slots)), tuple(self._positions), self._shared

    def cost(self, slot: int, position: int) -> StageCost:
        # (the cost model memoises placed stages: nothing to keep here)
        return self._model._placed_as(self._slots[slot], *self._positions[position],
                                      self._shared)


class _TableRow:
    """One mesh row of a StageTable (a plain class: the partition makes one per lookup)."""

    __slots__ = ("table", "slot")

    def __init__(self, table: StageTable, slot: int):
        self.table, self.slot = table, slot

    def __getitem__(self, position: int) -> StageCost:
        return self.table.cost(self.slot, position)


def _floats(xs) -> tuple[float, ...]:
    return tuple(float(x) for x in xs)






__all__ = ["CostModel", "CostOptions", "SharedPrices", "PRICED_EXECUTORS", "LayerProfile", "ComputeCurve", "StageCost",
           "Prediction", "DEFAULT_EFFICIENCY"]

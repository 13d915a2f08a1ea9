"""The calibration file: what `hetjax calibrate` (hetjax/measure.py) measured on a job's devices.

`Calibration` holds the measurements -- the model's block, head and optimizer update per
accelerator kind, collectives per link class -- fits a `ComputeCurve` per kind and a `LinkFit`
per link class and operation (`options()`), compares measured with modelled times
(`describe`, `plot_calibration`) and is the JSON file `planner.calibration` names. The
testbed's benches (scripts/bench/het*.py) calibrate with it like a user would. The fits on
published runs are hetjax/planner/reference_runs.py's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hetjax.errors import PlanError, TopologyValueError
from hetjax.planner import compute as ck
from hetjax.planner.compute_profile import ComputeProfile, ProfileRow
from hetjax.planner.cost import DEFAULT_EFFICIENCY, ComputeCurve, CostModel, CostOptions
from hetjax.planner.fit_range import FitRange, link_kinds
from hetjax.planner.network import LinkFit
from hetjax.core.topology import Topology, topology_from_dict

if TYPE_CHECKING:
    from hetjax.core.model_config import ModelConfig


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
    bytes in `fwd_s`. `spread`: the repeated samples' (max - min) / mean (0: not kept)."""

    kind: str
    batch: int
    seq_len: int
    fwd_s: float
    bwd_s: float
    peak_tflops: float = 0.0
    part: str = "block"
    params: int = 0
    spread: float = 0.0
    # "staged:<policy>": bytes per device the forward keeps for the backward, and the
    # backward's peak beyond the parameters (kept + incoming gradient + temporaries); 0: not
    # measured
    kept_bytes: float = 0.0
    peak_bytes: float = 0.0


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
    # compute profile rows measured beyond the block rows: the layer at TP degrees > 1, with
    # peak and kept bytes (hetjax/planner/compute_profile.py)
    profile_rows: tuple[ProfileRow, ...] = ()

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

    def profile(self) -> ComputeProfile | None:
        """The measurements as a compute profile: each "block" row a layer at tp 1 (no
        recompute), each "staged:<policy>" row the layer as the pipelines run it under that
        policy, each "head" row the head (with the embedding: measured together), and the
        profile rows measured at other TP degrees. None without compute rows."""
        rows = list(self.profile_rows)
        for r in self.compute:
            staged = r.part.startswith(STAGED)
            if r.part not in ("block", "head") and not staged:
                continue
            rows.append(ProfileRow(
                accelerator=r.kind, piece="head" if r.part == "head" else "layer", tp=1,
                tokens=r.batch * r.seq_len, seq_len=r.seq_len, fwd_s=r.fwd_s, bwd_s=r.bwd_s,
                recompute=r.part[len(STAGED):] if staged else "none", spread=r.spread,
                pipelined=staged, kept_bytes=r.kept_bytes, peak_bytes=r.peak_bytes))
        if not rows:
            return None
        return ComputeProfile(tuple(rows), ComputeProfile.of_model(self.model),
                              f"hetjax calibrate on {self.topology.name}")

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
                                   link_fits=self.link_fits(), profile=self.profile(), **extra)

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
                "profile_rows": [dataclasses.asdict(r) for r in self.profile_rows],
                "fitted": {"curves": {k: dataclasses.asdict(c) for k, c in self.curves().items()},
                           "link_fits": {k: {op: dataclasses.asdict(f) for op, f in v.items()}
                                         for k, v in self.link_fits().items()},
                           "kernel_rates": {k: dataclasses.asdict(r)
                                            for k, r in self.kernel_rates().items()}}}

    @staticmethod
    def from_dict(d: dict) -> "Calibration":
        """A calibration from its file's JSON; every value is checked (`_checked`) before
        anything is built from it, a bad one named by its JSON path."""
        from hetjax.core.model_config import ModelConfig

        try:
            if not isinstance(d, dict):
                raise TypeError(f"the file holds a JSON {type(d).__name__}, not an object")
            if d.get("version") != CALIBRATION_VERSION:
                raise KeyError(f"version {d.get('version')!r}")
            try:
                topology = topology_from_dict(d["topology"])
            except TopologyValueError as e:
                raise _Malformed(f"topology.{e.where}: {e.problem}") from None
            d = _checked(d, topology.num_devices)
            return Calibration(
                topology, ModelConfig(**d["model"]),
                tuple(ComputeRow(**r) for r in d["compute"]),
                tuple(LinkRow(r["op"], int(r["nbytes"]), tuple(map(tuple, r["groups"])),
                              float(r["seconds"])) for r in d["links"]),
                int(d.get("processes", 1)), str(d.get("collectives", "")),
                tuple(ProfileRow(**r) for r in d.get("profile_rows", ())))
        except _Malformed as e:
            raise PlanError(f"not a hetjax calibration file ({e}); write one with "
                            "'hetjax calibrate'") from None
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise PlanError(f"not a hetjax calibration file ({type(e).__name__}: {e}); write "
                            "one with 'hetjax calibrate'") from None


# --- checking a calibration file before anything is built from it ------------------------------
# A file larger than this is refused unread (hetjax calibrate writes tens of kB).
MAX_CALIBRATION_BYTES = 64 * 2**20
MAX_COUNT = 2**53  # token counts, parameters and bytes: exact as floats
MODEL_SIZES = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
               "max_seq_len")
# What each compute part divides by (ComputeRow's docstring): those values must be > 0.
_TIMED = ("block", "head")  # and the staged parts
_SIZED = ("matmul", "memory")  # and the attention parts


class _Malformed(ValueError):
    """A value of a calibration file at a JSON path is unusable (the message names it)."""


def _number(v, where: str, positive: bool) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Malformed(f"{where}: must be a finite number, got {v!r}")
    try:  # an integer too large for a float (JSON allows any number of digits) is refused too
        finite = math.isfinite(v)
    except OverflowError:
        finite, v = False, f"a number of {len(str(v))} digits"
    if not finite:
        raise _Malformed(f"{where}: must be a finite number, got {v}")
    if v < 0 or (positive and v == 0):
        raise _Malformed(f"{where}: must be {'> 0' if positive else '>= 0'}, got {v}")
    return float(v)


def _whole(v, where: str, positive: bool) -> int:
    _number(v, where, positive)
    if v != int(v) or v > MAX_COUNT:
        raise _Malformed(f"{where}: must be a whole number up to 2**53, got {v}")
    return int(v)


def _list(d: dict, key: str, where: str = "") -> list:
    v = d[key]
    if not isinstance(v, list):
        raise _Malformed(f"{where}{key}: must be a list, got {type(v).__name__}")
    return v


def _fields(r, where: str, cls) -> dict:
    if not isinstance(r, dict):
        raise _Malformed(f"{where}: must be an object, got {type(r).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(map(str, r)) - names)
    if extra:
        raise _Malformed(f"{where}.{extra[0]}: is not a field of a {cls.__name__}")
    return r


def _checked(d: dict, n_devices: int) -> dict:
    """`d` (a calibration file's JSON) when every value can be used: the model's sizes whole
    and > 0, each compute row's times > 0 where the fits divide by them, each collective's
    groups equal-sized lists of ranks of the topology; else `_Malformed` naming the value."""
    from hetjax.core.model_config import ModelConfig

    model = _fields(d["model"], "model", ModelConfig)
    for key in MODEL_SIZES:
        if key in model:
            _whole(model[key], f"model.{key}", positive=True)
    for i, r in enumerate(_list(d, "compute")):
        where = f"compute[{i}]"
        r = _fields(r, where, ComputeRow)
        part = r.get("part", "block")
        if not isinstance(part, str) or not (part in _TIMED + _SIZED + ("update",) or
                                              part.startswith((STAGED, "attention:"))):
            raise _Malformed(f"{where}.part: {part!r} is not a part hetjax calibrate measures")
        if not isinstance(r.get("kind"), str):
            raise _Malformed(f"{where}.kind: must be an accelerator name, got {r.get('kind')!r}")
        timed = part in _TIMED or part.startswith(STAGED)
        sized = part in _SIZED or part.startswith("attention:")
        _number(r.get("fwd_s"), f"{where}.fwd_s", positive=True)
        _number(r.get("bwd_s"), f"{where}.bwd_s", positive=timed)
        shaped = timed or sized and part != "memory"  # its batch, length and peak are used
        _number(r.get("peak_tflops", 0.0), f"{where}.peak_tflops", positive=shaped)
        for key in ("batch", "seq_len"):
            _whole(r.get(key), f"{where}.{key}", positive=shaped)
        _whole(r.get("params", 0), f"{where}.params", positive=sized)
        for key in ("spread", "kept_bytes", "peak_bytes"):
            _number(r.get(key, 0.0), f"{where}.{key}", positive=False)
    for i, r in enumerate(_list(d, "links")):
        where = f"links[{i}]"
        r = _fields(r, where, LinkRow)
        if r.get("op") not in OPS_MEASURED:
            raise _Malformed(f"{where}.op: {r.get('op')!r} is not one of "
                             f"{', '.join(OPS_MEASURED)}")
        _whole(r.get("nbytes"), f"{where}.nbytes", positive=True)
        _number(r.get("seconds"), f"{where}.seconds", positive=True)
        groups = _list(r, "groups", f"{where}.")
        sizes = {len(g) if isinstance(g, list) else -1 for g in groups}
        if not groups or len(sizes) != 1 or min(sizes) < 1:
            raise _Malformed(f"{where}.groups: must be a non-empty list of equal-sized lists "
                             "of ranks")
        for j, g in enumerate(groups):
            for k, rank in enumerate(g):
                _whole(rank, f"{where}.groups[{j}][{k}]", positive=False)
                if rank >= n_devices:
                    raise _Malformed(f"{where}.groups[{j}][{k}]: rank {rank} is not one of "
                                     f"the topology's {n_devices} devices")
    profile = d.get("profile_rows", [])
    if not isinstance(profile, list):
        raise _Malformed(f"profile_rows: must be a list, got {type(profile).__name__}")
    for i, r in enumerate(profile):  # types here; ProfileRow checks its own bounds
        where = f"profile_rows[{i}]"
        r = _fields(r, where, ProfileRow)
        for key in ("tp", "tokens", "seq_len"):
            _whole(r.get(key), f"{where}.{key}", positive=False)
        for key in ("fwd_s", "bwd_s", "peak_bytes", "kept_bytes", "spread"):
            _number(r.get(key, 0.0), f"{where}.{key}", positive=False)
    _whole(d.get("processes", 1), "processes", positive=True)
    return d


def calibration_range(cal: Calibration, path: str = "") -> FitRange:
    return FitRange(f"hetjax calibrate{' ' + path if path else ''}",
                    (cal.model.num_params,) * 2, (cal.topology.num_devices,) * 2,
                    link_kinds(cal.topology),
                    tuple(sorted({c.accelerator.name for c in cal.topology.clusters})))


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
        with open(path, "rb") as f:
            data = f.read(MAX_CALIBRATION_BYTES + 1)
        if len(data) > MAX_CALIBRATION_BYTES:
            raise ValueError(f"larger than {MAX_CALIBRATION_BYTES // 2**20} MiB, which no "
                             "calibration is")
        d = json.loads(data)
    except RecursionError:
        raise PlanError(f"cannot read the calibration file {path!r} (lists or objects nested "
                        "deeper than a calibration ever is); write one with 'hetjax "
                        "calibrate'") from None
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


__all__ = ["Calibration", "ComputeRow", "LinkRow", "OPS_MEASURED", "STAGED", "calibration_range",
           "topology_mismatch", "load_calibration", "save_calibration", "plot_calibration"]

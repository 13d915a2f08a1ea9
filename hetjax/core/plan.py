"""The Plan: the complete training layout, as plain data.

A Plan says how many pipeline stages, data-parallel replicas and tensor-parallel shards to use
(one shape for every stage, or each stage its own under the MPMD executor: `stage_shapes`),
which topology ranks sit at each (stage, replica, shard) position (`device_order`, possibly a
subset of the topology's ranks: the others stay idle), how many layers each stage runs, how the
batch is cut into micro-batches, which schedule runs them and how the model states are
ZeRO-sharded. It may carry the planner's predictions (and why it left devices out).
Everything downstream (mesh, shardings, pipeline, NIC environment, trainer) reads only a Plan
and a Topology; a Plan is saved as JSON next to checkpoints.

`resolve_schedule` is the one place a plan becomes a schedule object (of the registry in
`hetjax.core.schedules`). This module is a leaf: it imports only the topology, the errors, the
units, the schedule registry and the executor registry's names (`hetjax.core.registry`; none of
them imports JAX). Turning a config into a
Plan is the planner's (`hetjax.planner.plan_from_config`). A `DilocoPlan` is a plan of plans:
each DiLoCo site's Plan and the exchange between the sites (`hetjax.planner.diloco_pricing.plan_sites`
builds it, the DiLoCo executor runs it).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from hetjax.errors import ConfigError, PlanError
from hetjax.units import gib, percent, seconds
from hetjax.core.topology import Topology
from hetjax.core.schedules import SCHEDULES, Schedule, folded, make_schedule, spmd_schedules
from hetjax.core.registry import EXECUTORS  # the pipeline executors a Plan can name

# The mesh a Plan lays its devices on, slowest axis first (parallel/mesh.py builds it): the
# data-parallel devices of a stage are factored into ('dp', 'dp_os', 'dp_p', 'expert'), with
# sizes dp / (s_os ep), s_os / s_p, s_p and ep. 'expert' (expert parallelism, an MoE model's
# experts split over it) is the innermost: an expert-parallel group is ep neighbouring
# data-parallel devices, on the fastest links after tensor parallelism. The batch is split over
# all four; DP_AXES names the replicas every parameter but the experts is reduced over
# (the experts' own data-parallel group); with ep = 1 they are all data-parallel devices.
MESH_AXES = ("pp", "dp", "dp_os", "dp_p", "expert", "tp")
DP_AXES = ("dp", "dp_os", "dp_p")
EXPERT_AXIS = "expert"


# The key of `Plan.predicted` that says why the planner left devices out: {rank (a string in
# JSON): reason}; `Plan.unused_reasons` reads it, `describe()` shows it.
UNUSED_KEY = "unused"


# Where a pipeline's model chunks live (parallel/pipeline.py): "looped", one chunk per stage in
# model order; "folded", two chunks per device in a V (DHelix's W, ZB-V's V): layers go down the
# devices and back up, so device 0 holds the first chunk (embedding) and the last (head).
PLACEMENTS = ("looped", "folded")


@dataclass(frozen=True)
class ZeroFactors:
    """AMSP sharding factors over the data-parallel devices of a stage.

    s_p, s_g, s_os: how many devices each of parameters, gradients and optimizer states is
    sharded over (1 = replicated, dp = fully sharded).
    """

    s_p: int = 1
    s_g: int = 1
    s_os: int = 1
    name: str = "ddp"


@dataclass(frozen=True)
class ZeroAxes:
    """The mesh axes P, G and OS shard over for one point; axes of size 1 are left out."""

    p: tuple[str, ...]
    g: tuple[str, ...]
    os: tuple[str, ...]

    @staticmethod
    def of(z: ZeroFactors) -> "ZeroAxes":
        p = ("dp_p",) if z.s_p > 1 else ()
        os = p + (("dp_os",) if z.s_os > z.s_p else ())
        return ZeroAxes(p=p, g=p if z.s_g == z.s_p else os, os=os)

    @property
    def replica(self) -> tuple[str, ...]:
        """Data-parallel axes an OS shard is replicated over (summed once per step)."""
        return tuple(a for a in DP_AXES if a not in self.os)


@dataclass(frozen=True)
class Plan:
    pp: int
    dp: int
    tp: int
    stage_layers: tuple[int, ...]
    microbatches: int
    global_batch: int  # sequences per step
    seq_len: int
    schedule: str = "1f1b"
    zero: ZeroFactors = ZeroFactors()
    # How a pipeline runs (pp > 1): "spmd", one shard_map program whose stages advance in
    # lockstep ticks, or "mpmd", one program per stage, stages running asynchronously.
    executor: str = "spmd"
    placement: str = "looped"  # one of PLACEMENTS
    # Recompute policy the planner chose for model.remat = 'auto' (none | dots | full); empty:
    # the model's own model.remat.
    remat: str = ""
    # The topology ranks the plan uses, stage after stage, each stage's dp_s x tp_s ranks in
    # (replica, shard) order: with one shape, reshape(pp, dp, tp)[s, d, t] is the rank at stage
    # s, data-parallel replica d, tensor shard t (`mesh_ranks`); `stage_mesh(s)` in general.
    # Distinct ranks, possibly a subset of the topology's: the rest are left out (idle).
    # Default: the first `num_devices` ranks in rank order.
    device_order: tuple[int, ...] = ()
    source: str = "config"  # "config" (fixed by the user) or "planner"
    # Expert parallelism (MoE models): the dp data-parallel devices of a stage form dp / ep
    # groups of ep neighbours, each group holding all experts, each device n_experts / ep.
    ep: int = 1
    predicted: dict[str, Any] = field(default_factory=dict, compare=False)
    # Each stage's (dp_s, tp_s) when the stages' shapes differ (only the MPMD executor runs
    # that: `stage_shape_problems`); empty: every stage (dp, tp). Then `dp` and `tp` are stage
    # 0's (given as 0 they are filled from it); a reader that needs every stage uses
    # `stage_shape(s)`. Shapes that are all equal are stored as () (one shape).
    stage_shapes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        shapes = tuple((int(d), int(t)) for d, t in self.stage_shapes)
        if shapes:
            if len(shapes) != self.pp:
                raise ValueError(f"stage_shapes gives {len(shapes)} stages' (dp, tp) but pp = "
                                 f"{self.pp}")
            if any(d < 1 or t < 1 for d, t in shapes):
                raise ValueError(f"every stage needs dp >= 1 and tp >= 1, got {list(shapes)}")
            for name, value, first in (("dp", self.dp, shapes[0][0]),
                                       ("tp", self.tp, shapes[0][1])):
                if value and value != first:
                    raise ValueError(f"{name} = {value} but stage 0's is {first}: with "
                                     f"stage_shapes, {name} is stage 0's (or 0)")
            object.__setattr__(self, "dp", shapes[0][0])
            object.__setattr__(self, "tp", shapes[0][1])
            if len(set(shapes)) == 1:
                shapes = ()
        object.__setattr__(self, "stage_shapes", shapes)
        n = self.num_devices
        if not self.device_order:
            object.__setattr__(self, "device_order", tuple(range(n)))
        order = tuple(map(int, self.device_order))
        object.__setattr__(self, "device_order", order)
        if len(order) != n or len(set(order)) != n or min(order) < 0:
            raise ValueError(f"device_order must list {n} distinct topology ranks (the plan's "
                             f"{n} devices), got {len(order)} ({len(set(order))} distinct)")
        # What a Plan must be to exist at all (its other rules are `problems()`).
        bad = name_problems(self.executor, "", self.placement) + [
            p for p in [stage_count_problem(self.pp, self.stage_layers)] if p]
        if bad:
            raise ValueError(bad[0].message())

    def problems(self, topology: Topology | None = None, n_layers: int = 0,
                 model: Any = None) -> list["Problem"]:
        """Everything wrong with this plan as data (field, problem, fix), checked by the same
        rules as config validation and the planner (`layout_problems`): names, schedule and
        placement against the executor, per-stage shapes against the executor, ZeRO factors
        (against every stage's dp), micro-batch split (over every stage's dp), layers per
        stage (against the model's `n_layers` when given), every stage's tp against the
        `model`'s heads, kv heads and d_ff (anything with those attributes, when given), and
        its ranks against the `topology`'s devices when given (they exist; a plan may leave
        some of them out); the schedule only for a pipeline (pp > 1). Empty: the executor it
        names can run it."""
        out = layout_problems(
            pp=self.pp, dp=self.dp, tp=self.tp, stage_shapes=self.stage_shapes,
            stage_layers=self.stage_layers, n_layers=n_layers, microbatches=self.microbatches,
            global_batch=self.global_batch, executor=self.executor, placement=self.placement,
            # one stage runs as one program, whatever schedule it names (make_executor)
            schedule=self.schedule if self.pp > 1 else "", zero=self.zero, allow_auto=False,
            ep=self.ep)
        if model is not None:
            for tp in sorted({t for _, t in self.shapes()}):
                out += tp_problems(tp, model)
        if topology is not None:
            out += rank_problems(self.device_order, topology)
        return out

    # --- derived --------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        """Devices the plan uses (`len(device_order)`)."""
        return sum(d * t for d, t in self.shapes())

    @property
    def uniform(self) -> bool:
        """Every stage has the same (dp, tp) (`stage_shapes` empty)."""
        return not self.stage_shapes

    def shapes(self) -> tuple[tuple[int, int], ...]:
        """Every stage's (dp_s, tp_s)."""
        return self.stage_shapes or ((self.dp, self.tp),) * self.pp

    def stage_shape(self, s: int) -> tuple[int, int]:
        """Stage s's (dp_s, tp_s)."""
        return self.shapes()[s]

    def stage_mesh(self, s: int) -> np.ndarray:
        """(dp_s, tp_s) array of stage s's topology ranks."""
        dp, tp = self.stage_shape(s)
        start = sum(d * t for d, t in self.shapes()[:s])
        return np.asarray(self.device_order[start:start + dp * tp]).reshape(dp, tp)

    def used_ranks(self) -> list[int]:
        """The topology ranks the plan uses, in rank order."""
        return sorted(self.device_order)

    def unused_ranks(self, topology: Topology) -> list[int]:
        """The `topology`'s ranks the plan leaves out (idle), in rank order."""
        used = set(self.device_order)
        return [r for r in range(topology.num_devices) if r not in used]

    def unused_reasons(self) -> dict[int, str]:
        """Why the planner left each device out, from its predictions (`predicted['unused']`:
        rank, as a string in JSON -> reason); empty when it gave none."""
        return {int(r): why for r, why in self.predicted.get(UNUSED_KEY, {}).items()}

    @property
    def n_layers(self) -> int:
        return sum(self.stage_layers)

    @property
    def max_stage_layers(self) -> int:
        return max(self.stage_layers)

    def ep_replicas(self, s: int = 0) -> int:
        """Stage s's data-parallel devices as the executors split the batch for their
        per-device loss: dp_s / ep groups (an expert-parallel group shares its rows' loss;
        dp_s without expert parallelism)."""
        return self.stage_shape(s)[0] // self.ep

    @property
    def microbatch_size(self) -> int:
        """Sequences per micro-batch over the whole data-parallel group."""
        return self.global_batch // self.microbatches

    def mesh_ranks(self) -> np.ndarray:
        """(pp, dp, tp) array of topology ranks; only a plan whose stages share one shape has
        one (`stage_mesh(s)` is every plan's)."""
        if not self.uniform:
            raise PlanError(f"this plan's stages have different (dp, tp) shapes "
                            f"{list(self.stage_shapes)}: it has no (pp, dp, tp) mesh; read "
                            "each stage's with stage_mesh(s)")
        return np.asarray(self.device_order).reshape(self.pp, self.dp, self.tp)

    def stage_ranks(self, s: int) -> list[int]:
        return sorted(self.stage_mesh(s).ravel().tolist())

    def tp_groups(self) -> list[list[int]]:
        return [row.tolist() for s in range(self.pp) for row in self.stage_mesh(s)]

    def dp_groups(self) -> list[list[int]]:
        return [col.tolist() for s in range(self.pp) for col in self.stage_mesh(s).T]

    def ep_groups(self) -> list[list[int]]:
        """Expert-parallel groups: ep neighbouring data-parallel devices (the innermost data
        axis) of each stage and tensor shard."""
        out = []
        for s in range(self.pp):
            m = self.stage_mesh(s)
            out += [m[d:d + self.ep, t].tolist() for d in range(0, m.shape[0], self.ep)
                    for t in range(m.shape[1])]
        return out

    def pp_groups(self) -> list[list[int]]:
        """The ranks that pass activations on: with one shape, each (replica, shard)
        position's ranks down the stages; with per-stage shapes, each boundary's two stages'
        ranks (stage s and s + 1 reshard between their shapes)."""
        if self.uniform:
            r = self.mesh_ranks()
            return [r[:, d, t].tolist() for d in range(self.dp) for t in range(self.tp)]
        return [self.stage_ranks(s) + self.stage_ranks(s + 1) for s in range(self.pp - 1)]

    def layer_range(self, s: int) -> range:
        start = sum(self.stage_layers[:s])
        return range(start, start + self.stage_layers[s])

    def chunk_layers(self) -> tuple[tuple[int, int], ...]:
        """Folded placement: (down, up) layers of each device's two chunks. A device's
        `stage_layers[d]` split with the larger half going down: ceil(n / 2) in chunk d,
        floor(n / 2) in chunk 2 pp - 1 - d (a one-layer device has an empty up chunk)."""
        return tuple(((n + 1) // 2, n // 2) for n in self.stage_layers)

    def device_layers(self, s: int) -> tuple[int, ...]:
        """The model's layers device `s` holds, in its slot order. Looped: `layer_range(s)`.
        Folded: its down chunk's layers, then its up chunk's; model order is chunk 0 .. 2 pp - 1
        with chunk k on device k (k < pp) or 2 pp - 1 - k."""
        if self.placement == "looped":
            return tuple(self.layer_range(s))
        chunks = self.chunk_layers()
        sizes = [c[0] for c in chunks] + [c[1] for c in chunks[::-1]]
        starts = np.cumsum([0] + sizes)
        down, up = s, 2 * self.pp - 1 - s
        return (tuple(range(starts[down], starts[down + 1]))
                + tuple(range(starts[up], starts[up + 1])))

    # --- display and serialisation --------------------------------------------------------
    def stage_rows(self, topology: Topology | None = None) -> list[dict[str, str]]:
        """One row per stage: layers, ranks, clusters and, when predicted, time per
        micro-batch, memory per device and idle time per step."""
        pr = self.predicted
        rows = []
        for s in range(self.pp):
            ranks = self.stage_ranks(s)
            lr = self.layer_range(s)
            layers = (f"{lr.start}-{lr.stop - 1}" if len(lr) > 1 else str(lr.start)) + \
                f" ({len(lr)})"
            if self.placement == "folded":  # its down chunk's layers, then its up chunk's
                held = self.device_layers(s)
                down = self.chunk_layers()[s][0]
                layers = "+".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0])
                                  for r in (held[:down], held[down:]) if r) + f" ({len(held)})"
            row = {"stage": str(s), "layers": layers}
            if not self.uniform:  # each stage its own shape: a column for each degree
                row["dp"], row["tp"] = map(str, self.stage_shape(s))
            row["ranks"] = _fmt_ranks(ranks)
            if topology is not None:
                names = sorted({topology.cluster_of(r).name for r in ranks})
                row["clusters"] = ",".join(names) if len(names) <= 3 else \
                    f"{','.join(names[:2])},.. ({len(names)})"
            if "stage_time_s" in pr:
                row["time/micro-batch"] = _fmt_seconds(pr["stage_time_s"][s])
                need = pr["stage_memory_gib"][s]
                band = (f" ± {gib(need * pr['memory_band'] * 2**30)}"
                        if pr.get("memory_band") else "")
                row["memory / capacity"] = (f"{gib(need * 2**30)}{band} / "
                                            f"{gib(pr['stage_capacity_gib'][s] * 2**30)}")
                row["idle/step"] = _fmt_seconds(pr["stage_idle_s"][s])
            rows.append(row)
        return rows

    def group_lines(self, topology: Topology) -> list[str]:
        """The TP, DP and PP groups with the links they use (groups of one device have no
        traffic and are left out)."""
        lines = []
        for what, groups in (("tp", self.tp_groups()), ("dp", self.dp_groups()),
                             ("ep", self.ep_groups()), ("pp", self.pp_groups())):
            groups = [g for g in groups if len(g) > 1]
            if groups:
                sizes = sorted({len(g) for g in groups})
                kinds = sorted({topology.group_link(g).kind for g in groups})
                lines.append(f"{what} groups: {len(groups)} of {'/'.join(map(str, sizes))}, "
                             f"e.g. {_fmt_ranks(sorted(groups[0]))}; links: {', '.join(kinds)}")
        return lines

    def unused_lines(self, topology: Topology) -> list[str]:
        """The devices the plan leaves out, one line per run of consecutive ranks of one
        cluster and one reason: "unused: ranks 24-27 (l40s): <why>"."""
        reasons = self.unused_reasons()
        runs: list[tuple[list[int], str, str]] = []
        for r in self.unused_ranks(topology):
            key = (topology.cluster_of(r).name, reasons.get(r, ""))
            if runs and runs[-1][0][-1] == r - 1 and runs[-1][1:] == key:
                runs[-1][0].append(r)
            else:
                runs.append(([r], *key))
        return [f"unused: rank{'s' if len(ranks) > 1 else ''} {_fmt_ranks(ranks)} ({cluster})"
                + (f": {why}" if why else "") for ranks, cluster, why in runs]

    def summary_line(self) -> str:
        pr = self.predicted
        if "step_time_s" not in pr:
            return ""
        fits = "" if pr.get("fits", True) else " -- DOES NOT FIT in device memory"
        layout = f" ({pr['layout']})" if "layout" in pr else ""
        band = f" ± {_fmt_seconds(pr['step_band_s'])}" if pr.get("step_band_s") else ""
        source = f" (compute: {pr['compute_source']})" if "compute_source" in pr else ""
        line = (f"predicted{layout}: step {_fmt_seconds(pr['step_time_s'])}{band}{source}, "
                f"{pr['tokens_per_s']:,.0f} tokens/s, MFU {percent(pr['mfu'])}, "
                f"bubble {percent(pr['bubble'], 3)}{fits}")
        if pr.get("stage_reserve_gib") and max(pr["stage_reserve_gib"]) > 0:
            held = [m + r for m, r in zip(pr["stage_memory_gib"], pr["stage_reserve_gib"])]
            s = max(range(len(held)), key=held.__getitem__)
            line += (f"\n  a device holds up to {gib(held[s] * 2**30)}: the step's "
                     f"{gib(pr['stage_memory_gib'][s] * 2**30)} and the runtime reserve "
                     f"{gib(pr['stage_reserve_gib'][s] * 2**30)} (context, collective "
                     f"buffers, workspace, fragmentation), within a margin of "
                     f"{percent(pr.get('memory_margin', 0.0))}")
        return line

    def degrees(self) -> str:
        """The data- and tensor-parallel degrees in words: "dp=2 tp=1", or with per-stage
        shapes "dp,tp per stage: 1x2 2x1"."""
        if self.uniform:
            return f"dp={self.dp} tp={self.tp}"
        return "dp,tp per stage: " + " ".join(f"{d}x{t}" for d, t in self.stage_shapes)

    def header(self) -> str:
        z = self.zero
        executor = f"  executor={self.executor}" if self.pp > 1 else ""
        executor += f"  placement={self.placement}" if self.placement != "looped" else ""
        executor += f"  remat={self.remat}" if self.remat else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        return (f"plan ({self.source}): pp={self.pp} {self.degrees()}{ep}  "
                f"schedule={self.schedule}{executor}  micro-batches={self.microbatches} x "
                f"{self.microbatch_size} seq  zero={z.name} (s_p={z.s_p}, s_g={z.s_g}, "
                f"s_os={z.s_os})")

    def describe(self, topology: Topology | None = None) -> str:
        rows = self.stage_rows(topology)
        cols = list(rows[0])
        width = {c: max(len(c), *(len(r[c]) for r in rows)) + 2 for c in cols}
        lines = [self.header(), "  " + "".join(f"{c:<{width[c]}}" for c in cols).rstrip()]
        lines += ["  " + "".join(f"{r[c]:<{width[c]}}" for c in cols).rstrip() for r in rows]
        if topology is not None:
            lines += ["  " + g for g in self.group_lines(topology)]
            lines += ["  " + u for u in self.unused_lines(topology)]
        if self.summary_line():
            lines.append("  " + self.summary_line())
        if "executor_choice" in self.predicted:
            lines.append("  executor: " + self.predicted["executor_choice"])
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html

        rows = self.stage_rows()
        cols = list(rows[0])
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(r[c])}</td>" for c in cols) +
                       "</tr>" for r in rows)
        summary = self.summary_line()
        return (f"<p><b>{html.escape(self.header())}</b></p>"
                f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                + (f"<p>{html.escape(summary)}</p>" if summary else ""))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not self.stage_shapes:  # one shape: the JSON of a plan without per-stage shapes
            del d["stage_shapes"]
        if self.ep == 1:  # no expert parallelism: the JSON of a plan without it
            del d["ep"]
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Plan":
        d = dict(d)
        d["zero"] = ZeroFactors(**d.get("zero", {}))
        d["stage_layers"] = tuple(d["stage_layers"])
        d["device_order"] = tuple(d.get("device_order", ()))
        d["stage_shapes"] = tuple(tuple(x) for x in d.get("stage_shapes", ()))
        return Plan(**d)

    @staticmethod
    def from_json(text: str) -> "Plan":
        return Plan.from_dict(json.loads(text))


def _fmt_ranks(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    if len(ranks) > 8:  # a long scattered group: its start and its size
        return ",".join(map(str, ranks[:4])) + f",.. ({len(ranks)} ranks)"
    return ",".join(map(str, ranks))


def comparison_rows(plans: list["Plan"]) -> list[dict[str, str]]:
    """One row per plan (e.g. the planner's choice and its runners-up): layout and prediction.
    Recompute, placement, the number of devices used and device order get a column only where
    the plans differ in them, so two rows never look alike while their predictions differ."""
    extra = {"remat": lambda p: p.remat or "model's",
             "placement": lambda p: p.placement,
             "used": lambda p: f"{p.num_devices} devices",
             "devices": lambda p: p.predicted.get("layout") or (
                 "rank order" if p.device_order == tuple(range(len(p.device_order)))
                 else "reordered")}
    shown = [k for k, f in extra.items() if len({f(p) for p in plans}) > 1]
    rows = []
    for i, p in enumerate(plans):
        pr = p.predicted
        degrees = f"{p.pp} x {p.dp} x {p.tp}" if p.uniform else f"{p.pp} x (" + ", ".join(
            f"{d} x {t}" for d, t in p.stage_shapes) + ")"
        row = {"#": str(i), "pp x dp x tp": degrees,
               "schedule": p.schedule + (f" ({p.executor})" if p.pp > 1 else ""),
               "micro-batches": str(p.microbatches), "zero": p.zero.name,
               "layers/stage": ",".join(map(str, p.stage_layers))
               if p.pp <= 8 else f"{min(p.stage_layers)}-{max(p.stage_layers)}"}
        row.update({k: extra[k](p) for k in shown})
        if "step_time_s" in pr:
            row.update({"step": seconds(pr["step_time_s"]),
                        "tokens/s": f"{pr['tokens_per_s']:,.0f}",
                        "MFU": percent(pr["mfu"]),
                        "bubble": percent(pr["bubble"], 3),
                        "fits": "yes" if pr.get("fits", True) else "NO"})
        rows.append(row)
    return rows


def comparison_table(plans: list["Plan"]) -> str:
    """`comparison_rows` as a text table."""
    rows = comparison_rows(plans)
    cols = list(rows[0])
    width = {c: max(len(c), *(len(r.get(c, "")) for r in rows)) for c in cols}
    return "\n".join("  ".join(f"{r.get(c, ''):<{width[c]}}" for c in cols).rstrip()
                     for r in [dict(zip(cols, cols)), *rows])


_fmt_seconds = seconds


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a layout: the config field to change, what is wrong, the fix."""

    field: str
    problem: str
    fix: str

    def message(self) -> str:
        """One line for a PlanError (a ConfigError takes the three parts as they are)."""
        return f"config.{self.field}: {self.problem}. Fix: {self.fix}"


def raise_first(problems: "list[Problem]", error: type = PlanError) -> None:
    """Raise the first of `problems` as `error` (ConfigError: field, problem, fix; any other
    HetjaxError: one line); nothing when there are none."""
    if problems:
        p = problems[0]
        raise error(p.field, p.problem, p.fix) if error is ConfigError else error(p.message())


def batch_split_problem(global_batch: int, microbatches: int, dp: int, per_stage: bool = False
                        ) -> tuple[str, str] | None:
    """(problem, fix) when `global_batch` sequences do not split into `microbatches` equal
    micro-batches that each split evenly over `dp` replicas; None when they do. With
    per-stage shapes (`per_stage`) `dp` is the least common multiple of the stages' dp (a
    micro-batch's rows split over each stage's replicas). The one rule that `layout_problems`
    (config validation, config -> Plan, the executors) and the planner's search (its
    micro-batch counts) apply."""
    if microbatches < 1 or global_batch % microbatches:
        return (f"the batch of {global_batch} sequences does not split into {microbatches} "
                "micro-batches", f"make train.batch_size a multiple of {microbatches}, or change "
                "the count (train.batch_size must be a multiple of pipeline.microbatches)")
    if (global_batch // microbatches) % dp:
        what = (f"every stage's dp (least common multiple {dp})" if per_stage
                else f"dp = {dp}")
        return (f"each of the {microbatches} micro-batches has {global_batch // microbatches} "
                f"sequences, not divisible by {what}",
                f"make train.batch_size a multiple of microbatches x dp = {microbatches * dp}")
    return None


def stage_shape_problem(executor: str, pp: int, stages: int) -> Problem | None:
    """Per-stage (dp, tp) shapes: one per stage, and an executor that runs each stage on its
    own sub-mesh (`ExecutorKind.stage_shapes`); the others lay every stage on one mesh."""
    if pp and stages != pp:
        return Problem("parallel.stage_dp", f"gives {stages} stages' degrees but parallel.pp = "
                       f"{pp}", f"give {pp} numbers in parallel.stage_dp and parallel.stage_tp")
    kind = EXECUTORS.get(executor)
    if kind is None or kind.stage_shapes:
        return None
    runs = [k.name for k in EXECUTORS.values() if k.stage_shapes]
    return Problem("pipeline.executor", f"stages with different (dp, tp) shapes cannot run on "
                   f"the {executor} executor (one mesh for every stage)",
                   f"set --config.pipeline.executor={' or '.join(runs)}, or give every stage "
                   "the same parallel.stage_dp and parallel.stage_tp")


def tp_problems(tp: int, model: Any, field: str = "parallel.tp") -> list[Problem]:
    """Tensor parallelism splits the `model`'s heads, kv heads and d_ff (anything with those
    attributes): `tp` must divide each. Config validation checks parallel.tp and every
    parallel.stage_tp with it, `Plan.problems` every stage's tp."""
    dims = {"model.n_heads": model.n_heads, "model.n_kv_heads": model.n_kv_heads,
            "model.d_ff": model.d_ff}
    if getattr(model, "n_experts", 0):  # an MoE model's experts are split alike
        dims["model.moe_d_ff"] = model.moe_d_ff or model.d_ff
        if model.shared_expert_d_ff:
            dims["model.shared_expert_d_ff"] = model.shared_expert_d_ff
    common = _divisors(math.gcd(*dims.values()))
    return [Problem(field, f"tp = {tp} does not divide {f} = {v}; tensor parallelism splits it",
                    f"choose tp from the common divisors of n_heads, n_kv_heads and d_ff: "
                    f"{common}") for f, v in dims.items() if v % tp][:1]


def rank_problems(ranks, topology: Topology) -> list[Problem]:
    """A plan's ranks must be the `topology`'s (it may leave some out, and uses none twice:
    the Plan refuses that when it is built)."""
    n = topology.num_devices
    missing = sorted(r for r in ranks if r >= n)
    if not missing:
        return []
    return [Problem("parallel", f"the plan places stages on ranks {_fmt_ranks(missing)}, but "
                    f"topology {topology.name!r} has {n} devices (ranks 0-{n - 1})",
                    "plan for this topology (hetjax plan), or use the topology the plan was "
                    "made for")]


def schedule_problem(executor: str, schedule: str) -> Problem | None:
    """Whether the pipeline executor `executor` (a registered name) can run `schedule`: one
    that runs only the tick grid (`ExecutorKind.tick_grid_only`) runs only the schedules the
    registry marks `spmd_compatible`."""
    kind = EXECUTORS.get(executor)
    if kind is None or not kind.tick_grid_only or SCHEDULES[schedule].spmd_compatible:
        return None
    return Problem("pipeline.schedule", f"the {executor} executor cannot run {schedule!r} "
                   "(several chunks per stage or a split backward)",
                   "set --config.pipeline.executor=" + " or ".join(
                       k.name for k in EXECUTORS.values() if not k.tick_grid_only) +
                   f", or use one of {', '.join(spmd_schedules())}")


def placement_problem(placement: str, schedule: str) -> Problem | None:
    """The folded placement runs its two chunks per device on the tick grid: it takes only
    tick-grid schedules."""
    if placement != "folded" or SCHEDULES[schedule].spmd_compatible:
        return None
    return Problem("pipeline.placement", "the folded placement takes a tick-grid schedule, not "
                   f"{schedule!r}", f"use pipeline.schedule one of "
                   f"{', '.join(spmd_schedules())}, or pipeline.placement=looped")


def zero_order_problem(s_p: int, s_g: int, s_os: int) -> Problem | None:
    """AMSP's ordering rule on the ZeRO factors: s_p divides s_os (each optimizer-state shard
    lies inside its parameter shard) and s_g is s_p or s_os."""
    if s_p > s_os:  # raising s_os may be impossible (it divides dp): lowering s_p never is
        return Problem("zero.s_p",
                       f"s_p = {s_p} is larger than s_os = {s_os}; each optimizer-state shard "
                       "must lie inside its device's parameter shard, so s_p must divide s_os",
                       f"choose zero.s_p from the divisors of s_os = {s_os}: "
                       f"{_divisors(s_os)}")
    if s_os % s_p:
        return Problem("zero.s_os",
                       f"s_os = {s_os} is not a multiple of s_p = {s_p}; each optimizer-state "
                       "shard must lie inside its device's parameter shard",
                       f"choose s_os from the multiples of s_p = {s_p} (and divisors of dp)")
    if s_g not in (s_p, s_os):
        return Problem("zero.s_g",
                       f"s_g = {s_g} must equal s_p = {s_p} or s_os = {s_os} (gradients are "
                       "sharded like the parameters or like the optimizer states)",
                       f"set zero.s_g to {s_p} or {s_os}")
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def name_problems(executor: str = "", schedule: str = "", placement: str = "",
                  allow_auto: bool = False) -> list[Problem]:
    """Names a layout gives that their registries lack (the executor registry, the schedule
    registry, PLACEMENTS); 'auto' is a name only where `allow_auto`."""
    auto = ("auto",) if allow_auto else ()
    out = []
    for name, value, names, what in (
            ("pipeline.executor", executor, (*EXECUTORS, *auto), "executor"),
            ("pipeline.schedule", schedule, (*SCHEDULES, *auto), "schedule"),
            ("pipeline.placement", placement, (*PLACEMENTS, *auto), "placement")):
        if value and value not in names:
            out.append(Problem(name, f"unknown {what} {value!r}",
                               f"choose one of {', '.join(names)}"))
    return out


def stage_count_problem(pp: int, stage_layers) -> Problem | None:
    """A layer count for each of the pp stages."""
    if not pp or not stage_layers or len(stage_layers) == pp:
        return None
    return Problem("pipeline.stage_layers", f"has {len(stage_layers)} stages but parallel.pp = "
                   f"{pp}", f"give {pp} numbers, or set parallel.pp = {len(stage_layers)}")


def layout_problems(*, pp: int = 0, dp: int = 0, tp: int = 0, devices: int = 0,
                    topology_name: str = "", stage_layers=(), n_layers: int = 0,
                    microbatches: int = 0, global_batch: int = 0, schedule: str = "",
                    executor: str = "", placement: str = "", zero: ZeroFactors | None = None,
                    allow_auto: bool = True, stage_shapes=(), ep: int = 1) -> list[Problem]:
    """Everything wrong with a (possibly partial) layout, as data, in the order a user should
    fix it. The one definition of each layout rule: `Plan.problems` passes a whole plan, config
    validation the fields a config fixes before a topology is known, config -> Plan the degrees
    against the `devices` it may use (the topology's, less any left out). A value left at 0 /
    empty is unknown and its rules are skipped; with `allow_auto` (a config) `executor` and
    `placement` may be 'auto' (the planner chooses). `stage_shapes`: each stage's (dp_s, tp_s)
    when they differ (then dp and tp are read from them)."""
    out: list[Problem] = []

    def add(p: Problem | None) -> None:
        if p is not None:
            out.append(p)

    out += name_problems(executor, schedule, placement, allow_auto)
    executor = executor if executor in EXECUTORS else ""
    schedule = schedule if schedule in SCHEDULES else ""
    shapes = tuple(tuple(x) for x in stage_shapes)
    if len(set(shapes)) > 1:
        add(stage_shape_problem(executor, pp, len(shapes)))
    dps = sorted({d for d, _ in shapes}) if shapes else ([dp] if dp else [])
    if executor and schedule:
        add(schedule_problem(executor, schedule))
    if schedule and placement in PLACEMENTS:
        add(placement_problem(placement, schedule))
    if zero is not None:
        add(zero_order_problem(zero.s_p, zero.s_g, zero.s_os))
        bad = [d for d in dps if d % zero.s_os]
        if bad and len(dps) == 1:
            add(Problem("zero.s_os", f"s_os = {zero.s_os} does not divide dp = {dp}",
                        f"choose s_os from the divisors of dp: {_divisors(dp)}"))
        elif bad:
            common = [d for d in _divisors(min(dps)) if all(x % d == 0 for x in dps)]
            add(Problem("zero.s_os", f"s_os = {zero.s_os} does not divide every stage's dp "
                        f"{dps}", f"choose s_os from their common divisors: {common}"))
    if ep > 1 and dps:
        # expert-parallel groups are made of each stage's data-parallel devices, beside the
        # ZeRO sub-groups (parallel/mesh.py: dp_s = replicas x s_os x ep)
        s_os = zero.s_os if zero is not None else 1
        if any(d % (ep * s_os) for d in dps):
            ok = [e for e in _divisors(min(dps)) if all(d % (e * s_os) == 0 for d in dps)]
            add(Problem("parallel.ep", f"ep = {ep}{f' x zero.s_os = {s_os}' if s_os > 1 else ''}"
                        f" does not divide {'dp' if len(dps) == 1 else 'every stage dp'} = "
                        f"{dps[0] if len(dps) == 1 else dps}; expert-parallel groups are made "
                        "of a stage's data-parallel devices", f"choose ep from {ok}"))
    # micro-batches
    if global_batch and microbatches:
        split = batch_split_problem(global_batch, microbatches, math.lcm(*dps) if dps else 1,
                                    per_stage=len(dps) > 1)
        if split:
            add(Problem("train.batch_size", *split))
    # degrees against the devices
    if devices and len(set(shapes)) > 1:
        where = f"topology {topology_name!r}" if topology_name else "the topology"
        used = sum(d * t for d, t in shapes)
        if used != devices:
            add(Problem("parallel", f"the stages' dp x tp sum to {used} devices, but {where} "
                        f"has {devices} to use", f"give per-stage degrees whose dp x tp sum to "
                        f"{devices}, or leave the others out with parallel.exclude"))
    elif devices:
        where = f"topology {topology_name!r}" if topology_name else "the topology"
        for f, v in (("parallel.pp", pp), ("parallel.dp", dp), ("parallel.tp", tp)):
            if v and devices % v:
                add(Problem(f, f"{v} does not divide the {devices} devices of {where}",
                            f"choose {f.split('.')[1]} from {_divisors(devices)}"))
        fixed = [d for d in (pp, dp, tp) if d]
        prod = int(np.prod(fixed)) if fixed else 1
        if devices % prod:
            add(Problem("parallel", f"pp x dp x tp = {prod} does not divide the {devices} "
                        f"devices of {where}", f"choose degrees whose product is {devices}"))
        elif len(fixed) == 3 and prod != devices:
            add(Problem("parallel", f"pp x dp x tp = {pp} x {dp} x {tp} = {prod}, but {where} "
                        f"has {devices} devices", f"choose degrees whose product is {devices}, "
                        "or set one of them to 0 to let hetjax fill it in"))
    # layers per stage
    sl = tuple(stage_layers)
    if sl:
        if not all(isinstance(n, (int, np.integer)) and n >= 1 for n in sl):
            add(Problem("pipeline.stage_layers", f"every stage needs at least one layer, got "
                        f"{list(sl)}", "give each stage >= 1 layer, or leave it empty for an "
                        "even split"))
        elif n_layers and sum(sl) != n_layers:
            add(Problem("pipeline.stage_layers", f"{list(sl)} sums to {sum(sl)}; the stages' "
                        f"layers must sum to model.n_layers = {n_layers}",
                        f"make the layers per stage sum to {n_layers}"))
        add(stage_count_problem(pp, sl))
    elif pp and n_layers and pp > n_layers:
        add(Problem("parallel.pp", f"{pp} stages for model.n_layers = {n_layers} layers",
                    f"use at most {n_layers} stages"))
    return out


@dataclass(frozen=True)
class ScheduleSpec:
    """The fields of a Plan that pick its schedule object, for callers without a Plan (the
    simulator prices schedules by name and size)."""

    schedule: str
    pp: int
    microbatches: int
    placement: str = "looped"


def resolve_schedule(plan: "Plan | ScheduleSpec") -> Schedule:
    """The schedule object `plan` runs: the registered schedule for its stages and
    micro-batches, wrapped for the folded placement when it asks (`folded`). The one
    place a plan becomes a schedule (the MPMD executors, the SPMD pipeline, the simulator); a
    plan it cannot run is one PlanError naming the fields to change."""
    try:
        if plan.placement == "folded":
            return folded(plan.schedule, plan.pp, plan.microbatches)
        return make_schedule(plan.schedule, plan.pp, plan.microbatches)
    except ValueError as e:
        fields = "pipeline.microbatches or pipeline.schedule" + (
            " or pipeline.placement" if plan.placement == "folded" else "")
        raise PlanError(f"{e}. Fix: change {fields}") from None


def even_split(n_layers: int, stages: int) -> tuple[int, ...]:
    """Layers per stage as even as possible, earlier stages taking the remainder."""
    q, r = divmod(n_layers, stages)
    return tuple(q + (1 if s < r else 0) for s in range(stages))


def effective_remat(remat: str, spmd_pipeline: bool = False) -> str:
    """`model.remat` with 'auto' resolved to what each executor did before recompute was a
    choice: 'full' in the SPMD pipeline (its stash would otherwise hold every intermediate of
    every layer slot of every in-flight micro-batch), else 'none'. Executors and the cost
    model both resolve it here, so they agree."""
    if remat == "auto":
        return "full" if spmd_pipeline else "none"
    return remat


# The optimizers a DiLoCo plan names (the executor, parallel/diloco.py, builds them): the outer
# one ('sgd', or 'nesterov': SGD with Nesterov momentum) and the sites' ('adamw': the train.*
# optimizer, or plain 'sgd' at its schedule).
OUTER_OPTIMIZERS = ("nesterov", "sgd")
INNER_OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True)
class DilocoPlan:
    """What the DiLoCo executor (parallel/diloco.py) runs, decided by the planner from the
    config so the executor never reads it: the sites (name, cluster indices), each site's
    sub-topology, Plan (pp = 1, its share `rows_per_site` of the global batch) and topology
    ranks (`site_ranks`, in the whole topology), the exchange (`inner_steps` H, `codec`,
    `fragments`, `overlap_steps`, `mix`), the outer optimizer and the inner one's settings,
    and the logging cadence (`log_every`, `steps`: on those steps the sites' mean loss is
    gathered across processes). Field names are the config's `diloco.*` ones."""

    # the executor registry's entry for plans of this kind (`hetjax.core.registry.COMPOSITE`)
    executor: ClassVar[str] = "diloco"

    sites: tuple
    site_topologies: tuple
    site_plans: tuple
    site_ranks: tuple
    rows_per_site: int
    inner_steps: int
    codec: str
    fragments: int
    overlap_steps: int
    mix: float
    outer_optimizer: str
    outer_lr: float
    outer_momentum: float
    inner_optimizer: str
    inner_lr_scale: float
    log_every: int
    steps: int


def vocab_shards(plan) -> int:
    """How many ways the embedding and head are split: the plan's tp, or for a DilocoPlan the
    least common multiple of its sites' (`hetjax.core.model_config.vocab_rows` pads for it)."""
    import math

    plans = getattr(plan, "site_plans", None) or (plan,)
    return math.lcm(*(p.tp for p in plans))

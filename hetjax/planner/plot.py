"""A picture of a Plan: the device map (which stage each device runs, TP groups outlined, DP
replica numbered) above the simulated timeline of one step, in the step time's unit.

Labels are drawn only where they fit: a text wider than its box is dropped, never overlapped.
The timeline's axis ends at the predicted step time (the pipeline, then the gradient sync no
stage could hide), the same number `hetjax plan` prints.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from hetjax import units
from hetjax.core.plan import Plan
from hetjax.planner.cost import CostModel, CostOptions
from hetjax.core.topology import Topology

if TYPE_CHECKING:
    from hetjax.core.model_config import ModelConfig

FWD, BWD, SYNC = "#4C72B0", "#DD8452", "#9a9a9a"
MIXED = "#8172B3"  # an aggregated run of alternating forwards and backwards
# Beyond this many tasks per stage a timeline is drawn as phases (warm-up, steady state,
# cool-down) rather than one bar per task: 128 micro-batches would otherwise be a barcode.
MAX_BARS_PER_STAGE = 32


def plot_plan(plan: Plan, topology: Topology, model: "ModelConfig", path: str,
              options: CostOptions | None = None) -> str:
    """Write a PNG of `plan` on `topology`: device map and simulated timeline."""
    fig = plan_figure(plan, topology, model, options)
    fig.savefig(path, dpi=110)
    return path


def plan_figure(plan: Plan, topology: Topology, model: "ModelConfig",
                options: CostOptions | None = None):
    """The matplotlib Figure `plot_plan` writes (notebooks display it as it is)."""
    from matplotlib.figure import Figure  # no pyplot: no global state, safe in notebooks

    rows = min(len(topology.clusters) if topology.num_nodes > 16 else topology.num_nodes, 32)
    map_h = 0.9 + 0.32 * rows
    if not plan.uniform:  # the cost model prices one (dp, tp) shape: no timeline to play
        fig = Figure(figsize=(12, map_h + 0.4))
        device_map(fig.add_subplot(), plan, topology)
        fig.tight_layout()
        return fig
    pred, sim = CostModel(topology, model, options).predict(plan, with_events=True)
    line_h = 0.9 + 0.45 * plan.pp
    fig = Figure(figsize=(12, map_h + line_h + 0.8))
    grid = fig.add_gridspec(2, 1, height_ratios=[map_h, line_h])
    device_map(fig.add_subplot(grid[0]), plan, topology)
    timeline(fig.add_subplot(grid[1]), plan, pred, sim)
    fig.tight_layout()
    return fig


def _fits(ax, text: str, width_data: float, fontsize: float) -> bool:
    """Whether `text` at `fontsize` is narrower than `width_data` x-units of `ax`."""
    fig = ax.figure
    width_px = ax.get_position().width * fig.get_figwidth() * fig.dpi
    x0, x1 = ax.get_xlim()
    px_per_unit = width_px / abs(x1 - x0)
    text_px = len(text) * fontsize * 0.62 * fig.dpi / 72  # a generous average glyph width
    return text_px + 4 <= width_data * px_per_unit


def device_map(ax, plan: Plan, topology: Topology) -> None:
    """One row per node (per cluster when there are more than 16 nodes; at most 32 rows
    shown), one cell per device, coloured by pipeline stage;
    each TP group outlined in black; the cell text names the stage and the DP replica
    (devices of one stage and TP index across replicas form a DP group)."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch, Rectangle
    import matplotlib

    per_cluster = topology.num_nodes > 16  # many small nodes: one row per cluster instead
    if per_cluster:
        width = max(c.nodes * c.devices_per_node for c in topology.clusters)
        names = [c.name for c in topology.clusters]
    else:
        width = max(c.devices_per_node for c in topology.clusters)
        names = [f"{c.name}/{n}" for c in topology.clusters for n in range(c.nodes)]
    nodes = len(names)
    stage = np.full((nodes, width), np.nan)
    replica = np.full((nodes, width), -1)
    def cell_of(r: int) -> tuple[int, int]:
        dev = topology.devices[r]
        return ((dev.cluster, r - topology.cluster_ranks(dev.cluster).start) if per_cluster
                else (dev.global_node, dev.local))

    where = {}
    for s, d, r in ((s, d, r) for s in range(plan.pp)
                    for (d, _), r in np.ndenumerate(plan.stage_mesh(s))):
        cell = cell_of(int(r))
        stage[cell], replica[cell] = s, d
        where[int(r)] = cell
    shown = min(nodes, 32)
    colors = matplotlib.colormaps["tab20" if plan.pp > 10 else "tab10"].colors
    cmap = ListedColormap([colors[i % len(colors)] for i in range(max(plan.pp, 1))])
    ax.imshow(stage[:shown], cmap=cmap, vmin=-0.5, vmax=plan.pp - 0.5, aspect="auto",
              interpolation="nearest")
    ax.set_xlim(-0.5, width - 0.5)
    ax.set_ylim(shown - 0.5, -0.5)
    # TP groups: a black box around each group's cells when they sit side by side in a node.
    tp_any = any(t > 1 for _, t in plan.shapes())
    if tp_any:
        for group in plan.tp_groups():
            if len(group) > 1:
                cells = [where[int(r)] for r in group]
                node = {n for n, _ in cells}
                cols = sorted(c for _, c in cells)
                if len(node) == 1 and cols == list(range(cols[0], cols[-1] + 1)) and \
                        next(iter(node)) < shown:
                    ax.add_patch(Rectangle((cols[0] - 0.45, next(iter(node)) - 0.42),
                                           len(cols) - 0.1, 0.84, fill=False, lw=1.6,
                                           edgecolor="black"))
    if not per_cluster:  # the devices the plan leaves out: blank cells, said so
        for r in plan.unused_ranks(topology):
            n, c = cell_of(r)
            if n < shown and _fits(ax, "unused", 0.9, 7):
                ax.text(c, n, "unused", ha="center", va="center", fontsize=7, color="grey")
    for (n, c), s in np.ndenumerate(stage[:shown]):
        if np.isnan(s):
            continue
        replicas = plan.stage_shape(int(s))[0]
        text = f"s{int(s)} r{replica[n, c]}" if replicas > 1 else f"s{int(s)}"
        if _fits(ax, text, 0.9, 7):
            ax.text(c, n, text, ha="center", va="center", fontsize=7)
        elif _fits(ax, f"{int(s)}", 0.9, 6):
            ax.text(c, n, f"{int(s)}", ha="center", va="center", fontsize=6)
    names = names[:shown]
    step = max(1, math.ceil(len(names) / 16))  # tick labels never crowd
    ax.set_yticks(range(0, len(names), step))
    ax.set_yticklabels(names[::step], fontsize=7)
    ax.set_xticks(range(0, width, max(1, math.ceil(width / 16))))
    ax.set_xlabel("device in cluster" if per_cluster else "device in node")
    more = f" (first {shown} of {nodes} rows)" if shown < nodes else ""
    ax.set_title(f"device map: pp={plan.pp} {plan.degrees()}{more} -- colour: stage, "
                 f"r: DP replica{', black box: TP group' if tp_any else ''}", fontsize=10)
    if plan.pp <= 12:
        ax.legend(handles=[Patch(color=cmap(s), label=f"stage {s}") for s in range(plan.pp)],
                  loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=7, frameon=False)


def phases(events) -> list[tuple[int, float, float, str, str, float]]:
    """A stage's tasks as up to three phases: the forwards before its first backward (warm-up,
    blue), the forwards and backwards that alternate (steady state, purple), the backwards
    after its last forward (cool-down, orange). (stage, start, end, colour, label, busy share
    of the phase's span)."""
    out = []
    by_stage: dict[int, list] = {}
    for e in sorted(events, key=lambda e: (e.stage, e.start)):
        by_stage.setdefault(e.stage, []).append(e)
    for s, evs in sorted(by_stage.items()):
        fwd = [e.action.kind == "F" for e in evs]
        first_b = fwd.index(False) if False in fwd else len(evs)
        after_f = len(evs) - fwd[::-1].index(True) if True in fwd else 0
        cuts = sorted({0, first_b, max(first_b, after_f), len(evs)})
        for a, b in zip(cuts, cuts[1:]):
            run = evs[a:b]
            n_f = sum(fwd[a:b])
            n_b = len(run) - n_f
            colour = FWD if not n_b else BWD if not n_f else MIXED
            label = " + ".join(f"{n} {k}" for n, k in ((n_f, "F"), (n_b, "B")) if n)
            span = run[-1].end - run[0].start
            busy = sum(e.end - e.start for e in run) / span if span > 0 else 1.0
            out.append((s, run[0].start, run[-1].end, colour, label, busy))
    return out


def timeline(ax, plan: Plan, pred, sim) -> None:
    """One row per stage: forward (blue) and backward (orange) per micro-batch, then the
    gradient sync the stage could not hide (grey); the axis ends at the step time. A long
    schedule (more than MAX_BARS_PER_STAGE tasks a stage) is drawn as its phases instead."""
    events = list(sim.events)
    step = pred.step_time
    unit, scale = _time_unit(step)
    aggregated = len(events) > MAX_BARS_PER_STAGE * max(plan.pp, 1)
    # Separators between bars only while bars are wide: on a long schedule they would paint
    # the thin bars white.
    edge = "white" if len(events) <= 24 * max(plan.pp, 1) or aggregated else "none"
    # An aggregated phase is shaded by how busy the stage is in it (its idle gaps are part of
    # the bubble); its label counts its tasks.
    bars = (phases(events) if aggregated else
            [(e.stage, e.start, e.end, FWD if e.action.kind == "F" else BWD, str(e.action), 1.0)
             for e in events])
    for s, start, end, colour, _, busy in bars:
        ax.broken_barh([(start * scale, (end - start) * scale)], (s - 0.4, 0.8),
                       facecolors=colour, alpha=0.35 + 0.65 * busy, edgecolors=edge,
                       linewidth=0.5)
    ax.set_xlim(0, step * scale)
    ax.set_ylim(plan.pp - 0.5, -0.5)
    for s, start, end, _, label, busy in bars:  # after the limits: the fit test knows the scale
        if aggregated:
            label += f", {busy:.0%} busy"
        if _fits(ax, label, (end - start) * scale, 7):
            ax.text((start + end) / 2 * scale, s, label, ha="center",
                    va="center", fontsize=7, color="white")
    for s in range(plan.pp):
        ends = [e.end for e in events if e.stage == s]
        exposed = sim.sync_exposed[s] if s < len(sim.sync_exposed) else 0.0
        if ends and exposed > 0:
            x, w = max(ends) * scale, exposed * scale
            ax.broken_barh([(x, w)], (s - 0.4, 0.8), facecolors=SYNC, edgecolors="white")
            if _fits(ax, "sync", w, 7):
                ax.text(x + w / 2, s, "sync", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(plan.pp))
    ax.set_yticklabels([f"stage {s}: {units.count(plan.stage_layers[s], 'layer')}, "
                        f"{units.gib(pred.stage_memory[s])}" for s in range(plan.pp)],
                       fontsize=8)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(f"simulated step: {units.seconds(step)} ({plan.schedule}, "
                 f"{units.count(plan.microbatches, 'micro-batch', 'micro-batches')}), bubble "
                 f"{units.percent(pred.bubble, 3)} -- blue: forward, orange: backward, "
                 + ("purple: both (shade: busy share), " if aggregated else "")
                 + "grey: gradient sync not hidden", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def _time_unit(t: float) -> tuple[str, float]:
    """The unit a time axis ending at `t` seconds reads best in, and its scale."""
    if t >= 1:
        return "s", 1.0
    if t >= 1e-3:
        return "ms", 1e3
    return f"{units.MICRO}s", 1e6


__all__ = ["plot_plan", "plan_figure", "device_map", "timeline"]

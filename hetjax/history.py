"""A run's history: the rows of its metrics file as columns, and the loss curve drawn from them.

`Trainer.train()` returns a `RunSummary` (the summary dict, with `.history`); `History.load`
reads any workdir's `metrics.jsonl` back. `History.columns()` gives one numpy array per metric
(NaN where a row lacks it: eval_loss exists only on evaluation rows, step_s not on the first
row), ready for pandas (`pd.DataFrame(h.columns())`) or matplotlib. `plot_history` writes the
`loss.png` the end of every run leaves in its workdir; `summary_rows` / `format_summary` render
the end-of-run summary (the terminal table and the notebook's HTML).
"""

from __future__ import annotations

import html
import os
from typing import Any

import numpy as np

LOSS_PNG = "loss.png"


class History:
    """The logged rows of one run (one dict per logged step, in step order)."""

    def __init__(self, rows: list[dict[str, float]]):
        self.rows = sorted(rows, key=lambda r: r["step"])

    @staticmethod
    def load(path: str) -> "History":
        """Read `metrics.jsonl` (or a workdir holding one)."""
        if os.path.isdir(path):
            path = os.path.join(path, "metrics.jsonl")
        if not os.path.exists(path):
            return History([])
        from hetjax.metrics import read_metrics  # it skips a torn last line

        return History(read_metrics(path))

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def keys(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.rows:
            seen.update(dict.fromkeys(r))
        return list(seen)

    def columns(self) -> dict[str, np.ndarray]:
        """{metric: array over the logged rows}; NaN where a row lacks the metric."""
        return {k: np.array([r.get(k, np.nan) for r in self.rows],
                            dtype=np.int64 if k == "step" else np.float64) for k in self.keys}

    def __getitem__(self, key: str) -> np.ndarray:
        return self.columns()[key]

    def last(self, key: str) -> float | None:
        """The latest logged value of `key`, or None."""
        for r in reversed(self.rows):
            if key in r:
                return r[key]
        return None

    def __repr__(self) -> str:
        steps = f", steps {self.rows[0]['step']}-{self.rows[-1]['step']}" if self.rows else ""
        return f"History({len(self.rows)} rows{steps}, metrics: {', '.join(self.keys)})"

    def _repr_html_(self) -> str:
        keys = [k for k in ("step", "loss", "eval_loss", "grad_norm", "lr", "tokens_per_s",
                            "step_s") if k in self.keys]
        head = "".join(f"<th>{k}</th>" for k in keys)
        body = "".join("<tr>" + "".join(f"<td>{_cell(k, r.get(k))}</td>" for k in keys)
                       + "</tr>" for r in self.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def plot(self, path: str, title: str = "", marks: dict[int, str] | None = None) -> str:
        return plot_history(self, path, title, marks)


def _cell(key: str, v) -> str:
    if v is None:
        return ""
    if key == "step":
        return str(int(v))
    if key == "tokens_per_s":
        return f"{v:,.0f}"
    return f"{v:.4g}"


def plot_history(history: History, path: str, title: str = "",
                 marks: dict[int, str] | None = None) -> str:
    """Write a PNG: train and eval loss over steps (left), tokens/s over steps (right);
    `marks` {step: text} draws a dashed line at each step (e.g. where a run resumed)."""
    from matplotlib.figure import Figure  # no pyplot: no global state, safe in notebooks

    c = history.columns()
    fig = Figure(figsize=(10, 3.6))
    ax_loss, ax_tps = fig.subplots(1, 2)
    if len(history):
        steps = c["step"]
        ax_loss.plot(steps, c["loss"], marker="." if len(steps) < 30 else None,
                     label="train loss")
        if "eval_loss" in c and np.isfinite(c["eval_loss"]).any():
            ok = np.isfinite(c["eval_loss"])
            ax_loss.plot(steps[ok], c["eval_loss"][ok], "o-", label="eval loss (held out)")
        if "tokens_per_s" in c and np.isfinite(c["tokens_per_s"]).any():
            ok = np.isfinite(c["tokens_per_s"])
            ax_tps.plot(steps[ok], c["tokens_per_s"][ok], ".-", color="tab:green")
        else:
            ax_tps.text(0.5, 0.5, "no timed interval yet", ha="center", va="center",
                        transform=ax_tps.transAxes)
    for step, text in (marks or {}).items():  # in the legend: free text would hit the data
        ax_loss.axvline(step, color="grey", ls="--", lw=1, label=text)
        ax_tps.axvline(step, color="grey", ls="--", lw=1)
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    ax_loss.legend(loc="best")
    ax_loss.grid(alpha=0.3)
    ax_tps.set(xlabel="step", ylabel="tokens/s", title="throughput (after the first step)")
    ax_tps.set_ylim(bottom=0)
    ax_tps.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


class RunSummary(dict):
    """What `Trainer.train()` returns: the summary (a dict: steps, first_loss, final_loss,
    tokens_per_s, ...) with the run's `history`; prints as the summary table, renders as an
    HTML table (with the loss curve) in notebooks."""

    def __init__(self, summary: dict[str, Any], history: History):
        super().__init__(summary)
        self.history = history

    def __str__(self) -> str:
        return format_summary(self)

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
                       f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
                       for k, v in summary_rows(self))
        out = f"<table>{rows}</table>"
        png = self.get("plot")
        if png and os.path.exists(png):
            import base64

            with open(png, "rb") as f:
                data = base64.b64encode(f.read()).decode()
            out += f"<img src='data:image/png;base64,{data}' style='max-width:100%'/>"
        return out


def _shown_path(path: str) -> str:
    """A path as the summary shows it: relative when under the working directory (the summary
    dict keeps it absolute), so a log reads runs/default/... rather than this machine's tree."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary as (label, text) rows, for the terminal table and the notebook's HTML."""
    def num(v, fmt):
        return format(v, fmt) if v is not None else "-"

    s = {**s, **{k: _shown_path(s[k]) for k in ("workdir", "metrics", "tensorboard", "plot")
                 if s.get(k)}}

    if s.get("complete"):
        rows = [("status", s["message"]), ("workdir", s["workdir"]),
                ("loss", f"{num(s['first_loss'], '.4f')} -> {num(s['final_loss'], '.4f')}")]
        if s.get("eval_loss") is not None:
            rows.append(("eval loss", f"{s['eval_loss']:.4f} (held-out documents)"))
        rows.append(("metrics", s["metrics"]))
        if s.get("plot"):
            rows.append(("loss curve", s["plot"]))
        return rows
    rows = [
        ("steps", str(s["steps"])),
        ("loss", f"{num(s['first_loss'], '.4f')} -> {num(s['final_loss'], '.4f')}"),
        *([("eval loss", f"{s['eval_loss']:.4f} (held-out documents)")]
          if s.get("eval_loss") is not None else []),
        ("tokens/s", f"{s['tokens_per_s']:,.0f} (after the first step)"),
        ("MFU", f"{s['mfu']:.2%} of the topology's peak" +
         (f" (warning: {s['mfu_warning']})" if s.get("mfu_warning") else "")),
        *([("attention", s["attention"])] if s.get("attention") else []),
        ("compile + first step", f"{num(s['compile_and_first_step_s'], '.1f')} s"),
        ("input wait", f"{s.get('input_wait_s', 0.0) * 1e3:.2f} ms per step"),
        ("wall time", f"{s['wall_s']:.1f} s"),
        ("metrics", s["metrics"]),
    ]
    if s.get("tensorboard"):
        rows.append(("tensorboard", s["tensorboard"]))
    if s.get("wandb"):
        rows.append(("wandb", s["wandb"]))
    if s.get("checkpoints"):
        rows.append(("checkpoints", s["checkpoints"]))
    if s.get("plot"):
        rows.append(("loss curve", s["plot"]))
    if s.get("profile"):
        rows.append(("profile", f"{s['profile']} (open at ui.perfetto.dev)"))
    return rows


def format_summary(s: dict[str, Any]) -> str:
    rows = summary_rows(s)
    w = max(len(k) for k, _ in rows)
    return "summary\n" + "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


__all__ = ["History", "RunSummary", "plot_history", "LOSS_PNG", "summary_rows", "format_summary"]

"""Where training metrics go: a JSON-lines file, TensorBoard event files, Weights & Biases (when
`wandb.project` is set), and a progress bar.

Only the primary process (process 0) writes files, so a multi-host run leaves one copy. The
progress bar is a tqdm widget in notebooks that have ipywidgets, tqdm's text bar in notebooks
without them and on terminals; when neither (stderr is a pipe or a file) it is replaced by one
log line every `log_every` steps.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from hetjax.files import open_in_place


class MetricsWriter:
    def __init__(self, workdir: str, tensorboard: bool = True, primary: bool = True,
                 wandb: dict | None = None):
        """`wandb`: {"project", "mode", "name", "config"} to log to Weights & Biases too (the
        config dict is stored with the W&B run); None or an empty project: off."""
        self.primary = primary
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb_dir = os.path.join(workdir, "tensorboard") if tensorboard else None
        self._file = None
        self._tb = None
        self._wandb = None
        self.wandb_url = None
        if primary:
            os.makedirs(workdir, exist_ok=True)
            self._file = open_in_place(self.path, "a")
            if self.tb_dir:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(self.tb_dir)
            if wandb and wandb.get("project"):
                self._wandb = _start_wandb(workdir, wandb)
                self.wandb_url = getattr(self._wandb, "url", None)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.primary:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self._tb.add_scalar(f"train/{k}", v, step)
        if self._wandb is not None:
            self._wandb.log({f"train/{k}": v for k, v in clean.items() if math.isfinite(v)},
                            step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _start_wandb(workdir: str, spec: dict):
    """A W&B run for this workdir. Its id is kept in <workdir>/wandb_id, so a resumed run
    continues the same W&B run (resume="allow"); offline runs write under <workdir>/wandb."""
    import wandb

    id_path = os.path.join(workdir, "wandb_id")
    if os.path.exists(id_path):
        with open(id_path) as f:
            run_id = f.read().strip()
    else:
        run_id = wandb.util.generate_id()
        with open(id_path, "w") as f:
            f.write(run_id + "\n")
    name = spec.get("name") or os.path.basename(os.path.abspath(workdir))
    return wandb.init(project=spec["project"], name=name, mode=spec.get("mode", "online"),
                      dir=workdir, id=run_id, resume="allow", config=spec.get("config"))


def rebuild_tensorboard(workdir: str) -> None:
    """Rewrite `<workdir>/tensorboard` from `<workdir>/metrics.jsonl`, after a resume.

    TensorBoard would otherwise keep the steps logged after the restored checkpoint (which the
    metrics file has dropped) twice, and lose the events a killed run still buffered; the
    metrics file is written line by line, so it is the record both follow."""
    import shutil

    from tensorboardX import SummaryWriter

    tb_dir = os.path.join(workdir, "tensorboard")
    shutil.rmtree(tb_dir, ignore_errors=True)
    path = os.path.join(workdir, "metrics.jsonl")
    # Its own file name: the run's writer, opened within the same second, must not reuse it.
    writer = SummaryWriter(tb_dir, filename_suffix=".restored")
    for row in read_metrics(path) if os.path.exists(path) else []:
        for k, v in row.items():
            if k not in ("step", "time") and isinstance(v, (int, float)) and math.isfinite(v):
                writer.add_scalar(f"train/{k}", v, row["step"], walltime=row.get("time"))
    writer.close()


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics file; a torn last line (a run killed mid-write, a full disk) is
    left out -- `truncate_metrics` removes it when the run resumes."""
    rows, _ = _scan(path)
    return [row for row, _ in rows]


def _scan(path: str) -> tuple[list[tuple[dict, int]], int | None]:
    """(row, byte offset where its line starts) for each whole row, and the offset of a torn
    last line (None if there is none). A bad line before the last is not a tear: it raises."""
    with open(path, "rb") as f:
        data = f.read()
    rows, offset, torn = [], 0, None
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        last = i == len(lines) - 1 or (i == len(lines) - 2 and not lines[-1])
        if line.strip():
            try:
                rows.append((json.loads(line), offset))
            except ValueError:
                if not last:
                    raise ValueError(f"{path}: line {i + 1} is not JSON; fix: remove that line "
                                     "(a metrics file is one JSON object per line)") from None
                torn = offset
        offset += len(line) + 1
    return rows, torn


def truncate_metrics(path: str, step: int) -> tuple[int, bool]:
    """Cut a metrics file back to the rows up to `step` (the step training restarts after) and
    drop a torn last line, in place: the file is only ever appended to and cut at the end, so
    each step appears once across any number of resumes. Returns (rows dropped, whether a torn
    line was dropped)."""
    if not os.path.exists(path):
        return 0, False
    rows, torn = _scan(path)
    later = [offset for row, offset in rows if row.get("step", 0) > step]
    cut = min(later + ([torn] if torn is not None else []), default=None)
    with open_in_place(path, "r+b") as f:
        if cut is not None:
            f.truncate(cut)
        elif f.seek(0, os.SEEK_END) and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
            f.write(b"\n")  # a whole last row whose newline was not written: keep it
    return len(later), torn is not None


class Progress:
    """A tqdm bar on a terminal or in a notebook; plain log lines otherwise."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, log_every: int = 10,
                 primary: bool = True):
        self.enabled = enabled and primary
        self.log_every = log_every
        self.total = total
        self.bar = None
        if self.enabled and _interactive():
            self.bar = _bar_class()(total=total, initial=initial, desc="train", unit="step",
                                    dynamic_ncols=True)

    def update(self, step: int, metrics: dict[str, float] | None) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            if metrics:
                self.bar.set_postfix(_short(metrics), refresh=False)
        elif metrics and (step % self.log_every == 0 or step == self.total):
            parts = "  ".join(f"{k}={v}" for k, v in _short(metrics).items())
            print(f"step {step:>6}/{self.total}  {parts}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _short(m: dict[str, float]) -> dict[str, str]:
    out = {}
    for k in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu"):
        if k in m:
            v = m[k]
            out[k] = f"{v:.2%}" if k == "mfu" else (f"{v:.3g}" if k != "tokens_per_s"
                                                     else f"{v:,.0f}")
    # an MoE model's routers: the balance loss (1: even) and the fraction of tokens dropped
    for k, short in (("moe_balance", "balance"), ("moe_drop", "dropped")):
        if k in m:
            out[short] = f"{m[k]:.3g}" if k == "moe_balance" else f"{m[k]:.2%}"
    return out


def _bar_class():
    """tqdm's notebook widget when ipywidgets is there (tqdm.auto would warn "IProgress not
    found" without it and fall back), else the text bar, which notebooks render too."""
    if _in_notebook():
        try:
            import ipywidgets  # noqa: F401
            from tqdm.notebook import tqdm

            return tqdm
        except ImportError:
            pass
    from tqdm import tqdm

    return tqdm


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _interactive() -> bool:
    try:
        from IPython import get_ipython

        if get_ipython() is not None:
            return True
    except ImportError:
        pass
    return sys.stderr.isatty()

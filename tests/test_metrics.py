"""hetjax/metrics.py: the Weights & Biases hook beside metrics.jsonl and TensorBoard.

wandb is an optional dependency (not installed in CI): the hook is tested against a fake
module injected in sys.modules, and against the real package in offline mode where it is
importable."""

import importlib.machinery
import json
import sys
import types

import pytest

from conftest import tiny_config
from hetjax.errors import ConfigError


class FakeRun:
    def __init__(self, **kw):
        self.init = kw
        self.logged = []
        self.finished = False
        self.url = f"https://wandb.example/{kw['project']}/{kw['id']}"

    def log(self, row, step):
        self.logged.append((step, row))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    mod = types.ModuleType("wandb")
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    mod.runs = []
    ids = iter(["id0", "id1"])
    mod.util = types.SimpleNamespace(generate_id=lambda: next(ids))

    def init(**kw):
        mod.runs.append(FakeRun(**kw))
        return mod.runs[-1]

    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return mod


def test_wandb_gets_every_logged_row_and_a_resumed_run_continues_the_same_run(fake_wandb,
                                                                               tmp_path):
    from hetjax.metrics import MetricsWriter

    spec = {"project": "p", "mode": "offline", "name": "", "config": {"train": {"steps": 3}}}
    w = MetricsWriter(str(tmp_path / "run"), tensorboard=False, wandb=spec)
    w.write(1, {"loss": 5.0, "grad_norm": float("nan")})
    w.write(2, {"loss": 4.0, "eval_loss": 4.5})
    w.close()
    (run,) = fake_wandb.runs
    assert run.init["project"] == "p" and run.init["mode"] == "offline"
    assert run.init["name"] == "run" and run.init["dir"] == str(tmp_path / "run")
    assert run.init["config"] == {"train": {"steps": 3}} and run.init["resume"] == "allow"
    assert run.logged == [(1, {"train/loss": 5.0}),  # non-finite values left out, as in TB
                          (2, {"train/loss": 4.0, "train/eval_loss": 4.5})]
    assert run.finished and w.wandb_url.endswith("/p/id0")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # the file is written as before
    MetricsWriter(str(tmp_path / "run"), tensorboard=False, wandb=spec).close()
    assert fake_wandb.runs[1].init["id"] == "id0"  # resumed: the same W&B run


def test_no_project_no_wandb_and_only_process_0_logs(fake_wandb, tmp_path):
    from hetjax.metrics import MetricsWriter

    MetricsWriter(str(tmp_path / "a"), tensorboard=False,
                  wandb={"project": "", "mode": "online"}).close()
    MetricsWriter(str(tmp_path / "b"), tensorboard=False, primary=False,
                  wandb={"project": "p", "mode": "online"}).close()
    assert fake_wandb.runs == []


def test_config_checks_the_mode_and_that_wandb_is_installed(monkeypatch):
    from hetjax.config import validate

    with pytest.raises(ConfigError, match="(?s)wandb.mode.*choose one of online, offline"):
        validate(tiny_config(**{"wandb.mode": "sometimes"}))
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"(?s)wandb.project.*pip install 'hetjax\[wandb\]'"):
        validate(tiny_config(**{"wandb.project": "p"}))
    validate(tiny_config())  # no project: wandb is not needed


@pytest.mark.slow  # a (tiny) Trainer run: compile and two steps
def test_the_trainer_logs_to_wandb_and_names_the_run_in_its_summary(fake_wandb, tmp_path):
    from hetjax.train import Trainer

    cfg = tiny_config(**{"train.steps": 2, "train.log_every": 1, "parallel.dp": 8,
                         "wandb.project": "hetjax-test", "wandb.mode": "offline",
                         "workdir": str(tmp_path / "w"), "checkpoint.every": 0})
    summary = Trainer(cfg, quiet=True).train()
    (run,) = fake_wandb.runs
    assert [step for step, _ in run.logged] == [1, 2] and run.finished
    assert "train/loss" in run.logged[0][1]
    assert run.init["config"]["wandb"]["project"] == "hetjax-test"
    assert summary["wandb"] == run.url


def test_real_wandb_offline_writes_its_run_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from hetjax.metrics import MetricsWriter

    monkeypatch.setenv("WANDB_SILENT", "true")
    w = MetricsWriter(str(tmp_path), tensorboard=False,
                      wandb={"project": "hetjax-test", "mode": "offline", "config": {}})
    w.write(1, {"loss": 1.0})
    w.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))

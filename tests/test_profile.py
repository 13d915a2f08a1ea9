"""Profiling steps: train.profile_steps traces them with jax.profiler and summarises the trace."""

import gzip
import json

import pytest

from conftest import tiny_config


@pytest.mark.slow  # a profiled training run
def test_profiled_steps_are_traced_and_summarised(tmp_path, capsys):
    from hetjax.train import Trainer

    cfg = tiny_config(**{"workdir": str(tmp_path), "train.steps": 4, "train.profile_from": 2,
                         "train.profile_steps": 2, "checkpoint.every": 0, "eval.every": 0})
    summary = Trainer(cfg).train()
    path = summary["profile"]
    assert path.startswith(str(tmp_path / "profile" / "0-0")) and path.endswith(".json.gz")
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)
    out = capsys.readouterr().out
    # Two steps traced, one jitted train step each, whose programs ran on the XLA threads.
    assert "2 steps" in out and "_train_step" in out and "program runs per step" in out

    from hetjax.profile import summarise

    s = summarise(path)
    calls = {k: n for k, (n, _) in s.dispatches.items()}
    assert calls.get("_train_step", 0) >= 2
    assert sum(runs for runs, _ in s.programs.values()) >= 2 * 8  # 2 steps x 8 devices


def test_profile_fields_are_checked():
    from hetjax.config import validate
    from hetjax.errors import HetjaxError

    with pytest.raises(HetjaxError, match="train.profile_from"):
        validate(tiny_config(**{"train.profile_from": 0}))
    with pytest.raises(HetjaxError, match="train.profile_steps"):
        validate(tiny_config(**{"train.profile_steps": -1}))

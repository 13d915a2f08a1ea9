"""The terminal and notebook experience: run history and loss plot, the re-run message, help
text, plan output in human units, launch output lines, HTML displays."""

import os

import numpy as np
import pytest

from conftest import tiny_config
from hetjax.history import History
from hetjax.train import Trainer


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 12-step run with evaluation and checkpoints, and its summary."""
    workdir = str(tmp_path_factory.mktemp("run"))
    config = tiny_config(**{"train.steps": 12, "train.log_every": 3, "eval.every": 6,
                            "checkpoint.every": 6, "workdir": workdir})
    return config, Trainer(config, quiet=True).train()


def test_train_returns_the_history_as_columns_and_reads_it_back(finished_run):
    config, summary = finished_run
    cols = summary.history.columns()
    assert list(cols["step"]) == [1, 3, 6, 9, 12]
    assert cols["loss"].dtype == np.float64 and np.isfinite(cols["loss"]).all()
    assert cols["loss"][-1] == summary["final_loss"]
    # eval_loss exists on evaluation rows only; the others hold NaN so columns line up.
    assert list(np.isfinite(cols["eval_loss"])) == [False, False, True, False, True]
    assert np.isnan(cols["tokens_per_s"][0]) and (cols["tokens_per_s"][1:] > 0).all()
    again = History.load(config.workdir).columns()
    assert set(again) == set(cols)
    np.testing.assert_array_equal(again["loss"], cols["loss"])


def test_the_end_of_a_run_writes_the_loss_plot_and_the_summary_names_it(finished_run):
    config, summary = finished_run
    png = os.path.join(config.workdir, "loss.png")
    assert summary["plot"] == os.path.abspath(png)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert f"loss curve            {summary['plot']}" in str(summary)
    assert "<table>" in summary._repr_html_() and "data:image/png;base64," in \
        summary._repr_html_()


def test_rerunning_a_finished_run_says_it_is_complete_and_at_which_step(finished_run, capsys):
    config, summary = finished_run
    again = Trainer(config).train()
    out = capsys.readouterr().out
    assert "run complete at step 12 of 12 (checkpoint 12); nothing to train" in out
    assert "tokens/s" not in out  # no empty timing summary
    assert again["complete"] and again["steps"] == 12
    assert again["final_loss"] == summary["final_loss"]
    assert len(again.history) == len(summary.history)


# --- hetjax <command> --help -------------------------------------------------------------------
def cli_out(capsys, *argv) -> str:
    from hetjax import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["hetjax", *argv])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_every_config_field_has_a_description():
    from hetjax.cli import _flat
    from hetjax.config import DESCRIPTIONS, base_config

    fields = [k for k, _ in _flat(base_config())]
    assert sorted(fields) == sorted(DESCRIPTIONS)
    assert all(len(d) > 5 for d in DESCRIPTIONS.values())


def test_help_describes_each_field_with_the_values_of_the_config_given(capsys):
    out = cli_out(capsys, "train", "--help")  # no --config: the default job
    assert "values of configs/default.py" in out
    assert " *parallel.pp = 2 " in out and "(base default: 1)" in out
    assert "train.steps = 300" in out and "optimizer steps of the run" in out
    assert "pipeline.stage_layers = ()" in out and "!!python" not in out
    assert max(map(len, out.splitlines())) <= 100
    out = cli_out(capsys, "plan", "--config=configs/holmes_mini.py",
                  "--config.pipeline.stage_layers=(3,1)", "--help")
    assert "values of configs/holmes_mini.py and --config.pipeline.stage_layers=(3,1)" in out
    assert "*pipeline.stage_layers = (3, 1)" in out


def test_train_without_config_runs_the_default_job():
    from hetjax import cli

    assert cli._parse("train", []).to_dict() == \
        cli._parse("train", ["--config=configs/default.py"]).to_dict()
    assert cli._parse("train", []).parallel.pp == 2

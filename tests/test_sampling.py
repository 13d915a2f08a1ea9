"""`hetjax sample` / `hetjax eval` / `Trainer.generate` on a tiny trained checkpoint
(hetjax/sampling.py): a pipeline run's checkpoint opened under pp = 1."""

import os

import numpy as np
import pytest
from conftest import tiny_config

from hetjax.cli import main
from hetjax.metrics import read_metrics
from hetjax.train import Trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """3 steps of the tiny model under pp = 2 x tp = 2 (the default job's kind of layout)."""
    workdir = str(tmp_path_factory.mktemp("sampling") / "run")
    cfg = tiny_config(**{"parallel.pp": 2, "parallel.tp": 2, "parallel.dp": 0,
                         "train.microbatches": 2, "eval.every": 3, "eval.batches": 2,
                         "checkpoint.every": 3, "workdir": workdir, "data.tokenizer": "byte"})
    trainer = Trainer(cfg, quiet=True)
    trainer.train()
    eval_loss = [r["eval_loss"] for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))
                 if "eval_loss" in r][-1]
    return {"workdir": workdir, "trainer": trainer, "eval_loss": eval_loss}


def test_hetjax_eval_equals_the_training_eval_loss(run, capsys):
    assert main(["hetjax", "eval", f"--checkpoint={run['workdir']}"]) == 0
    out = capsys.readouterr().out
    loss = float(out.split("eval loss ")[1].split(",")[0])
    assert out.startswith("checkpoint 3:") and "perplexity" in out
    np.testing.assert_allclose(loss, run["eval_loss"], rtol=1e-5)


def test_hetjax_sample_prints_the_greedy_continuation(run, capsys):
    assert main(["hetjax", "sample", f"--checkpoint={run['workdir']}", "--prompt=The ",
                 "--max_new_tokens=6"]) == 0
    out = capsys.readouterr().out.rstrip("\n")
    # the pp = 2 trainer's own greedy text: the checkpoint under pp = 1 x tp = 2 decodes alike
    want = run["trainer"].generate("The ", 6)
    assert out == "The " + want and len(want) > 0


def test_bad_sampling_arguments_are_one_line_errors(run, capsys):
    assert main(["hetjax", "sample", f"--checkpoint={run['workdir']}", "--prompt=x",
                 "--top_p=0"]) == 2
    assert "top_p = 0.0 is out of range" in capsys.readouterr().err
    assert main(["hetjax", "sample", "--checkpoint=/nonexistent", "--prompt=x"]) == 2
    assert "no checkpoints there" in capsys.readouterr().err

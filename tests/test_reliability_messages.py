"""One clear line where a user met a bare or wrong one: a workdir on a pseudo file system, a
damaged only checkpoint, orbax's bookkeeping warning in `hetjax export`, an NCCL note on a
CPU-only launch, a stale testing claim in the docs, and benchmarks that checked their output
paths only after the work."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, tiny_config
from hetjax.errors import ConfigError


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_workdir_under_proc_is_refused_before_anything_runs():
    """(before: planning went ahead and the run ended in a bare 'No such file or directory')"""
    from hetjax.config import validate

    with pytest.raises(ConfigError) as e:
        validate(tiny_config(workdir="/proc/hetjax_run"))
    assert str(e.value) == (
        "config.workdir: /proc/hetjax_run cannot be created (/proc: No such file or directory)"
        "\n  fix: choose a --config.workdir under a directory you can write")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny run whose only checkpoint is step 2, and the trainer that wrote it."""
    from hetjax.train import Trainer

    run = tmp_path_factory.mktemp("saved")
    trainer = Trainer(tiny_config(**{"workdir": str(run), "train.steps": 2,
                                     "checkpoint.every": 2, "checkpoint.async_save": False}),
                      quiet=True)
    trainer.train()
    trainer.checkpointer.close()
    return run, trainer


def test_a_damaged_only_checkpoint_says_there_is_none_before_it(saved, tmp_path, capsys):
    """(before: '... moved aside to 2.corrupt, trying the previous one', when there was none)"""
    run, trainer = saved
    shutil.copytree(run / "checkpoints", tmp_path / "checkpoints")
    state = tmp_path / "checkpoints" / "2" / "state"
    arrays = [os.path.join(r, f) for r, _, fs in os.walk(state) for f in fs
              if os.sep + "d" + os.sep in os.path.join(r, f)]
    biggest = max(arrays, key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.truncate(os.path.getsize(biggest) // 2)
    trainer.workdir = str(tmp_path)
    trainer._checkpointer = None
    capsys.readouterr()
    assert not trainer.restore()
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hetjax: checkpoint 2 in {tmp_path}/checkpoints cannot be read (")
    assert err.endswith("); moved aside to 2.corrupt, and there is no earlier checkpoint: "
                        "starting from step 0"), err
    assert "\n" not in err


def test_hetjax_export_prints_no_orbax_bookkeeping_warning(saved, tmp_path, caplog):
    """(before: 'WARNING:absl:Metadata file does not exist: .../state/_CHECKPOINT_METADATA' on
    every export)"""
    from hetjax.config import base_config
    from hetjax.interop.hf_checkpoint import export_checkpoint

    run, _ = saved
    caplog.set_level("WARNING")
    assert "model.safetensors" in export_checkpoint(str(run), str(tmp_path / "hf"),
                                                    base_config().model.to_dict())
    assert not [r for r in caplog.records if r.name == "absl"], caplog.text


def test_a_cpu_only_launch_prints_no_nccl_note(capsys):
    """CPU devices talk over gloo; a note about what stock NCCL reads is for GPU clusters.
    (before: a 4-line note about pp groups across ib/roce on `hetjax launch --local 2`)"""
    from hetjax import launch

    assert launch.main(["--local", "2", "--dry-run", "--config.data.source=synthetic"]) == 0
    out = capsys.readouterr().out
    assert "pp    4       ethernet" in out  # the link report is still there
    assert "NCCL" not in out.split("links per group")[1].split("\n# process")[0].replace(
        "NCCL net", "")


def test_the_checkpoint_docs_claim_no_test_that_is_skipped():
    text = open(os.path.join(REPO, "docs", "checkpoints.md")).read()
    assert "skipped until" not in text
    assert "restored under pp=1\n  dp=8 and pp=4 split [1, 1, 1, 1] (slow tier)" in text


@pytest.mark.parametrize("argv,message", [
    (["hetnet.py", "--only", "mpmd", "--out", "x.md"],
     "bench_hetnet: error: --out=x.md: cannot write a plot as .md; fix: end the name with one "
     "of .png, .pdf, .svg, .jpg, .jpeg"),
    (["hetaccel.py", "--json", "{tmp}"],
     "bench_hetaccel: error: --json={tmp}: is a directory; fix: give a file name, e.g. "
     "--json={tmp}/out.json"),
    (["gpu.py", "--out", "results.csv"],
     "bench_gpu: error: --out=results.csv: cannot write results as .csv; fix: end the name "
     "with one of .json"),
    (["predict.py", "--smoke", "--json", "{tmp}/rows.md"],
     "bench_predict: error: --json={tmp}/rows.md: cannot write results as .md; fix: end the "
     "name with one of .json"),
    (["diloco.py", "--smoke", "--json", "{tmp}/r.txt"],
     "bench_diloco: error: --json={tmp}/r.txt: cannot write results as .txt; fix: end the "
     "name with one of .json"),
])
def test_every_bench_checks_its_output_paths_before_the_work(tmp_path, argv, message):
    """(before: `bench_hetnet.py --only mpmd --out x.md` ran 20 minutes, then died on
    matplotlib's "Format 'md' is not supported")"""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench", argv[0]), *argv[1:]],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stderr.strip() == message.replace("{tmp}", str(tmp_path))
    assert not p.stdout.strip()

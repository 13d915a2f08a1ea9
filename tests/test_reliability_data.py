"""What a run reads, said and checked: data.path without data.source=files, the data line at
start, a held-out split too small for one batch, `hetjax eval` never evaluating a batch twice,
and `hetjax eval` / `hetjax sample` on a checkpoint that sits on a read-only file system."""

import json
import os
import random
import subprocess

import pytest

from conftest import tiny_config
from hetjax.config import validate
from hetjax.corpus_size import check_corpus_size
from hetjax.errors import ConfigError, HetjaxError


def _jsonl(path, docs: int = 200, words: int = 50):
    """`docs` JSON lines of `words` words each (about 290 bytes a document)."""
    rng = random.Random(0)
    vocab = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words))})
                            + "\n" for _ in range(docs)))
    return path


@pytest.mark.parametrize("source", ["stdlib", "synthetic"])
def test_data_path_without_source_files_is_refused(tmp_path, source):
    c = tiny_config(**{"data.source": source, "data.path": str(tmp_path)})
    with pytest.raises(ConfigError) as e:
        validate(c)
    assert str(e.value) == (
        f"config.data.path: is {str(tmp_path)!r}, but data.source = {source!r} reads "
        + {"stdlib": "the Python standard library's .py files",
           "synthetic": "random token sequences"}[source]
        + ", not data.path\n  fix: add --config.data.source=files to train on data.path (or "
          "drop data.path)")


def test_a_run_says_at_start_what_data_it_reads(tmp_path):
    """The `data:` line of `Trainer.describe()`, which `hetjax train` prints at start."""
    from hetjax.corpus_size import source_line
    from hetjax.train import Trainer

    docs = _jsonl(tmp_path / "docs.jsonl")
    for over, line in (
            ({}, "data: random token sequences (data.source = synthetic), tokenizer byte"),
            ({"data.source": "stdlib"}, "data: the Python standard library's .py files "
             "(data.source = stdlib), tokenizer byte, 0.01 of the documents held out for "
             "evaluation"),
            ({"data.source": "files", "data.path": str(docs)},
             f"data: data.path {str(docs)!r}, tokenizer byte, 0.01 of the documents held out "
             "for evaluation")):
        assert source_line(tiny_config(**over).data) == line
    trainer = Trainer(tiny_config(workdir=str(tmp_path / "run")), quiet=True)
    assert "data: random token sequences (data.source = synthetic), tokenizer byte" in \
        trainer.describe().splitlines()


def test_a_held_out_split_too_small_is_named_before_anything_is_built(tmp_path):
    """200 JSON lines at the default eval_fraction hold out 2 documents (about 4 sequences):
    the pre-check names the held-out split (before: the loader's 'the data packs into 4
    sequences, fewer than one batch of 32', after the corpus was prepared)."""
    c = tiny_config(**{"data.source": "files", "data.path": str(_jsonl(tmp_path / "d.jsonl")),
                       "eval.every": 2, "train.seq_len": 128, "train.batch_size": 32})
    with pytest.raises(ConfigError) as e:
        check_corpus_size(c)
    assert str(e.value).startswith(
        "config.data.eval_fraction: 0.01 of the 200 documents of ")
    assert "holds out 2, which make at most 4 sequences of 129 tokens, fewer than one " \
           "evaluation batch of train.batch_size = 32" in str(e.value)


def test_the_loader_names_the_held_out_split_it_cannot_fill():
    from hetjax.data import Loader

    rows = [list(range(17))] * 3
    with pytest.raises(HetjaxError, match=r"^the held-out split \(x\) packs into 3 sequences, "
                                          r"fewer than one batch of 8; raise it$"):
        Loader(rows, 8, 0, what="the held-out split (x)", fix="raise it")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A tiny run with checkpoint 2, and a corpus of 10 held-out documents."""
    from hetjax.train import Trainer

    root = tmp_path_factory.mktemp("saved")
    c = tiny_config(**{"workdir": str(root / "run"), "train.steps": 2, "checkpoint.every": 2,
                       "train.batch_size": 8})
    Trainer(c, quiet=True).train()
    return root / "run", _jsonl(root / "docs.jsonl")


def test_hetjax_eval_never_evaluates_a_batch_twice(saved_run, tmp_path, capsys):
    """eval.batches = 64 on a held-out split of 10 documents: it evaluates the distinct
    batches there are, says so, and reports that number (before: 64, most of them repeats)."""
    from hetjax.cli import main

    run, docs = saved_run
    assert main(["hetjax", "eval", f"--checkpoint={run}", "--config.data.source=files",
                 f"--config.data.path={docs}", "--config.data.eval_fraction=0.05",
                 f"--config.data.dir={tmp_path}", "--config.eval.batches=64"]) == 0
    out, err = capsys.readouterr()
    distinct = int(err.split("sequences, ")[1].split(" distinct")[0])
    assert 0 < distinct < 64
    assert "hetjax: eval.batches = 64, but the held-out split packs into " in err
    assert f"evaluating {distinct}, none twice (raise data.eval_fraction for more)" in err
    assert f"({distinct} batches of 8 x 16 tokens, data.source=files)" in out


@pytest.mark.root
def test_eval_and_sample_read_a_checkpoint_on_a_read_only_file_system(saved_run, tmp_path,
                                                                      capsys):
    """The run's directory bind-mounted read-only (root): both commands work (before: the
    checkpoint directory was refused as not writable, and the suggested fix failed)."""
    from hetjax.cli import main

    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    run, _ = saved_run
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = subprocess.run(f"mount --bind {run} {ro} && mount -o remount,bind,ro {ro}",
                             shell=True, capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"could not mount: {mounted.stderr.strip()}")
    try:
        with pytest.raises(OSError):
            (ro / "probe").write_text("x")
        assert main(["hetjax", "sample", f"--checkpoint={ro}", "--prompt=def ",
                     "--max_new_tokens=4"]) == 0
        assert main(["hetjax", "eval", f"--checkpoint={ro}", "--config.eval.batches=1"]) == 0
        assert "checkpoint 2: eval loss " in capsys.readouterr().out
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)

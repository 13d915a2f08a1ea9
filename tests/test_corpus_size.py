"""The corpus-size rules (`hetjax.corpus_size`), checked from the files alone before anything is
built: a held-out fraction that holds out no document, record files counted without preparing
them, a corpus or held-out split too small for one batch, a source that names no files."""

import os
import re

import pytest

from hetjax import data
from hetjax.errors import HetjaxError
from hetjax.tokenizer import ByteTokenizer
from test_data import (RECORDS, corpus, text_config, write_corpus,  # noqa: F401 - a fixture
                       write_jsonl, write_parquet)


# --- corpus-size rules, checked from the files before anything is built --------------------------
def _refusal(config):
    """The ConfigError check_corpus_size raises for `config` (the test fails if none)."""
    from hetjax.corpus_size import check_corpus_size
    from hetjax.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        check_corpus_size(config)
    return e.value


def test_an_eval_fraction_that_holds_out_no_document_is_refused_before_any_work(tmp_path):
    from hetjax.corpus_size import check_corpus_size

    corpus = write_corpus(tmp_path / "c", {f"f{i}.txt": "some text here " * 40 for i in range(13)})
    config = text_config(corpus, tmp_path, **{"data.eval_fraction": 0.01, "eval.every": 2})
    e = _refusal(config)
    assert e.field == "data.eval_fraction" and "13 documents" in e.problem
    assert "--config.data.eval_fraction=0.077" in e.fix and "--config.eval.every=0" in e.fix
    # The fix is right: 0.077 holds out exactly one of 13 documents, as the data splits them.
    assert len(data.split_documents(13, 0.077)[1]) == 1
    check_corpus_size(text_config(corpus, tmp_path, **{"data.eval_fraction": 0.077,
                                                       "eval.every": 2}))
    check_corpus_size(text_config(corpus, tmp_path, **{"data.eval_fraction": 0.01}))  # no eval
    # The Trainer refuses it before preparing anything: the tfds directory is never made.
    from hetjax.errors import ConfigError
    from hetjax.train import Trainer

    with pytest.raises(ConfigError, match="data.eval_fraction"):
        Trainer(config, quiet=True)
    assert not os.path.exists(tmp_path / "tfds")


def test_record_files_count_their_documents_without_preparing_them(tmp_path):
    # Parquet rows come from the footer, .jsonl documents are at most its lines.
    write_parquet(tmp_path / "p" / "a.parquet", RECORDS)
    e = _refusal(text_config(tmp_path / "p", tmp_path, **{"data.eval_fraction": 0.1,
                                                         "eval.every": 1}))
    assert "0.1 of the 6 documents" in e.problem and "eval_fraction=0.167" in e.fix
    write_jsonl(tmp_path / "j" / "a.jsonl", RECORDS)
    e = _refusal(text_config(tmp_path / "j", tmp_path, **{"data.eval_fraction": 0.1,
                                                         "eval.every": 1}))
    assert e.field == "data.eval_fraction"


def test_a_large_jsonl_corpus_is_bounded_from_its_size_without_reading_it(tmp_path, monkeypatch):
    from hetjax import corpus_size

    path = write_jsonl(tmp_path / "j" / "a.jsonl", RECORDS)
    monkeypatch.setattr(corpus_size, "EXACT_READ_LIMIT", 0)  # as if it were hundreds of GB
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: pytest.fail(f"read {f}")
                        if str(f) == str(path) else real_open(f, *a, **k))
    size = corpus_size.source_size([str(path)], "text", exact=True)
    # each record is at least {"text":""} and a newline: a bound, and above the 6 records
    assert size.documents == (os.path.getsize(path) + 1) // 12 >= len(RECORDS)
    corpus_size.check_corpus_size(text_config(tmp_path / "j", tmp_path, **{
        "data.eval_fraction": 0.1, "eval.every": 1}))  # not refused on a bound it cannot prove


def test_a_batch_larger_than_the_corpus_is_refused_with_a_bound_that_holds(corpus, tmp_path):
    config = text_config(corpus, tmp_path, **{"train.batch_size": 64})
    e = _refusal(config)
    assert e.field == "train.batch_size" and "lower train.batch_size" in e.fix
    most = int(re.search(r"at most (\d+) sequences", e.problem).group(1))
    # The bound is an upper bound of what the packer makes, and the packer indeed falls short.
    rows, _ = data.row_source(config.data, ByteTokenizer(), config.train.seq_len, 0)
    assert len(rows) <= most < 64
    with pytest.raises(HetjaxError, match="fewer than one batch"):
        data.make_loader(config, ByteTokenizer())


def test_a_held_out_split_too_small_for_one_batch_is_refused(tmp_path):
    corpus = write_corpus(tmp_path / "c", {f"f{i}.txt": "word " * 20 for i in range(20)})
    config = text_config(corpus, tmp_path, **{"data.eval_fraction": 0.1, "eval.every": 1,
                                              "train.batch_size": 16, "train.seq_len": 32})
    e = _refusal(config)  # 2 of 20 held out: 2 x (100 + 3 + EOS) tokens, < 16 rows of 33
    assert e.field == "data.eval_fraction" and "holds out 2" in e.problem
    assert "evaluation batch" in e.problem
    with pytest.raises(HetjaxError, match="fewer than one batch"):
        data.make_loader(config, ByteTokenizer(), split="eval")


def test_an_empty_source_is_named_before_any_work(tmp_path):
    (tmp_path / "empty" / ".git").mkdir(parents=True)
    (tmp_path / "empty" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    e = _refusal(text_config(tmp_path / "empty", tmp_path))
    assert e.field == "data.path" and "empty" in e.problem and "names no files" in e.problem
    full = write_corpus(tmp_path / "full")
    for weights in ("", "1,1"):  # one corpus or a mixture: the empty source is named
        e = _refusal(text_config(f"{full},{tmp_path / 'empty'}", tmp_path,
                                 **{"data.weights": weights}))
        assert f"{str(tmp_path / 'empty')!r} names no files" in e.problem

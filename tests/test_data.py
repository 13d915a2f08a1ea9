"""Data: tokenizers, the tfds corpus (text, JSONL and Parquet records), packing (EOS and BOS at
document boundaries), weighted mixtures, the grain loader (order, state, per-process rows), and
a clear error for each kind of bad input."""

import json
import os
import re

import numpy as np
import pytest

from conftest import tiny_config
from hetjax import data
from hetjax.errors import HetjaxError
from hetjax.text_dataset import open_corpus
from hetjax.tokenizer import ByteTokenizer, load_tokenizer

DOCS = {"a.txt": "alpha beta gamma\n" * 3, "b.txt": "delta\n", "sub/c.txt": "ε ζ η θ " * 9,
        "d.txt": "iota kappa lambda mu\n" * 2, "e.txt": "nu xi omicron\n" * 4}


def write_corpus(root, docs=DOCS):
    for name, text in docs.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus")


def text_config(corpus, tmp_path, **overrides):
    return tiny_config(**{"data.source": "files", "data.path": str(corpus),
                          "data.dir": str(tmp_path / "tfds"), "data.eval_fraction": 0.0,
                          "train.seq_len": 8, "train.batch_size": 4, **overrides})


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ∑")
    assert ids.max() < 256 and tok.decode(ids) == "héllo ∑"
    np.testing.assert_array_equal(tok.encode("héllo ∑".encode()), ids)
    assert data.padded_vocab(tok.vocab_size) == 384


def test_stdlib_corpus_is_found_and_excludes_site_packages():
    files = data.stdlib_files()
    assert len(files) > 500 and not any("site-packages" in f for f in files)
    assert any(f.endswith("/json/__init__.py") for f in files)


def test_corpus_is_prepared_once_and_again_when_a_file_changes(corpus, tmp_path):
    files = data.text_files(str(corpus))
    docs, where = open_corpus(files, str(tmp_path / "tfds"), "files")
    assert where.startswith(str(tmp_path / "tfds")) and os.path.exists(where)
    assert sorted(docs[i]["text"].decode() for i in range(len(docs))) == sorted(DOCS.values())
    stamp = os.stat(os.path.join(where, "dataset_info.json")).st_mtime_ns
    _, again = open_corpus(files, str(tmp_path / "tfds"), "files")
    assert again == where
    assert os.stat(os.path.join(where, "dataset_info.json")).st_mtime_ns == stamp
    (corpus / "b.txt").write_text("delta, edited\n")
    docs2, changed = open_corpus(files, str(tmp_path / "tfds"), "files")
    assert changed != where and "delta, edited\n" in {docs2[i]["text"].decode()
                                                      for i in range(len(docs2))}


def test_packed_rows_are_the_eos_joined_stream_cut_evenly():
    texts = [b"abc", b"defg", b"", b"hijklmnop"]
    tok = ByteTokenizer()
    tokens = np.concatenate([tok.encode(t) for t in texts]).astype(np.uint8)
    counts = np.array([len(t) for t in texts])
    order = np.array([3, 0, 2, 1])
    rows = data.PackedRows(tokens, counts, order, tok.eos_id, row_len=4)
    stream = np.concatenate([np.append(tok.encode(texts[i]), tok.eos_id) for i in order
                             if texts[i]])  # the empty document adds no lone EOS
    assert len(stream) == 19 and len(rows) == 4  # the last 3 tokens fill no row
    for i in range(len(rows)):
        np.testing.assert_array_equal(rows[i], stream[4 * i:4 * i + 4])
    with pytest.raises(IndexError):
        rows[len(rows)]


def test_loader_is_seeded_reshuffles_each_epoch_and_shifts_targets():
    source = np.arange(12 * 5).reshape(12, 5)  # row i holds 5i .. 5i+4
    a = data.Loader(source, batch_size=4, seed=1)
    b = data.Loader(source, batch_size=4, seed=1)
    c = data.Loader(source, batch_size=4, seed=2)
    first = [next(a) for _ in range(6)]  # two epochs of 3 steps
    np.testing.assert_array_equal(first[0]["inputs"], next(b)["inputs"])
    assert not np.array_equal(first[0]["inputs"], next(c)["inputs"])
    np.testing.assert_array_equal(first[0]["inputs"][:, 1:], first[0]["targets"][:, :-1])
    epoch = lambda batches: sorted(r[0] for x in batches for r in x["inputs"])  # noqa: E731
    assert epoch(first[:3]) == epoch(first[3:]) == list(range(0, 60, 5))  # every row once
    assert [x["inputs"][:, 0].tolist() for x in first[:3]] != \
        [x["inputs"][:, 0].tolist() for x in first[3:]]


def test_loader_state_resumes_at_the_exact_next_batch():
    source = np.arange(40 * 3).reshape(40, 3)
    straight = data.Loader(source, batch_size=4, seed=3)
    expected = [next(straight)["inputs"] for _ in range(15)]
    first = data.Loader(source, batch_size=4, seed=3)
    for _ in range(7):
        next(first)
    state = first.get_state()
    assert state == {"next_index": 7} and first.step == 7
    resumed = data.Loader(source, batch_size=4, seed=3)
    resumed.set_state(state)
    for k in range(7, 15):
        np.testing.assert_array_equal(next(resumed)["inputs"], expected[k])


def test_two_processes_see_disjoint_rows_that_together_are_one_process_rows(corpus, tmp_path):
    # With dp = 2 over two processes, each holds half of every global batch.
    source = np.repeat(np.arange(60)[:, None], 3, axis=1)  # row i is [i, i, i]
    p0 = data.Loader(source, batch_size=6, seed=5, rows=[0, 1, 2])
    p1 = data.Loader(source, batch_size=6, seed=5, rows=[3, 4, 5])
    seen = [[next(p)["inputs"][:, 0] for _ in range(10)] for p in (p0, p1)]  # one epoch
    ids0, ids1 = (set(np.concatenate(s).tolist()) for s in seen)
    assert len(ids0) == len(ids1) == 30 and not ids0 & ids1 and ids0 | ids1 == set(range(60))
    # And on a real corpus, the two halves are exactly what one process loads.
    cfg = text_config(corpus, tmp_path, **{"train.seq_len": 4, "train.batch_size": 6})
    whole, _ = data.make_loader(cfg, ByteTokenizer())
    h0, _ = data.make_loader(cfg, ByteTokenizer(), rows=[0, 1, 2])
    h1, _ = data.make_loader(cfg, ByteTokenizer(), rows=[3, 4, 5])
    for _ in range(12):  # past the end of the tiny corpus's first epoch
        full, a, b = next(whole), next(h0), next(h1)
        for k in ("inputs", "targets"):
            np.testing.assert_array_equal(np.concatenate([a[k], b[k]]), full[k])


def test_a_process_loads_the_rows_its_devices_hold():
    from types import SimpleNamespace

    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from hetjax.core.plan import Plan
    from hetjax.parallel.train_state import batch_rows

    devices = np.array(jax.devices()).reshape(4, 2)  # dp = 4, tp = 2
    sharding = NamedSharding(Mesh(devices, ("dp", "tp")), P(None, "dp", None))
    plan = Plan(pp=1, dp=4, tp=2, stage_layers=(2,), microbatches=2, global_batch=16,
                seq_len=4)  # 2 micro-batches of 8 rows; each dp shard holds 2 rows of each

    def rows_of(process_devices):  # what the executor's data_rows sees in that process
        held = {d: i for d, i in sharding.devices_indices_map((2, 8, 4)).items()
                if d in set(process_devices)}
        fake = SimpleNamespace(addressable_devices_indices_map=lambda shape: held)
        return batch_rows(plan, fake).tolist()

    # A process with the first four devices holds dp shards 0 and 1 (tp replicas share rows).
    assert rows_of(devices[:2].ravel()) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert rows_of(devices[2:].ravel()) == [4, 5, 6, 7, 12, 13, 14, 15]
    assert rows_of(devices[:, 0]) == list(range(16))


def test_held_out_documents_are_not_trained_on(corpus, tmp_path):
    cfg = text_config(corpus, tmp_path, **{"data.eval_fraction": 0.4, "train.seq_len": 4,
                                           "train.batch_size": 2})
    tok = ByteTokenizer()
    train, _ = data.make_loader(cfg, tok)
    held, _ = data.make_loader(cfg, tok, split="eval")
    text = lambda ld, n: b"".join(  # noqa: E731
        bytes(int(t) for t in r if t < 256) for s in range(n) for r in ld.batch(s)["inputs"])
    train_ids, eval_ids = data.split_documents(len(DOCS), 0.4)
    assert len(eval_ids) == 2 and not set(train_ids) & set(eval_ids)
    seen_eval = text(held, 2)
    assert seen_eval and seen_eval[:4] not in text(train, 30)


def test_sentencepiece_tokenizer_trains_on_the_corpus_and_feeds_the_loader(corpus, tmp_path):
    words = " ".join(f"w{i} x{i % 7}" for i in range(400))
    write_corpus(corpus, {f"more{i}.txt": words + "\n" for i in range(3)})
    cfg = text_config(corpus, tmp_path, **{"train.seq_len": 16})
    tok, n_docs, where = data.train_tokenizer(cfg.data, 300, str(tmp_path / "tok.model"))
    assert n_docs == len(DOCS) + 3 and tok.vocab_size == 300 and tok.eos_id == 1
    again = load_tokenizer(str(tmp_path / "tok.model"))
    text = "alpha beta\n\tdelta ε\n"
    assert again.decode(again.encode(text)) == text and again.fingerprint == tok.fingerprint
    loader, spec = data.make_loader(cfg, again)
    batch = next(loader)
    assert batch["inputs"].shape == (4, 16) and batch["inputs"].max() < 300
    assert spec.tokenizer == tok.fingerprint
    cache = os.path.join(where, f"tokens.{tok.fingerprint}")
    ids, counts = np.load(cache + ".ids.npy"), np.load(cache + ".counts.npy")
    assert ids.dtype == np.uint16 and counts.sum() == len(ids) and len(counts) == n_docs


def test_missing_directory_and_empty_corpus_are_clear_errors(tmp_path):
    with pytest.raises(HetjaxError, match="names no files"):
        data.text_files(str(tmp_path / "nothing-here"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("")
    with pytest.raises(HetjaxError, match="too few for one sequence"):
        data.make_loader(text_config(empty, tmp_path), ByteTokenizer())


def test_sequence_longer_than_the_corpus_stream_is_a_clear_error(corpus, tmp_path):
    total = sum(len(t.encode()) + 1 for t in DOCS.values())
    with pytest.raises(HetjaxError, match=f"one sequence of train.seq_len \\+ 1 = {total + 1}"):
        data.make_loader(text_config(corpus, tmp_path, **{"train.seq_len": total}),
                         ByteTokenizer())
    with pytest.raises(HetjaxError, match="fewer than one batch"):
        data.make_loader(text_config(corpus, tmp_path, **{"train.seq_len": total // 3,
                                                          "train.batch_size": 8}),
                         ByteTokenizer())


def test_corrupt_prepared_dataset_is_a_clear_error(corpus, tmp_path):
    files = data.text_files(str(corpus))
    _, where = open_corpus(files, str(tmp_path / "tfds"), "files")
    (record,) = [f for f in os.listdir(where) if "array_record" in f]
    with open(os.path.join(where, record), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(where, record)) // 2)
    with pytest.raises(HetjaxError, match="is corrupt.*delete that directory") as e:
        open_corpus(files, str(tmp_path / "tfds"), "files")
    assert where in str(e.value)


def test_no_held_out_documents_is_a_clear_error(corpus, tmp_path):
    with pytest.raises(HetjaxError, match="holds none out for evaluation"):
        data.make_loader(text_config(corpus, tmp_path), ByteTokenizer(), split="eval")


# --- JSONL / Parquet records, mixtures, BOS ------------------------------------------------------
RECORDS = [{"text": f"record {i}: " + "lorem ipsum " * (i + 1), "id": i} for i in range(6)]


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    return path


def write_parquet(path, records):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), str(path))
    return path


def prepared_texts(paths, tmp_path, field="text"):
    files = sorted(f for p in paths for f in data.text_files(str(p)))
    docs, _ = open_corpus(files, str(tmp_path / "tfds"), "files", field)
    return sorted(docs[i]["text"].decode() for i in range(len(docs)))


def test_jsonl_and_parquet_records_are_documents_of_their_field(tmp_path):
    import gzip

    root = tmp_path / "mixed"
    write_jsonl(root / "a.jsonl", RECORDS[:2])
    with gzip.open(root / "z.jsonl.gz", "wt") as f:
        f.write(json.dumps(RECORDS[2]) + "\n")
    write_parquet(root / "b.parquet", RECORDS[3:])
    (root / "notes.txt").write_text("a plain text file is one document\n")
    texts = prepared_texts([root], tmp_path)
    assert texts == sorted([r["text"] for r in RECORDS] + ["a plain text file is one document\n"])
    assert not any("{" in t for t in texts)  # never the raw JSON
    # another field is another corpus
    renamed = [{"body": r["text"].upper(), "id": r["id"]} for r in RECORDS]
    write_jsonl(tmp_path / "body" / "c.jsonl", renamed[:2])
    write_parquet(tmp_path / "body" / "d.parquet", renamed[2:])
    assert prepared_texts([tmp_path / "body"], tmp_path, "body") == \
        sorted(r["body"] for r in renamed)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_file_without_the_field_names_the_file_and_its_fields(tmp_path, fmt):
    writer = write_jsonl if fmt == "jsonl" else write_parquet
    path = writer(tmp_path / "src" / f"x.{fmt}", [{"body": "words", "id": 1}])
    where = re.escape(f"{path}:1" if fmt == "jsonl" else str(path))
    with pytest.raises(HetjaxError, match=f"^{where} has no field 'text' \\(its fields: 'body', "
                       "'id'\\); set --config.data.field"):
        prepared_texts([path], tmp_path)
    # a record further down without the field is caught while preparing, with its line
    if fmt == "jsonl":
        write_jsonl(path, [{"text": "a"}, {"text": "b"}, {"body": "c"}])
        with pytest.raises(HetjaxError, match=re.escape(f"{path}:3 has no field 'text'")):
            prepared_texts([path], tmp_path)
        path.write_text('{"text": "a"}\nnot json\n')
        with pytest.raises(HetjaxError, match=re.escape(f"{path}:2 is not a JSON object")):
            prepared_texts([path], tmp_path)


def test_mixed_rows_hold_the_weights_per_block_and_every_row_of_every_source():
    big = np.arange(50)[:, None] * np.ones((1, 3), int)  # rows 0..49
    small = 1000 + np.arange(7)[:, None] * np.ones((1, 3), int)  # rows 1000..1006
    mix = data.MixedRows([big, small], [0.3, 0.7], block=100)
    assert list(mix.counts) == [30, 70] and len(mix) == 200  # 50 big rows need two blocks
    firsts = np.array([mix[i][0] for i in range(len(mix))])
    for b in range(2):
        block = firsts[b * 100:(b + 1) * 100]
        assert (block < 1000).sum() == 30
    assert set(firsts[firsts < 1000]) == set(range(50))  # none cut short
    assert set(firsts[firsts >= 1000]) == set(range(1000, 1007))  # the small one repeats
    assert data.MixedRows([big, small], [1, 1e-6], block=100).counts.tolist() == [99, 1]


def test_a_weighted_mixture_feeds_the_loader_in_its_proportions(tmp_path):
    write_jsonl(tmp_path / "a" / "a.jsonl", [{"text": "a" * (20 + i)} for i in range(40)])
    write_parquet(tmp_path / "b" / "b.parquet", [{"text": "b" * (20 + i)} for i in range(10)])
    cfg = text_config(f"{tmp_path / 'a'},{tmp_path / 'b' / '*.parquet'}", tmp_path,
                      **{"data.weights": "3,1", "train.batch_size": 8})
    loader, spec = data.make_loader(cfg, ByteTokenizer())
    assert "*0.75+" in spec.corpus and spec.corpus.endswith("*0.25")
    rows = np.concatenate([next(loader)["inputs"] for _ in range(50)])  # 400 rows
    share_a = np.mean([(r == ord("a")).sum() > (r == ord("b")).sum() for r in rows])
    assert abs(share_a - 0.75) < 0.06, share_a
    # without weights, the sources are one corpus of all their documents
    cfg = text_config(f"{tmp_path / 'a'},{tmp_path / 'b'}", tmp_path)
    whole, name = data.row_source(cfg.data, ByteTokenizer(), 8, seed=0)
    assert isinstance(whole, data.PackedRows) and len(whole.counts) == 50 and "*" not in name


def test_weights_and_sources_are_checked_before_training(tmp_path):
    from hetjax.config import validate
    from hetjax.errors import ConfigError

    write_jsonl(tmp_path / "a.jsonl", RECORDS)
    for overrides, match in [
        ({"data.weights": "1,2"}, "data.weights: gives 2 weights for the 1 sources"),
        ({"data.weights": "1,x", "data.path": f"{tmp_path}/a.jsonl,{tmp_path}"},
         "data.weights: '1,x' is not a list of positive numbers"),
        ({"data.path": f"{tmp_path}/a.jsonl,{tmp_path}/none*"}, "data.path: '.*none\\*' matches"),
        ({"data.add_bos": "maybe"}, "data.add_bos: unknown value 'maybe'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            validate(text_config(tmp_path / "a.jsonl", tmp_path, **overrides))


def test_documents_begin_with_bos_and_end_with_eos_in_the_packed_stream(tmp_path):
    from test_tokenizer import write_tiktoken

    write_jsonl(tmp_path / "src" / "d.jsonl", RECORDS)
    tok_path = str(write_tiktoken(tmp_path / "tok.tiktoken"))
    cfg = text_config(tmp_path / "src", tmp_path, **{"train.seq_len": 15})
    for add_bos in ("auto", "false"):
        tok = load_tokenizer(tok_path, add_bos)
        rows, _ = data.row_source(cfg.data, tok, 15, seed=0)
        stream = np.concatenate([rows[i] for i in range(len(rows))])
        docs, _ = open_corpus(data.text_files(str(tmp_path / "src")), cfg.data.dir, "files")
        order = np.random.default_rng(0).permutation(len(docs))
        bos = [tok.bos_id] if add_bos == "auto" else []
        expected = np.concatenate([np.concatenate([bos, tok.encode(docs[int(i)]["text"]),
                                                   [tok.eos_id]]) for i in order])
        np.testing.assert_array_equal(stream, expected[:len(stream)])
        n_eos = int((stream == tok.eos_id).sum())
        assert n_eos >= 3  # the rows cross several document boundaries
        assert (stream == tok.bos_id).sum() in ((n_eos, n_eos + 1) if bos else (0,))


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    import sys

    path = write_parquet(tmp_path / "p" / "x.parquet", RECORDS[:1])
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(HetjaxError, match=r"needs the 'pyarrow' package; install it with pip "
                       r"install 'hetjax\[parquet\]'"):
        prepared_texts([path], tmp_path)


def test_segment_ids_number_the_documents_of_each_packed_row(corpus, tmp_path):
    """With data.document_mask the loader's batches carry segment ids: 1, 2, ... per row, a new
    document right after each EOS (the EOS stays with the document it ends)."""
    rows = np.array([[5, 6, 9, 7, 9, 9, 8, 1], [9, 1, 2, 3, 4, 9, 5, 6]])
    np.testing.assert_array_equal(data.segment_ids(rows, eos_id=9),
                                  [[1, 1, 1, 2, 2, 3, 4], [1, 2, 2, 2, 2, 2, 3]])
    tok = load_tokenizer("byte")
    cfg = text_config(corpus, tmp_path, **{"data.document_mask": True, "train.seq_len": 32})
    loader, _ = data.make_loader(cfg, tok)
    batch = next(loader)
    seg = batch["segment_ids"]
    assert seg.shape == batch["inputs"].shape and seg.dtype == np.int32
    is_eos = batch["inputs"] == tok.eos_id
    np.testing.assert_array_equal(seg[:, 0], 1)
    np.testing.assert_array_equal(np.diff(seg, axis=1), is_eos[:, :-1])  # +1 after each EOS
    assert is_eos.any()  # the tiny corpus's documents are shorter than a row
    off, _ = data.make_loader(text_config(corpus, tmp_path), tok)
    assert "segment_ids" not in next(off)


def test_corpus_identity_follows_content_not_modification_times(corpus, tmp_path):
    """`touch` and a copy elsewhere (cp without -p, staging to node-local disk) keep the
    prepared corpus and so the checkpoint's data spec; an edit does not."""
    import shutil

    files = data.text_files(str(corpus))
    _, where = open_corpus(files, str(tmp_path / "tfds"), "files")
    os.utime(files[0], (1, 1))
    assert open_corpus(files, str(tmp_path / "tfds"), "files")[1] == where
    copy = tmp_path / "staged"
    shutil.copytree(corpus, copy)  # new modification times, new paths, same content
    assert open_corpus(data.text_files(str(copy)), str(tmp_path / "tfds"), "files")[1] == where


def test_vcs_directories_and_binary_files_are_skipped_with_a_count(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("text")
    (tmp_path / ".git" / "objects").mkdir(parents=True)
    (tmp_path / ".git" / "objects" / "pack").write_bytes(b"PACK\0\1\2")
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0")
    assert data.text_files(str(tmp_path)) == [str(tmp_path / "a.txt")]
    assert capsys.readouterr().err == (
        f"hetjax: data.path {str(tmp_path)!r}: using 1 text files; skipped 2 files in "
        f"version-control directories (.git, .hg, .svn, .bzr) and 1 binary files (e.g. "
        f"{tmp_path}/logo.png)\n")


def test_undecodable_bytes_are_reported_per_file(tmp_path, capsys):
    corpus = tmp_path / "c"
    corpus.mkdir()
    (corpus / "latin1.txt").write_bytes("café crème".encode("latin-1"))
    (corpus / "utf8.txt").write_text("café")
    docs, _ = open_corpus(data.text_files(str(corpus)), str(tmp_path / "tfds"), "files")
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hetjax:")
           and not line.startswith("hetjax: preparing the corpus")]
    assert err == [f"hetjax: {corpus}/latin1.txt: 2 bytes are not UTF-8 and became U+FFFD; "
                   "fix: convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8) if that "
                   "matters"]


def test_preparing_a_corpus_hides_tfds_noise_unless_verbose(corpus, tmp_path, capfd, caplog,
                                                            monkeypatch):
    from hetjax.noise import ENV_VERBOSE

    noise = ("Downloading and preparing dataset", "Generating splits", "has no dataset_info.json",
             "downloaded and prepared to")
    files = data.text_files(str(corpus))
    for verbose in ("0", "1"):
        monkeypatch.setenv(ENV_VERBOSE, verbose)
        open_corpus(files, str(tmp_path / f"tfds{verbose}"), "files")  # prepared anew each
        out, err = capfd.readouterr()
        text = out + err + caplog.text  # absl's records reach pytest's handler, not stderr
        caplog.clear()
        assert f"hetjax: preparing the corpus (5 files) once into {tmp_path}/tfds" in text
        if verbose == "1":
            assert all(n in text for n in noise), text
        else:
            assert not [n for n in noise if n in text], text

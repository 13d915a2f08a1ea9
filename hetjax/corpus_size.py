"""The corpus-size rules, checked from the files alone before anything is built: a source that
names no files, a `data.eval_fraction` that holds out no document of a small corpus, a corpus
or held-out split too small for one batch of `train.batch_size` x (`train.seq_len` + 1) tokens.
Each otherwise fails only after the corpus is prepared and tokenized (or the model compiled).

Every number here is an upper bound, so a refusal is certain to match a later failure: a text
file is one document; a Parquet file's rows come from its footer; a .jsonl file has at most one
document a line. A document of b bytes is at most 3 b + 3 tokens (undecodable bytes become the
3-byte U+FFFD; BOS, EOS and a tokenizer's word prefix); when that loose bound is within 3x of
failing, the files are read for their exact UTF-8 lengths (a token is at least one byte). A
corpus over EXACT_READ_LIMIT bytes is only listed, never read. Compressed files (.jsonl.gz,
Parquet's text) have no cheap size bound and leave their batch rules to the loader.
JAX-free, like config validation: `Trainer` and `hetjax launch` call `check_corpus_size` first.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sysconfig
from dataclasses import dataclass

from hetjax.errors import ConfigError

# Version-control directories hold object and pack files, never the corpus.
VCS_DIRS = (".git", ".hg", ".svn", ".bzr")
PER_DOCUMENT_TOKENS = 3  # BOS, EOS and a tokenizer's word prefix, beyond one per byte
LOOSE_TOKENS_PER_BYTE = 3  # an undecodable byte becomes U+FFFD, 3 bytes of UTF-8
EXACT_READ_LIMIT = 256 * 2**20  # read a source for its exact text lengths only up to this size
# .jsonl sources up to this size are read to check the held-out split's documents one by one
EXACT_EVAL_READ_LIMIT = 32 * 2**20


# What each data.source reads, as the run's start and its errors say it.
SOURCE_TEXT = {"stdlib": "the Python standard library's .py files",
               "files": "data.path", "synthetic": "random token sequences"}


def source_line(d) -> str:
    """The line a run prints at start about what it reads (`d`: a config's data section): the
    source, the tokenizer and the held-out share."""
    what = (f"data.path {d.path!r}" + (f" weighted {d.weights}" if d.weights else "")
            if d.source == "files" else f"{SOURCE_TEXT[d.source]} (data.source = {d.source})")
    held = (f", {d.eval_fraction:g} of the documents held out for evaluation"
            if d.source != "synthetic" else "")
    return f"data: {what}, tokenizer {d.tokenizer}{held}"


def record_kind(path: str) -> str | None:
    """'jsonl' (.jsonl, .jsonl.gz) or 'parquet' for a file of records, None for a text file
    (one document)."""
    name = path.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return None


def stdlib_files() -> list[str]:
    """The Python standard library's .py files (without site-packages), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
    return sorted(f for f in files if "site-packages" not in f and "dist-packages" not in f)


def listed_files(path: str) -> list[str]:
    """Every file a data.path source names (below a directory, outside version-control
    directories; or a glob's files), binary ones included: an upper bound on what
    `hetjax.data.text_files` keeps, found without reading any file."""
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        files = []
        for d, dirs, fs in os.walk(path):
            dirs[:] = [x for x in dirs if x not in VCS_DIRS]
            files += [os.path.join(d, f) for f in fs]
    else:
        files = glob.glob(path, recursive=True)
    return sorted({os.path.abspath(f) for f in files if os.path.isfile(f)})


@dataclass
class SourceSize:
    """Upper bounds on one source's documents and on each document's tokens (None: no cheap
    bound; `doc_tokens` lists the documents whose bound is known)."""

    files: int
    documents: int | None
    doc_tokens: list[int] | None

    @property
    def tokens(self) -> int | None:
        return None if self.doc_tokens is None else sum(self.doc_tokens)


def _jsonl_texts(path: str, field: str) -> list[int] | None:
    """The UTF-8 length of each record's `field` in a plain .jsonl file (None where the file
    cannot be read as such: the preparation will say why)."""
    sizes = []
    try:
        with open(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                text = json.loads(line).get(field)
                sizes.append(len(text.encode("utf-8")) if isinstance(text, str) else 0)
    except (OSError, ValueError, AttributeError):
        return None
    return sizes


def _parquet_rows(path: str) -> int | None:
    try:
        import pyarrow.parquet as pq

        return int(pq.read_metadata(path).num_rows)
    except Exception:  # noqa: BLE001 - unreadable here: the preparation reports it
        return None


def source_size(files: list[str], field: str, exact: bool = False) -> SourceSize:
    """Bounds for the documents of `files`: loose ones from sizes and footers, or (`exact`,
    when they hold at most EXACT_READ_LIMIT bytes) each text or plain .jsonl file read for its
    documents' exact UTF-8 lengths."""
    small = sum(os.path.getsize(p) for p in files) <= EXACT_READ_LIMIT
    exact = exact and small
    docs: int | None = 0
    tokens: list[int] | None = []
    for path in files:
        kind, name = record_kind(path), path.lower()
        size = os.path.getsize(path)
        if kind == "parquet" or name.endswith(".gz"):
            n = _parquet_rows(path) if kind == "parquet" else None
            docs = None if docs is None or n is None else docs + n
            tokens = None
            continue
        if kind == "jsonl":
            lengths = _jsonl_texts(path, field) if exact else None
            if lengths is None:  # at most one document a line, all of the file's bytes
                if small:
                    with open(path, "rb") as f:
                        n = 1 + sum(chunk.count(b"\n")
                                    for chunk in iter(lambda: f.read(2**20), b""))
                else:  # not read: each record is at least {"FIELD":""} and a newline
                    n = (size + 1) // (len(field.encode()) + 8)
                bound = [LOOSE_TOKENS_PER_BYTE * size + PER_DOCUMENT_TOKENS * n]
            else:
                n, bound = len(lengths), [b + PER_DOCUMENT_TOKENS for b in lengths]
        else:
            if exact:
                with open(path, "rb") as f:
                    utf8 = len(f.read().decode("utf-8", errors="replace").encode("utf-8"))
                bound = [utf8 + PER_DOCUMENT_TOKENS]
            else:
                bound = [LOOSE_TOKENS_PER_BYTE * size + PER_DOCUMENT_TOKENS]
            n = 1
        docs = None if docs is None else docs + n
        if tokens is not None:
            tokens += bound
    return SourceSize(len(files), docs, tokens)


def least_eval_fraction(documents: int) -> float:
    """The smallest eval_fraction, to three decimals, that holds out one of `documents`
    (as `hetjax.data.split_documents` counts: int(fraction x documents))."""
    f = math.ceil(1000 / documents) / 1000
    while int(f * documents) < 1:
        f += 0.001
    return round(f, 3)


def _check_source(name: str, files: list[str], c, eval_needed: bool) -> None:
    d, t = c.data, c.train
    row = t.seq_len + 1
    if not files:
        raise ConfigError("data.path", f"{name!r} names no files (an empty directory?)",
                          "put text, .jsonl or .parquet files there, or point data.path at a "
                          "directory or glob that has them, e.g. '/data/**/*.txt'")
    size = source_size(files, d.field)
    where = f"{name!r}" if d.source == "files" else "the stdlib corpus"
    if eval_needed and size.documents is not None:
        n = size.documents
        if int(d.eval_fraction * n) < 1:
            least = least_eval_fraction(n)
            fix = (f"set --config.data.eval_fraction={least} (holds out one document) or "
                   "--config.eval.every=0" if least <= 0.5 else
                   "add documents, or set --config.eval.every=0 (no evaluation)")
            raise ConfigError("data.eval_fraction",
                              f"{d.eval_fraction} of the {n} document{'s' * (n != 1)} of "
                              f"{where} holds out none for evaluation (eval.every = "
                              f"{c.eval.every})", fix)

    def sequences(doc_tokens: list[int]) -> int:
        return sum(b + 1 for b in doc_tokens) // row  # + 1: the EOS after each document

    if size.tokens is None:
        return
    # The loose bound is at most 3x the exact one: below 3 batches, the exact one may fail.
    if sequences(size.doc_tokens) < LOOSE_TOKENS_PER_BYTE * t.batch_size:
        size = source_size(files, d.field, exact=True)
        most = sequences(size.doc_tokens)
        if most < t.batch_size:
            raise ConfigError(
                "train.batch_size",
                f"{where} ({size.files} file{'s' * (size.files != 1)}) makes at most {most} "
                f"sequences of train.seq_len + 1 = {row} tokens, fewer than one batch of "
                f"{t.batch_size}", f"add text, or lower train.batch_size (to at most "
                f"{max(most, 1)}) or train.seq_len")
    if (eval_needed and size.documents is not None and size.documents != len(size.doc_tokens)
            and sum(os.path.getsize(p) for p in files) <= EXACT_EVAL_READ_LIMIT):
        # .jsonl records are bounded per file, not per document: the held-out documents'
        # sizes need the records read (cheap at this size)
        size = source_size(files, d.field, exact=True)
    if eval_needed and size.documents == len(size.doc_tokens):
        n_eval = int(d.eval_fraction * size.documents)
        largest = sorted(size.doc_tokens, reverse=True)[:n_eval]
        if sequences(largest) < LOOSE_TOKENS_PER_BYTE * t.batch_size:
            size = source_size(files, d.field, exact=True)
            if size.documents != len(size.doc_tokens):
                return
            n_eval = int(d.eval_fraction * size.documents)
            most = sequences(sorted(size.doc_tokens, reverse=True)[:n_eval])
            if most < t.batch_size:
                raise ConfigError(
                    "data.eval_fraction",
                    f"{d.eval_fraction} of the {size.documents} documents of {where} holds "
                    f"out {n_eval}, which make at most {most} sequences of {row} tokens, "
                    f"fewer than one evaluation batch of train.batch_size = {t.batch_size}",
                    "raise data.eval_fraction, lower train.batch_size or train.seq_len, or "
                    "set --config.eval.every=0")


def check_corpus_size(c, eval_needed: bool | None = None) -> None:
    """Refuse a config whose corpus cannot give one training batch, or (`eval_needed`, default
    when eval.every > 0) one held-out document and one evaluation batch; ConfigError naming
    the field and the fix. Each weighted source (data.weights) is its own corpus."""
    d = c.data
    if eval_needed is None:
        eval_needed = bool(c.eval.every)
    if d.source == "synthetic":
        return
    if d.source == "stdlib":
        _check_source("stdlib", stdlib_files(), c, eval_needed)
        return
    paths = [os.path.expanduser(p.strip()) for p in d.path.split(",")]
    if d.weights:
        for p in paths:
            _check_source(p, listed_files(p), c, eval_needed)
    else:
        for p in paths:  # an empty source among several is named on its own
            if not listed_files(p):
                _check_source(p, [], c, eval_needed)
        _check_source(d.path, sorted({f for p in paths for f in listed_files(p)}), c,
                      eval_needed)


__all__ = ["SOURCE_TEXT", "VCS_DIRS", "check_corpus_size", "least_eval_fraction",
           "listed_files", "record_kind", "source_line", "source_size", "stdlib_files"]

"""Training data: corpora, packing into fixed-length rows, and a grain loader of global batches.

Corpora: the Python standard library's own sources (every machine has them, no download), a
user's directories, globs or files of text, JSON Lines or Parquet (a record's `data.field` is a
document), all prepared once by tfds (`hetjax.text_dataset`), or a deterministic synthetic source
for tests. A few documents (`data.eval_fraction`) are held out for evaluation. Several sources
(`data.path` joined by commas) are one corpus, or, with `data.weights`, a mixture (`MixedRows`).

Packing: the corpus is tokenized once per tokenizer and cached beside it (memory-mapped
.npy); the training documents, in an order fixed by the seed, each begun by BOS when the
tokenizer adds one, are joined by the tokenizer's EOS into one stream that is cut into rows of
`seq_len + 1` tokens, so every document boundary stays visible as EOS (then BOS) for the packer's
document masks. `PackedRows` makes every row addressable (row i is tokens
[i (L+1), (i+1)(L+1)) of the stream, one or two slices of the cache), so a process reads only the rows it needs. grain's own packers are sequential
iterators: every process would have to pack the whole global stream to find its rows, and
their position would depend on the stream itself.

Loading (`Loader`, grain): rows are shuffled globally with the seed (a new order each epoch),
step k's global batch is rows [k B, (k+1) B) of that order, and a loader yields only the rows of
the global batch that its process's devices hold (`rows`), prefetched by background threads.
Its state is the next step, so a checkpoint resumes at the exact next example under any plan
and any number of processes.
"""

from __future__ import annotations

import glob
import os
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import grain
import numpy as np

from hetjax.corpus_size import VCS_DIRS, record_kind, stdlib_files  # noqa: F401 - re-exported
from hetjax.errors import HetjaxError
from hetjax.tokenizer import ByteTokenizer  # noqa: F401 - the default tokenizer, re-exported
from hetjax.tokenizer import padded_vocab  # noqa: F401 - re-exported (the planner reads it there)

SYNTHETIC_ROWS = 4096  # distinct synthetic rows (an epoch); fixed so runs of any length agree


# --- corpora -------------------------------------------------------------------------------------
_reported: set[str] = set()  # data.path values whose skipped files were reported


def _binary(path: str) -> bool:
    """A NUL byte in the first 8 KiB: not a text file (as git and grep decide)."""
    try:
        with open(path, "rb") as f:
            return b"\0" in f.read(8192)
    except OSError:
        return False


def text_files(path: str) -> list[str]:
    """Files named by a directory (all files below it, but not in version-control directories),
    a glob or a file, without binary files (record files -- .parquet, .jsonl.gz -- are read as
    records); what was skipped is reported once, with counts."""
    vcs = 0
    if os.path.isdir(path):
        files = []
        for d, dirs, fs in os.walk(path):
            for name in [x for x in dirs if x in VCS_DIRS]:
                dirs.remove(name)
                vcs += sum(len(f) for _, _, f in os.walk(os.path.join(d, name)))
            files += [os.path.join(d, f) for f in fs]
    else:
        files = glob.glob(path, recursive=True)
    files = sorted(os.path.abspath(f) for f in files if os.path.isfile(f))
    binary = [f for f in files if record_kind(f) is None and _binary(f)]
    files = [f for f in files if f not in set(binary)]
    if (vcs or binary) and path not in _reported:
        _reported.add(path)
        parts = ([f"{vcs} files in version-control directories ({', '.join(VCS_DIRS)})"]
                 if vcs else []) + ([f"{len(binary)} binary files (e.g. {binary[0]})"]
                                    if binary else [])
        print(f"hetjax: data.path {path!r}: using {len(files)} text files; skipped "
              f"{' and '.join(parts)}", file=sys.stderr, flush=True)
    if not files:
        only = " but binary or version-control ones" if vcs or binary else ""
        raise HetjaxError(f"data.path {path!r} names no files{only}; give a directory of text "
                          "files or a glob such as '/data/**/*.txt'")
    return files


def source_paths(data_cfg) -> list[str]:
    """The comma-separated sources of `data.path`."""
    return [os.path.expanduser(p.strip()) for p in data_cfg.path.split(",")]


def source_weights(data_cfg) -> list[float] | None:
    """`data.weights` normalised to sum to 1, or None (no mixture)."""
    if not data_cfg.weights:
        return None
    w = np.array([float(x) for x in data_cfg.weights.split(",")])
    return list(w / w.sum())


def corpus_files(data_cfg) -> tuple[list[str], str]:
    """The files of a text source (every source of `data.path` together) and the kind used to
    name its prepared dataset."""
    if data_cfg.source == "stdlib":
        return stdlib_files(), "stdlib"
    return sorted({f for p in source_paths(data_cfg) for f in text_files(p)}), "files"


def split_documents(n: int, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) document ids: a fixed pseudo-random `eval_fraction` of them held out.

    The split does not depend on the training seed, so runs with other seeds evaluate on
    the same documents."""
    order = np.random.default_rng(0x5EED).permutation(n)
    n_eval = int(eval_fraction * n)
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def tokenized_corpus(docs, tokenizer, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Every document's tokens (BOS first when the tokenizer adds it, no EOS), concatenated in
    document order, and the count of each.

    Tokenized once per (prepared corpus, tokenizer) and cached beside the corpus as .npy files
    that later runs memory-map, so rows are slices and no tokenizer runs while training."""
    base = os.path.join(where, f"tokens.{tokenizer.fingerprint}")
    try:
        ids, counts = np.load(base + ".ids.npy", mmap_mode="r"), np.load(base + ".counts.npy")
        if len(counts) == len(docs) and len(ids) == counts.sum():
            return ids, counts
    except (OSError, ValueError):
        pass  # not built yet, or damaged: build it again
    from hetjax.text_dataset import document_text

    print(f"hetjax: tokenizing {len(docs)} documents once (cached in {base}.*.npy)",
          file=sys.stderr, flush=True)
    parts = [tokenizer.encode_document(document_text(docs, i, where)) for i in range(len(docs))]
    counts = np.array([len(p) for p in parts], np.int64)
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    top = int(ids.max()) if len(ids) else 0
    ids = ids.astype(np.uint8 if top < 2**8 else np.uint16 if top < 2**16 else np.int32)
    # Each file appears whole (write, then rename) and the counts last, so processes sharing
    # the directory never read a half-written cache.
    for suffix, array in ((".ids.npy", ids), (".counts.npy", counts)):
        tmp = f"{base}.{os.getpid()}.tmp{suffix}"
        np.save(tmp, array)
        os.replace(tmp, base + suffix)
    return np.load(base + ".ids.npy", mmap_mode="r"), counts


# --- packing -------------------------------------------------------------------------------------
class PackedRows:
    """Rows of `row_len` tokens cut from documents joined by EOS, each readable on its own.

    `tokens` holds every document's tokens in document order and `counts` their lengths;
    `doc_ids` is the order of the stream. Empty documents are skipped.
    """

    def __init__(self, tokens: np.ndarray, counts: np.ndarray, doc_ids: np.ndarray,
                 eos_id: int, row_len: int):
        doc_ids = np.asarray(doc_ids)
        self.doc_ids = doc_ids[counts[doc_ids] > 0]  # empty documents add nothing, not an EOS
        self.tokens, self.counts, self.eos_id, self.row_len = tokens, counts, eos_id, row_len
        self.first = np.cumsum(counts) - counts  # where each document starts in `tokens`
        self.lengths = counts[self.doc_ids] + 1  # each document is followed by EOS
        self.ends = np.cumsum(self.lengths)  # where each stream entry ends in the stream
        self.total = int(self.ends[-1]) if len(self.ends) else 0

    def __len__(self) -> int:
        return self.total // self.row_len

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        a, b = i * self.row_len, (i + 1) * self.row_len
        j = int(np.searchsorted(self.ends, a, side="right"))  # the document holding token a
        row, filled = np.empty(self.row_len, np.int32), 0
        while a < b:
            d, start = self.doc_ids[j], int(self.ends[j] - self.lengths[j])
            lo, hi = a - start, min(b, int(self.ends[j])) - start  # in document j + its EOS
            n = int(self.counts[d])
            piece = self.tokens[self.first[d] + lo:self.first[d] + min(hi, n)]
            row[filled:filled + len(piece)] = piece
            filled += len(piece)
            if hi > n:
                row[filled] = self.eos_id
                filled += 1
            a, j = start + hi, j + 1
        return row


class MixedRows:
    """Rows drawn from several row sources in proportion to `weights`, each readable on its own.

    The mixture is cut into blocks of `block` rows; every block holds round(w_s * block) rows of
    source s (largest remainders, at least one) in one fixed shuffled pattern, so any window of
    whole blocks has the weights exactly and the loader's global shuffle mixes them further.
    Source s's k-th row in the mixture is its row k mod len(s). The mixture is as many blocks
    as it takes to hold every row of every source at least once: a source weighted above its
    share of the rows repeats, none is cut short.
    """

    def __init__(self, sources: Sequence[Sequence[np.ndarray]], weights: Sequence[float],
                 block: int = 1000, seed: int = 0):
        w = np.asarray(weights, float) / np.sum(weights)
        counts = np.floor(w * block).astype(int)
        by_remainder = np.argsort(-(w * block - counts), kind="stable")
        counts[by_remainder[:block - counts.sum()]] += 1
        for s in np.flatnonzero(counts == 0):  # a tiny weight still gets one row a block
            counts[np.argmax(counts)] -= 1
            counts[s] = 1
        self.sources, self.counts, self.block = list(sources), counts, block
        self.pattern = np.random.default_rng(seed).permutation(np.repeat(np.arange(len(w)),
                                                                         counts))
        # occurrence[p]: how many rows of the same source come before position p in a block
        self.occurrence = np.zeros(block, np.int64)
        for s in range(len(w)):
            where = np.flatnonzero(self.pattern == s)
            self.occurrence[where] = np.arange(len(where))
        self.blocks = max(-(-len(src) // int(c)) for src, c in zip(self.sources, counts))

    def __len__(self) -> int:
        return self.blocks * self.block

    def source_of(self, i: int) -> tuple[int, int]:
        """(source, row of that source) of mixture row i."""
        b, p = divmod(i, self.block)
        s = int(self.pattern[p])
        return s, (b * int(self.counts[s]) + int(self.occurrence[p])) % len(self.sources[s])

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        s, j = self.source_of(i)
        return self.sources[s][j]


def synthetic_sequences(vocab: int, seq_len: int, n: int, seed: int,
                        split: str = "train") -> np.ndarray:
    """[n, seq_len + 1] learnable rows: each row starts at a random token and follows one fixed
    random successor table (a deterministic bigram chain), so the achievable loss is ~0.
    The eval split follows the same table from other starting tokens."""
    successor = np.random.default_rng(seed).permutation(vocab)
    starts = np.random.default_rng((seed, split == "eval")).integers(0, vocab, size=n)
    rows = np.empty((n, seq_len + 1), np.int32)
    rows[:, 0] = starts
    for t in range(seq_len):
        rows[:, t + 1] = successor[rows[:, t]]
    return rows


# --- loading -------------------------------------------------------------------------------------
def segment_ids(rows: np.ndarray, eos_id: int) -> np.ndarray:
    """[n, L] int32 document numbers 1, 2, ... of rows' inputs ([n, L + 1] packed rows).

    A document's EOS belongs to it (it is the last token its document attends to); the token
    after an EOS starts the next document. Tokenized text never holds EOS, so the EOS positions
    are exactly the packer's document ends."""
    inputs = rows[:, :-1]
    ends = np.cumsum(inputs == eos_id, axis=1, dtype=np.int32)
    return 1 + ends - (inputs == eos_id)  # EOSs strictly before each position, + 1


def _inputs_and_targets(rows: np.ndarray, eos_id: int | None = None) -> dict[str, np.ndarray]:
    batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:]}
    if eos_id is not None:
        batch["segment_ids"] = segment_ids(rows, eos_id)
    return batch


class Loader:
    """Batches of step 0, 1, ...: the rows `rows` (indices into the global batch) of each.

    Built on grain: `MapDataset.source(rows).shuffle(seed).repeat()` orders the rows (a new
    permutation each epoch), step k takes positions [k B, (k+1) B) of that order, and
    `to_iter_dataset` prefetches upcoming steps in `threads` background threads. `get_state`
    / `set_state` are grain's: {"next_index": next step}. With `eos_id` (packed documents),
    batches also carry `segment_ids` (the document of each input token, `segment_ids`).
    """

    def __init__(self, source: Sequence[np.ndarray], batch_size: int, seed: int,
                 rows: Sequence[int] | None = None, *, shuffle: bool = True, prefetch: int = 4,
                 threads: int = 2, eos_id: int | None = None,
                 what: str = "the data", fix: str = "add text, lower train.seq_len or lower "
                 "train.batch_size"):
        if len(source) < batch_size:
            raise HetjaxError(f"{what} packs into {len(source)} sequences, fewer than one "
                              f"batch of {batch_size}; {fix}")
        self.batch_size = batch_size
        self.sequences = len(source)  # distinct rows before the stream repeats
        self.rows = np.arange(batch_size) if rows is None else np.asarray(rows)
        if self.rows.size == 0 or self.rows.min() < 0 or self.rows.max() >= batch_size:
            raise ValueError(f"rows must be indices into a batch of {batch_size}")
        ordered = grain.MapDataset.source(source)
        if shuffle:
            ordered = ordered.shuffle(seed % 2**32)
        self.ordered = ordered.repeat()

        def local_batch(step: int) -> dict[str, np.ndarray]:
            base = step * batch_size
            return _inputs_and_targets(np.stack([self.ordered[base + r] for r in self.rows]),
                                       eos_id)

        self.steps = grain.MapDataset.range(sys.maxsize // batch_size).map(local_batch)
        self._iter = self.steps.to_iter_dataset(grain.ReadOptions(
            num_threads=threads, prefetch_buffer_size=prefetch)).__iter__()
        self.waited_s = 0.0  # total time __next__ blocked: the training loop's input wait

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The rows of step `step`'s batch, read directly (no prefetch, no state change)."""
        return self.steps[step]

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        t = time.perf_counter()
        batch = next(self._iter)
        self.waited_s += time.perf_counter() - t
        return batch

    def get_state(self) -> dict:
        return self._iter.get_state()

    def set_state(self, state: dict) -> None:
        self._iter.set_state(state)

    @property
    def step(self) -> int:
        """The step whose batch comes next."""
        return int(self.get_state()["next_index"])


@dataclass(frozen=True)
class DataSpec:
    """What fixes the batch stream; a checkpoint's data position is valid only for the same."""

    source: str
    corpus: str  # the prepared corpus name (with its fingerprint), or "synthetic"
    tokenizer: str
    seq_len: int
    batch_size: int
    seed: int
    eval_fraction: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _packed_source(files: list[str], kind: str, data_cfg, tokenizer, seq_len: int, seed: int,
                   split: str) -> tuple[PackedRows, str]:
    """The packed rows of one split of one prepared corpus, and the corpus's name."""
    from hetjax.text_dataset import open_corpus

    docs, where = open_corpus(files, data_cfg.dir, kind, data_cfg.field)
    train_ids, eval_ids = split_documents(len(docs), data_cfg.eval_fraction)
    ids = train_ids if split == "train" else eval_ids
    if not len(ids):
        raise HetjaxError(f"data.eval_fraction = {data_cfg.eval_fraction} of the corpus's "
                          f"{len(docs)} documents ({where}) holds none out for evaluation; "
                          "raise data.eval_fraction or set eval.every = 0")
    tokens, counts = tokenized_corpus(docs, tokenizer, where)
    if split == "train":  # a seeded document order, so rows mix neighbouring files less
        ids = np.random.default_rng(seed).permutation(ids)
    rows = PackedRows(tokens, counts, ids, tokenizer.eos_id, seq_len + 1)
    if len(rows) == 0:
        raise HetjaxError(f"the {split} documents of {where} hold {rows.total} tokens with EOS, "
                          f"too few for one sequence of train.seq_len + 1 = {seq_len + 1}; add "
                          "text or lower train.seq_len")
    return rows, os.path.basename(os.path.dirname(where))


def row_source(data_cfg, tokenizer, seq_len: int, seed: int,
               split: str = "train") -> tuple[Sequence[np.ndarray], str]:
    """The packed rows of one split of the configured corpus (or mixture), and its name."""
    if data_cfg.source == "synthetic":
        return synthetic_sequences(tokenizer.vocab_size, seq_len, SYNTHETIC_ROWS, seed,
                                   split), "synthetic"
    weights = source_weights(data_cfg) if data_cfg.source == "files" else None
    if weights is None:
        files, kind = corpus_files(data_cfg)
        return _packed_source(files, kind, data_cfg, tokenizer, seq_len, seed, split)
    # A mixture: each source is prepared, tokenized and packed on its own (a source shared
    # by several mixtures is prepared once), then rows are drawn by weight.
    parts = [_packed_source(text_files(p), "files", data_cfg, tokenizer, seq_len, seed, split)
             for p in source_paths(data_cfg)]
    name = "+".join(f"{n}*{w:.4g}" for (_, n), w in zip(parts, weights))
    return MixedRows([rows for rows, _ in parts], weights, seed=seed), name


def make_loader(config, tokenizer, rows: Sequence[int] | None = None,
                split: str = "train") -> tuple[Loader, DataSpec]:
    """The loader of a config's data for the batch rows `rows` (default all), and its spec.

    The eval split is neither shuffled nor prefetched: evaluation reads fixed batches."""
    d, t = config.data, config.train
    source, corpus = row_source(d, tokenizer, t.seq_len, t.seed, split)
    train = split == "train"
    # Synthetic rows are one sequence each (and may hold the EOS id as an ordinary token).
    eos = tokenizer.eos_id if d.document_mask and d.source != "synthetic" else None
    held_out = dict(what=f"the held-out split (data.eval_fraction = {d.eval_fraction} of the "
                         f"documents, for evaluation)",
                    fix="raise data.eval_fraction, lower train.batch_size or train.seq_len, or "
                        "set --config.eval.every=0") if not train else {}
    loader = Loader(source, t.batch_size, t.seed, rows, shuffle=train,
                    prefetch=d.prefetch if train else 1, threads=d.threads if train else 0,
                    eos_id=eos, **held_out)
    spec = DataSpec(d.source, corpus, tokenizer.fingerprint, t.seq_len, t.batch_size, t.seed,
                    float(d.eval_fraction))
    return loader, spec


def train_tokenizer(data_cfg, vocab_size: int, out_path: str):
    """Train a SentencePiece tokenizer on the training documents of the configured corpus."""
    from hetjax.text_dataset import document_text, open_corpus
    from hetjax.tokenizer import train_sentencepiece

    if data_cfg.source == "synthetic":
        raise HetjaxError("data.source = 'synthetic' has no text to train a tokenizer on; use "
                          "--config.data.source=stdlib or files with --config.data.path=...")
    files, kind = corpus_files(data_cfg)
    docs, where = open_corpus(files, data_cfg.dir, kind, data_cfg.field)
    train_ids, _ = split_documents(len(docs), data_cfg.eval_fraction)
    tokenizer = train_sentencepiece((document_text(docs, int(i), where) for i in train_ids),
                                    vocab_size, out_path)
    return tokenizer, len(train_ids), where

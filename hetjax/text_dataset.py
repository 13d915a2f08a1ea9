"""The tfds dataset of a local corpus, prepared once as array_record: one document per text
file, one per record of a `.jsonl` or `.parquet` file (its `field`).

`open_corpus(files, data_dir, kind, field)` prepares the files into `data_dir` the first time
(`hetjax_text/<kind>_<fingerprint>/1.0.0/`) and returns a random-access source of documents
(dicts with `text` and `path` as UTF-8 bytes). The fingerprint is the corpus's content identity:
a hash of each file's name below the corpus root, size and bytes (and the field, when a file has
records), so an edited corpus prepares anew instead of serving stale text, while `touch`, `cp`
without `-p`, a `git checkout` or a copy to node-local disk keep the identity (and a checkpoint's
resume). Reading the corpus to hash it happens once per (paths, sizes, modification times): the
result is remembered under `<data_dir>/hetjax_text/identity/`. A record file without the field is
refused before anything is prepared, naming the fields it has; undecodable bytes are reported
per file. The array_record format needs no TensorFlow. The builder lives in this importable
module because tfds cannot prepare a builder defined in `__main__`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys

import tensorflow_datasets as tfds
from etils import epath

from hetjax import noise
from hetjax.corpus_size import record_kind
from hetjax.errors import HetjaxError


@dataclasses.dataclass
class CorpusConfig(tfds.core.BuilderConfig):
    # repr=False: tfds logs the config, and a corpus can have many thousands of files.
    files: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    field: str = "text"


class HetjaxText(tfds.core.GeneratorBasedBuilder):
    """Documents of a local text corpus, one per file."""

    VERSION = tfds.core.Version("1.0.0")

    # tfds derives this from the package via `importlib_resources`, which is not a dependency;
    # the answer is simply this file.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
        return epath.Path(__file__)

    def _info(self):
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({"text": tfds.features.Text(),
                                                 "path": tfds.features.Text()}),
            description="Local text files (one document per file) and .jsonl/.parquet records "
                        "(one document per record) (hetjax).")

    # tfds announces a "download" of "Unknown size" and the finished preparation in bold on
    # stdout; open_corpus says what happens in one line of its own (`hetjax.noise`).
    def _log_download_bytes(self) -> None:
        if noise.verbose():
            super()._log_download_bytes()

    def _log_download_done(self) -> None:
        if noise.verbose():
            super()._log_download_done()

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        field = self.builder_config.field
        for path in self.builder_config.files:
            kind = record_kind(path)
            if kind is None:
                with open(path, "rb") as f:
                    raw = f.read()
                # Undecodable bytes become U+FFFD, so every tokenizer sees valid UTF-8 -- said
                # per file, not silently (a Latin-1 file loses its accented letters).
                text = raw.decode("utf-8", errors="replace")
                bad = text.count("\ufffd") - raw.count("\ufffd".encode())
                if bad:  # reported when the preparation ends (not inside tfds' progress bars)
                    self.undecodable.append((path, bad))
                yield path, {"text": text, "path": path}
                continue
            for i, text in enumerate(RECORD_READERS[kind](path, field)):
                yield f"{path}:{i}", {"text": text, "path": path}


# --- record files ----------------------------------------------------------------------------
def _no_field(path: str, field: str, fields, where: str = "") -> HetjaxError:
    have = ", ".join(repr(f) for f in fields) or "none"
    return HetjaxError(f"{path}{where} has no field {field!r} (its fields: {have}); set "
                       "--config.data.field to the field holding the text")


def _jsonl_texts(path: str, field: str):
    """The `field` of every record of a JSON Lines file, gzipped or not (blank lines skipped)."""
    import gzip

    with (gzip.open if path.lower().endswith(".gz") else open)(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise HetjaxError(f"{path}:{n} is not a JSON object ({e}); a .jsonl file holds "
                                  "one JSON object per line") from None
            if not isinstance(record, dict):
                raise HetjaxError(f"{path}:{n} is a JSON {type(record).__name__}, not an object;"
                                  " a .jsonl file holds one JSON object per line")
            if field not in record:
                raise _no_field(path, field, list(record), f":{n}")
            text = record[field]
            if not isinstance(text, str):
                raise HetjaxError(f"{path}:{n}: field {field!r} holds a "
                                  f"{type(text).__name__}, not text; set --config.data.field "
                                  "to a field of strings")
            yield text


def _parquet_texts(path: str, field: str):
    """The `field` column of a Parquet file, read a batch of rows at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise HetjaxError(f"reading {path} needs the 'pyarrow' package; install it with "
                          "pip install 'hetjax[parquet]'") from None
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        raise HetjaxError(f"{path} is not a readable Parquet file ({e})") from None
    names = f.schema_arrow.names
    if field not in names:
        raise _no_field(path, field, names)
    column = f.schema_arrow.field(field)
    import pyarrow as pa

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise HetjaxError(f"{path}: column {field!r} is {column.type}, not text; set "
                          "--config.data.field to a string column")
    for batch in f.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield text or ""  # a null is an empty document


RECORD_READERS = {"jsonl": _jsonl_texts, "parquet": _parquet_texts}


def check_field(path: str, field: str) -> None:
    """Raise the clear error now if the first record of `path` lacks `field` (before a
    preparation that would fail inside tfds)."""
    kind = record_kind(path)
    if kind is not None:
        next(iter(RECORD_READERS[kind](path, field)), None)


def _stat_key(files: list[str], field: str) -> str:
    h = hashlib.sha1()
    for path in files:
        st = os.stat(path)
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    h.update(f"field\0{field}".encode())
    return h.hexdigest()


def content_fingerprint(files: list[str], field: str = "text") -> str:
    """A short hash of each file's name relative to the corpus root, its size and its bytes
    (and of the field, when a file holds records: another field is another corpus)."""
    root = os.path.commonpath(files) if len(files) > 1 else os.path.dirname(files[0])
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        h.update(f"{os.path.relpath(path, root)}\0{len(data)}\0".encode())
        h.update(hashlib.sha256(data).digest())
    if any(record_kind(p) for p in files):
        h.update(f"field\0{field}".encode())
    return h.hexdigest()[:12]


def fingerprint(files: list[str], data_dir: str | None = None, field: str = "text") -> str:
    """The corpus's content identity (`content_fingerprint`), read back from `data_dir` when
    the files' paths, sizes and modification times are those it was computed for."""
    memo = os.path.join(data_dir, "hetjax_text", "identity", _stat_key(files, field)) \
        if data_dir else None
    try:
        with open(memo) as f:
            known = f.read().strip()
        if len(known) == 12:
            return known
    except (OSError, TypeError):
        pass
    value = content_fingerprint(files, field)
    if memo:
        try:  # whole or not at all: processes sharing the directory read it
            os.makedirs(os.path.dirname(memo), exist_ok=True)
            tmp = f"{memo}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(value)
            os.replace(tmp, memo)
        except OSError:
            pass  # a read-only data dir: hash again next time
    return value


class _DropCustomConfigWarning(logging.Filter):
    """tfds warns "Using custom data configuration" for every corpus, but every corpus *is* a
    custom configuration (named by its files' fingerprint): the warning says nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Using custom data configuration")


logging.getLogger("absl").addFilter(_DropCustomConfigWarning())
noise.install()


def default_data_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "hetjax", "tfds")


def open_corpus(files: list[str], data_dir: str, kind: str, field: str = "text"):
    """The prepared documents of `files` (preparing them into `data_dir` if needed), the
    `field` of each record of their .jsonl/.parquet files.

    Returns a tfds array_record data source (`len(src)` documents, `src[i]["text"]` bytes)
    and the directory it was prepared in.
    """
    data_dir = os.path.expanduser(data_dir or default_data_dir())
    config = CorpusConfig(name=f"{kind}_{fingerprint(files, data_dir, field)}",
                          files=tuple(files), field=field)
    builder = HetjaxText(config=config, data_dir=data_dir, file_format="array_record")
    builder.undecodable = []
    if not builder.is_prepared():
        for path in files:
            check_field(path, field)
        print(f"hetjax: preparing the corpus ({len(files)} files) once into "
              f"{builder.data_dir}", file=sys.stderr, flush=True)
        try:
            with noise.quiet_tfds_progress():
                builder.download_and_prepare()
            for path, bad in builder.undecodable:
                print(f"hetjax: {path}: {bad} bytes are not UTF-8 and became U+FFFD; fix: "
                      "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8) if that "
                      "matters", file=sys.stderr, flush=True)
        except OSError as e:
            # Another process on this machine may have prepared it first (tfds renames a
            # finished preparation into place, so a lost race fails the rename).
            builder = HetjaxText(config=config, data_dir=data_dir, file_format="array_record")
            if not builder.is_prepared():
                raise HetjaxError(f"could not prepare the corpus into {data_dir}: {e}; set "
                                  "data.dir to a writable directory") from None
    where = str(builder.data_dir)
    try:
        source = builder.as_data_source()["train"]
        expected = builder.info.splits["train"].num_examples
    except Exception as e:  # noqa: BLE001 - any failure to open means the same fix
        raise corrupt(where, e) from None
    if len(source) != expected:
        raise corrupt(where, f"{len(source)} records, dataset_info.json says {expected}")
    for i in {0, len(source) - 1}:
        document_text(source, i, where)
    return source, where


def document_text(source, i: int, where: str) -> bytes:
    """The UTF-8 text of document i, or a clear error if its record cannot be read."""
    try:
        text = source[i]["text"]
    except Exception as e:  # noqa: BLE001 - any failure to read means the same fix
        raise corrupt(where, e) from None
    if not isinstance(text, bytes):  # a damaged array_record file decodes to None
        raise corrupt(where, f"record {i} does not decode")
    return text


def corrupt(where: str, problem) -> HetjaxError:
    if isinstance(problem, Exception):
        problem = f"{type(problem).__name__}: {problem}"
    return HetjaxError(f"the prepared dataset at {where} is corrupt ({problem}); delete that "
                       "directory and run again to prepare it anew")

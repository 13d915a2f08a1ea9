"""The tfds dataset of a local text corpus: one record per file, prepared once as array_record.

`open_corpus(files, data_dir, kind)` prepares the files into `data_dir` the first time
(`hetjax_text/<kind>_<fingerprint>/1.0.0/`) and returns a random-access source of documents
(dicts with `text` and `path` as UTF-8 bytes). The fingerprint is the corpus's content identity:
a hash of each file's name below the corpus root, size and bytes, so an edited corpus prepares
anew instead of serving stale text, while `touch`, `cp` without `-p`, a `git checkout` or a
copy to node-local disk keep the identity (and a checkpoint's resume). Reading the corpus to hash
it happens once per (paths, sizes, modification times): the result is remembered under
`<data_dir>/hetjax_text/identity/`. Undecodable bytes are reported per file. The array_record
format needs no TensorFlow. The builder lives in this importable module because
tfds cannot prepare a builder defined in `__main__`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import sys

import tensorflow_datasets as tfds
from etils import epath

from hetjax.errors import HetjaxError


@dataclasses.dataclass
class CorpusConfig(tfds.core.BuilderConfig):
    # repr=False: tfds logs the config, and a corpus can have many thousands of files.
    files: tuple[str, ...] = dataclasses.field(default=(), repr=False)


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
            description="Local text files, one document per file (hetjax).")

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for path in self.builder_config.files:
            with open(path, "rb") as f:
                raw = f.read()
            # Undecodable bytes become U+FFFD, so every tokenizer sees valid UTF-8 -- said per
            # file, not silently (a Latin-1 file loses its accented letters).
            text = raw.decode("utf-8", errors="replace")
            bad = text.count("\ufffd") - raw.count("\ufffd".encode())
            if bad:  # reported when the preparation ends (not inside tfds' progress bars)
                self.undecodable.append((path, bad))
            yield path, {"text": text, "path": path}


def _stat_key(files: list[str]) -> str:
    h = hashlib.sha1()
    for path in files:
        st = os.stat(path)
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def content_fingerprint(files: list[str]) -> str:
    """A short hash of each file's name relative to the corpus root, its size and its bytes."""
    root = os.path.commonpath(files) if len(files) > 1 else os.path.dirname(files[0])
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        h.update(f"{os.path.relpath(path, root)}\0{len(data)}\0".encode())
        h.update(hashlib.sha256(data).digest())
    return h.hexdigest()[:12]


def fingerprint(files: list[str], data_dir: str | None = None) -> str:
    """The corpus's content identity (`content_fingerprint`), read back from `data_dir` when
    the files' paths, sizes and modification times are those it was computed for."""
    memo = os.path.join(data_dir, "hetjax_text", "identity", _stat_key(files)) \
        if data_dir else None
    try:
        with open(memo) as f:
            known = f.read().strip()
        if len(known) == 12:
            return known
    except (OSError, TypeError):
        pass
    value = content_fingerprint(files)
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


def default_data_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "hetjax", "tfds")


def open_corpus(files: list[str], data_dir: str, kind: str):
    """The prepared documents of `files` (preparing them into `data_dir` if needed).

    Returns a tfds array_record data source (`len(src)` documents, `src[i]["text"]` bytes)
    and the directory it was prepared in.
    """
    data_dir = os.path.expanduser(data_dir or default_data_dir())
    config = CorpusConfig(name=f"{kind}_{fingerprint(files, data_dir)}", files=tuple(files))
    builder = HetjaxText(config=config, data_dir=data_dir, file_format="array_record")
    builder.undecodable = []
    if not builder.is_prepared():
        try:
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

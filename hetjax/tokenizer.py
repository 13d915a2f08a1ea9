"""Tokenizers: UTF-8 bytes (the default), SentencePiece, HuggingFace `tokenizer.json` and
tiktoken BPE rank files, one interface, found from a path.

A tokenizer turns a document (str or UTF-8 bytes) into int32 ids (`encode`, no special tokens;
`encode_document` adds BOS when `add_bos`), has an `eos_id` that ends each document when they are
packed, an optional `bos_id`, a `vocab_size`, and a `fingerprint` naming its exact vocabulary and
BOS choice (caches of token ids and checkpoints' data specs are keyed by it). `load_tokenizer(spec,
add_bos)` reads `data.tokenizer`: "byte", a SentencePiece `.model`, a HuggingFace `tokenizer.json`
(or a directory holding one), a tiktoken rank file (Llama-3's `tokenizer.model` is one), or a
directory written by `Tokenizer.save` (every checkpoint directory has one, `<checkpoint
dir>/tokenizer`). The format is read from the file's content, not its name: SentencePiece and
Llama-3 both call their file `tokenizer.model`. The optional packages (`sentencepiece`,
`tokenizers`, `tiktoken`) are imported only when a tokenizer of their kind is loaded.
"""

from __future__ import annotations

import abc
import base64
import hashlib
import io
import json
import os
import re
import shutil
from typing import Iterable

import numpy as np

from hetjax.errors import ConfigError, HetjaxError
from hetjax.files import inside

SAVED = "hetjax_tokenizer.json"  # the descriptor `Tokenizer.save` writes beside the files
ADD_BOS = ("auto", "true", "false")

# Llama-3's pre-tokenizer pattern (also cl100k_base's): how a tiktoken rank file splits text.
TIKTOKEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                    r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama-3's special tokens, numbered after the rank file's tokens: BOS, EOS, then reserved ones.
TIKTOKEN_SPECIALS = (["<|begin_of_text|>", "<|end_of_text|>"]
                     + [f"<|reserved_special_token_{i}|>" for i in range(4)]
                     + ["<|start_header_id|>", "<|end_header_id|>",
                        "<|reserved_special_token_4|>", "<|eot_id|>"]
                     + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)])
# Names of BOS / EOS in HF vocabularies, tried in order when tokenizer_config.json names none.
HF_BOS = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]")
HF_EOS = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[SEP]")


def padded_vocab(vocab_size: int, multiple: int = 128) -> int:
    """Vocabulary rounded up so the vocab axis splits evenly over tensor-parallel shards."""
    return -(-vocab_size // multiple) * multiple


def _optional(module: str, extra: str):
    """Import an optional dependency, or say which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise HetjaxError(f"this tokenizer needs the '{module}' package; install it with "
                          f"pip install 'hetjax[{extra}]'") from None


class Tokenizer(abc.ABC):
    """What every tokenizer has; subclasses set the vocabulary and implement encode/decode."""

    kind = ""
    vocab_size = 0
    eos_id = -1
    bos_id: int | None = None
    add_bos = False
    base_fingerprint = ""
    path = ""  # the file it was read from ("" for bytes)
    companions: tuple[str, ...] = ()  # files beside it that belong to it (HF configs)

    @property
    def fingerprint(self) -> str:
        return self.base_fingerprint + ("+bos" if self.add_bos else "")

    @abc.abstractmethod
    def encode(self, text: str | bytes) -> np.ndarray:
        """The ids of `text`, without special tokens (special-token text stays text)."""

    @abc.abstractmethod
    def decode(self, ids) -> str:
        """The text of `ids`, special tokens left out."""

    def encode_document(self, text: str | bytes) -> np.ndarray:
        """A document's ids as training sees them: BOS first when `add_bos` (EOS, which ends
        every document, is added by the packer). A prompt to continue is encoded the same
        way, so the model sees it as it saw the start of every training document."""
        ids = self.encode(text)
        return np.concatenate([[self.bos_id], ids]).astype(np.int32) if self.add_bos else ids

    def _set_bos(self, add_bos: str, name: str) -> None:
        """Resolve data.add_bos: 'auto' takes `self.add_bos` (the tokenizer's own convention,
        set by the subclass), 'true' needs a BOS token."""
        if add_bos not in ADD_BOS:
            raise ConfigError("data.add_bos", f"unknown value {add_bos!r}",
                              "use auto (as the tokenizer's own config says), true or false")
        if add_bos == "true" and self.bos_id is None:
            raise ConfigError("data.add_bos", f"is true, but the tokenizer {name} has no "
                              "beginning-of-sequence token",
                              "set --config.data.add_bos=auto or false")
        if add_bos != "auto":
            self.add_bos = add_bos == "true"

    def save(self, directory: str) -> None:
        """Copy the tokenizer's files into `directory` with a descriptor, so that
        `load_tokenizer(directory)` gives this tokenizer back (same fingerprint)."""
        tmp = f"{directory.rstrip('/')}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for f in filter(None, (self.path, *self.companions)):
            shutil.copyfile(f, os.path.join(tmp, os.path.basename(f)))
        with open(os.path.join(tmp, SAVED), "w") as f:
            json.dump({"kind": self.kind, "file": os.path.basename(self.path),
                       "add_bos": self.add_bos, "bos_id": self.bos_id, "eos_id": self.eos_id,
                       "vocab_size": self.vocab_size, "fingerprint": self.fingerprint}, f,
                      indent=1)
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens 0..255, and 256 as the end-of-document separator (no BOS)."""

    kind = "byte"
    eos_id = 256
    vocab_size = 257
    base_fingerprint = "byte"

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, str):
            text = text.encode("utf-8", errors="replace")
        return np.frombuffer(text, dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (BPE with byte fallback, so any text encodes). BOS is added when
    the model has a BOS piece (Llama-2's has; those `hetjax tokenizer train` writes have not)."""

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes, path: str = "", add_bos: str = "auto"):
        spm = _optional("sentencepiece", "sentencepiece")
        self.path = path
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = self._sp.vocab_size()
        self.eos_id = self._sp.eos_id()
        if self.eos_id < 0:
            raise HetjaxError(f"the SentencePiece model {path or '<memory>'} has no "
                              "end-of-sequence piece (eos_id = -1), which hetjax needs to join "
                              "documents; train one with 'hetjax tokenizer train'")
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.add_bos = self.bos_id is not None
        self._set_bos(add_bos, path)
        self.base_fingerprint = "sp-" + hashlib.sha1(model_proto).hexdigest()[:16]

    @classmethod
    def load(cls, path: str, add_bos: str = "auto") -> "SentencePieceTokenizer":
        try:
            with open(path, "rb") as f:
                proto = f.read()
            if not proto:  # sentencepiece reads b"" as a model without pieces
                raise HetjaxError(f"the tokenizer model {path!r} is an empty file; set "
                                  "data.tokenizer to 'byte' or to a file written by 'hetjax "
                                  "tokenizer train'")
            return cls(proto, path, add_bos)
        except OSError as e:
            raise HetjaxError(f"cannot read the tokenizer model {path!r} ({e.strerror}); set "
                              "data.tokenizer to 'byte' or to a file written by "
                              "'hetjax tokenizer train'") from None
        except RuntimeError as e:  # sentencepiece's parse error
            raise HetjaxError(f"{path!r} is not a SentencePiece model ({e}); train one with "
                              "'hetjax tokenizer train'") from None

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._sp.encode(text), dtype=np.int32)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
    """A HuggingFace `tokenizer.json` (the `tokenizers` package). BOS and EOS are the ones
    `tokenizer_config.json` (or `special_tokens_map.json`) beside it names, else the ids of the
    model's `config.json` beside it, else the usual names (`<s>`, `</s>`,
    `<|begin_of_text|>`, ...); BOS is added when that config's
    `add_bos_token` says so, or else when the tokenizer's own post-processor adds it."""

    kind = "hf"

    def __init__(self, path: str, add_bos: str = "auto",
                 ids: tuple[int | None, int] | None = None):
        tokenizers = _optional("tokenizers", "tokenizers")
        self.path = path
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the Rust parser raises plain Exceptions
            raise HetjaxError(f"{path!r} is not a HuggingFace tokenizer.json ({e}); give the "
                              "tokenizer.json of a HuggingFace model") from None
        here = os.path.dirname(os.path.abspath(path))
        config, self.companions = {}, ()
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
            f = os.path.join(here, name)
            if os.path.isfile(f):
                with open(f) as fh:
                    config.update(json.load(fh))
                self.companions += (f,)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        model = {}
        if os.path.isfile(os.path.join(here, "config.json")):  # a model directory's ids
            with open(os.path.join(here, "config.json")) as fh:
                model = json.load(fh)
        bos = self._special(config.get("bos_token"), model.get("bos_token_id"), HF_BOS)
        eos = self._special(config.get("eos_token"), model.get("eos_token_id"), HF_EOS)
        if ids is not None:  # a saved tokenizer: the ids it was trained with
            bos, eos = ids
        if eos is None:
            raise HetjaxError(f"the tokenizer {path} has no end-of-sequence token (none named "
                              f"eos_token in tokenizer_config.json, none of {', '.join(HF_EOS)}),"
                              " which hetjax needs to end documents; use a tokenizer that has one")
        self.eos_id, self.bos_id = eos, bos
        if isinstance(config.get("add_bos_token"), bool):
            self.add_bos = config["add_bos_token"] and bos is not None
        elif bos is not None:  # what the tokenizer's post-processor does on its own
            with_special = self._tok.encode("a", add_special_tokens=True).ids
            self.add_bos = bool(with_special) and with_special[0] == bos
        self._set_bos(add_bos, path)
        # Special-token text inside a document ("</s>", "<|im_end|>") is text, as with every
        # other tokenizer kind; only the ids hetjax adds (BOS, EOS) are control tokens.
        self._tok.encode_special_tokens = True
        with open(path, "rb") as f:
            h = hashlib.sha1(f.read())
        h.update(f"{self.bos_id}/{self.eos_id}".encode())
        self.base_fingerprint = "hf-" + h.hexdigest()[:16]

    def _special(self, name, model_id, fallbacks) -> int | None:
        """The id of the token tokenizer_config.json names, else of the model config's id
        (the first of a list), else of the first usual name the vocabulary has."""
        if _token_name(name):
            return self._tok.token_to_id(_token_name(name))
        if isinstance(model_id, list):
            model_id = model_id[0] if model_id else None
        if isinstance(model_id, int) and 0 <= model_id < self.vocab_size:
            return model_id
        for n in fallbacks:
            i = self._tok.token_to_id(n)
            if i is not None:
                return int(i)
        return None

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE rank file (lines `<base64 token> <rank>`, as OpenAI's `.tiktoken` files
    and Llama-3's `tokenizer.model`), with Llama-3's pre-tokenizer pattern and its 256 special
    tokens numbered after the ranks: BOS `<|begin_of_text|>`, EOS `<|end_of_text|>`. BOS is
    added, as Llama-3 does."""

    kind = "tiktoken"

    def __init__(self, path: str, add_bos: str = "auto"):
        tiktoken = _optional("tiktoken", "tiktoken")
        self.path = path
        with open(path, "rb") as f:
            contents = f.read()
        ranks = {}
        try:
            for line in contents.splitlines():
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise HetjaxError(f"{path!r} is not a tiktoken rank file (a line is not "
                              "'<base64 token> <rank>')") from None
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:  # tiktoken cannot encode text holding a byte without a token
            raise HetjaxError(f"the tiktoken rank file {path} has no token for {len(missing)} "
                              "of the 256 single bytes, so some text cannot be encoded; use a "
                              "complete rank file")
        n = len(ranks)
        if sorted(ranks.values()) != list(range(n)):
            raise HetjaxError(f"the ranks of the tiktoken file {path} are not 0..{n - 1}; use "
                              "an unmodified rank file")
        specials = {name: n + i for i, name in enumerate(TIKTOKEN_SPECIALS)}
        self._enc = tiktoken.Encoding(os.path.basename(path), pat_str=TIKTOKEN_PATTERN,
                                      mergeable_ranks=ranks, special_tokens=specials)
        self.n_ranks = n
        self.vocab_size = n + len(specials)
        self.bos_id, self.eos_id = specials["<|begin_of_text|>"], specials["<|end_of_text|>"]
        self.add_bos = True
        self._set_bos(add_bos, path)
        self.base_fingerprint = "tt-" + hashlib.sha1(contents).hexdigest()[:16]

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        # encode_ordinary: special-token text in a document is text, not a control token.
        return np.asarray(self._enc.encode_ordinary(text), np.int32)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids if int(i) < self.n_ranks],
                                errors="replace")


def tokenizer_kind(path: str) -> str:
    """'sentencepiece' | 'hf' | 'tiktoken' | 'saved', read from the file's content (or a
    directory's files); a clear error for anything else."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, SAVED)):
            return "saved"
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return "hf"
        if os.path.isfile(os.path.join(path, "tokenizer.model")):
            return tokenizer_kind(os.path.join(path, "tokenizer.model"))
        raise HetjaxError(f"the directory {path} holds no tokenizer.json, tokenizer.model or "
                          f"{SAVED}; set data.tokenizer to a tokenizer file")
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise HetjaxError(f"cannot read the tokenizer {path!r} ({e.strerror}); set "
                          "data.tokenizer to 'byte' or a tokenizer file") from None
    if not head:  # sentencepiece would read b"" as a model without pieces
        raise HetjaxError(f"the tokenizer model {path!r} is an empty file; set data.tokenizer "
                          "to 'byte' or to a file written by 'hetjax tokenizer train'")
    if head.lstrip()[:1] == b"{":
        return "hf"
    first = head.split(b"\n", 1)[0].strip()
    if re.fullmatch(rb"[A-Za-z0-9+/]+=* \d+", first):
        return "tiktoken"
    if head[:1] == b"\x0a":  # a SentencePiece ModelProto starts with its pieces (field 1)
        return "sentencepiece"
    raise HetjaxError(f"{path!r} is not a tokenizer hetjax reads: not a HuggingFace "
                      "tokenizer.json, a tiktoken rank file or a SentencePiece model; set "
                      "data.tokenizer to 'byte' or one of those")


def load_tokenizer(spec: str, add_bos: str = "auto") -> Tokenizer:
    """The tokenizer `data.tokenizer` names, with BOS as `data.add_bos` says."""
    if spec == "byte":
        tok = ByteTokenizer()
        tok._set_bos(add_bos, "byte")
        return tok
    path = os.path.expanduser(spec)
    kind = tokenizer_kind(path)
    if kind == "saved":
        with open(os.path.join(path, SAVED)) as f:
            saved = json.load(f)
        if add_bos == "auto":  # as the run that saved it trained
            add_bos = "true" if saved["add_bos"] else "false"
        file = saved["kind"] != "byte" and inside(
            path, saved.get("file"), os.path.join(path, SAVED),
            "copy the tokenizer directory whole from the run that wrote it")
        tok = (load_tokenizer("byte", add_bos) if saved["kind"] == "byte" else
               HFTokenizer(file, add_bos, (saved["bos_id"], saved["eos_id"]))
               if saved["kind"] == "hf" else load_tokenizer(file, add_bos))
        if tok.base_fingerprint != saved["fingerprint"].removesuffix("+bos"):
            raise HetjaxError(f"the saved tokenizer in {path} does not match its {SAVED} "
                              f"({tok.base_fingerprint} != {saved['fingerprint']}); copy the "
                              "tokenizer directory whole from the run that wrote it")
        return tok
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json" if kind == "hf" else "tokenizer.model")
    if kind == "sentencepiece":
        return SentencePieceTokenizer.load(path, add_bos)
    return (HFTokenizer if kind == "hf" else TiktokenTokenizer)(path, add_bos)


def tokenizer_from_config(data_cfg) -> Tokenizer:
    """The tokenizer of a config's `data` section (data.tokenizer, data.add_bos)."""
    return load_tokenizer(data_cfg.tokenizer, data_cfg.add_bos)


# SentencePiece skips longer lines (its max_sentence_length).
MAX_LINE_CHARS = 16384


def train_sentencepiece(documents: Iterable[str | bytes], vocab_size: int,
                        out_path: str) -> SentencePieceTokenizer:
    """Train a BPE SentencePiece model on `documents` (one sentence per non-blank line).

    Settings suit source code and prose alike: no normalisation and whitespace kept as is
    (indentation matters), byte fallback (no unknown tokens), digits split, and id 1 = EOS.
    """
    import re

    import sentencepiece as spm

    seen = {"lines": 0, "long": 0}  # what the trainer was given, for an accurate failure

    def lines():
        for doc in documents:
            if isinstance(doc, bytes):
                doc = doc.decode("utf-8", errors="replace")
            for line in doc.splitlines():
                if line.strip():
                    seen["lines"] += 1
                    seen["long"] += len(line) > MAX_LINE_CHARS
                    yield line

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines(), model_writer=model, vocab_size=vocab_size,
            model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
            remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
            split_digits=True, user_defined_symbols=["\t"], unk_id=0, eos_id=1, bos_id=-1,
            pad_id=-1, input_sentence_size=1_000_000, shuffle_input_sentence=True,
            max_sentence_length=MAX_LINE_CHARS, num_threads=os.cpu_count() or 1, minloglevel=2)
    except RuntimeError as e:
        text = str(e)
        high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= "
                         r"(\d+)", text)
        low = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", text)
        long = (f"; {seen['long']} of its {seen['lines']} lines are longer than "
                f"{MAX_LINE_CHARS:,} characters, which SentencePiece skips (break them into "
                "shorter lines)") if seen["long"] else ""
        if not seen["lines"]:
            raise HetjaxError("SentencePiece training failed: the training documents hold no "
                              "non-blank line; fix: train on text files with content") from None
        if seen["long"] == seen["lines"]:
            raise HetjaxError(f"SentencePiece training failed: all {seen['lines']} lines are "
                              f"longer than {MAX_LINE_CHARS:,} characters, which SentencePiece "
                              "skips; fix: break them into shorter lines") from None
        if high:
            raise HetjaxError(f"SentencePiece training failed: --vocab_size={high.group(1)} is "
                              f"more pieces than this text yields (at most {high.group(2)})"
                              f"{long}; fix: use --vocab_size={high.group(2)} or less, or "
                              "train on more text") from None
        if low:
            raise HetjaxError(f"SentencePiece training failed: --vocab_size={low.group(1)} is "
                              f"smaller than the {low.group(2)} distinct characters and special"
                              f" pieces of this text{long}; fix: use --vocab_size="
                              f"{low.group(2)} or more") from None
        raise HetjaxError(f"SentencePiece training failed: {text}{long}") from None
    proto = model.getvalue()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(proto)
    os.replace(tmp, out_path)
    return SentencePieceTokenizer(proto, out_path)

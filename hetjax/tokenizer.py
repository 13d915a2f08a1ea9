"""Tokenizers: UTF-8 bytes (the default) and SentencePiece models trained on the user's corpus.

A tokenizer turns a document (str or UTF-8 bytes) into int32 ids, has an `eos_id` that joins
documents when they are packed, a `vocab_size`, and a `fingerprint` naming its exact vocabulary
(caches of token counts are keyed by it). `load_tokenizer(spec)` reads `data.tokenizer`:
"byte" or the path of a SentencePiece `.model` file written by `hetjax tokenizer train`
(`train_sentencepiece`).
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Iterable

import numpy as np

from hetjax.errors import HetjaxError


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, and 256 as the end-of-document separator."""

    eos_id = 256
    vocab_size = 257
    fingerprint = "byte"

    def encode(self, text: str | bytes) -> np.ndarray:
        if isinstance(text, str):
            text = text.encode("utf-8", errors="replace")
        return np.frombuffer(text, dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A SentencePiece model (BPE with byte fallback, so any text encodes)."""

    def __init__(self, model_proto: bytes, path: str = "<memory>"):
        import sentencepiece as spm

        self.path = path
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = self._sp.vocab_size()
        self.eos_id = self._sp.eos_id()
        if self.eos_id < 0:
            raise HetjaxError(f"the SentencePiece model {path} has no end-of-sequence piece "
                              "(eos_id = -1), which hetjax needs to join documents; train one "
                              "with 'hetjax tokenizer train'")
        self.fingerprint = "sp-" + hashlib.sha1(model_proto).hexdigest()[:16]

    @classmethod
    def load(cls, path: str) -> "SentencePieceTokenizer":
        try:
            with open(path, "rb") as f:
                proto = f.read()
            if not proto:  # sentencepiece reads b"" as a model without pieces
                raise HetjaxError(f"the tokenizer model {path!r} is an empty file; set "
                                  "data.tokenizer to 'byte' or to a file written by 'hetjax "
                                  "tokenizer train'")
            return cls(proto, path)
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


def load_tokenizer(spec: str):
    """The tokenizer `data.tokenizer` names: "byte" or a SentencePiece model path."""
    if spec == "byte":
        return ByteTokenizer()
    return SentencePieceTokenizer.load(os.path.expanduser(spec))


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

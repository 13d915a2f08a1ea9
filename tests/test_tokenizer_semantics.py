"""One behaviour per tokenizer kind (docs/data.md, docs/sampling.md): special-token text inside
a document is text, never a control id; a prompt to continue begins as every training document
does (BOS first when the tokenizer adds one)."""

import io

import numpy as np
import pytest

from hetjax.tokenizer import load_tokenizer
from test_tokenizer import TEXTS, write_hf_tokenizer, write_tiktoken


def _sentencepiece(tmp_path):
    """A SentencePiece BPE with Llama-2's layout: <unk> 0, BOS <s> 1, EOS </s> 2."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS * 5), model_writer=model,
                                   vocab_size=400, model_type="bpe", byte_fallback=True,
                                   minloglevel=2)
    path = tmp_path / "sp.model"
    path.write_bytes(model.getvalue())
    return str(path)


KINDS = {
    "byte": lambda tmp: "byte",
    "sentencepiece": _sentencepiece,
    "hf": lambda tmp: str(write_hf_tokenizer(tmp / "hf", post_bos=True,
                                             config={"bos_token": "<s>", "eos_token": "</s>"})),
    "tiktoken": lambda tmp: str(write_tiktoken(tmp / "t.tiktoken")),
}
# The special tokens' text each kind has (and a document may hold as ordinary text).
SPECIAL_TEXT = ["<s>", "</s>", "<|begin_of_text|>", "<|end_of_text|>", "<unk>"]


@pytest.mark.parametrize("kind", list(KINDS))
def test_special_token_text_in_a_document_is_text(tmp_path, kind):
    """(before: a tokenizer.json tokenizer turned '</s>' in a document into EOS, which the
    packer then took for a document end)"""
    tok = load_tokenizer(KINDS[kind](tmp_path))
    text = "a </s> b <s> c <|end_of_text|> d <|begin_of_text|> <unk> e"
    ids = tok.encode_document(text)
    specials = {tok.eos_id} | ({tok.bos_id} if tok.bos_id is not None else set())
    body = ids[1:] if tok.add_bos else ids
    assert not specials & set(body.tolist()), (kind, ids)
    assert tok.decode(body) == text
    assert (ids[0] == tok.bos_id) == tok.add_bos


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_prompt_begins_as_training_documents_do(tmp_path, monkeypatch, kind):
    """`hetjax sample` / Trainer.generate: the ids the model continues are the document's
    (before: no BOS, although every training document started with one)."""
    from conftest import tiny_config
    from hetjax.train import Trainer
    import hetjax.layers.generate as gen

    spec = KINDS[kind](tmp_path)
    tok = load_tokenizer(spec)
    trainer = Trainer(tiny_config(**{"data.tokenizer": spec, "workdir": str(tmp_path / "run"),
                                     "model.n_layers": 1}), quiet=True)
    seen = {}

    def fake_generate(model, params, ids, max_new_tokens, **kw):
        seen["ids"] = ids
        return [[] for _ in ids]

    monkeypatch.setattr(gen, "generate", fake_generate)
    monkeypatch.setattr(type(trainer), "params", property(lambda self: {}))
    trainer.generate(["def add", "x"], max_new_tokens=2)
    assert seen["ids"] == [tok.encode_document("def add").tolist(),
                           tok.encode_document("x").tolist()]
    if tok.add_bos:
        assert all(i[0] == tok.bos_id for i in seen["ids"])
    np.testing.assert_array_equal(seen["ids"][1][-len(tok.encode("x")):], tok.encode("x"))

"""Tokenizers: HuggingFace tokenizer.json and tiktoken rank files built in the test (no
downloads), BOS as data.add_bos and the tokenizer's config say, format detection from content,
and saving a tokenizer so that it loads back identical."""

import base64
import json
import shutil

import numpy as np
import pytest

from hetjax.errors import ConfigError, HetjaxError
from hetjax.tokenizer import ByteTokenizer, load_tokenizer

TEXTS = ["the quick brown fox jumps over the lazy dog\n", "def add(x, y):\n    return x + y\n",
         "héllo wörld, ∑ of bytes\n"] * 10


def write_hf_tokenizer(directory, *, post_bos=False, config=None):
    """Train a tiny byte-level BPE with `tokenizers` and save it as tokenizer.json (plus a
    tokenizer_config.json when `config` is given)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    if post_bos:  # as Llama's tokenizer.json: the post-processor puts BOS first
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 0)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory / "tokenizer.json"


def write_tiktoken(path, merges=(b"th", b"he", b"the", b" the", b"ll", b"llo")):
    """A rank file: the 256 single bytes, then `merges` (each a pair of earlier tokens)."""
    tokens = [bytes([b]) for b in range(256)] + list(merges)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n"
                            for i, t in enumerate(tokens)))
    return path


def test_hf_tokenizer_json_round_trips_and_finds_its_special_tokens(tmp_path):
    path = write_hf_tokenizer(tmp_path / "hf")
    tok = load_tokenizer(str(path))
    assert tok.kind == "hf" and (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.vocab_size == 320 and not tok.add_bos  # no config, no BOS post-processor
    for text in TEXTS[:3]:
        ids = tok.encode(text)
        assert len(ids) < len(text.encode()) and tok.decode(ids) == text
    np.testing.assert_array_equal(tok.encode_document("the fox"), tok.encode("the fox"))
    # the directory works as well as the file, and gives the same vocabulary
    assert load_tokenizer(str(tmp_path / "hf")).fingerprint == tok.fingerprint


def test_bos_follows_the_hf_post_processor_then_tokenizer_config_then_add_bos(tmp_path):
    post = load_tokenizer(str(write_hf_tokenizer(tmp_path / "post", post_bos=True)))
    assert post.add_bos and post.fingerprint.endswith("+bos")
    ids = post.encode_document("the fox")
    assert ids[0] == 0 and list(ids[1:]) == list(post.encode("the fox"))
    assert 0 not in post.encode("the fox")  # encode alone never adds special tokens
    # tokenizer_config.json's add_bos_token and its token names win over the defaults
    cfg = load_tokenizer(str(write_hf_tokenizer(
        tmp_path / "cfg", post_bos=True,
        config={"add_bos_token": False, "bos_token": {"content": "</s>"}, "eos_token": "<s>"})))
    assert (cfg.bos_id, cfg.eos_id, cfg.add_bos) == (1, 0, False)
    # and data.add_bos wins over both
    forced = load_tokenizer(str(tmp_path / "cfg" / "tokenizer.json"), "true")
    assert forced.add_bos and forced.encode_document("x")[0] == 1
    off = load_tokenizer(str(tmp_path / "post" / "tokenizer.json"), "false")
    assert not off.add_bos and off.fingerprint == post.fingerprint.removesuffix("+bos")


def test_a_model_directory_config_json_gives_the_ids_and_its_saved_copy_keeps_them(tmp_path):
    write_hf_tokenizer(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [0, 1]}))  # as Llama-3.1's list of stop ids
    tok = load_tokenizer(str(tmp_path / "model"))
    assert (tok.bos_id, tok.eos_id) == (1, 0)
    tok.save(str(tmp_path / "saved"))
    back = load_tokenizer(str(tmp_path / "saved"))  # without the config.json beside it
    assert (back.bos_id, back.eos_id, back.fingerprint) == (1, 0, tok.fingerprint)


def test_add_bos_true_without_a_bos_token_is_a_config_error():
    with pytest.raises(ConfigError, match="data.add_bos: is true, but the tokenizer byte has no"):
        load_tokenizer("byte", "true")
    with pytest.raises(ConfigError, match="data.add_bos: unknown value 'yes'"):
        load_tokenizer("byte", "yes")
    assert not load_tokenizer("byte").add_bos


def test_tiktoken_rank_file_uses_llama3_specials_and_adds_bos(tmp_path):
    path = write_tiktoken(tmp_path / "tokenizer.model")  # Llama-3 names its rank file so
    tok = load_tokenizer(str(path))
    n = 262
    assert tok.kind == "tiktoken" and tok.vocab_size == n + 256
    assert (tok.bos_id, tok.eos_id) == (n, n + 1) and tok.add_bos
    # BPE by hand: t h e -> th e -> the; " hello" -> " " he ll o -> " " he llo
    np.testing.assert_array_equal(tok.encode("the hello"), [258, 32, 257, 261])
    ids = tok.encode("the hello <|end_of_text|>")
    assert n + 1 not in ids  # special-token text in a document is text
    assert tok.decode(ids) == "the hello <|end_of_text|>"
    doc = tok.encode_document("wörld")
    assert doc[0] == n and tok.decode(doc) == "wörld"
    # the directory of a Llama-3 checkpoint (tokenizer.model inside) works too
    assert load_tokenizer(str(tmp_path)).fingerprint == tok.fingerprint


def test_unknown_and_broken_tokenizer_files_are_clear_errors(tmp_path):
    (tmp_path / "notes.txt").write_text("just some words\n")
    with pytest.raises(HetjaxError, match="is not a tokenizer hetjax reads"):
        load_tokenizer(str(tmp_path / "notes.txt"))
    (tmp_path / "other.json").write_text('{"model": 3}')
    with pytest.raises(HetjaxError, match="is not a HuggingFace tokenizer.json"):
        load_tokenizer(str(tmp_path / "other.json"))
    partial = tmp_path / "partial.tiktoken"
    partial.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n"
                               for b in range(100)))
    with pytest.raises(HetjaxError, match="no token for 156 of the 256 single bytes"):
        load_tokenizer(str(partial))
    (tmp_path / "empty").mkdir()
    with pytest.raises(HetjaxError, match="holds no tokenizer.json, tokenizer.model"):
        load_tokenizer(str(tmp_path / "empty"))


@pytest.mark.parametrize("kind", ["byte", "hf", "tiktoken"])
def test_a_saved_tokenizer_loads_back_identical(tmp_path, kind):
    spec = {"byte": "byte", "hf": str(write_hf_tokenizer(tmp_path / "hf", post_bos=True,
                                                         config={"eos_token": "</s>"})),
            "tiktoken": str(write_tiktoken(tmp_path / "t.tiktoken"))}[kind]
    tok = load_tokenizer(spec, "false" if kind == "tiktoken" else "auto")
    tok.save(str(tmp_path / "saved"))
    shutil.rmtree(tmp_path / "hf", ignore_errors=True)  # the copy must stand on its own
    back = load_tokenizer(str(tmp_path / "saved"))
    assert (back.kind, back.fingerprint, back.add_bos, back.bos_id, back.eos_id,
            back.vocab_size) == (tok.kind, tok.fingerprint, tok.add_bos, tok.bos_id,
                                 tok.eos_id, tok.vocab_size)
    np.testing.assert_array_equal(back.encode_document(TEXTS[1]), tok.encode_document(TEXTS[1]))
    if kind == "hf":
        assert (tmp_path / "saved" / "tokenizer_config.json").exists()


def test_byte_tokenizer_is_unchanged():
    tok = ByteTokenizer()
    assert tok.fingerprint == "byte" and tok.bos_id is None and tok.eos_id == 256
    np.testing.assert_array_equal(tok.encode_document("ab"), [97, 98])


def test_a_missing_optional_package_names_the_extra_that_installs_it(tmp_path, monkeypatch):
    import sys

    path = write_tiktoken(tmp_path / "t.tiktoken")
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` fail
    with pytest.raises(HetjaxError, match=r"needs the 'tiktoken' package; install it with "
                       r"pip install 'hetjax\[tiktoken\]'"):
        load_tokenizer(str(path))

"""Tokenizer loading, special tokens, encode/decode for SentencePiece and tokenizer.json."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchat.model.errors import KVChatError, ModelLoadError
from kvchat.model.text.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from tests.helpers.paths import STORIES260K as STORIES
from tests.helpers.tiny_tokenizers import (
    byte_level_bpe,
    sentencepiece_byte_fallback,
    tokenizer_json_from_sentencepiece,
    write_folder,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROPERTY = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def stories() -> dict[str, Tokenizer]:
    return {k: load_tokenizer(STORIES, prefer=k) for k in ("sentencepiece", "hf")}


# --- stories260K: the real model's two tokenizer files -----------------------------------

def test_kind_is_chosen_by_files():
    assert load_tokenizer(STORIES).kind == "hf"  # both present: tokenizer.json wins
    assert load_tokenizer(STORIES, prefer="sentencepiece").kind == "sentencepiece"
    assert load_tokenizer(STORIES, prefer="hf").kind == "hf"


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_stories_once_upon_a_time(stories, kind):
    tok = stories[kind]
    assert tok.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tok.encode("Once upon a time", add_special_tokens=False) == [403, 407, 261, 378]
    assert (tok.bos_id, tok.eos_ids, tok.bos_token, tok.eos_token) == (1, [2], "<s>", "</s>")
    assert tok.add_bos is True and tok.vocab_size == 512 and tok.chat_template is None
    assert tok.decode([1, 403, 407, 261, 378]) == "<s> Once upon a time"
    assert tok.decode([1, 403, 407, 261, 378], skip_special_tokens=True) == "Once upon a time"


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_stories_special_token_strings_become_ids(stories, kind):
    tok = stories[kind]
    assert tok.encode("<s>Once upon</s> a<unk>", add_special_tokens=False) == [
        1, 403, 407, 2, 261, 0]
    assert tok.decode([403, 2, 410, 403]) == "Once</s>  Once"
    assert tok.decode([403, 2, 410, 403], skip_special_tokens=True) == "Once  Once"


WORD = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Zs", "Zl", "Zp", "Cc", "Cf")),
    min_size=1, max_size=8,
).filter(lambda w: "<" not in w and "▁" not in w)  # no special tokens, no "▁" (a space to SP)
SINGLE_SPACED = st.lists(WORD, min_size=1, max_size=8).map(" ".join)

SENTENCES = [
    "Once upon a time, there was a little girl named Lily.",
    "She loved to play outside in the sun. One day, she saw a big, red ball!",
    "\"Can I have it?\" asked Tom. Mom said: yes.",
    "Zebras eat 42 apples; émigrés café naïve 日本 👋",
]


@pytest.mark.parametrize("text", SENTENCES)
def test_both_files_same_ids_on_sentences(stories, text):
    assert stories["sentencepiece"].encode(text) == stories["hf"].encode(text)


@PROPERTY
@given(text=SINGLE_SPACED)
def test_both_files_same_ids_single_spaced(stories, text):
    sp, hf = stories["sentencepiece"], stories["hf"]
    ids = sp.encode(text)
    assert ids == hf.encode(text)
    assert sp.decode(ids, skip_special_tokens=True) == hf.decode(ids, True) == text
    assert sp.decode(ids) == hf.decode(ids)


@PROPERTY
@given(text=st.text(max_size=40))
def test_both_files_decode_alike(stories, text):
    """Whatever the text, ids from either file decode the same way with both."""
    for ids in (stories["sentencepiece"].encode(text), stories["hf"].encode(text)):
        assert stories["sentencepiece"].decode(ids) == stories["hf"].decode(ids)


# --- special tokens and add_bos from the config files -----------------------------------

@pytest.fixture(scope="module")
def bpe():
    return byte_level_bpe(["<unk>", "<s>", "</s>", "<|im_end|>", "<|extra|>"], 400)


def _with_bos_post_processor(tok):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    copy = HFTokenizer.from_str(tok.to_str())
    copy.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", copy.token_to_id("<s>"))])
    return copy


@pytest.mark.parametrize("post_processor, config, want_bos", [
    (False, {}, False),                          # nothing adds BOS
    (True, {}, True),                            # the post-processor does: follow it
    (True, {"add_bos_token": False}, False),     # the config's key decides
    (False, {"add_bos_token": True}, True),
])
def test_add_bos_follows_config_then_post_processor(tmp_path, bpe, post_processor, config,
                                                    want_bos):
    tok = _with_bos_post_processor(bpe) if post_processor else bpe
    folder = write_folder(tmp_path / "m", tok, tokenizer_config={
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        **config})
    ours = load_tokenizer(folder)
    assert ours.add_bos is want_bos
    text = "Hello <|im_end|> world"
    plain = ours.encode(text, add_special_tokens=False)
    assert ours.encode(text) == ([1] if want_bos else []) + plain
    if not config:
        # Without the key, transformers keeps the post-processor: we must agree with it. (With
        # the key, transformers 5.24 still follows the post-processor; we follow the key.)
        transformers = pytest.importorskip("transformers")
        ref = transformers.AutoTokenizer.from_pretrained(folder)
        assert ours.encode(text) == ref(text)["input_ids"]
        assert plain == ref(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_stories_matches_transformers(stories, kind):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(STORIES)
    for text in [*SENTENCES, "<s>Once upon</s> a<unk> time"]:
        assert stories[kind].encode(text) == ref(text)["input_ids"]


def test_special_tokens_from_maps_and_generation_config(tmp_path, bpe):
    ids = {t: bpe.token_to_id(t) for t in ("<s>", "</s>", "<|im_end|>", "<|extra|>")}
    folder = write_folder(
        tmp_path / "m", bpe,
        special_tokens_map={
            "bos_token": {"content": "<s>", "lstrip": False, "normalized": False},
            "eos_token": {"content": "<|im_end|>", "single_word": False},
            "additional_special_tokens": [{"content": "<|extra|>"}],
        },
        generation_config={"bos_token_id": ids["<s>"], "eos_token_id": [ids["</s>"],
                                                                        ids["<|im_end|>"]]},
        config={"eos_token_id": ids["</s>"]},
    )
    tok = load_tokenizer(folder)
    assert tok.bos_token == "<s>" and tok.bos_id == ids["<s>"]
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_ids == [ids["<|im_end|>"], ids["</s>"]]  # the EOS token first, no repeats
    assert tok.encode("a<|extra|>b", add_special_tokens=False)[1] == ids["<|extra|>"]


def test_ids_only_in_generation_config(tmp_path, bpe):
    folder = write_folder(tmp_path / "m", bpe, generation_config={"bos_token_id": 1,
                                                                  "eos_token_id": 2})
    tok = load_tokenizer(folder)
    assert (tok.bos_id, tok.bos_token, tok.eos_ids, tok.eos_token) == (1, "<s>", [2], "</s>")


# --- SentencePiece specifics ----------------------------------------------------------------

@pytest.fixture(scope="module")
def sp_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sp")
    sentencepiece_byte_fallback(folder, user_defined_symbols=("<|im_start|>", "<|im_end|>"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}))
    return folder


def test_sentencepiece_splits_added_tokens(sp_folder):
    tok = load_tokenizer(sp_folder)
    assert tok.kind == "sentencepiece" and tok.add_bos and tok.bos_id == 1
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    ids = tok.encode("<s><|im_start|>user\nHi 👋<|im_end|>", add_special_tokens=False)
    assert ids[:2] == [1, start] and ids[-1] == end
    assert tok.decode(ids) == "<s><|im_start|>user\nHi 👋<|im_end|>"  # no "▁" after specials
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi 👋"


@PROPERTY
@given(text=st.text(max_size=40).filter(lambda t: "<" not in t and "▁" not in t))
def test_sentencepiece_matches_its_tokenizer_json(sp_folder, tmp_path_factory, text):
    """Our SentencePiece path and transformers' conversion of the same model agree."""
    sp = load_tokenizer(sp_folder)
    hf = _converted(sp_folder)
    ids = sp.encode(text)
    assert ids == hf.encode(text)
    assert sp.decode(ids) == hf.decode(ids)


_CONVERTED: dict[Path, Tokenizer] = {}


def _converted(sp_folder: Path) -> Tokenizer:
    if sp_folder not in _CONVERTED:
        pytest.importorskip("transformers")
        folder = sp_folder.parent / (sp_folder.name + "_hf")
        write_folder(folder, tokenizer_json_from_sentencepiece(sp_folder / "tokenizer.model"),
                     tokenizer_config={"bos_token": "<s>", "eos_token": "</s>"})
        _CONVERTED[sp_folder] = load_tokenizer(folder)
    return _CONVERTED[sp_folder]


@pytest.mark.parametrize("legacy", [True, False, None])
def test_legacy_prefix_after_special_tokens_like_transformers(tmp_path, legacy):
    """legacy=true: a dummy "▁" after every special token; false or absent: only at the start."""
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(STORIES / "tokenizer.model", folder)
    config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>"}
    if legacy is not None:
        config["legacy"] = legacy
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(folder)
    ids = tok.encode("Once<s>Once", add_special_tokens=False)
    assert ids[:2] == [403, 1] and (ids[2:] == [403]) is (legacy is True)
    assert tok.decode(ids) == ("Once<s> Once" if legacy else "Once<s>Once")
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    for text in ["Once<s>Once", "<s>Once upon</s>a time", "Lily said:<unk>hi."]:
        assert tok.encode(text, add_special_tokens=False) == ref(
            text, add_special_tokens=False)["input_ids"]


# --- errors: one line, KVChatError -------------------------------------------------------------

def _one_line_error(call) -> str:
    with pytest.raises(TokenizerError) as err:
        call()
    assert isinstance(err.value, ModelLoadError) and isinstance(err.value, KVChatError)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_missing_files_errors(tmp_path, bpe):
    assert "no such model folder" in _one_line_error(lambda: load_tokenizer(tmp_path / "nope"))
    message = _one_line_error(lambda: load_tokenizer(tmp_path))
    assert "no tokenizer.json or tokenizer.model" in message
    write_folder(tmp_path, bpe)
    assert "no tokenizer.model" in _one_line_error(
        lambda: load_tokenizer(tmp_path, prefer="sentencepiece"))
    assert "unknown tokenizer kind" in _one_line_error(lambda: load_tokenizer(tmp_path, "tiktoken"))


def test_hf_forced_but_missing(sp_folder):
    assert "no tokenizer.json" in _one_line_error(lambda: load_tokenizer(sp_folder, prefer="hf"))


@pytest.mark.parametrize("name, content", [
    ("tokenizer.json", "{not json"),
    ("tokenizer.model", "\x00garbage"),
])
def test_corrupt_tokenizer_file(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    assert name in _one_line_error(lambda: load_tokenizer(tmp_path))


def test_corrupt_config_file(tmp_path, bpe):
    write_folder(tmp_path, bpe)
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    assert "tokenizer_config.json" in _one_line_error(lambda: load_tokenizer(tmp_path))


def test_bad_template_value_is_a_load_error(tmp_path, bpe):
    write_folder(tmp_path, bpe, tokenizer_config={"chat_template": 7})
    assert "chat_template" in _one_line_error(lambda: load_tokenizer(tmp_path))


@pytest.mark.parametrize("prefer", ["sentencepiece", "hf"])
@pytest.mark.parametrize("bad", [[-1], [5, 10**6]])
def test_decode_out_of_range(sp_folder, prefer, bad):
    tok = load_tokenizer(sp_folder) if prefer == "sentencepiece" else _converted(sp_folder)
    _one_line_error(lambda: tok.decode(bad))

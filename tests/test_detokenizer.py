"""Streaming detokenizer: the deltas add up to decode(ids), never split a character, and each
token costs a short window of decoding, on every kind of tokenizer we load."""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvchat.model.text.tokenizer import StreamDetokenizer, Tokenizer, load_tokenizer
from tests.helpers.paths import STORIES260K as STORIES
from tests.helpers.tiny_tokenizers import (
    byte_level_bpe,
    sentencepiece_byte_fallback,
    tokenizer_json_from_sentencepiece,
    write_folder,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

KINDS = ["stories-sp", "stories-hf", "trained-sp", "trained-hf", "byte-level-bpe"]
PROPERTY = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer | None]:
    root = tmp_path_factory.mktemp("detok")
    out: dict[str, Tokenizer | None] = {
        "stories-sp": load_tokenizer(STORIES, prefer="sentencepiece"),
        "stories-hf": load_tokenizer(STORIES, prefer="hf"),
    }
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    sp_model = sentencepiece_byte_fallback(root / "sp")
    write_folder(root / "sp", tokenizer_config=config)
    out["trained-sp"] = load_tokenizer(root / "sp")
    try:
        converted = tokenizer_json_from_sentencepiece(sp_model)
    except ImportError:  # transformers is a test extra; the converter lives there
        out["trained-hf"] = None
    else:
        out["trained-hf"] = load_tokenizer(write_folder(root / "sp_hf", converted,
                                                        tokenizer_config=config))
    bpe = byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 400)
    out["byte-level-bpe"] = load_tokenizer(write_folder(
        root / "bpe", bpe, tokenizer_config={"eos_token": "<|im_end|>"}))
    return out


@pytest.fixture(params=KINDS)
def tok(request, tokenizers) -> Tokenizer:
    found = tokenizers[request.param]
    if found is None:
        pytest.skip("transformers (test extra) is not installed")
    return found


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False
           ) -> tuple[list[str], str]:
    detok = tok.detokenizer(skip_special_tokens=skip_special_tokens)
    deltas = [detok.add_token(i) for i in ids]
    final = detok.finalize()
    assert detok.text == "".join(deltas) + final
    return deltas, final


def check_stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> None:
    deltas, final = stream(tok, ids, skip_special_tokens)
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) + final == full
    for delta in deltas:
        # Never half a character: no surrogates, no replacement char at the end of a delta.
        assert not any(unicodedata.category(c) == "Cs" for c in delta)
        assert not delta.endswith("\ufffd")
        if "\ufffd" not in full:
            assert "\ufffd" not in delta


# Ids that decode to part of a character (byte pieces, byte-level fragments): drawn often, so
# random sequences are full of unfinished and broken UTF-8.
_PARTIAL: dict[int, list[int]] = {}


def partial_ids(tok: Tokenizer) -> list[int]:
    if id(tok) not in _PARTIAL:
        _PARTIAL[id(tok)] = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    return _PARTIAL[id(tok)]


@PROPERTY
@given(data=st.data())
def test_random_ids_stream_to_decode(tok, data):
    ids = data.draw(st.lists(st.one_of(
        st.integers(0, tok.vocab_size - 1),
        st.sampled_from(partial_ids(tok) or [0]),
    ), max_size=40))
    check_stream(tok, ids)
    check_stream(tok, ids, skip_special_tokens=True)


@PROPERTY
@given(text=st.text(max_size=60))
def test_random_text_streams_to_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    check_stream(tok, ids)
    check_stream(tok, tok.encode(text))  # with BOS where the model adds one


@pytest.mark.parametrize("text", ["Hello 👋 世界 ok", "café naïve e\u0301 👨‍👩‍👧 🇫🇷 한국어 ❤️"])
def test_emoji_and_cjk_stream_intact(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    deltas, final = stream(tok, ids)
    assert tok.decode(ids) == text
    assert "".join(deltas) + final == text
    assert all("\ufffd" not in d for d in [*deltas, final])
    if not tok.detokenizer()._pending:
        assert final == ""  # else a byte-fallback run at the very end waits for finalize()
    pieces = [d for d in deltas if d]
    assert any("👋" in d for d in pieces) or "👋" not in text  # whole, in one delta
    if text.startswith("Hello"):
        assert any("世" in d for d in pieces) and any("界" in d for d in pieces)


@pytest.mark.parametrize("kind", ["stories-sp", "stories-hf"])
def test_leading_space_of_first_token_is_stripped(tokenizers, kind):
    tok = tokenizers[kind]
    ids = tok.encode("Once upon a time", add_special_tokens=False)  # ▁Once ▁upon ▁a ▁time
    deltas, final = stream(tok, ids)
    assert deltas == ["Once", " upon", " a", " time"] and final == ""
    deltas, _ = stream(tok, [1, *ids])  # after BOS the space stays, as decode keeps it
    assert deltas == ["<s>", " Once", " upon", " a", " time"]
    deltas, _ = stream(tok, [1, *ids], skip_special_tokens=True)
    assert "".join(deltas) == "Once upon a time"


def test_unfinished_character_is_held_then_flushed(tok):
    ids = tok.encode("ok 👋", add_special_tokens=False)
    full = tok.decode(ids)
    assert full == "ok 👋"
    for cut in range(1, len(ids)):
        head = ids[:cut]
        deltas, final = stream(tok, head)
        assert "".join(deltas) + final == tok.decode(head)
        assert all(not d.endswith("\ufffd") for d in deltas)


def test_work_per_token_is_bounded(tok):
    """Each token decodes a short window, not the whole history."""
    text = ("Once upon a time there was a little girl named Lily. She liked to play in the "
            "park with her dog 👋 世界. ") * 40
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 800
    decoded = 0

    def counting_decode(window: list[int]) -> str:
        nonlocal decoded
        decoded += len(window)
        return tok.decode(window)

    detok = StreamDetokenizer(counting_decode, tok.detokenizer()._pending)
    text_out = "".join(detok.add_token(i) for i in ids) + detok.finalize()
    assert text_out == tok.decode(ids)
    assert decoded / len(ids) < 24  # a few ids per call, two calls per token


def test_add_after_finalize_is_an_error(tok):
    detok = tok.detokenizer()
    detok.add_token(tok.encode("a", add_special_tokens=False)[0])
    detok.finalize()
    assert detok.finalize() == ""
    with pytest.raises(RuntimeError):
        detok.add_token(0)


def test_fixture_paths_exist():
    assert isinstance(STORIES, Path)

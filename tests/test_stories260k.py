"""The real pretrained stories260K: greedy decoding from BOS agrees with transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.greedy import BOS, greedy_ids

STEPS = 60


@pytest.fixture(scope="module")
def our_greedy_ids(stories260k: Path) -> list[int]:
    return greedy_ids(stories260k, STEPS)


def hf_greedy_ids(folder: Path) -> list[int]:
    """The same loop in transformers' LlamaForCausalLM, recomputing the whole prefix."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = [BOS]
    with torch.no_grad():
        for _ in range(STEPS):
            logits = model(torch.tensor([ids])).logits
            ids.append(int(logits[0, -1].argmax()))
    return ids[1:]


def test_greedy_ids_match_transformers(stories260k: Path, our_greedy_ids: list[int]) -> None:
    assert our_greedy_ids == hf_greedy_ids(stories260k)


def test_greedy_text_is_the_lily_story(stories260k: Path, our_greedy_ids: list[int]) -> None:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(stories260k / "tokenizer.model"))
    text = sp.decode(our_greedy_ids)
    assert text.startswith("Once upon a time, there was a little girl named Lily."), text

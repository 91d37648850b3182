"""Tiny random-weight chat models whose byte-level BPE can spell any text (JSON, tool
calls), with a chat template of the test's choosing: what structured output and tool
calling must work on even when the model itself writes noise."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tests.conftest import TinySpec, build_tiny_checkpoint
from tests.tokenizer_fixtures import CHAT_SPECIAL_TOKENS, byte_level_bpe

# markers some families write as control tokens: present so grammars can name them by id
TOOL_SPECIAL_TOKENS = ("[TOOL_CALLS]", "<|python_tag|>")


def random_chat_model(folder: Path, template: str, *, eos: str = "<|im_end|>", seed: int = 11,
                      extra_specials: Sequence[str] = TOOL_SPECIAL_TOKENS,
                      arch: str = "llama") -> Path:
    """A tiny random Llama (or `arch`) checkpoint in `folder` with a byte-level BPE tokenizer
    (the chat families' control tokens plus `extra_specials`) and `template`; its
    embedding table is a little wider than the vocabulary, as real ones often are."""
    tok = byte_level_bpe([*CHAT_SPECIAL_TOKENS, *extra_specials])
    build_tiny_checkpoint(TinySpec(arch, {"vocab_size": tok.get_vocab_size() + 8}, seed=seed),
                          folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": eos, "add_bos_token": False, "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder

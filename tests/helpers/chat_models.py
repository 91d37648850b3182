"""Tiny random-weight chat models whose byte-level BPE can spell any text (JSON, tool
calls), with a chat template of the test's choosing: what structured output and tool
calling must work on even when the model itself writes noise."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tests.helpers.checkpoints import TinySpec, build_tiny_checkpoint
from tests.helpers.tiny_tokenizers import CHAT_SPECIAL_TOKENS, LLAMA3, QWEN25, byte_level_bpe

# markers some families write as control tokens: present so grammars can name them by id
TOOL_SPECIAL_TOKENS = ("[TOOL_CALLS]", "<|python_tag|>")


def random_chat_model(folder: Path, template: str, *, eos: str = "<|im_end|>", seed: int = 11,
                      extra_specials: Sequence[str] = TOOL_SPECIAL_TOKENS,
                      arch: str = "llama", context: int | None = None) -> Path:
    """A tiny random Llama (or `arch`) checkpoint in `folder` with a byte-level BPE tokenizer
    (the chat families' control tokens plus `extra_specials`) and `template`; its
    embedding table is a little wider than the vocabulary, as real ones often are.
    `context`: its max_position_embeddings (a server refuses prompts past it; tools
    rendered by a template take several hundred tokens)."""
    tok = byte_level_bpe([*CHAT_SPECIAL_TOKENS, *extra_specials])
    overrides: dict[str, int] = {"vocab_size": tok.get_vocab_size() + 8}
    if context is not None:
        overrides["max_position_embeddings"] = context
    build_tiny_checkpoint(TinySpec(arch, overrides, seed=seed), folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": eos, "add_bos_token": False, "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


TOOLS_MODEL, NO_TOOLS_MODEL = "tools-model", "no-tools"


def tool_models(root: Path) -> Path:
    """A --models-dir for the tool-calling servers: `tools-model` (Qwen 2.5's template,
    hermes calls) and `no-tools` (Llama 3's, which never reads `tools`), each with room
    for the few hundred tokens the tools take."""
    random_chat_model(root / TOOLS_MODEL, QWEN25, context=4096)
    random_chat_model(root / NO_TOOLS_MODEL, LLAMA3, eos="<|eot_id|>", seed=12, context=4096)
    return root

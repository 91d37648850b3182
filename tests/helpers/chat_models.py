"""Tiny random-weight chat models whose byte-level BPE can spell any text (JSON, tool
calls), with a chat template of the test's choosing: what structured output and tool
calling must work on even when the model itself writes noise."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tests.helpers.checkpoints import TinySpec, build_tiny_checkpoint
from tests.helpers.tiny_tokenizers import CHAT_SPECIAL_TOKENS, byte_level_bpe

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


# Qwen 2.5's template (hermes-style calls), as the model ships it: reads `tools`, writes
# assistant `tool_calls` and `role: "tool"` results
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501

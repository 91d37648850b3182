"""Tiny tokenizers built in tests (offline, fast): a byte-level BPE with chat special tokens,
a byte-fallback SentencePiece model and its tokenizer.json twin, and four chat templates
written the way Llama 3, ChatML (Qwen), Mistral and Gemma write theirs."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

CORPUS = [
    "Once upon a time there was a little girl named Lily. She liked to play in the park.",
    "You are a helpful assistant. Answer the question in one short sentence.",
    "What is the capital of France? The capital of France is Paris.",
    "Tell me a story about a dragon and a brave knight who became friends.",
    "system user assistant model tool function arguments name content role",
    "Hello, how are you today? I am fine, thank you! And you?",
    "Héllo wörld, naïve café, Ça va? Grüße aus München.",
    "日本語のテキスト、中文文本，한국어 텍스트。 Emoji: 👋 🙂 🚀 ❤️",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 2024, symbols: #$%&*()[]{}<>/\\|~^`'\"",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
]

# Every family's control tokens, so one vocabulary serves all four templates.
CHAT_SPECIAL_TOKENS = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]",
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>",
]


def byte_level_bpe(special_tokens: list[str] = CHAT_SPECIAL_TOKENS, vocab_size: int = 600):
    """A GPT-2-style byte-level BPE (the Llama 3 / Qwen kind) trained on CORPUS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


def write_folder(folder: Path, tokenizer=None, **json_files: Any) -> Path:
    """A model folder: tokenizer.json (if given) plus ``name=dict`` JSON files (name.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        tokenizer.save(str(folder / "tokenizer.json"))
    for name, data in json_files.items():
        (folder / f"{name}.json").write_text(json.dumps(data, ensure_ascii=False, indent=1))
    return folder


def sentencepiece_byte_fallback(folder: Path, vocab_size: int = 420,
                                user_defined_symbols: tuple[str, ...] = (), **options: Any
                                ) -> Path:
    """Train a small BPE SentencePiece model with byte_fallback into folder/tokenizer.model."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(**{
        "sentence_iterator": iter(CORPUS * 5),
        "model_writer": buf,
        "vocab_size": vocab_size,
        "model_type": "bpe",
        "byte_fallback": True,
        "character_coverage": 0.98,  # leave rare characters to the byte pieces
        "normalization_rule_name": "identity",  # as Llama's: newlines survive
        "unk_id": 0,
        "bos_id": 1,
        "eos_id": 2,
        "pad_id": -1,
        "hard_vocab_limit": False,
        "user_defined_symbols": list(user_defined_symbols),
        "num_threads": 1,
        "minloglevel": 2,
        **options,
    })
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.model"
    path.write_bytes(buf.getvalue())
    return path


def tokenizer_json_from_sentencepiece(model_path: Path):
    """The tokenizer.json twin of a SentencePiece model, as transformers converts it."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import SpmConverter

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_path.read_bytes())
    vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


# --- chat templates, written after the real ones -------------------------------------------

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

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

MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501

GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim -}}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# How each family stores its template and special tokens (the forms vary on purpose).
STYLES: dict[str, dict[str, Any]] = {
    "llama3": {
        "tokenizer_config": {
            "bos_token": "<|begin_of_text|>",
            "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "lstrip": False,
                          "normalized": False, "rstrip": False, "single_word": False,
                          "special": True},
            "chat_template": LLAMA3,
        },
        "eos_list": ["<|end_of_text|>", "<|eot_id|>"],
    },
    "chatml": {
        "tokenizer_config": {
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "add_bos_token": False,
            "chat_template": QWEN25,
        },
    },
    "mistral": {
        "tokenizer_config": {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "chat_template": [
                {"name": "default", "template": MISTRAL},
                {"name": "tool_use", "template": "{{ raise_exception('tools') }}"},
            ],
        },
    },
    "gemma": {
        "tokenizer_config": {
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "pad_token": "<pad>",
            "add_bos_token": True,
        },
        "special_tokens_map": {"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]},
        "jinja": GEMMA,  # as a chat_template.jinja file
    },
}


def chat_folder(root: Path, style: str, tokenizer) -> Path:
    """A fixture model folder for one template style, loadable by transformers and by us."""
    spec = STYLES[style]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
              **spec["tokenizer_config"]}
    files: dict[str, Any] = {"tokenizer_config": config}
    if "special_tokens_map" in spec:
        files["special_tokens_map"] = spec["special_tokens_map"]
    if "eos_list" in spec:
        ids = [tokenizer.token_to_id(t) for t in spec["eos_list"]]
        files["generation_config"] = {"bos_token_id": tokenizer.token_to_id("<|begin_of_text|>"),
                                      "eos_token_id": ids}
    folder = write_folder(root / style, tokenizer, **files)
    if "jinja" in spec:
        (folder / "chat_template.jinja").write_text(spec["jinja"])
    return folder

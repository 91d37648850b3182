"""Every request field `kvchat serve` knows, per route: honoured, refused or advisory
(docs/serve.md, Fields, prints the same tables).

A field a server skips in silence is a bug its client cannot see (tools answered with
plain text, a schema with free text), so each field is one of:

- honoured: it does what the API says;
- refused: a 400 naming it, unless its value asks for nothing kvchat lacks (null, or
  its default: `n` 1, `tools` [], `response_format` text, a penalty of 0);
- advisory: the API makes it a hint or bookkeeping that leaves the answer as it is
  (`store`, `metadata`, `service_tier`, a cache-retention wish): accepted, no effect.

A field in no table is refused too: a misspelt `temprature` must not pass for a default.
Checked first, before any value is read (protocol.py, anthropic.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvchat.app.serve.errors import ApiError, bad

HONOURED, REFUSED, ADVISORY = "honoured", "refused", "advisory"


@dataclass(frozen=True)
class Field:
    status: str
    note: str  # what kvchat does with it (the docs' table; a refusal's reason)
    # a refused field: the values that ask for nothing kvchat lacks, accepted
    accepts: Callable[[Any], bool] | None = None


def _none_or(*values: Any) -> Callable[[Any], bool]:
    """Accepts None and `values` compared with their types (JSON true is not 1)."""
    return lambda v: v is None or any(type(v) is type(x) and v == x for x in values)


def _empty(v: Any) -> bool:
    return v is None or v in ([], {}, "")


def _zero(v: Any) -> bool:
    return v is None or (type(v) in (int, float) and v == 0)


def _honoured(note: str) -> Field:
    return Field(HONOURED, note)


def _advisory(note: str) -> Field:
    return Field(ADVISORY, note)


def _is_none(v: Any) -> bool:
    return v is None


def _refused(note: str, accepts: Callable[[Any], bool] = _is_none) -> Field:
    return Field(REFUSED, note, accepts)


# fields both OpenAI routes share
_SAMPLING = {
    "model": _honoured("the loaded model's id (or path), or a --models-dir model"),
    "max_tokens": _honoured("≥ 1; capped by the cache bound"),
    "temperature": _honoured("0–2"),
    "top_p": _honoured("0 < p ≤ 1"),
    "seed": _honoured("0 … 2⁶⁴−1: seeded runs repeat"),
    "stop": _honoured("up to 16 strings"),
    "stream": _honoured("server-sent events"),
    "stream_options": _honoured("`include_usage`; `include_obfuscation` is advisory"),
    "user": _honoured("names the client's cache partition (when no `prompt_cache_key`)"),
    "n": _refused("one choice per request", _none_or(1)),
    "frequency_penalty": _refused("use `repetition_penalty`", _zero),
    "presence_penalty": _refused("use `repetition_penalty`", _zero),
    "logit_bias": _refused("no per-token bias", _empty),
    # kvchat's and other local servers' extensions
    "prompt_cache_key": _honoured("names the client's cache partition"),
    "truncation": _honoured("`disabled` (default) or `auto` (as the Responses API)"),
    "top_k": _honoured("≥ 0 (mlx-lm)"),
    "min_p": _honoured("0–1 (mlx-lm)"),
    "repetition_penalty": _honoured("0 < r ≤ 100 (mlx-lm)"),
    "repetition_context_size": _honoured("≥ 1 recent tokens penalised (mlx-lm)"),
    "ignore_eos": _honoured("generate max_tokens whatever the model says (llama-server)"),
    # speculative decoding (kvchat's; docs/design.md, Speculative decoding): the same
    # reply when greedy, so a request may choose it within what the server loaded
    "speculation": _honoured("`off`, `lookup`, or `draft` where the server has"
                             " `--draft-model` (kvchat)"),
    "draft_tokens": _honoured("1–16 drafts per step at most (kvchat)"),
    "lookup_ngram": _honoured("1–8 ids matched by prompt lookup (kvchat)"),
}

CHAT = {
    **_SAMPLING,
    "messages": _honoured("system / developer / user / assistant / tool, text content"),
    "max_completion_tokens": _honoured("as `max_tokens` (wins over it)"),
    "logprobs": _refused("no log probabilities", _none_or(False)),
    "top_logprobs": _refused("no log probabilities", _none_or(0)),
    "tools": _honoured("functions, rendered by the model's chat template (one that never"
                       " reads `tools` is refused)"),
    "tool_choice": _honoured("`auto`, `none`, `required` or a named function (forced calls"
                             " are constrained to validate)"),
    "parallel_tool_calls": _honoured("false: one call at most (the reply ends with it);"
                                     " true (default): the calls the model writes"),
    "functions": _refused("the deprecated form: use `tools`", _empty),
    "function_call": _refused("the deprecated form: use `tool_choice`", _none_or("none")),
    "response_format": _honoured("`text`, `json_object` or `json_schema` (enforced while"
                                 " decoding; an unenforceable keyword is refused by name)"),
    "audio": _refused("text only"),
    "modalities": _refused("text only", lambda v: v is None or v == ["text"]),
    "reasoning_effort": _refused("no reasoning controls"),
    "verbosity": _refused("no verbosity control"),
    "web_search_options": _refused("no web search"),
    "moderation": _refused("no moderation"),
    "prediction": _advisory("a predicted output only speeds up a reply; the reply is the same"),
    "store": _advisory("kvchat stores no completions"),
    "metadata": _advisory("kvchat stores no completions to tag"),
    "service_tier": _advisory("one tier"),
    "safety_identifier": _advisory("no usage-policy monitoring"),
    "prompt_cache_retention": _advisory("the prefix pool keeps caches by its byte budget"),
    "prompt_cache_options": _advisory("the prefix pool finds shared prefixes by itself"),
}

TEXT = {
    **_SAMPLING,
    "prompt": _honoured("a string or token ids (one prompt)"),
    "max_completion_tokens": _honoured("as `max_tokens` (kvchat: wins over it)"),
    "logprobs": _refused("no log probabilities", _none_or(0, False)),
    "echo": _refused("the prompt is not repeated", _none_or(False)),
    "best_of": _refused("one choice per request", _none_or(1)),
    "suffix": _refused("no insertion", _empty),
}

STREAM_OPTIONS = {
    "include_usage": _honoured("a last chunk with `usage` and the `kvchat` object"),
    "include_obfuscation": _advisory("no obfuscation padding is added"),
}

MESSAGE = {
    "role": _honoured("system, developer (as system), user, assistant, tool"),
    "content": _honoured("a string or text parts (null beside an assistant's tool_calls)"),
    "name": _refused("the chat template is not given participant names", _empty),
    "tool_calls": _honoured("an assistant's past calls, rendered by the chat template"),
    "tool_call_id": _honoured("a tool result's call id, rendered by the chat template"),
    "function_call": _refused("the deprecated form: use `tool_calls`"),
    "audio": _refused("text only"),
    "refusal": _advisory("a past refusal's text; its content is what the model reads"),
}

# Anthropic's Messages API (anthropic.py)
MESSAGES = {
    "model": _honoured("the loaded model's id (or path), or a --models-dir model"),
    "max_tokens": _honoured("≥ 1 (0, a cache warm-up, is refused)"),
    "messages": _honoured("user / assistant turns: text, tool_use and tool_result blocks"),
    "system": _honoured("a string or text blocks"),
    "stop_sequences": _honoured("up to 16 strings"),
    "stream": _honoured("Anthropic's event sequence"),
    "temperature": _honoured("0–1"),
    "top_p": _honoured("0 < p ≤ 1"),
    "top_k": _honoured("≥ 0"),
    "metadata": _honoured("`user_id` names the client's cache partition"),
    "tools": _honoured("custom tools, rendered by the model's chat template (one that never"
                       " reads `tools` is refused); server tools are refused"),
    "tool_choice": _honoured("`auto`, `any`, `tool` (forced calls are constrained to"
                             " validate) or `none`; `disable_parallel_tool_use`"),
    "thinking": _refused("no extended thinking",
                         lambda v: v is None or v == {"type": "disabled"}),
    "output_config": _refused("no output format or effort settings", _empty),
    "container": _refused("no code-execution containers"),
    "cache_control": _advisory("caching is automatic (the prefix pool)"),
    "service_tier": _advisory("one tier"),
    "speed": _advisory("one speed"),
    "inference_geo": _advisory("it runs here"),
    "diagnostics": _advisory("every answer's `kvchat.cache` says why the cache missed"),
    "user_profile_id": _advisory("no billing to attribute"),
    "workspace_id": _advisory("no workspaces"),
}

MESSAGES_METADATA = {"user_id": _honoured("names the client's cache partition")}

TEXT_BLOCK = {
    "type": _honoured("`text` (images, documents, thinking blocks are refused)"),
    "text": _honoured("the text"),
    "cache_control": _advisory("caching is automatic"),
    "citations": _refused("no citations", _empty),
}

# tool use on /v1/messages (anthropic_messages.py): a tool, the choice, and the blocks
TOOL = {
    "type": _honoured("`custom` (server tools are refused by their type)"),
    "name": _honoured("the function's name"),
    "description": _honoured("rendered by the chat template"),
    "input_schema": _honoured("the function's parameters (a forced call validates)"),
    "cache_control": _advisory("caching is automatic"),
    # kvchat holds a call to its schema only when tool_choice forces it
    "strict": _refused("only a forced call (tool_choice any / tool) is held to its schema",
                       _none_or(False)),
    "input_examples": _refused("the chat template has no place for examples", _empty),
    "allowed_callers": _refused("only direct calls, no programmatic tool calling",
                                lambda v: v is None or v == ["direct"]),
    "defer_loading": _refused("no tool search: every tool is rendered", _none_or(False)),
    # it asks for input deltas sooner; the input the client assembles is the same
    "eager_input_streaming": _advisory("a call's input is streamed whole, once complete"),
}

TOOL_CHOICE = {
    "type": _honoured("`auto`, `any`, `tool` or `none`"),
    "name": _honoured("the tool that `tool` forces"),
    "disable_parallel_tool_use": _honoured("true: one call at most"),
}

TOOL_USE_BLOCK = {
    "type": _honoured("`tool_use`: an assistant's past call"),
    "id": _honoured("the call's id"),
    "name": _honoured("the tool's name"),
    "input": _honoured("the call's arguments"),
    "cache_control": _advisory("caching is automatic"),
    "caller": _refused("only direct calls, no programmatic tool calling",
                       lambda v: v is None or v == {"type": "direct"}),
    "toolset_name": _refused("no toolsets", _empty),
}

TOOL_RESULT_BLOCK = {
    "type": _honoured("`tool_result`: a tool's result"),
    "tool_use_id": _honoured("the call it answers"),
    "content": _honoured("a string or text blocks"),
    "is_error": _honoured("the result is shown to the model as an error"),
    "cache_control": _advisory("caching is automatic"),
    "toolset_name": _refused("no toolsets", _empty),
}


def check(body: Mapping[str, Any], table: Mapping[str, Field], where: str = "") -> None:
    """ApiError 400 naming the first field of `body` that `table` refuses or lacks."""
    for name, value in body.items():
        path = f"{where}{name}"
        path = path if len(path) <= 200 else path[:199] + "…"  # a client's key: bounded
        f = table.get(name)
        if f is None:
            raise bad(f"unknown field '{path}': kvchat serve does not know it (docs/serve.md,"
                      " Fields)", path)
        if f.status == REFUSED and not (f.accepts is not None and f.accepts(value)):
            raise bad(f"'{path}' is not supported by kvchat serve: {f.note}", path)


def refused(message: str, param: str) -> ApiError:
    """A value kvchat cannot honour, inside an honoured field."""
    return bad(f"'{param}' is not supported by kvchat serve: {message}", param)

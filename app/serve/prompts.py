"""Prompts become token ids in the server, before they queue: a prompt longer than the
model can read is refused at once (or cut, when the request asks), never run for minutes
ahead of everyone else's (docs/serve.md, Who can reach the server).

The engine is sent the ids, so it renders and tokenizes nothing itself: the count the
server checked is the count the engine runs. The tokenizer is the engine's (same folder,
same `--tokenizer` choice), loaded here once per model; work runs on one thread of its
own, so the event loop keeps answering while a long prompt is read. A request with tools
is rendered with them exactly as the engine's turn would (model/runtime/turn.py,
`tool_use` and `prompt_ids`); the engine still parses the calls out of the reply.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from typing import Any

from kvchat.app.serve.errors import ApiError
from kvchat.app.serve.protocol import Request
from kvchat.model.errors import KVChatError
from kvchat.model.runtime.events import GenParams
from kvchat.model.runtime.turn import tool_use
from kvchat.model.text.tokenizer import Tokenizer, load_tokenizer
from kvchat.model.text.tool_calls import template_messages

KEPT_TOKENIZERS = 4  # models a server switches between (--models-dir); the rest load again


def fit(ids: list[int], req: Request) -> list[int]:
    """`ids` when they fit `req.prompt_limit`; else cut (truncation "auto": the first
    `keep` tokens and the most recent, leaving max_tokens of the context for the reply,
    or half of it at most) or refused with OpenAI's `context_length_exceeded`."""
    limit = req.prompt_limit
    if limit <= 0 or len(ids) <= limit:
        return ids
    if req.truncation == "auto":
        context = req.context or limit
        target = max(1, min(limit, max(context - req.params.max_tokens, context // 2)))
        keep = max(0, min(req.params.keep, target - 1))
        return ids[:keep] + ids[len(ids) - (target - keep):]
    param = "messages" if req.kind == "chat" else "prompt"
    raise ApiError(400, f"This model's maximum context length is {limit} tokens. However,"
                   f" your {param} resulted in {len(ids)} tokens. Shorten it, or send"
                   " \"truncation\": \"auto\" to drop tokens from its middle.",
                   param=param, code="context_length_exceeded")


class PromptEncoder:
    """Token ids for requests, with each model's tokenizer loaded once."""

    def __init__(self, tokenizer_kind: str = "auto"):
        self.kind = tokenizer_kind
        self._tokenizers: collections.OrderedDict[str, Tokenizer] = collections.OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "kvchat-prompts")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def ids(self, req: Request, model_path: str) -> list[int]:
        """The prompt's ids as the engine would make them, checked against the limit;
        ApiError 400 for a prompt the template or tokenizer refuses or that is too long."""
        if isinstance(req.prompt, list) and all(isinstance(t, int) for t in req.prompt):
            return fit(list(req.prompt), req)  # ids already: nothing to wait for
        loop = asyncio.get_running_loop()
        try:
            ids = await loop.run_in_executor(self._pool, self._encode, req.prompt, model_path,
                                             req.params)
        except KVChatError as e:  # a template that raises (or reads no tools), a tokenizer
            # that cannot load
            param = "tools" if req.params.tools else None
            raise ApiError(400, str(e), param=param, code="invalid_prompt") from None
        return fit(ids, req)

    async def decode(self, ids: list[int], model_path: str) -> str:
        """A reply's ids as text, as the engine's streaming detokenizer gave it (special
        tokens skipped)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, lambda: self._tokenizer(model_path).decode(ids, skip_special_tokens=True))

    def _encode(self, prompt: Any, model_path: str, params: GenParams
                ) -> list[int]:  # the prompts thread
        tok = self._tokenizer(model_path)
        if isinstance(prompt, str):
            return tok.encode(prompt)
        tools = tool_use(tok, params)  # ToolCallError: a template that never reads tools
        extra = {"tools": tools.tools} if tools is not None else {}
        return tok.encode_chat(template_messages(prompt), **extra)

    def _tokenizer(self, path: str) -> Tokenizer:
        tok = self._tokenizers.pop(path, None)
        if tok is None:
            tok = load_tokenizer(path, prefer=self.kind)  # type: ignore[arg-type]
        self._tokenizers[path] = tok
        while len(self._tokenizers) > KEPT_TOKENIZERS:
            self._tokenizers.popitem(last=False)
        return tok

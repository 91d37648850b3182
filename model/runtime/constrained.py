"""Constrained decoding: a grammar decides which tokens may come next (docs/serve.md,
"Structured output").

The grammar engine is llguidance (chosen by measurement: tests/benchmarks/grammar_mask.py;
it refuses every JSON-Schema keyword it cannot enforce, by name, where others skip them
silently). One `Constraint` follows one reply:

- `apply(logits)` computes, on the host, the mask of tokens the grammar allows after the
  reply so far, and returns the logits with every other token at -inf. The decode loop
  (model/runtime/generate.py) calls it on the logits the compiled step returns, so the
  step itself is unchanged, and the mask is computed while that step runs.
- `advance(token)` feeds the chosen token to the grammar and returns the token to keep:
  the same one, unless keeping it would leave too few tokens to finish a valid reply.

Finishing within `max_tokens`: a reply cut off by the token limit would not parse, and a
small or random-weight model can wander (an endless string, an ever-deeper array). So
the constraint keeps a *closing plan*: the single-byte tokens that would complete the
grammar from where the reply is, found by a depth-first search that tries closing
characters first (`"`, `}`, `]`, then short values). While the plan is short next to the
tokens left, the model chooses freely; near the limit each chosen token is checked, and
one that would leave no completion within the tokens left is replaced by the plan's next
token. A reply then ends valid whenever a completion exists (the search is bounded:
`PLAN_NODES`; a grammar whose completion it cannot find, such as a long `pattern`, runs
unguarded and may still end at the limit). llguidance has no such mode of its own.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from kvchat.model.errors import KVChatError, one_line

if TYPE_CHECKING:
    import mlx.core as mx

    from kvchat.model.text.tokenizer import Tokenizer

# Between JSON tokens: nothing, one space, or one newline and an indent of up to 20 (the
# rule llama.cpp's JSON grammars use): a model may pretty-print, never loop on whitespace.
JSON_WHITESPACE = r"(?:[ ]|\n[ \t]{0,20})?"
# Options kvchat fixes, whatever a schema's own "x-guidance" says: never skip a keyword it
# cannot enforce (`lenient`), never read oneOf as anyOf (`coerce_one_of`).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE,
                                "lenient": False, "coerce_one_of": False}
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}  # response_format json_object

# The closing plan: bytes in the order the search tries them. A string closes first, then
# a container; a value is the shortest that fits (`""`, `0`, `null`...); letters and
# digits spell required keys, enums and patterns.
PLAN_ORDER = (b'"}],:0' + b"ntf1" + bytes(range(ord("a"), ord("z") + 1))
              + bytes(range(ord("A"), ord("Z") + 1)) + b"23456789-.eE+[{ " + b"\n")
PLAN_NODES = 4000  # tokens tried per search (each ~1 µs): a bound, not a target
PLAN_MAX = 256  # the longest plan searched for
GUARD_MARGIN = 32  # check each token once the tokens left are within plan + this
RECHECK_EVERY = 8  # outside that zone, re-measure the plan every this many tokens

_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


class GrammarError(KVChatError):
    """A response format, schema or grammar that constrained decoding cannot enforce;
    one line that names the feature (the server answers it with a 400)."""


def _llg() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a declared dependency
        raise GrammarError("structured output needs the llguidance package") from None
    return llguidance


def _refusal(message: str, what: str) -> GrammarError:
    """llguidance's error as one line naming the feature."""
    if m := _UNIMPLEMENTED.search(message):
        keys = ", ".join(k.strip().strip('"') for k in m.group(1).split(","))
        return GrammarError(f"{what}: JSON Schema keyword not supported: {keys} (constrained"
                            " decoding cannot enforce it)")
    if "oneOf" in message and "coerce_one_of" in message:
        return GrammarError(f"{what}: JSON Schema keyword not supported: oneOf whose"
                            " branches can overlap (use anyOf)")
    return GrammarError(f"{what}: {one_line(message, 240)}")


def json_schema_grammar(schema: Any, what: str = "response_format") -> str:
    """The llguidance grammar enforcing `schema` (a JSON Schema object, or true/false);
    GrammarError naming the keyword it cannot enforce. Checked here, before any turn."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, Mapping):
        raise GrammarError(f"{what}: the JSON schema must be an object,"
                           f" got {type(schema).__name__}")
    llg = _llg()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(dict(schema), overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{what}: not a usable JSON schema: {one_line(e, 200)}") from None
    return check_grammar(grammar, what)


def lark_grammar(lark: str, what: str = "grammar") -> str:
    """The llguidance grammar of a Lark grammar text (llguidance's dialect: `%json {...}`
    embeds a JSON schema, `<[id]>` a special token)."""
    return check_grammar(_llg().LLMatcher.grammar_from_lark(lark), what)


def check_grammar(grammar: str, what: str) -> str:
    message = _llg().LLMatcher.validate_grammar(grammar)
    if message:
        raise _refusal(message, what)
    return grammar


def response_format_grammar(response_format: Any) -> str | None:
    """The grammar of an OpenAI `response_format` (`{"type": "text"}`, `"json_object"`, or
    `"json_schema"` with `json_schema.schema`); None for plain text. GrammarError, naming
    the field, for any other shape or a schema it cannot enforce."""
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise GrammarError("response_format must be an object with a type")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(JSON_OBJECT_SCHEMA)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or "schema" not in spec:
            raise GrammarError("response_format.json_schema.schema is missing")
        return json_schema_grammar(spec["schema"], "response_format.json_schema.schema")
    raise GrammarError(f"response_format.type must be text, json_object or json_schema,"
                       f" got {json.dumps(kind)[:40]}")


# ---- the tokenizer as the grammar engine sees it ---------------------------------------------

class _SentencePieceVocab:
    """What llguidance's TokenizerWrapper reads: each id's bytes, specials, an encoder."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.tokens = tokenizer.token_bytes()
        self.special_token_ids = sorted(tokenizer.special_ids)
        self.eos_token_id = tokenizer.end_ids[0] if tokenizer.end_ids else None
        self.bos_token_id = tokenizer.bos_id

    def __call__(self, data: bytes | str) -> list[int]:
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
        return self._tokenizer.encode(text, add_special_tokens=False)


_VOCABS: weakref.WeakKeyDictionary[Any, Vocabulary] = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()


class Vocabulary:
    """A tokenizer's grammar-engine form (llguidance's LLTokenizer) and its single-byte
    tokens: built once per tokenizer (`of`), ~1 s for a 150k vocabulary."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        llg = _llg()
        ends = list(tokenizer.end_ids)
        try:
            source = tokenizer.tokenizer_json()
            if source is not None:
                self.ll = llg.LLTokenizer(source, eos_token=ends or None)
            else:
                wrapper = llg.TokenizerWrapper(_SentencePieceVocab(tokenizer))
                self.ll = llg.LLTokenizer(wrapper, eos_token=ends or None)
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(f"structured output cannot use this model's tokenizer:"
                               f" {one_line(e, 160)}") from None
        self.size = self.ll.vocab_size
        self.end_ids = ends
        # one token per byte the closing plan may use (any token that spells just that byte)
        ids: dict[int, int] = {}
        for i in range(self.size):
            if self.ll.is_special_token(i):
                continue
            b = self.ll.decode_bytes([i])
            if len(b) == 1 and b[0] not in ids:
                ids[b[0]] = i
        self.plan_ids = [ids[b] for b in PLAN_ORDER if b in ids]

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Vocabulary:
        with _VOCABS_LOCK:
            vocab = _VOCABS.get(tokenizer)
            if vocab is None:
                vocab = _VOCABS[tokenizer] = cls(tokenizer)
            return vocab


# ---- one reply under a grammar -------------------------------------------------------------

def mask_logits(logits: mx.array, words: np.ndarray, n_ids: int, bits: mx.array) -> mx.array:
    """`logits` (1, V) cut to the first min(V, n_ids) ids, those whose bit is clear in the
    packed mask `words` (int32, little-endian bit order) at -inf. `bits` holds 1 << i for
    i < 32. Unpacked by MLX on the device: one small upload, no per-id work on the host."""
    import mlx.core as mx

    keep = ((mx.array(words).view(mx.uint32)[:, None] & bits[None, :]) != 0).reshape(-1)
    n = min(logits.shape[-1], n_ids)
    return mx.where(keep[None, :n], logits[..., :n], -mx.inf)


class Constraint:
    """One reply's grammar state: masks logits before sampling, follows the chosen tokens,
    and keeps a way to finish within `max_tokens` (the module's docstring says how)."""

    def __init__(self, vocab: Vocabulary, grammar: str, max_tokens: int,
                 what: str = "response_format") -> None:
        import mlx.core as mx

        llg = _llg()
        self.vocab = vocab
        self.matcher = llg.LLMatcher(vocab.ll, grammar, log_level=0)
        if self.matcher.is_error():
            raise _refusal(self.matcher.get_error(), what)
        self.max_tokens = max_tokens
        self.produced = 0
        self.replaced = 0  # tokens the closing plan chose instead of the model
        self._words = np.zeros((vocab.size + 31) // 32, dtype=np.int32)
        self._bits = mx.array([1 << i for i in range(32)], dtype=mx.uint32)
        self.plan = self._search(max_tokens)
        self.guarded = self.plan is not None
        self._estimate = len(self.plan) if self.plan is not None else 0
        if self.plan is None:
            longer = self._search(PLAN_MAX)
            if longer is not None and len(longer) > max_tokens:
                raise GrammarError(f"max_tokens {max_tokens} is too few for this {what}: the"
                                   f" shortest valid reply takes about {len(longer)} tokens")

    # -- state
    @property
    def finished(self) -> bool:
        """The grammar takes no more tokens (it has ended the reply)."""
        return self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """The reply so far is a whole sentence of the grammar."""
        return self.matcher.is_accepting()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError("constrained decoding failed:"
                               f" {one_line(self.matcher.get_error(), 200)}")

    # -- masking
    def mask(self) -> np.ndarray:
        """The allowed ids after the reply so far, as packed bits (little-endian words)."""
        self.matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        self._check()
        return self._words

    def apply(self, logits: mx.array) -> mx.array:
        """`logits` (1, V) with every token the grammar forbids at -inf; the width becomes
        the ids both the model and the tokenizer know."""

        if self.guarded and self.plan is None and self._zone():
            self.plan = self._search(self.max_tokens - self.produced)
            self.guarded = self.plan is not None  # no ending found: no further searches
        return mask_logits(logits, self.mask(), self.vocab.size, self._bits)

    # -- following the reply
    def advance(self, token: int) -> int:
        """Feed the chosen id; returns the id to keep (the closing plan's, when the chosen
        one would leave no valid ending within the tokens left)."""
        token = int(token)
        m = self.matcher
        left = self.max_tokens - self.produced - 1  # tokens after this one
        in_zone = self.guarded and self._zone()
        plan = self.plan
        self.plan = None
        self.produced += 1
        if in_zone and plan and token == plan[0]:
            m.consume_token(token)
            self._check()
            self.plan = plan[1:]
            return token
        if not m.consume_token(token):
            self._check()
            raise GrammarError("constrained decoding failed: the grammar refused a token")
        if in_zone:
            after = self._search(left)
            if after is not None:
                self.plan, self._estimate = after, len(after)
            elif plan is not None:  # the chosen token strands the reply: the plan's instead
                # (an empty plan: the reply was complete, so it ends here)
                instead = plan[0] if plan else self.vocab.end_ids[0] if self.vocab.end_ids else None
                if instead is not None:
                    m.rollback(1)
                    m.consume_token(instead)
                    self._check()
                    self.plan, self.replaced = plan[1:], self.replaced + 1
                    return instead
        elif self.guarded and self.produced % RECHECK_EVERY == 0:
            self.plan = self._search(min(left, PLAN_MAX))
            if self.plan is not None:
                self._estimate = len(self.plan)
        return token

    def _zone(self) -> bool:
        """Few enough tokens left that every one is checked against the plan."""
        return self.max_tokens - self.produced <= self._estimate + GUARD_MARGIN

    def _search(self, limit: int) -> list[int] | None:
        """Tokens that complete the grammar from here, at most `limit` of them: the tokens
        a state forces (llguidance's fast-forward tokens: a key's name, say), else single
        bytes tried depth first in `PLAN_ORDER`; None if none was found within
        `PLAN_NODES` tries."""
        m = self.matcher
        order = self.vocab.plan_ids
        path: list[int] = []
        frames: list[tuple[int, int]] = []  # per move: tokens it took, where to resume
        at, nodes = 0, 0
        limit = min(limit, PLAN_MAX)
        found = None
        while True:
            if m.is_accepting() or (m.is_stopped() and not m.is_error()):
                found = list(path)
                break
            moved = False
            if at == 0 and len(path) < limit:
                forced = m.compute_ff_tokens()[: limit - len(path)]
                took = m.try_consume_tokens(forced) if forced else 0
                nodes += 1
                if took:
                    path += forced[:took]
                    frames.append((took, len(order)))  # nothing else to try here
                    continue
            while len(path) < limit and at < len(order) and nodes < PLAN_NODES:
                tok = order[at]
                at += 1
                nodes += 1
                if m.try_consume_tokens([tok]) == 1:
                    path.append(tok)
                    frames.append((1, at))
                    at, moved = 0, True
                    break
            if moved:
                continue
            if not frames or nodes >= PLAN_NODES:
                break
            took, at = frames.pop()
            m.rollback(took)
            del path[len(path) - took:]
        if path:
            m.rollback(len(path))
        return found


def constraint_for(tokenizer: Tokenizer, grammar: str, max_tokens: int,
                   what: str = "response_format") -> Constraint:
    """A fresh Constraint for one reply of `tokenizer`'s model under `grammar`."""
    return Constraint(Vocabulary.of(tokenizer), grammar, max_tokens, what)


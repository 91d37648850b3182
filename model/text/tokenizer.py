"""Tokenizers: SentencePiece ``tokenizer.model`` or Hugging Face ``tokenizer.json``, one API.

``load_tokenizer(folder)`` picks the file the folder has (``tokenizer.json`` when both exist,
as transformers does; ``prefer=`` forces one; a GGUF file: the tokenizer its metadata
describes, built by gguf_tokenizer.py) and reads the special tokens the way
transformers and ``generate()`` do:

- BOS/EOS strings from tokenizer_config.json, else special_tokens_map.json (a string or a
  ``{"content": ...}`` dict); ids from generation_config.json and config.json
  (``eos_token_id`` may be a list). ``eos_ids`` holds every EOS id found, the EOS token first.
- ``add_bos`` is tokenizer_config's ``add_bos_token``; without that key a ``tokenizer.json``
  adds BOS when its post-processor does (transformers keeps the post-processor then), and a
  SentencePiece model adds BOS when it has one (LlamaTokenizer's default).
- Special-token strings in the text (``<s>``, ``<|im_start|>``, any added token) become their
  ids, so a rendered chat template encodes as transformers' ``apply_chat_template`` does. The
  SentencePiece path splits the text on those strings itself (control and unknown pieces plus
  every token the config files declare) and encodes each stretch between them with
  SentencePiece. Whether a stretch after a special token gets SentencePiece's dummy ``▁``
  prefix follows tokenizer_config's ``legacy`` as transformers 5 does: ``"legacy": true``
  prefixes every stretch; false or absent only the start of the text. Each stretch goes
  through SentencePiece's own normalizer, so a model that folds whitespace also drops spaces
  next to a special token (tokenizer.json and transformers keep them).
- Where tokenizer_config's ``add_bos_token`` contradicts a tokenizer.json post-processor we
  follow the key (transformers 5.24 follows the post-processor there).

Decoding keeps special tokens unless ``skip_special_tokens=True``. The SentencePiece path
decodes the way Llama's tokenizer.json decoder does (``▁`` -> space, ``<0xNN>`` bytes, one
leading space stripped), so both files of one model decode valid text alike; bytes that are
not valid UTF-8 become U+FFFD per bad sequence, as SentencePiece does.

``StreamDetokenizer`` turns tokens into text deltas as they arrive; see its docstring.

Text to encode is untrusted (a prompt, a pasted file, a server request) and so is the
tokenizer (a downloaded tokenizer.json), so encoding is bounded (docs/reliability.md,
"Tokenizers"): at most `MAX_ENCODE_CHARS` characters (the rendered prompt's own cap), and
on the Rust library a deadline that grows with the text (`encode_time_limit`). The Rust
call holds the GIL in ``encode``, so it runs as ``encode_batch`` (which lets it go) on a
worker thread the caller stops waiting for at the deadline or on cancel; a worker still
stuck makes the next encode a refusal rather than a second stuck thread. A panic of the
library (``pyo3_runtime.PanicException``, a BaseException: a pre-tokenizer regex past the
regex engine's limit, say) is one ``TokenizerError`` line.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Container, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from kvchat.model.errors import NEVER_CAUGHT, ModelLoadError, one_line
from kvchat.model.files import read_json_object
from kvchat.model.gguf_file import is_gguf, read_gguf

from . import chat_template as _chat
from .gguf_tokenizer import gguf_vocab

__all__ = ["MAX_ENCODE_CHARS", "StreamDetokenizer", "Tokenizer", "TokenizeCancelled",
           "TokenizerError", "encode_time_limit", "load_tokenizer"]

# The library's thread pool would only serve batches we never send, and a process that
# forks after using it prints a warning into whatever owns the terminal.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MAX_ENCODE_CHARS = _chat.RENDER_OUTPUT_LIMIT  # what a chat template may render, too
# A deadline of ENCODE_BASE_S plus one second per ENCODE_CHARS_PER_S characters:
# stories260K's tokenizer.json read 175,000 characters a second on a loaded 2-core CPU, so
# a real tokenizer meets it only on a far slower machine, a pathological pre-tokenizer
# (catastrophic regex backtracking) within seconds.
ENCODE_BASE_S = 10.0
ENCODE_CHARS_PER_S = 50_000
_POLL_S = 0.05  # how often a wait checks the caller's cancel flag

Kind = Literal["sentencepiece", "hf"]

# The named special tokens transformers passes to chat templates (its special_tokens_map).
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenizerError(ModelLoadError):
    """A tokenizer that cannot be found or loaded, or text/ids it cannot handle."""


class TokenizeCancelled(TokenizerError):
    """The caller's should_stop() asked a running encode to stop (the turn was cancelled)."""


def encode_time_limit(n_chars: int) -> float:
    """Seconds an encode of `n_chars` characters may take before it is refused."""
    return ENCODE_BASE_S + n_chars / ENCODE_CHARS_PER_S


def _library_error(e: BaseException, what: str) -> TokenizerError:
    """A tokenizer library's failure (a Rust panic included) as one line."""
    return TokenizerError(f"the tokenizer failed {what}: {one_line(e, 200)}")


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _id_list(value: Any) -> list[int]:
    """eos_token_id and friends: an int, a list of ints, or missing."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


# --------------------------------------------------------------------------- backends


class _SentencePieceBackend:
    """``sentencepiece`` plus our own special-token splitting and Llama-style decoding."""

    kind: Kind = "sentencepiece"

    def __init__(self, path: Path, legacy: bool) -> None:
        try:
            import sentencepiece as spm
        except ImportError:  # pragma: no cover - a declared dependency
            raise TokenizerError("the sentencepiece package is not installed") from None
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as e:  # noqa: BLE001 - the library raises plain RuntimeError/OSError
            raise TokenizerError(f"{path}: not a SentencePiece model: {one_line(e)}") from None
        sp = self.sp
        self.legacy = legacy
        self.size = sp.get_piece_size()
        self.pieces = [sp.id_to_piece(i) for i in range(self.size)]
        # SentencePiece adds a "▁" before the text when its normalizer has add_dummy_prefix;
        # decoding then strips one leading space (tokenizer.json's Strip decoder does the same).
        probe = sp.encode("a", out_type=str)
        self.dummy_prefix = bool(probe) and probe[0].startswith("▁")
        self.special: dict[str, int] = {}  # text -> id, split out of text before encoding
        self.special_ids: set[int] = set()  # dropped by skip_special_tokens
        # Bytes each id decodes to (with and without special tokens): decoding is a join.
        self.table: list[bytes] = []
        for i, piece in enumerate(self.pieces):
            if sp.is_byte(i) and (m := _BYTE_PIECE.fullmatch(piece)):
                self.table.append(bytes([int(m.group(1), 16)]))
            elif sp.is_control(i) or sp.is_unknown(i):
                self.table.append(piece.encode("utf-8"))
                self.special[piece] = i
                self.special_ids.add(i)
            else:
                self.table.append(piece.replace("▁", " ").encode("utf-8"))
        self.table_skip = [b"" if i in self.special_ids else b for i, b in enumerate(self.table)]
        unk = sp.unk_id()
        self.unk_piece = self.pieces[unk] if 0 <= unk < self.size else None
        self.split_re: re.Pattern[str] | None = None
        self.finish()

    def register(self, text: str, token_id: int, special: bool) -> None:
        """A config-declared (added) token: split it out of text, decode it as written."""
        if not 0 <= token_id < self.size:
            return
        self.special[text] = token_id
        self.pieces[token_id] = text
        self.table[token_id] = text.encode("utf-8")
        if special:
            self.special_ids.add(token_id)
            self.table_skip[token_id] = b""
        else:
            self.table_skip[token_id] = self.table[token_id]

    def finish(self) -> None:
        """Compile the splitter once every special token is registered."""
        if self.special:
            # Longest first, so "<|im_start|>" wins over a shorter token it contains.
            alternatives = sorted(self.special, key=len, reverse=True)
            self.split_re = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")

    def token_to_id(self, text: str) -> int | None:
        if text in self.special:
            return self.special[text]
        i = self.sp.piece_to_id(text)
        return i if 0 <= i < self.size and self.pieces[i] == text else None

    def id_to_token(self, token_id: int) -> str | None:
        return self.pieces[token_id] if 0 <= token_id < self.size else None

    def _encode_chunk(self, text: str, first: bool) -> list[int]:
        if first or self.legacy or not self.dummy_prefix or self.unk_piece is None:
            return self.sp.encode(text)
        # Non-legacy: no dummy prefix after a special token. SentencePiece has no switch for
        # that, so encode behind the unknown piece and drop it (as transformers' LlamaTokenizer).
        head = self.sp.encode(self.unk_piece)
        ids = self.sp.encode(self.unk_piece + text)
        return ids[len(head):]

    def encode(self, text: str, should_stop: Callable[[], bool] | None = None) -> list[int]:
        # SentencePiece runs in C++ in time linear in the text: the length cap bounds it
        if self.split_re is None:
            return self.sp.encode(text)
        ids: list[int] = []
        for n, part in enumerate(self.split_re.split(text)):
            if n % 2:  # the captured special-token strings sit at odd positions
                ids.append(self.special[part])
            elif part:
                ids.extend(self._encode_chunk(part, first=n == 0))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        table = self.table_skip if skip_special_tokens else self.table
        if ids and (min(ids) < 0 or max(ids) >= self.size):
            raise TokenizerError(f"token ids out of range 0..{self.size - 1}")
        data = b"".join([table[i] for i in ids])
        text = data.decode("utf-8", "replace")
        if self.dummy_prefix and text.startswith(" "):
            text = text[1:]
        return text

    def pending_ids(self, skip_special_tokens: bool = False) -> frozenset[int]:
        # Local UTF-8 decoding: a byte run's completed characters never change later.
        return frozenset()


class _HFBackend:
    """The ``tokenizers`` library on a tokenizer.json."""

    kind: Kind = "hf"

    def __init__(self, path: Path, text: str | None = None) -> None:
        """From a tokenizer.json file, or from its `text` (a GGUF file's, built)."""
        try:
            from tokenizers import Tokenizer as _HFTokenizer
        except ImportError:  # pragma: no cover - comes with mlx-lm/transformers
            raise TokenizerError("the tokenizers package is not installed") from None
        try:
            self.tok = (_HFTokenizer.from_file(str(path)) if text is None
                        else _HFTokenizer.from_str(text))
        except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception
            raise TokenizerError(f"{path}: not a tokenizer.json: {one_line(e)}") from None
        self.size = self.tok.get_vocab_size(with_added_tokens=True)
        decoder = json.loads(self.tok.to_str()).get("decoder")
        self.byte_fallback = "ByteFallback" in json.dumps(decoder)
        self._added = set(self.tok.get_added_tokens_decoder())
        self._to_add: dict[int, tuple[str, bool]] = {}
        self._stuck: threading.Thread | None = None  # a worker abandoned at its deadline

    def register(self, text: str, token_id: int, special: bool) -> None:
        """Make a config-declared token an added token, as transformers does (if in the vocab)."""
        if token_id not in self._added and self.tok.token_to_id(text) == token_id:
            self._to_add[token_id] = (text, special)

    def finish(self) -> None:
        from tokenizers import AddedToken

        # One call each: the library rebuilds its matcher per call.
        specials = [AddedToken(t, special=True, normalized=False)
                    for t, special in self._to_add.values() if special]
        others = [AddedToken(t, special=False, normalized=False)
                  for t, special in self._to_add.values() if not special]
        if specials:
            self.tok.add_special_tokens(specials)
        if others:
            self.tok.add_tokens(others)
        self._added.update(self._to_add)
        self._to_add.clear()

    def token_to_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    def encode(self, text: str, should_stop: Callable[[], bool] | None = None,
               add_special_tokens: bool = False) -> list[int]:
        """The library's ids, on a worker thread the caller waits for until the deadline
        (see the module docstring)."""
        stuck = self._stuck
        if stuck is not None and stuck.is_alive():
            raise TokenizerError("the tokenizer is still working on an earlier text that took"
                                 " too long; try again in a moment")
        limit = encode_time_limit(len(text))
        result: dict[str, Any] = {}

        def work() -> None:
            try:
                enc = self.tok.encode_batch([text], add_special_tokens=add_special_tokens)
                result["ids"] = enc[0].ids
            except BaseException as e:  # noqa: BLE001 - a panic too: handed to the caller
                result["error"] = e

        worker = threading.Thread(target=work, name="kvchat-tokenize", daemon=True)
        deadline = time.monotonic() + limit
        worker.start()
        while worker.is_alive():
            worker.join(_POLL_S)
            if worker.is_alive() and should_stop is not None and should_stop():
                self._stuck = worker
                raise TokenizeCancelled("tokenizing cancelled")
            if worker.is_alive() and time.monotonic() > deadline:
                self._stuck = worker
                raise TokenizerError(
                    f"the tokenizer took longer than {limit:.0f} s on {len(text):,} characters;"
                    " refused (a tokenizer.json whose pre-tokenizer is pathological?)")
        if "error" in result:
            raise _library_error(result["error"], f"on {len(text):,} characters")
        return result["ids"]

    def post_processor_adds(self, token_id: int) -> bool:
        """Does the post-processor put ``token_id`` in front (transformers' add_bos default)?"""
        with_special = self.encode("a", add_special_tokens=True)
        plain = self.encode("a")
        return len(with_special) > len(plain) and with_special[0] == token_id

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        # The library silently drops unknown ids; we refuse them, as the SentencePiece path does.
        if ids and (min(ids) < 0 or max(ids) >= self.size):
            raise TokenizerError(f"token ids out of range 0..{self.size - 1}")
        try:
            return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except NEVER_CAUGHT:
            raise
        except BaseException as e:  # a panic of the library's decoder
            raise _library_error(e, "to decode") from None

    def pending_ids(self, skip_special_tokens: bool = False) -> frozenset[int]:
        # tokenizers' ByteFallback decoder judges a whole run of <0xNN> tokens at once: if any
        # byte is bad, every byte of the run becomes U+FFFD. So a run's text is final only when
        # a non-byte token ends it; a special token that decoding skips does not end it.
        if not self.byte_fallback:
            return frozenset()
        vocab = self.tok.get_vocab(with_added_tokens=False)
        pending = {i for t, i in vocab.items() if _BYTE_PIECE.fullmatch(t)}
        if skip_special_tokens:
            pending |= {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        return frozenset(pending)


# --------------------------------------------------------------------------- streaming


class StreamDetokenizer:
    """Text deltas as tokens arrive, whose concatenation (with ``finalize()``) is ``decode(ids)``.

    Only a short window of recent ids is decoded per token (the prefix/read offsets of TGI and
    vLLM's incremental detokenizer): ``anchor`` is where the window starts and ``base`` the
    window's text up to the last emission. A new token decodes ``ids[anchor:]``; what goes
    past ``base`` is the delta.
    After an emission the window slides to start at the previous emission point, so it holds
    one emitted chunk plus new tokens (O(1) per token). Starting the window at a chunk that was
    already emitted keeps decoders' start-of-text rules (the stripped leading space of a
    SentencePiece ``▁`` token) inside text we subtract anyway.

    Text is held back (delta "") while it could still change:
    - it ends in U+FFFD: an unfinished UTF-8 sequence (byte-fallback ``<0xNN>`` tokens, or a
      byte-level BPE token holding half an emoji or CJK character) that later tokens complete;
    - the last token is in ``pending``: tokenizers' ByteFallback decoder judges a run of
      ``<0xNN>`` tokens as a whole, so on such a tokenizer.json a character spelled in bytes
      arrives with the next ordinary token (the SentencePiece path decodes locally and needs
      no wait);
    - it does not extend the text already emitted (a decoder that looks back).
    ``finalize()`` returns whatever is held back, so nothing is lost at the end.
    """

    def __init__(self, decode: Callable[[list[int]], str], pending: Container[int] = frozenset()
                 ) -> None:
        self._decode = decode
        self._pending = pending
        self.ids: list[int] = []
        self._anchor = 0  # window start
        self._mark = 0  # ids[:mark] are emitted in full
        self._base = ""  # decode(ids[anchor:mark])
        self._parts: list[str] = []
        self._done = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._parts)

    def add_token(self, token: int) -> str:
        """Feed one generated id; returns the new text it completes (maybe "")."""
        if self._done:
            raise RuntimeError("add_token after finalize(): start a new detokenizer")
        token = int(token)
        ids = self.ids
        ids.append(token)
        if token in self._pending:
            return ""
        window = self._decode(ids[self._anchor:])
        base = self._base
        if len(window) <= len(base) or window.endswith("\ufffd") or not window.startswith(base):
            return ""
        delta = window[len(base):]
        chunk_start, self._mark = self._mark, len(ids)
        chunk = self._decode(ids[chunk_start:]) if chunk_start > self._anchor else window
        if chunk:
            self._anchor, self._base = chunk_start, chunk
        else:
            # The chunk decodes to nothing on its own (e.g. a lone "▁" whose space is stripped
            # at the start of text): starting a window there would lose that rule's context.
            self._base = window
        self._parts.append(delta)
        return delta

    def finalize(self) -> str:
        """End of the stream: the text still held back (possibly "")."""
        if self._done:
            return ""
        self._done = True
        if self._mark == len(self.ids):
            return ""
        window = self._decode(self.ids[self._anchor:])
        delta = window[len(self._base):] if window.startswith(self._base) else ""
        self._mark = len(self.ids)
        if delta:
            self._parts.append(delta)
        return delta


# --------------------------------------------------------------------------- tokenizer


class Tokenizer:
    """One tokenizer API over SentencePiece and tokenizer.json; build it with load_tokenizer."""

    def __init__(
        self,
        backend: _SentencePieceBackend | _HFBackend,
        *,
        bos_token: str | None,
        eos_token: str | None,
        bos_id: int | None,
        eos_ids: list[int],
        add_bos: bool,
        chat_template: str | None,
        special_tokens: Mapping[str, str],
        path: Path | None = None,
        tool_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.kind: Kind = backend.kind
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_id = bos_id
        self.eos_ids = list(eos_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.tool_template = tool_template  # a config's "tool_use" template, used with tools
        self.special_tokens = dict(special_tokens)  # named tokens, passed to templates
        self.path = path
        # Ids whose text stays open until a later token (see StreamDetokenizer), per skip mode;
        # built on first use (a scan of the vocabulary).
        self._pending: dict[bool, frozenset[int]] = {}

    def __repr__(self) -> str:
        return (f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id},"
                f" eos_ids={self.eos_ids}, add_bos={self.add_bos})")

    @property
    def vocab_size(self) -> int:
        return self._backend.size

    @property
    def end_ids(self) -> list[int]:
        """Ids that end a reply: EOS, and BOS (a base model such as stories260K writes BOS
        to start the next document; it must end the reply, never show as text)."""
        extra = [self.bos_id] if self.bos_id is not None and self.bos_id not in self.eos_ids else []
        return [*self.eos_ids, *extra]

    @property
    def special_ids(self) -> frozenset[int]:
        """Control ids (BOS, EOS, chat markers): never text, dropped by skip_special_tokens."""
        b = self._backend
        if isinstance(b, _SentencePieceBackend):
            return frozenset(b.special_ids)
        return frozenset(i for i, t in b.tok.get_added_tokens_decoder().items() if t.special)

    def tokenizer_json(self) -> str | None:
        """The tokenizer.json this tokenizer runs, config-declared tokens included; None
        for SentencePiece (then `token_bytes` spells the vocabulary)."""
        b = self._backend
        return b.tok.to_str() if isinstance(b, _HFBackend) else None

    def token_bytes(self) -> list[bytes]:
        """The bytes each id spells (`▁` as a space, `<0xNN>` as its byte, control tokens
        as written), for the SentencePiece kind; a tokenizer.json: `tokenizer_json()`."""
        b = self._backend
        if not isinstance(b, _SentencePieceBackend):
            raise TokenizerError("token_bytes is for SentencePiece; use tokenizer_json()")
        return list(b.table)

    def token_to_id(self, token: str) -> int | None:
        """The id of one token string (special tokens included), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True,
               should_stop: Callable[[], bool] | None = None) -> list[int]:
        """Token ids of ``text``; BOS first iff ``add_special_tokens`` and ``add_bos``.
        Bounded (module docstring): TokenizerError past `MAX_ENCODE_CHARS` characters or
        the time limit, TokenizeCancelled when ``should_stop()`` turns true meanwhile."""
        if len(text) > MAX_ENCODE_CHARS:
            raise TokenizerError(f"text of {len(text):,} characters is longer than the"
                                 f" {MAX_ENCODE_CHARS:,} the tokenizer reads at once")
        ids = self._backend.encode(text, should_stop)
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = False,
                    keep: Container[int] = frozenset()) -> StreamDetokenizer:
        """A fresh streaming detokenizer whose text equals ``decode(ids, skip_special_tokens)``;
        ids in `keep` are written even when special tokens are skipped (a tool-call
        marker that is a control token, say): the text between them decodes on its own."""
        backend = self._backend
        skip = bool(skip_special_tokens)
        kept = frozenset(i for i in self.special_ids if i in keep) if skip else frozenset()

        def decode(ids: list[int]) -> str:
            if not kept or not kept.intersection(ids):
                return backend.decode(ids, skip)
            parts, run = [], []
            for i in ids:
                if i in kept:
                    parts += [backend.decode(run, True), backend.decode([i], False)]
                    run = []
                else:
                    run.append(i)
            return "".join(parts) + backend.decode(run, True)

        if skip not in self._pending:
            self._pending[skip] = backend.pending_ids(skip)
        return StreamDetokenizer(decode, self._pending[skip] - kept)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **extra: Any) -> str:
        """The prompt text for ``messages``: the model's template, or the plain fallback."""
        # Like transformers: the named special tokens, which the caller's values override.
        context = {**self.special_tokens, **extra}
        bos = context.pop("bos_token", None)
        eos = context.pop("eos_token", None)
        template = self.chat_template
        if context.get("tools") and self.tool_template is not None:
            template = self.tool_template  # as transformers picks it
        if template is None:
            template = _chat.PLAIN_FALLBACK
            # The fallback is plain text, so BOS goes in front only when the model wants one.
            bos = (bos or self.bos_token) if self.add_bos else None
        return _chat.render(template, messages, bos_token=bos, eos_token=eos,
                            add_generation_prompt=add_generation_prompt, **context)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **extra: Any) -> list[int]:
        """Ids of the rendered chat; the template writes BOS itself (as apply_chat_template).
        ``should_stop`` in ``extra`` stops the render and the encode alike."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **extra),
                           add_special_tokens=False, should_stop=extra.get("should_stop"))


def load_tokenizer(
    folder: str | Path, prefer: Literal["auto", "sentencepiece", "hf"] = "auto"
) -> Tokenizer:
    """Load the tokenizer in ``folder`` (tokenizer.json preferred; ``prefer`` forces one)."""
    folder = Path(folder)
    if prefer not in ("auto", "sentencepiece", "hf"):
        raise TokenizerError(f"unknown tokenizer kind {prefer!r}: use auto, sentencepiece or hf")
    if is_gguf(folder):
        return _load_gguf(folder, prefer)
    if not folder.is_dir():
        raise TokenizerError(f"{folder}: no such model folder")
    hf_file, sp_file = folder / "tokenizer.json", folder / "tokenizer.model"
    if prefer == "hf" and not hf_file.is_file():
        raise TokenizerError(f"{folder}: no tokenizer.json (asked for the Hugging Face tokenizer)")
    if prefer == "sentencepiece" and not sp_file.is_file():
        raise TokenizerError(
            f"{folder}: no tokenizer.model (asked for the SentencePiece tokenizer)")
    if prefer == "auto" and not hf_file.is_file() and not sp_file.is_file():
        raise TokenizerError(f"{folder}: no tokenizer.json or tokenizer.model found")
    use_hf = prefer == "hf" or (prefer == "auto" and hf_file.is_file())

    tok_cfg = read_json_object(folder / "tokenizer_config.json", TokenizerError)
    tok_map = read_json_object(folder / "special_tokens_map.json", TokenizerError)
    gen_cfg = read_json_object(folder / "generation_config.json", TokenizerError)
    model_cfg = read_json_object(folder / "config.json", TokenizerError)

    backend: _SentencePieceBackend | _HFBackend
    if use_hf:
        backend = _HFBackend(hf_file)
    else:
        # transformers 5's LlamaTokenizer defaults to legacy=False (4.x defaulted to True).
        backend = _SentencePieceBackend(sp_file, legacy=tok_cfg.get("legacy") is True)

    # Added tokens transformers knows from the config: make them split out of text too.
    added = tok_cfg.get("added_tokens_decoder")
    if isinstance(added, Mapping):
        for key, spec in added.items():
            text = _token_str(spec)
            if text is not None and str(key).isdigit():
                special = not isinstance(spec, Mapping) or bool(spec.get("special", True))
                backend.register(text, int(key), special)

    named: dict[str, str] = {}
    for name in _NAMED_TOKENS:
        value = _token_str(tok_cfg.get(name)) or _token_str(tok_map.get(name))
        if value is not None:
            named[name] = value
    extra_specials = []
    for cfg in (tok_cfg, tok_map):
        for key in ("additional_special_tokens", "extra_special_tokens"):
            values = cfg.get(key)
            if isinstance(values, Mapping):
                values = list(values.values())
            if isinstance(values, list):
                extra_specials += [t for v in values if (t := _token_str(v)) is not None]
    for text in [*named.values(), *extra_specials]:
        token_id = backend.token_to_id(text)
        if token_id is not None:
            backend.register(text, token_id, special=True)
    backend.finish()

    # BOS: the config's string, else an id from generation_config/config.json/the SP model.
    bos_token = named.get("bos_token")
    bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
    if bos_id is None:
        for cfg in (gen_cfg, model_cfg):
            ids = _id_list(cfg.get("bos_token_id"))
            if ids and 0 <= ids[0] < backend.size:
                bos_id = ids[0]
                break
        if bos_id is None and isinstance(backend, _SentencePieceBackend):
            sp_bos = backend.sp.bos_id()
            bos_id = sp_bos if sp_bos >= 0 else None
        if bos_id is not None:
            bos_token = backend.id_to_token(bos_id)

    # EOS: the config's token first, then every id generation_config/config.json list.
    eos_token = named.get("eos_token")
    eos_ids: list[int] = []
    if eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None:
        eos_ids.append(eos_id)
    for cfg in (gen_cfg, model_cfg):
        eos_ids += [i for i in _id_list(cfg.get("eos_token_id")) if 0 <= i < backend.size]
    if not eos_ids and isinstance(backend, _SentencePieceBackend) and backend.sp.eos_id() >= 0:
        eos_ids.append(backend.sp.eos_id())
    eos_ids = list(dict.fromkeys(eos_ids))
    if eos_token is None and eos_ids:
        eos_token = backend.id_to_token(eos_ids[0])

    if isinstance(backend, _SentencePieceBackend):
        # LlamaTokenizer's defaults: the model's own <s>/</s> count as configured. A
        # tokenizer.json has no such defaults, so templates only see the tokens the config
        # names (transformers leaves the others unset even when an id is known).
        if bos_token is not None:
            named.setdefault("bos_token", bos_token)
        if eos_token is not None:
            named.setdefault("eos_token", eos_token)

    add_bos_cfg = tok_cfg.get("add_bos_token")
    if isinstance(add_bos_cfg, bool):
        add_bos = add_bos_cfg and bos_id is not None
    elif isinstance(backend, _HFBackend):
        add_bos = bos_id is not None and backend.post_processor_adds(bos_id)
    else:
        add_bos = bos_id is not None

    try:
        template = _chat.load_chat_template(folder, tok_cfg)
    except _chat.TemplateError as e:
        raise TokenizerError(str(e)) from None
    tool_template = _chat.named_template(tok_cfg.get("chat_template"), "tool_use")

    return Tokenizer(
        backend,
        bos_token=bos_token,
        eos_token=eos_token,
        bos_id=bos_id,
        eos_ids=eos_ids,
        add_bos=add_bos,
        chat_template=template,
        special_tokens=named,
        path=folder,
        tool_template=tool_template,
    )


def _load_gguf(path: Path, prefer: str) -> Tokenizer:
    """A GGUF file's tokenizer (gguf_tokenizer.py builds its tokenizer.json)."""
    if prefer == "sentencepiece":
        raise TokenizerError(f"{path.name}: a GGUF file has no tokenizer.model; its tokenizer"
                             " is built as a tokenizer.json (use auto or hf)")
    try:
        vocab = gguf_vocab(read_gguf(path))
    except ModelLoadError as e:
        raise TokenizerError(str(e)) from None
    backend = _HFBackend(path, vocab.tokenizer_json)
    return Tokenizer(
        backend,
        bos_token=vocab.named.get("bos_token"),
        eos_token=vocab.named.get("eos_token"),
        bos_id=vocab.bos_id,
        eos_ids=vocab.eos_ids,
        add_bos=vocab.add_bos,
        chat_template=vocab.chat_template,
        special_tokens=vocab.named,
        path=path,
    )

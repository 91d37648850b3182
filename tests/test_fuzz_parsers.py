"""Property-based fuzzing (hypothesis) of everything that reads hostile input:

- the config parser: any JSON object gives a config within bounds or one ConfigError line;
- the safetensors header reader: any bytes give a checked header or one ModelLoadError line;
- the detokenizer: random byte-fallback id sequences never put a control character into
  display text, and the exact text always round-trips through --json;
- the template renderer: random templates built from runaway-prone pieces finish within
  the time limit with bounded output, or fail with one TemplateError line;
- the app's JSON loader (settings, session, chats): hostile documents (lone surrogates,
  deep nesting, wrong types, cut or non-UTF-8 bytes) load or give one line naming the file,
  and whatever loads writes back.

Bounded (max_examples, short limits) so the suite stays fast on CI.
"""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvchat.app.core.text import SafeStream
from kvchat.model.decoder.config import load_config
from kvchat.model.decoder.config_checks import MAX_LAYERS
from kvchat.model.errors import KVChatError
from kvchat.model.files import DTYPE_BYTES, safetensors_header
from kvchat.model.text import chat_template
from kvchat.model.text.chat_template import TemplateError, render
from kvchat.model.text.tokenizer import load_tokenizer
from tests.helpers.hostile_text import RAW_CONTROL
from tests.helpers.paths import REPO_ROOT

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


WRONG_TYPES = st.sampled_from([[1], "ab", -3, 0, {"x": 1}, float("nan"), True])


def mostly(valid: st.SearchStrategy[Any], hostile: st.SearchStrategy[Any] = json_values
           ) -> st.SearchStrategy[Any]:
    """Valid values three times in four, so checks past the first one get exercised."""
    return st.one_of(valid, valid, valid, hostile)


CONFIG_KEYS = {
    "hidden_size": mostly(st.sampled_from([8, 16, 32, 64]), st.integers(-4, 70)),
    "num_attention_heads": mostly(st.sampled_from([1, 2, 4]), st.integers(-2, 5)),
    "num_key_value_heads": mostly(st.sampled_from([1, 2]), st.integers(-2, 5)),
    "head_dim": mostly(st.sampled_from([4, 8, 16])),
    "num_hidden_layers": mostly(st.sampled_from([1, 2]), st.sampled_from([0, 10**6, -1])),
    "intermediate_size": mostly(st.sampled_from([8, 64])),
    "vocab_size": mostly(st.sampled_from([16, 512])),
    "rms_norm_eps": mostly(st.sampled_from([1e-6, 1e-5]),
                           st.sampled_from([0.0, -1.0, float("nan"), float("inf"), "x"])),
    "rope_theta": mostly(st.sampled_from([1e4, 5e5]), st.sampled_from([0.0, -1.0, "x"])),
    "rope_scaling": mostly(st.none() | st.fixed_dictionaries(
        {"rope_type": st.sampled_from(["linear", "llama3", "default"]),
         "factor": mostly(st.sampled_from([2.0, 8.0]), WRONG_TYPES)}), WRONG_TYPES),
    "rope_parameters": mostly(st.none() | st.fixed_dictionaries(
        {"rope_type": st.sampled_from(["default", "llama3", "yarn"]),
         "rope_theta": mostly(st.sampled_from([1e4]), WRONG_TYPES),
         "original_max_position_embeddings": mostly(st.sampled_from([64, 8192]),
                                                    WRONG_TYPES)}), WRONG_TYPES),
    "max_position_embeddings": mostly(st.sampled_from([16, 2048]), st.integers(-2, 2)),
    "sliding_window": mostly(st.none() | st.sampled_from([4, 4096])),
    "use_sliding_window": json_values,
    "tie_word_embeddings": json_values,
    "attention_bias": json_values,
    "quantization": mostly(st.none()),
}
REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
            "vocab_size")


BASE = {"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
        "intermediate_size": 8, "vocab_size": 8}


@FUZZ
@example(model_type="llama", values={**BASE, "rope_scaling": [1]})
@example(model_type="llama", values={**BASE, "rope_scaling": {"rope_type": "linear",
                                                               "factor": "x"}})
@example(model_type="llama", values={**BASE, "rope_parameters": "abc"})
@example(model_type="llama", values={**BASE, "rope_parameters": {
    "rope_type": "llama3", "original_max_position_embeddings": "x"}})
@given(model_type=st.sampled_from(["llama", "mistral", "qwen2", "gpt9", None]),
       values=st.fixed_dictionaries(
           {k: CONFIG_KEYS[k] for k in REQUIRED},
           optional={k: v for k, v in CONFIG_KEYS.items() if k not in REQUIRED}))
def test_config_parser_bounds_or_one_line(tmp_path: Path, model_type: Any,
                                          values: dict[str, Any]) -> None:
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"model_type": model_type, **values}))
    try:
        cfg = load_config(f)
    except KVChatError as e:
        msg = str(e)
        assert msg and "\n" not in msg
        return
    for size in (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                 cfg.head_dim, cfg.intermediate_size, cfg.vocab_size,
                 cfg.max_position_embeddings):
        assert isinstance(size, int) and size >= 1
    assert 1 <= cfg.num_hidden_layers <= MAX_LAYERS
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert math.isfinite(cfg.rms_norm_eps) and cfg.rms_norm_eps > 0
    assert math.isfinite(cfg.rope.theta) and cfg.rope.theta > 0
    assert cfg.sliding_window is None or cfg.sliding_window >= 1


tensor_entries = st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from(sorted(DTYPE_BYTES)), json_scalars),
    "shape": st.one_of(st.lists(st.integers(-2, 2**34), max_size=3), json_values),
    "data_offsets": st.one_of(st.lists(st.integers(-8, 2**40), min_size=2, max_size=2),
                              json_values),
})


@FUZZ
@given(header=st.one_of(st.dictionaries(st.text(max_size=8), tensor_entries, max_size=4),
                        json_values),
       data=st.binary(max_size=64),
       claimed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
       garbage=st.one_of(st.none(), st.binary(max_size=40)))
def test_safetensors_header_reader_checks_or_one_line(
    tmp_path: Path, header: Any, data: bytes, claimed: int | None, garbage: bytes | None
) -> None:
    raw = garbage if garbage is not None else json.dumps(header).encode()
    n = len(raw) if claimed is None else claimed
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", n) + raw + data)
    try:
        parsed = safetensors_header(f)
    except KVChatError as e:
        assert str(e) and "\n" not in str(e)
        return
    # whatever passed is safe to hand to a reader: every tensor's bytes are in the file
    data_size = f.stat().st_size - 8 - n
    for name, info in parsed.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        assert 0 <= begin <= end <= data_size
        assert math.prod(info["shape"]) * DTYPE_BYTES[info["dtype"]] == end - begin


# ---- detokenizer -----------------------------------------------------------------------


SHIPPED = REPO_ROOT / "assets" / "kvchat-mini"


@pytest.fixture(scope="module")
def shipped_tokenizer() -> tuple[Any, list[int]]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(SHIPPED / "tokenizer.model"))
    byte_ids = [i for i in range(sp.get_piece_size()) if sp.is_byte(i)]
    assert len(byte_ids) == 256  # <0x00> ... <0xFF>
    return load_tokenizer(SHIPPED), byte_ids


@FUZZ
@given(picks=st.lists(st.tuples(st.booleans(), st.integers(0, 10**6)), max_size=40))
def test_detokenizer_display_text_has_no_controls_and_json_round_trips(
    shipped_tokenizer: tuple[Any, list[int]], picks: list[tuple[bool, int]]
) -> None:
    tok, byte_ids = shipped_tokenizer
    # mostly byte-fallback ids (ESC, BEL, C1 bytes, broken UTF-8), some ordinary ones
    ids = [byte_ids[k % 256] if is_byte else k % tok.vocab_size for is_byte, k in picks]
    detok = tok.detokenizer()
    safe = SafeStream()
    raw_parts, shown = [], []
    for i in ids:
        delta = detok.add_token(i)
        raw_parts.append(delta)
        shown.append(safe.feed(delta))
    tail = detok.finalize()
    raw_parts.append(tail)
    shown.append(safe.feed(tail) + safe.flush())
    display = "".join(shown)
    assert not RAW_CONTROL.search(display), repr(display)
    text = "".join(raw_parts)
    assert text == tok.decode(ids)
    assert json.loads(json.dumps({"text": text}))["text"] == text


# ---- template renderer -----------------------------------------------------------------


PIECES = [
    "{% for i in range(N) %}", "{% endfor %}", "{{ 'x' * N }}", "{{ lipsum(N) }}",
    "{{ 'a'|center(N) }}", "{{ 'b'.ljust(N) }}", "{{ '%Nd' % 1 }}", "{{ '{:>N}'.format(1) }}",
    "{{ messages|tojson(indent=N) }}", "{% set ns.s = ns.s ~ ns.s %}",
    "{% set ns.s = ns.s + ns.s %}", "{{ ns.s }}", "{{ ('y\\n' * N)|indent(N) }}",
    "{{ (['z' * N] * N)|join }}", "{{ messages[0].content }}", "{{ N ** N }}",
    "{{ range(N)|list|length }}", "{{ ('q' * N).replace('q', 'rr') }}",
]


@st.composite
def templates(draw: Any) -> str:
    parts = draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=8))
    opened = 0
    out = ["{% set ns = namespace(s='ab') %}"]
    for p in parts:
        n = draw(st.sampled_from([0, 3, 99, 99999, 10**6, 3 * 10**9]))
        if p == "{% endfor %}":
            if not opened:
                continue
            opened -= 1
        elif p.startswith("{% for"):
            opened += 1
        out.append(p.replace("N", str(n)))
    out.extend(["{% endfor %}"] * opened)
    return "".join(out)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(template=templates())
def test_random_templates_finish_within_the_limits(
    monkeypatch: pytest.MonkeyPatch, template: str
) -> None:
    monkeypatch.setattr(chat_template, "RENDER_TIME_LIMIT_S", 0.5)
    t0 = time.monotonic()
    try:
        out = render(template, [{"role": "user", "content": "hi"}])
    except TemplateError as e:
        assert str(e) and "\n" not in str(e)
    else:
        assert len(out) <= chat_template.RENDER_OUTPUT_LIMIT
    assert time.monotonic() - t0 < 0.5 + 1.5, template


# ---- the app's JSON files: one defensive loader ---------------------------------------

# strings with lone surrogates and controls; nesting up to far past the depth cap
hostile_text = st.text(alphabet=st.one_of(st.characters(), st.sampled_from(
    ["\udfff", "\ud800", "\x00", "\u202e", "\\", '"'])), max_size=6)
hostile_json = st.recursive(
    st.one_of(json_scalars, hostile_text),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(hostile_text, inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def json_files(draw: st.DrawFn) -> bytes:
    """A JSON document (possibly wrapped in deep nesting), or one cut, spliced or with
    bytes that are not UTF-8."""
    doc = draw(st.one_of(
        hostile_json,
        st.fixed_dictionaries({}, optional={
            "id": st.one_of(st.just("20260101-000000-abcdef"), hostile_json),
            "version": st.one_of(st.just(1), hostile_json),
            "messages": st.one_of(st.lists(st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "assistant", "x"]),
                 "content": hostile_text}), max_size=3), hostile_json),
            "created": hostile_json, "updated": st.just(1.0), "title": hostile_text,
            "temp": hostile_json, "top_k": hostile_json, "system_prompt": hostile_text,
            "last_chat": hostile_json, "input_history": st.lists(hostile_text, max_size=3),
        })))
    depth = draw(st.sampled_from([0, 0, 0, 63, 65, 3000]))
    raw = json.dumps(doc, ensure_ascii=draw(st.booleans()))
    raw = "[" * depth + raw + "]" * depth
    data = raw.encode("utf-8", "surrogatepass")
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    if cut is not None:
        data = data[:cut] + draw(st.binary(max_size=4))
    return data


@FUZZ
@given(data=json_files())
def test_json_loader_and_every_reader_of_app_files(tmp_path: Path, data: bytes) -> None:
    """load_json returns an object or raises one BadJSONFile line naming the file; the
    settings, session and chat readers never raise, and what they read saves again."""
    from kvchat.app.core.settings import load_settings
    from kvchat.app.core.store import ConversationStore
    from kvchat.app.tui.session import load_session, save_session
    from kvchat.model.files import BadJSONFile, load_json

    f = tmp_path / "20260101-000000-abcdef.json"
    f.write_bytes(data)
    try:
        obj = load_json(f)
        assert isinstance(obj, dict)
        json.dumps(obj)  # no recursion left in it
    except BadJSONFile as e:
        assert str(e).startswith(str(f)) and "\n" not in str(e)

    s = load_settings(f)
    assert all("\n" not in w for w in s.warnings)
    s.validate()
    state = load_session(f)
    save_session(tmp_path / "elsewhere" / "session.json", state)
    store = ConversationStore(tmp_path)
    for conv in store.list():
        store.save(conv)  # what was read always writes back
    assert len(store.skipped) <= 1

"""Structured output by constrained decoding (model/runtime/constrained.py): replies parse
and validate against their JSON schema, checked with `jsonschema` (an independent
validator), on the real stories260K and on a tiny random-weight model that writes noise;
within max_tokens too; keywords the grammar engine cannot enforce are refused by name;
and decoding without a constraint is what it was."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvchat.model.runtime.client import EngineClient
from kvchat.model.runtime.constrained import (
    GrammarError,
    constraint_for,
    json_schema_grammar,
    lark_grammar,
    response_format_grammar,
)
from kvchat.model.runtime.events import GenParams
from tests.helpers import processes
from tests.helpers.chat_models import random_chat_model
from tests.helpers.paths import REPO_ROOT, STORIES260K
from tests.helpers.tiny_tokenizers import QWEN25

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "kind": {"enum": ["person", "animal", "place"]},
        "home": {"type": "object", "properties": {"city": {"type": "string"}},
                 "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "kind", "home"],
    "additionalProperties": False,
}
TREE = {  # recursive, numbers with bounds, a nullable field
    "$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "number", "exclusiveMinimum": -1, "maximum": 1},
        "note": {"type": ["string", "null"]},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["v", "kids"], "additionalProperties": False}},
    "$ref": "#/$defs/node",
}
STRINGS = {"type": "array", "items": {"type": "string"}, "minItems": 1}  # open-ended: noise
                                                                          # never closes it


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "test", "schema": schema}}


@pytest.fixture(scope="module")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_chat_model(tmp_path_factory.mktemp("random_qwen"), QWEN25)


@pytest.fixture(scope="module")
def clients(random_model: Path):
    made: dict[str, EngineClient] = {}

    def get(name: str) -> EngineClient:
        if name not in made:
            made[name] = EngineClient(STORIES260K if name == "stories260k" else random_model,
                                      timeout=120)
        return made[name]

    yield get
    for c in made.values():
        c.close()


def valid(text: str, schema: dict[str, Any]) -> Any:
    doc = json.loads(text)
    jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).validate(doc)
    return doc


MESSAGES = [{"role": "user", "content": "Tell me about a cat named Tom."}]


@pytest.mark.parametrize("model", ["stories260k", "random"])
@pytest.mark.parametrize("schema,max_tokens", [(PERSON, 70), (PERSON, 160), (TREE, 60),
                                                (STRINGS, 24)])
@pytest.mark.parametrize("temp,seed", [(0.0, None), (1.0, 3)])
def test_json_schema_reply_validates(clients, model, schema, max_tokens, temp, seed) -> None:
    done = clients(model).run(MESSAGES, GenParams(
        max_tokens=max_tokens, temp=temp, seed=seed, response_format=schema_format(schema)))
    assert done.finish_reason in ("eos", "length"), done.error
    assert len(done.ids) <= max_tokens
    valid(done.text, schema)


@pytest.mark.parametrize("model", ["stories260k", "random"])
def test_json_object_reply_parses_as_an_object(clients, model) -> None:
    for seed in (0, 1):
        done = clients(model).run(MESSAGES, GenParams(
            max_tokens=48, temp=1.0, seed=seed, response_format={"type": "json_object"}))
        assert done.finish_reason in ("eos", "length"), done.error
        assert isinstance(json.loads(done.text), dict)


def test_a_constrained_reply_decodes_without_speculation_and_says_why(clients) -> None:
    """A grammar masks each step's logits, which a verify pass of drafted tokens does not:
    a constrained reply that asks for speculation decodes plainly (the same ids, valid),
    and its statistics say why."""
    client, fmt = clients("stories260k"), schema_format(PERSON)
    plain = client.run(MESSAGES, GenParams(max_tokens=70, temp=0.0, response_format=fmt))
    asked = client.run(MESSAGES, GenParams(max_tokens=70, temp=0.0, response_format=fmt,
                                           speculation="lookup"))
    assert asked.finish_reason in ("eos", "length"), asked.error
    assert list(asked.ids) == list(plain.ids)
    valid(asked.text, PERSON)
    assert asked.stats.speculation is None
    assert "constrained" in (asked.stats.speculation_note or "")


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"const": 1}}, "contains"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"type": "integer", "not": {"const": 3}}, "not"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
    # a schema's own "x-guidance" cannot switch refusals off
    ({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}, "uniqueItems"),
    ({"type": "string", "format": "colour"}, "colour"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
])
def test_unenforceable_keywords_are_refused_by_name(schema, keyword) -> None:
    with pytest.raises(GrammarError) as e:
        json_schema_grammar(schema)
    message = str(e.value)
    assert keyword in message and "\n" not in message


def test_overlapping_one_of_is_refused_disjoint_one_of_is_enforced(clients) -> None:
    overlapping = {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer"}]}
    done = clients("random").run(MESSAGES, GenParams(response_format=schema_format(overlapping)))
    assert done.finish_reason == "error" and "oneOf" in (done.error or "")
    assert done.ids == []  # refused before the model ran
    disjoint = {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}
    done = clients("random").run(MESSAGES, GenParams(
        max_tokens=16, temp=1.0, seed=5, response_format=schema_format(disjoint)))
    valid(done.text, disjoint)


@pytest.mark.parametrize("response_format,field", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": [1]}}, "must be an object"),
    ("json", "response_format"),
])
def test_malformed_response_formats_name_the_field(response_format, field) -> None:
    with pytest.raises(GrammarError, match=field.replace(".", r"\.")):
        response_format_grammar(response_format)


def test_text_response_format_is_no_constraint() -> None:
    assert response_format_grammar({"type": "text"}) is None
    assert response_format_grammar(None) is None


def test_too_few_max_tokens_is_refused_with_the_needed_count(clients) -> None:
    done = clients("stories260k").run(MESSAGES, GenParams(
        max_tokens=5, response_format=schema_format(PERSON)))
    assert done.finish_reason == "error"
    assert "max_tokens 5 is too few" in (done.error or "")


def test_the_guard_replaces_tokens_that_would_strand_the_reply(random_model: Path) -> None:
    """Near the limit, a token that leaves no valid ending is replaced by the closing
    plan's: noise from a random model never closes an array of strings on its own."""
    import mlx.core as mx

    from kvchat.model.cache.kv import make_prompt_cache
    from kvchat.model.decoder.weights import load_model
    from kvchat.model.runtime.generate import generate_step
    from kvchat.model.runtime.sampling import Sampler, SamplingParams
    from kvchat.model.text.tokenizer import load_tokenizer

    model, tok = load_model(random_model), load_tokenizer(random_model)
    sampler = Sampler(SamplingParams(temp=1.0, seed=1))
    for budget in (6, 12, 30):
        constraint = constraint_for(tok, json_schema_grammar(STRINGS), budget)
        ids = list(generate_step(model, tok.encode_chat(MESSAGES), make_prompt_cache(model),
                                 sample=lambda x: sampler(x), max_tokens=budget,
                                 constraint=constraint))
        assert len(ids) <= budget
        valid(tok.decode(ids, skip_special_tokens=True), STRINGS)
        assert constraint.replaced > 0  # the model alone would not have finished
    mx.clear_cache()


def test_a_permissive_grammar_leaves_greedy_ids_unchanged() -> None:
    """The constrained loop feeds the model exactly what it chose: under a grammar that
    allows any text, greedy ids equal the plain loop's (compiled and not)."""
    from kvchat.model.cache.kv import make_prompt_cache
    from kvchat.model.decoder.weights import load_model
    from kvchat.model.runtime.generate import generate_step
    from kvchat.model.text.tokenizer import load_tokenizer

    model, tok = load_model(STORIES260K), load_tokenizer(STORIES260K)
    prompt = tok.encode("Once upon a time")
    anything = lark_grammar(r"start: /(.|\n)*/")
    for compiled in (True, False):
        plain = list(generate_step(model, prompt, make_prompt_cache(model), max_tokens=80,
                                   compiled=compiled))
        held = list(generate_step(model, prompt, make_prompt_cache(model), max_tokens=80,
                                  compiled=compiled,
                                  constraint=constraint_for(tok, anything, 80)))
        eos = [i for i, t in enumerate(plain) if t in tok.end_ids]
        n = eos[0] + 1 if eos else len(plain)
        assert held[:n] == plain[:n] and n > 20


def test_a_tokenizer_that_cannot_spell_json_is_one_line(tiny_checkpoint) -> None:
    """The tiny checkpoints' word-level vocabulary ("w3", "w4"...) has no bytes of its own."""
    with EngineClient(tiny_checkpoint("llama"), timeout=60) as client:
        done = client.run([1, 5, 7], GenParams(response_format={"type": "json_object"}))
    assert done.finish_reason == "error", done.text
    assert "tokenizer" in (done.error or "") and "\n" not in (done.error or "")


def _kvchat(*args: str):
    return processes.run([sys.executable, "-m", "kvchat.app", *args], capture_output=True,
                         text=True, cwd=REPO_ROOT, env=dict(os.environ), timeout=300)


def test_generate_json_schema_and_json_object(tmp_path: Path) -> None:
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(PERSON))
    r = _kvchat("generate", "--model", str(STORIES260K), "--prompt", "Once upon a time",
                "--json-schema", str(schema_file), "--max-tokens", "90", "--json")
    assert r.returncode == 0, r.stderr
    valid(json.loads(r.stdout)["text"], PERSON)
    r = _kvchat("generate", "--model", str(STORIES260K), "--prompt", "Hi", "--json-object",
                "--max-tokens", "30", "--quiet")
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout), dict)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    r = _kvchat("generate", "--model", str(STORIES260K), "--prompt", "Hi", "--json-schema",
                str(bad))
    assert r.returncode == 2 and "uniqueItems" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1

"""Chat templates: same text and ids as transformers, a sandbox that refuses hostile templates,
and the documented plain fallback for base models."""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

import pytest

from kvchat.model.errors import KVChatError
from kvchat.model.text.chat_template import (
    PLAIN_FALLBACK,
    TemplateError,
    load_chat_template,
    render,
)
from kvchat.model.text.tokenizer import load_tokenizer
from tests.helpers.paths import STORIES260K as STORIES
from tests.helpers.tiny_tokenizers import (
    STYLES,
    byte_level_bpe,
    chat_folder,
    sentencepiece_byte_fallback,
    write_folder,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # fixtures are local folders; never reach out

CONVERSATIONS = {
    "system_multi_turn": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello, how are you? 👋"},
        {"role": "assistant", "content": "  I am fine, thank you!\n"},
        {"role": "user", "content": "Tell me a story about 世界 & <b>dragons</b>."},
    ],
    "multi_turn": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Germany?"},
    ],
    "single": [{"role": "user", "content": "Hi"}],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tok = byte_level_bpe()
    root = tmp_path_factory.mktemp("chat")
    return {style: chat_folder(root, style, tok) for style in STYLES}


@pytest.fixture(scope="module")
def reference(folders: dict[str, Path]) -> dict:
    transformers = pytest.importorskip("transformers")
    return {s: transformers.AutoTokenizer.from_pretrained(f) for s, f in folders.items()}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("style", list(STYLES))
def test_matches_transformers(folders, reference, style, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    ours = load_tokenizer(folders[style])
    ref = reference[style]
    want_text = ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    want_ids = ref.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert ours.render_chat(messages, add_generation_prompt=add_generation_prompt) == want_text
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == want_ids
    # The template's control tokens really became single special ids.
    assert len(want_ids) < len(ours.encode(want_text.replace("<", "< "), False))


def test_generation_prompt_is_added(folders):
    messages = CONVERSATIONS["multi_turn"]
    for style, tail in [("llama3", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
                        ("chatml", "<|im_start|>assistant\n"),
                        ("gemma", "<start_of_turn>model\n")]:
        tok = load_tokenizer(folders[style])
        assert tok.render_chat(messages, add_generation_prompt=True).endswith(tail)
        assert not tok.render_chat(messages, add_generation_prompt=False).endswith(tail)


def test_system_prompt_folded_into_first_user_turn(folders):
    messages = CONVERSATIONS["system_multi_turn"]
    gemma = load_tokenizer(folders["gemma"]).render_chat(messages)
    assert gemma.startswith(
        "<bos><start_of_turn>user\nYou are a helpful assistant.\n\nHello, how are you? 👋"
        "<end_of_turn>\n")
    assert "<start_of_turn>system" not in gemma
    mistral = load_tokenizer(folders["mistral"]).render_chat(messages)
    assert mistral.startswith("<s> [INST] You are a helpful assistant.\n\nHello, how are you?")
    assert mistral.count("[INST]") == 2


def test_special_tokens_from_config_forms(folders):
    llama3 = load_tokenizer(folders["llama3"])  # eos as an AddedToken dict, eos list in gen config
    assert llama3.eos_token == "<|eot_id|>"
    eot, end = llama3.token_to_id("<|eot_id|>"), llama3.token_to_id("<|end_of_text|>")
    assert llama3.eos_ids == [eot, end]
    assert llama3.bos_id == llama3.token_to_id("<|begin_of_text|>")
    assert llama3.add_bos is False  # no add_bos_token and no post-processor adding it
    chatml = load_tokenizer(folders["chatml"])
    assert chatml.bos_id is None and chatml.bos_token is None and chatml.add_bos is False
    assert chatml.encode("hi") == chatml.encode("hi", add_special_tokens=False)
    mistral = load_tokenizer(folders["mistral"])  # template list: "default" taken
    assert "[INST]" in mistral.chat_template and "tools" not in mistral.chat_template
    assert mistral.encode("hi")[0] == mistral.bos_id == 1
    gemma = load_tokenizer(folders["gemma"])  # template from chat_template.jinja
    assert gemma.chat_template == STYLES["gemma"]["jinja"]


def test_tools_and_tojson_match_transformers(folders, reference):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Wetter in <city> & \"quoted\" – ünïcode 世界",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = CONVERSATIONS["system_multi_turn"]
    want = reference["chatml"].apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True)
    got = load_tokenizer(folders["chatml"]).render_chat(messages, tools=tools)
    assert got == want
    assert json.dumps(tools[0], ensure_ascii=False) in got  # not HTML-escaped


def test_role_alternation_error_is_one_line(folders):
    tok = load_tokenizer(folders["mistral"])
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(TemplateError, match="roles must alternate") as err:
        tok.render_chat(bad)
    assert isinstance(err.value, KVChatError) and "\n" not in str(err.value)


CHATML_BOS = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_sentencepiece_chatml_without_dummy_prefix(tmp_path):
    """A SentencePiece model that keeps text as written (no dummy prefix, no whitespace
    folding, ChatML markers as user-defined pieces, legacy off, BOS from the template): the
    chat encodes as transformers does and as one sp.encode of the text after <s> does."""
    import sentencepiece as spm

    folder = tmp_path / "spchat"
    model = sentencepiece_byte_fallback(
        folder, 400, ("<|im_start|>", "<|im_end|>"), add_dummy_prefix=False,
        remove_extra_whitespaces=False, split_digits=True, character_coverage=1.0)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    added = {str(i): {"content": sp.id_to_piece(i), "special": True, "normalized": False,
                      "lstrip": False, "rstrip": False, "single_word": False}
             for i in range(sp.get_piece_size())
             if sp.is_control(i) or sp.is_unknown(i)
             or sp.id_to_piece(i) in ("<|im_start|>", "<|im_end|>")}
    write_folder(folder, tokenizer_config={
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "legacy": False,
        "add_prefix_space": False, "bos_token": "<s>", "eos_token": "<|im_end|>",
        "unk_token": "<unk>", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "added_tokens_decoder": added, "chat_template": CHATML_BOS})
    tok = load_tokenizer(folder)
    assert tok.kind == "sentencepiece" and not tok.add_bos
    assert tok.eos_ids == [sp.piece_to_id("<|im_end|>")]
    messages = [*CONVERSATIONS["system_multi_turn"], {"role": "assistant", "content": " x  y"}]
    text = tok.render_chat(messages)
    ids = tok.encode_chat(messages)
    assert ids == [1, *sp.encode(text.removeprefix("<s>"))]
    assert tok.decode(ids) == text
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    assert ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    assert ref.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == ids


# --- helpers ------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


@pytest.mark.parametrize("template, expected", [
    ("{{ strftime_now('%Y') }}", str(datetime.now().year)),
    ("{{ {'a': '<é>'} | tojson }}", '{"a": "<é>"}'),
    ("{{ [1, 2] | tojson(indent=2) }}", "[\n  1,\n  2\n]"),
    ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
     "{% endfor %}", "user"),
    ("{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.content }}"
     "{% endfor %}", "yo"),
    ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
     "{{ ns.n }}", "2"),
    ("{{ dict(a=1)['a'] }}{{ bos_token }}{{ eos_token }}{{ add_generation_prompt }}",
     "1<s></s>True"),
    ("{% generation %}{{ messages[-1].content }}{% endgeneration %}", "yo"),
    ("{% if tools is not none %}tools{% else %}none{% endif %}", "none"),
    ("  {% if true %}\n  x\n  {% endif %}\n", "  x\n"),  # trim_blocks + lstrip_blocks
])
def test_helpers(template, expected):
    got = render(template, MSG, bos_token="<s>", eos_token="</s>", add_generation_prompt=True)
    assert got == expected


def test_raise_exception_becomes_template_error():
    with pytest.raises(TemplateError, match="chat template error: no system role here"):
        render("{{ raise_exception('no system role here') }}", MSG)


@pytest.mark.parametrize("template", [
    "{% for x in %}",  # syntax
    "{{ messages[0].content.missing.deeper }}",  # undefined
    "{{ 1 / 0 }}",  # Python error inside
    "{{ range(10**9) | list }}",  # the sandbox's range limit
])
def test_broken_templates_are_one_line_errors(template):
    with pytest.raises(TemplateError) as err:
        render(template, MSG)
    assert "\n" not in str(err.value) and str(err.value).startswith("chat template")


# --- hostile templates --------------------------------------------------------------------

HOSTILE = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ joiner.__init__.__globals__['__builtins__']['open']('MARKER', 'w').write('x') }}",
    "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "{{ raise_exception.__globals__['os'].system('touch MARKER') }}",
    "{{ namespace.__init__.__globals__['sys'].modules['os'].system('touch MARKER') }}",
    "{{ self._TemplateReference__context }}",
    "{{ self._TemplateReference__context.cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ '{0.__class__.__base__.__subclasses__}'.format(1) }}",
    "{% import 'os' as os %}{{ os.system('touch MARKER') }}",
    "{% from 'os' import system %}{{ system('touch MARKER') }}",
    "{% include '/etc/passwd' %}",
    "{% extends '/etc/passwd' %}",
    "{% set ns = namespace(__class__=1) %}",
    "{% set x = messages.append({'role': 'system', 'content': 'pwned'}) %}",  # mutation
    "{{ 'x' * 10**10 }}",  # memory bomb
    "{{ 2 ** 100000000 }}",  # CPU bomb
    "{{ ((2 ** 4000) ** 4000) ** 4000 }}",
    "{% set ns = namespace(x=2 ** 60000) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
    "{% endfor %}",
]


@pytest.mark.parametrize("template", HOSTILE)
def test_hostile_template_refused_and_nothing_runs(template, tmp_path, monkeypatch):
    marker = tmp_path / "MARKER"
    monkeypatch.chdir(tmp_path)  # a relative 'touch MARKER' would land here too
    source = template.replace("MARKER", str(marker))
    with pytest.raises(TemplateError) as err:
        render(source, MSG, bos_token="<s>")
    message = str(err.value)
    assert isinstance(err.value, KVChatError)
    assert "\n" not in message and message.startswith("chat template")
    assert not marker.exists()


def test_hostile_template_in_a_model_folder(tmp_path, monkeypatch):
    """A model whose tokenizer_config carries a hostile template loads; rendering refuses."""
    marker = tmp_path / "MARKER"
    monkeypatch.chdir(tmp_path)
    hostile = "{{ cycler.__init__.__globals__.os.popen('touch " + str(marker) + "').read() }}"
    folder = write_folder(tmp_path / "evil", byte_level_bpe(["<s>", "</s>"], 300),
                          tokenizer_config={"bos_token": "<s>", "eos_token": "</s>",
                                            "chat_template": hostile})
    tok = load_tokenizer(folder)
    with pytest.raises(TemplateError, match="refused"):
        tok.encode_chat(MSG)
    assert not marker.exists()


# --- the plain fallback -------------------------------------------------------------------

def test_plain_fallback_documented_example():
    messages = [{"role": "system", "content": "A story."},
                {"role": "user", "content": "Once upon a time"},
                {"role": "assistant", "content": "there was a cat. "},
                {"role": "user", "content": " It "}]
    got = render(PLAIN_FALLBACK, messages, bos_token="<s>", add_generation_prompt=True)
    # user text is stripped; a reply is kept exactly as generated (its tokens are cached)
    assert got == "<s>A story.\n\nOnce upon a time\nthere was a cat. \nIt\n"
    assert render(PLAIN_FALLBACK, messages, add_generation_prompt=False) == got[3:]


@pytest.mark.parametrize("prefer", ["sentencepiece", "hf"])
def test_base_model_uses_plain_fallback(prefer):
    tok = load_tokenizer(STORIES, prefer=prefer)
    assert tok.chat_template is None
    turn1 = [{"role": "user", "content": "Once upon a time"}]
    assert tok.render_chat(turn1) == "<s>Once upon a time\n"
    ids1 = tok.encode_chat(turn1)
    assert ids1[:5] == [1, 403, 407, 261, 378] == tok.encode("Once upon a time")
    # A reply as generated after the newline (no leading space marker) and as the
    # detokenizer streams it re-renders to the same ids, so the next turn's prompt starts
    # with everything the cache already holds.
    reply_ids = tok.encode("Once upon a time\nThere was a little girl.")[len(ids1):]
    reply = tok.decode(reply_ids)
    assert reply == "There was a little girl."
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "She"}]
    ids2 = tok.encode_chat(turn2)
    assert ids2[: len(ids1) + len(reply_ids)] == ids1 + reply_ids


def test_fallback_without_bos_when_model_adds_none(tmp_path):
    folder = write_folder(tmp_path / "nobos", byte_level_bpe(["<s>", "</s>"], 300),
                          tokenizer_config={"bos_token": "<s>", "eos_token": "</s>",
                                            "add_bos_token": False})
    tok = load_tokenizer(folder)
    assert tok.render_chat([{"role": "user", "content": "hello"}]) == "hello\n"


# --- loading --------------------------------------------------------------------------------

def test_load_chat_template_forms(tmp_path):
    assert load_chat_template(tmp_path) is None
    templates = [{"name": "rag", "template": "R"}, {"name": "tool_use", "template": "T"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    assert load_chat_template(tmp_path) == "R"  # no "default": the first one
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path) == "J"  # the .jinja file wins
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 42}))
    with pytest.raises(TemplateError):
        load_chat_template(tmp_path)


@pytest.mark.parametrize("messages", ["hello", [["user", "hi"]], None])
def test_bad_messages(messages):
    with pytest.raises(TemplateError):
        render("{{ messages }}", messages)


def test_none_fields_dropped_like_transformers():
    template = "{% for m in messages %}{{ 'tool_calls' in m }}{% endfor %}"
    assert render(template, [{"role": "user", "content": "x", "tool_calls": None}]) == "False"

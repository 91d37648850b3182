"""Runaway chat templates are bounded: a time limit, an output-size limit, and caps on
range, lipsum, repetition and format widths in the sandbox. Each case below ran past
60 s or 6 GB before; now each fails with one TemplateError line, fast."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvchat.model.text import chat_template
from kvchat.model.text.chat_template import TemplateError, render

MESSAGES = [{"role": "user", "content": "hi"}]

RUNAWAYS = {
    "nested range loops": "{% for i in range(99999) %}{% for j in range(99999) %}"
                          "{% endfor %}{% endfor %}",
    "nested loops over a string": "{% set s = 'x' * 99999 %}{% for a in s %}{% for b in s %}"
                                  "{% endfor %}{% endfor %}",
    "lipsum": "{{ lipsum(10**7) }}",
    "lipsum words": "{{ lipsum(1, False, 10**8, 10**8) }}",
    "namespace doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                          "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "plus doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                     "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "center": "{{ 'x'.center(5*10**9) }}",
    "center filter": "{{ 'x'|center(5*10**9) }}",
    "ljust": "{{ 'x'.ljust(5*10**9) }}",
    "tojson indent": "{{ messages|tojson(indent=2*10**9) }}",
    "percent width": "{{ '%3000000000d' % 1 }}",
    "percent star width": "{{ '%*d' % (3000000000, 1) }}",
    "format filter width": "{{ '%3000000000s'|format('x') }}",
    "str.format width": "{{ '{:>3000000000}'.format(1) }}",
    "str.format nested width": "{{ '{:>{w}}'.format(1, w=3000000000) }}",
    "indent filter": "{{ ('x\\n' * 999999)|indent(999999) }}",
    "join of a repeated list": "{{ (['x' * 999999] * 999999)|join }}",
    "replace": "{{ ('x' * 999999).replace('x', 'y' * 999999) }}",
    "output size": "{% for i in range(99999) %}{{ 'x' * 999999 }}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
}


@pytest.fixture
def short_limit(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(chat_template, "RENDER_TIME_LIMIT_S", 1.0)
    return 1.0


@pytest.mark.parametrize("name", sorted(RUNAWAYS))
def test_runaway_template_fails_fast_with_one_line(name: str, short_limit: float) -> None:
    t0 = time.monotonic()
    with pytest.raises(TemplateError) as info:
        render(RUNAWAYS[name], MESSAGES)
    took = time.monotonic() - t0
    msg = str(info.value)
    assert msg and "\n" not in msg
    assert took < short_limit + 1.5, f"{name} took {took:.1f}s"


@pytest.mark.slow  # waits the whole 5 s limit
def test_the_time_limit_is_the_stated_default() -> None:
    t0 = time.monotonic()
    with pytest.raises(TemplateError, match=r"longer than 5 s"):
        render(RUNAWAYS["nested range loops"], MESSAGES)
    assert time.monotonic() - t0 < chat_template.RENDER_TIME_LIMIT_S + 1.5


def test_output_limit_is_stated_in_the_message(short_limit: float) -> None:
    with pytest.raises(TemplateError, match="over the .* character limit"):
        render(RUNAWAYS["output size"], MESSAGES)


def test_renders_normally_after_a_runaway(short_limit: float) -> None:
    with pytest.raises(TemplateError):
        render(RUNAWAYS["nested range loops"], MESSAGES)
    ok = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert render(ok, MESSAGES) == "<user>hi"
    # legitimate uses of the capped features still work
    assert render("{{ '%5d|%-3s|' % (42, 'a') }}{{ '{:>4}'.format(7) }}", MESSAGES) == (
        "   42|a  |   7")
    assert render("{{ messages|tojson(indent=2) }}", MESSAGES).startswith("[\n  {")
    assert len(render("{{ lipsum(2, False) }}", MESSAGES).split()) >= 40
    assert render("{{ range(3)|list }}{{ 'ab' * 2 }}{{ 'x'|center(5) }}", MESSAGES) == (
        "[0, 1, 2]abab  x  ")


def test_should_stop_ends_a_render_at_once() -> None:
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(chat_template.TemplateCancelled):
        render(RUNAWAYS["nested range loops"], MESSAGES, should_stop=stop.is_set)
    assert time.monotonic() - t0 < 1.5


def test_raise_exception_message_is_one_line_and_kept() -> None:
    with pytest.raises(TemplateError, match=r"\[/INST\]"):
        render("{{ raise_exception('bad [/INST]\\nsecond line') }}", MESSAGES)


def test_engine_cancel_stops_a_hanging_template_at_once(copy_checkpoint: Any) -> None:
    import queue

    from kvchat.model.runtime.engine import Engine
    from kvchat.model.runtime.events import Done, GenParams, Loaded

    folder = copy_checkpoint("llama")
    (folder / "chat_template.jinja").write_text(RUNAWAYS["nested range loops"])
    events: queue.Queue[Any] = queue.Queue()
    eng = Engine(events.put, folder)
    try:
        while not isinstance(ev := events.get(timeout=60), Loaded):
            pass
        eng.submit(MESSAGES, GenParams(max_tokens=2))
        time.sleep(0.3)
        t0 = time.monotonic()
        eng.cancel()
        while not isinstance(ev := events.get(timeout=30), Done):
            pass
        assert ev.finish_reason == "cancelled", ev
        assert time.monotonic() - t0 < 1.0
    finally:
        eng.close()

"""Hybrid and state-space models on screen: each layer's kind (model/cache/layer_kinds.py,
Ctrl+L, `inspect`), the side panel's "state" row, and `explain`'s recurrent section,
against hand-computed sizes of the tiny checkpoints in tests/helpers/hybrid_families.py.

The state sizes by hand (float32 on the CPU; the recurrent state is float32 everywhere):
- Mamba (hidden 64, expand 2, N 8, 4 taps): conv 3 × 128, state 128 × 8 → 5,632 B a layer;
- Mamba-2 (8 heads of 16, 2 groups, N 16, 4 taps): conv 3 × (128 + 2·2·16), state
  8 × 16 × 16 → 2,304 + 8,192 = 10,496 B a layer (Nemotron-H's Mamba-2 layer too);
- gated delta (2 key heads, 4 value heads, all of 16, 4 taps): conv 3 × (2·2·16 + 4·16),
  state 4 × 16 × 16 → 1,536 + 4,096 = 5,632 B a layer;
- LFM2's short conv (hidden 64, 3 taps): conv 2 × 64 → 512 B a layer, no recurrent state.
One attention layer of these models holds 2 K/V heads × (16 + 16) × 4 B = 256 B a token.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from textual.widgets import DataTable, Static

from kvchat.app.core.settings import Settings
from kvchat.app.tui.app import KVChatApp
from kvchat.app.tui.screens import LayerCacheScreen
from kvchat.app.tui.screens.anatomy import AnatomyScreen
from kvchat.app.tui.turn_notices import overflow_message
from kvchat.app.tui.widgets.stats_panel import CONTENT_W, LABEL_W, state_rows
from kvchat.model import load_model
from kvchat.model.cache.kv import cache_stats, make_cache, make_prompt_cache
from kvchat.model.cache.kv_math import human_bytes
from kvchat.model.cache.layer_kinds import kinds_line, layer_kinds, layer_ranges
from kvchat.model.decoder.config import ModelConfig, load_config
from kvchat.model.decoder.kv_format import KVQuant
from kvchat.model.explain.anatomy import explain, render_text
from kvchat.model.explain.views import VIEWS
from kvchat.model.runtime.engine_process import EngineProcess
from kvchat.model.runtime.events import Done, Event, Overflow, TurnStats
from tests.helpers.app import make_app, ready, turn
from tests.helpers.families import IDS, build
from tests.helpers.hybrid_families import HYBRID_SPECS
from tests.helpers.scripted_engine import async_test, wait_for
from tests.helpers.tmux import NEEDS_TMUX, Tmux, chat_env, command, session, wait_file

F32 = 4
MAMBA2_LAYER = 3 * (128 + 2 * 2 * 16) * F32 + 8 * 16 * 16 * F32  # 10,496
DELTA_LAYER = 3 * (2 * 2 * 16 + 4 * 16) * F32 + 4 * 16 * 16 * F32  # 5,632
MAMBA_LAYER = 3 * 128 * F32 + 128 * 8 * F32  # 5,632
SHORT_CONV_LAYER = 2 * 64 * F32  # 512
ATTENTION_PER_TOKEN = 2 * 2 * 16 * F32  # K and V of 2 heads of 16: 256

KINDS = {
    "nemotron_h": ["Mamba-2", "full attention", "MLP-only", "MoE-only"],
    "qwen3_next": ["gated delta", "full attention", "gated delta"],
    "lfm2": ["short conv", "full attention", "short conv"],
    "mamba": ["Mamba", "Mamba"],
    "mamba2": ["Mamba-2", "Mamba-2"],
    # a layer that attends and keeps a state: both named (Falcon-H1 side by side; Zamba2's
    # shared block feeding its Mamba-2); Jamba's attention has no positions at all
    "falcon_h1": ["full attention + Mamba-2"] * 2,
    "zamba2": ["Mamba-2", "shared attention + Mamba-2", "Mamba-2",
               "shared attention + Mamba-2", "shared attention + Mamba-2"],
    "jamba": ["Mamba", "full attention", "Mamba", "Mamba"],
}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build(HYBRID_SPECS[name], tmp_path_factory.mktemp(f"ui_{name}"))
        return built[name]

    return get


# ---- each layer's kind -----------------------------------------------------------------------
@pytest.mark.parametrize("name", list(KINDS))
def test_each_layer_is_named_by_its_kind(name: str, hybrid: Callable[[str], Path]) -> None:
    """From the config alone and from the caches make_cache builds: the same names, the
    recurrent layers by their mixer, Nemotron-H's mixer-less layers by what is left."""
    cfg = load_config(hybrid(name))
    assert layer_kinds(cfg) == KINDS[name]
    assert layer_kinds(cfg, make_cache(cfg)) == KINDS[name]


def test_attention_kinds_follow_the_cache() -> None:
    """Gemma 3's pattern: sliding rings and a global layer, which is "full" while its ring
    holds the model's whole context, "rotating" under a smaller max KV size, and carries
    its bits when quantized; latent attention is MLA."""
    base = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 256}
    gemma = ModelConfig.from_dict({
        "model_type": "gemma3_text", **base, "num_hidden_layers": 3, "head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]})
    assert layer_kinds(gemma, make_cache(gemma)) == [
        "sliding attention", "sliding attention", "full attention"]
    assert layer_kinds(gemma, make_cache(gemma, max_kv_size=64))[2] == "rotating attention"
    assert layer_kinds(gemma, make_cache(gemma, kv=KVQuant(8))) == [
        "sliding attention · 8-bit K/V", "sliding attention · 8-bit K/V",
        "full attention · 8-bit K/V"]
    mla = ModelConfig.from_dict({
        "model_type": "deepseek_v3", **base, "num_hidden_layers": 2, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "n_group": 2, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16})
    assert layer_kinds(mla, make_cache(mla)) == ["MLA", "MLA"]


def test_kinds_line_groups_layers_by_kind() -> None:
    assert layer_ranges([0, 1, 2, 3, 5, 7, 8]) == "0-3, 5, 7-8"
    assert layer_ranges(list(range(0, 40, 2)), limit=3) == "0, 2, 4, …"
    assert kinds_line(["Mamba-2", "full attention", "Mamba-2", "MLP-only"]) == (
        "Mamba-2 0, 2; full attention 1; MLP-only 3")
    assert kinds_line(["full attention"] * 4) is None  # one kind: nothing to tell apart


def test_inspect_names_each_layer(hybrid: Callable[[str], Path],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    from kvchat.app.cli import inspect as inspect_cmd

    p = argparse.ArgumentParser()
    inspect_cmd.add_arguments(p)
    folder = hybrid("nemotron_h")
    assert inspect_cmd.run(p.parse_args(["--model", str(folder), "--json"])) == 0
    assert json.loads(capsys.readouterr().out)["kind_of_layer"] == KINDS["nemotron_h"]
    assert inspect_cmd.run(p.parse_args(["--model", str(folder)])) == 0
    text = capsys.readouterr().out
    assert "layers: Mamba-2 0; full attention 1; MLP-only 2; MoE-only 3" in text
    assert f"state of 1 recurrent layer: {MAMBA2_LAYER:,} B" in text


# ---- explain: the recurrent blocks with the model's own numbers ------------------------------
@pytest.mark.parametrize(("name", "per_layer", "conv", "recurrent"), [
    ("mamba", MAMBA_LAYER, [3, 128], [128, 8]),
    ("mamba2", MAMBA2_LAYER, [3, 192], [8, 16, 16]),
    ("nemotron_h", MAMBA2_LAYER, [3, 192], [8, 16, 16]),
    ("qwen3_next", DELTA_LAYER, [3, 128], [4, 16, 16]),
    ("lfm2", SHORT_CONV_LAYER, [3 - 1, 64], None),
])
def test_explain_states_against_the_formulas(
    name: str, per_layer: int, conv: list[int], recurrent: list[int] | None,
    hybrid: Callable[[str], Path],
) -> None:
    """The state explain gives each recurrent layer equals the hand-computed size and the
    bytes of the arrays the model really writes (40 tokens through its caches); beside
    attention, one attention layer's K/V at the context, at the maximum, and the first
    context at which it holds more than a state."""
    folder = hybrid(name)
    cfg = load_config(folder)
    data = explain(cfg, dtype_bytes=F32, context=40)
    r = data["recurrent"]
    layers = [i for i, k in enumerate(KINDS[name]) if k not in ("full attention", "MLP-only",
                                                                  "MoE-only")]
    assert r["layers"] == layers and r["kind"] == KINDS[name][layers[0]]
    assert r["conv"]["shape"] == conv and r["bytes_per_layer"] == per_layer
    assert (r["recurrent"] or {}).get("shape") == recurrent
    assert r["bytes"] == per_layer * len(layers)
    model = load_model(folder)
    cache = make_prompt_cache(model)
    model(mx.array(IDS[:, :40]), cache=cache)
    assert cache_stats(cache, model.config).state_bytes == r["bytes"]  # measured arrays
    a = r["attention_layer"]
    if name in ("mamba", "mamba2"):
        assert a is None and "no layer attends" in render_text(data)
        return
    assert a["bytes_per_token"] == ATTENTION_PER_TOKEN
    assert (a["bytes_at_context"], a["bytes_at_max"]) == (40 * 256, 256 * 256)
    assert (a["more_from"] - 1) * 256 <= per_layer < a["more_from"] * 256
    text = render_text(data)
    assert f"per layer {per_layer:,} B" in text
    assert f"from {a['more_from']:,} tokens" in text
    # the "worked: KV cache" figures count the one layer that attends, not every layer
    assert data["worked"]["cache_model"]["bytes_per_token"] == ATTENTION_PER_TOKEN


# Zamba2's fixture: Mamba-2 of 8 heads of 8 (hidden 32, expand 2), 2 groups, N 16, 4 taps
ZAMBA2_LAYER = 3 * (64 + 2 * 2 * 16) * F32 + 8 * 8 * 16 * F32  # 5,632


@pytest.mark.parametrize(("name", "per_layer", "layers", "row"), [
    ("falcon_h1", MAMBA2_LAYER, [0, 1], "state    20.5 KiB · fixed"),  # 20,992 B
    ("zamba2", ZAMBA2_LAYER, [0, 1, 2, 3, 4], "state    27.5 KiB · fixed"),  # 28,160 B
])
def test_state_kept_beside_kv_is_counted(name: str, per_layer: int, layers: list[int],
                                         row: str, hybrid: Callable[[str], Path]) -> None:
    """A layer that attends and keeps a state (model/cache/hybrid.py): explain's recurrent
    section and the panel's state row (cache_stats) count its state with the others',
    equal to the hand-computed size and to the arrays written by 40 tokens; its K/V stays
    in the K/V bytes."""
    folder = hybrid(name)
    r = explain(load_config(folder), dtype_bytes=F32, context=40)["recurrent"]
    assert r["layers"] == layers and r["bytes_per_layer"] == per_layer
    assert r["bytes"] == per_layer * len(layers)
    model = load_model(folder)
    cache = make_prompt_cache(model)
    model(mx.array(IDS[:, :40]), cache=cache)
    s = cache_stats(cache, model.config)
    assert (s.state_layers, s.state_bytes) == (len(layers), r["bytes"])
    assert s.cache_bytes > 0 and sum(c.nbytes for c in cache) == s.cache_bytes + s.state_bytes
    rows = state_rows(TurnStats(state_bytes=s.state_bytes, state_layers=s.state_layers),
                      {}, 256)
    assert [x.plain for x in rows] == [row]


def test_explain_text_names_each_block_kind(hybrid: Callable[[str], Path]) -> None:
    data = explain(load_config(hybrid("qwen3_next")), dtype_bytes=F32, context=40)
    text = render_text(data)
    assert data["model"]["layer_kinds"] == KINDS["qwen3_next"]
    assert "layers: gated delta 0, 2; full attention 1" in text
    assert "x → norm → RoPE → attention or gated delta → +" in text
    assert "v_heads × k_dim × v_dim = 4 × 16 × 16 = 1,024 float32 = 4,096 B" in text
    assert "a 16 × 16 matrix per value head" in text
    # NoPE is said of attention layers only (a recurrent layer has no RoPE to leave out)
    assert "NoPE" not in text
    # the attention table lists the attention layer only
    assert data["block"]["attention"]["layer_kinds"] == [
        {"kind": "global", "window": None, "layers": [1]}]


# ---- the side panel's state row --------------------------------------------------------------
HYBRID_INFO = {"state_layers": 1, "state_bytes": MAMBA2_LAYER, "attention_layers": 1,
               "context": 256, "attention": "GQA"}


@pytest.mark.parametrize(("stats", "info", "capacity", "expected"), [
    # before a turn: the config's formula; a window as long as the context does not rotate
    (TurnStats(), HYBRID_INFO, 256, ["state    10.25 KiB · fixed"]),
    # a max KV size below the context: the attention window rotates, the state does not
    (TurnStats(), HYBRID_INFO, 32,
     ["state    10.25 KiB · fixed", " " * LABEL_W + "kept through rotation"]),
    # the measured bytes win over the formula; a wrapped ring rotates
    (TurnStats(state_layers=1, state_bytes=2048, wrapped=True), HYBRID_INFO, 256,
     ["state    2 KiB · fixed", " " * LABEL_W + "kept through rotation"]),
    # every layer recurrent: nothing rotates
    (TurnStats(), {**HYBRID_INFO, "attention_layers": 0, "attention": "none"}, 32,
     ["state    10.25 KiB · fixed"]),
    # no recurrent layer: no row
    (TurnStats(state_layers=0, state_bytes=0), {"attention_layers": 5, "context": 512}, 64, []),
])
def test_state_rows(stats: TurnStats, info: dict[str, Any], capacity: int,
                    expected: list[str]) -> None:
    rows = [r.plain for r in state_rows(stats, info, capacity)]
    assert rows == expected
    assert all(len(r) <= CONTENT_W for r in rows)  # fits the panel: nothing wraps


@pytest.mark.parametrize(("mixer", "carried"), [
    ("mamba", True), ("mamba2", True), ("gated_delta", True), ("kda", True),
    ("short_conv", False),  # keeps its last K − 1 inputs only
    (None, False),
])
def test_context_full_notice_says_what_recurrent_layers_keep(mixer: str | None,
                                                             carried: bool) -> None:
    text = overflow_message(Overflow(14, 32, "reply"), mixer)
    assert text.startswith("The chat outgrew the 32-token window: 14 oldest tokens dropped")
    assert ("recurrent layers still carry it" in text) is carried
    assert ("The model no longer sees the start" in text) is not carried


@async_test
async def test_a_pure_attention_model_has_no_state_row(env: Path) -> None:
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await turn(pilot, "fill the cache")
        text = str(app.chat.query_one("#cache", Static).render())
        assert "KV " in text and "state" not in text and "rotation" not in text
        assert "GQA" in text  # an attention model keeps its GQA rows


def _hybrid_app(folder: Path, s: Settings) -> tuple[KVChatApp, list[Event]]:
    seen: list[Event] = []

    def factory(on_event: Any, path: str | None) -> EngineProcess:
        def recording(ev: Event) -> None:
            seen.append(ev)
            on_event(ev)

        return EngineProcess(recording, path, views=VIEWS)  # as engine_service builds it

    return KVChatApp(str(folder), s, engine_factory=factory), seen


@pytest.mark.slow
@async_test
async def test_hybrid_model_on_screen(hybrid: Callable[[str], Path], hermetic_env: Path) -> None:
    """The real app and engine on the tiny Nemotron-H (Mamba-2, attention, MLP-only,
    MoE-only) with a max KV size of 32 below its 256-token context: the panel's state row
    with the formula's bytes before the first turn and the measured ones after (equal),
    beside the K/V bytes, saying the state is fixed and kept through rotation; Ctrl+L's
    kind and state per layer; F4's recurrent section with the same numbers."""
    folder = hybrid("nemotron_h")
    s = Settings(temp=0.0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, max_tokens=40,
                 max_kv_size=32, keep=4)
    app, seen = _hybrid_app(folder, s)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        await pilot.pause(0.2)
        text = str(app.chat.query_one("#cache", Static).render())
        assert f"state    {human_bytes(MAMBA2_LAYER)} · fixed" in text
        assert "kept through rotation" in text
        await turn(pilot, "a b c d e f g h")
        done = [e for e in seen if isinstance(e, Done)][-1]
        assert done.stats.state_bytes == MAMBA2_LAYER and done.stats.state_layers == 1
        assert done.stats.wrapped  # the prompt and 40 tokens outgrew the 32-token window
        await pilot.pause(0.2)
        lines = str(app.chat.query_one("#cache", Static).render()).split("\n")
        kv = next(i for i, ln in enumerate(lines) if ln.startswith("KV "))
        assert lines[kv].split()[1:] == human_bytes(done.stats.cache_bytes).split()
        assert lines[kv + 1] == f"state    {human_bytes(MAMBA2_LAYER)} · fixed"
        assert lines[kv + 2] == " " * LABEL_W + "kept through rotation"
        # the reply that overflowed says what the Mamba-2 layer still carries
        reply = [m for m in app.chat.transcript.messages if m.role == "assistant"][-1]
        assert "recurrent layers still carry it" in str(reply.tooltip)

        await pilot.press("ctrl+l")
        assert isinstance(app.screen, LayerCacheScreen)
        table = app.screen.query_one(DataTable)
        titles = [str(c.label) for c in table.ordered_columns]
        kind, state = titles.index("kind"), titles.index("state")
        rows = [table.get_row_at(i) for i in range(table.row_count)]
        assert [str(r[kind]) for r in rows] == [
            "Mamba-2", "rotating attention", "MLP-only", "MoE-only"]
        assert [str(r[state]) for r in rows] == [human_bytes(MAMBA2_LAYER), "0 B", "0 B", "0 B"]
        summary = str(app.screen.query_one("#summary", Static).render())
        assert f"1 recurrent layers hold a {human_bytes(MAMBA2_LAYER)} state" in summary
        await pilot.press("escape")

        await pilot.press("f4")
        screen = app.screen
        assert isinstance(screen, AnatomyScreen)
        await wait_for(pilot, lambda: screen.data is not None, timeout=60)
        assert screen.data is not None
        r = screen.data["recurrent"]
        assert r["bytes_per_layer"] == MAMBA2_LAYER
        # at the cache's current context: what the rotating window holds now
        assert r["attention_layer"]["context"] == 32
        body = str(screen.query_one("#anatomy-text", Static).render())
        assert f"per layer {MAMBA2_LAYER:,} B" in body
        assert "layers: Mamba-2 0; full attention 1; MLP-only 2; MoE-only 3" in body


@NEEDS_TMUX
@pytest.mark.slow
@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
def test_hybrid_panel_in_a_real_terminal(size: tuple[int, int], tmp_path: Path,
                                         hybrid: Callable[[str], Path]) -> None:
    """The real app in tmux on the tiny Nemotron-H with a 32-token window: the state row
    and its rotation line sit under the K/V bytes, inside the panel, at 120 columns and at
    80 (where F3 shows the panel), before the first turn and after one that rotated."""
    folder = hybrid("nemotron_h")
    env, status = chat_env(tmp_path, {"temp": 0.0, "max_tokens": 40, "max_kv_size": 32})
    tmux = Tmux(f"kvchat-hybrid-{os.getpid()}-{size[0]}")
    state = f"state    {human_bytes(MAMBA2_LAYER)} · fixed"
    try:
        session(tmux, "chat", size, command(f"--model {shlex.quote(str(folder))}", env, status))
        tmux.wait_screen("chat", lambda s: folder.name in s and "Message" in s, timeout=90)
        if size[0] < 100:  # the panel starts hidden below 100 columns
            tmux("send-keys", "-t", "chat", "F3")
        for prompt in (None, "a b c d e f g"):
            if prompt is not None:
                tmux("send-keys", "-t", "chat", "-l", prompt)
                tmux("send-keys", "-t", "chat", "Enter")
            # after the turn: once the context-full toast no longer covers the panel
            screen = tmux.wait_screen(
                "chat", lambda s, p=prompt: state in s and (p is None or "40 generated" in s),
                timeout=90)
            lines = screen.splitlines()
            assert len(lines) == size[1] and all(len(ln) <= size[0] for ln in lines)
            at = next(i for i, ln in enumerate(lines) if state in ln)
            column = lines[at].index(state)
            assert lines[at - 1][column:].startswith("KV ")
            assert lines[at + 1][column:].rstrip() == " " * LABEL_W + "kept through rotation"
        tmux("send-keys", "-t", "chat", "C-q")
        assert wait_file(status, 30) == "0"
    finally:
        tmux.kill_server()

"""The live stats side panel: speed, context gauge, KV cache, model, runtime.

Updates are throttled: `update_stats()` only stores the newest TurnStats; a 10 Hz timer
renders it when something changed. The engine itself sends Stats about 10 times a
second, never per token, so the panel costs a few re-renders a second while decoding.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Sparkline, Static

from kvchat.app.core import blas
from kvchat.app.core.text import literal
from kvchat.app.tui.widgets.format import (
    context_level,
    fmt_bytes,
    fmt_count,
    fmt_device,
    fmt_params,
    fmt_rate,
    fmt_saving,
    fmt_seconds,
)
from kvchat.model.runtime import threads
from kvchat.model.runtime.events import CACHE_FIELDS, SPECULATION_FIELDS, TURN_FIELDS, TurnStats

REFRESH_S = 0.1
# the "now" rate spans at least this much decode time: the last Stats of a turn can
# follow the previous one by a token or two, and a rate over ~1 ms is noise
NOW_MIN_WINDOW_S = 0.03
SPARK_POINTS = 48
LABEL_W = 9
# the panel's text width (kvchat.tcss: StatsPanel width 38, less padding 2, border 1 and
# the scrollbar 1): a longer value wraps under itself, never back to the label column
CONTENT_W = 34
VALUE_W = CONTENT_W - LABEL_W


def _times(n: int | None, factor: float | None) -> int | None:
    return None if n is None or factor is None else round(n * factor)


def _wrap(value: Text, width: int) -> list[Text]:
    """`value` cut at spaces into lines of at most `width` cells (a longer word is cut
    where it must), keeping its styles."""
    plain, cuts, start = value.plain, [], 0
    while len(plain) - start > width:
        space = plain.rfind(" ", start + 1, start + width + 1)
        end = space if space > start else start + width
        cuts.append(end)
        start = end + 1 if space > start else end
    if not cuts:
        return [value]
    lines, prev = [], 0
    for end in cuts:
        lines.append(value[prev:end])
        prev = end + 1 if plain[end:end + 1] == " " else end
    lines.append(value[prev:])
    return lines


def _row(label: str, value: str | Text, style: str = "") -> Text:
    """`label` in the label column, `value` beside it; a value wider than the panel goes
    on in more lines indented to the value column."""
    t = Text(f"{label:<{LABEL_W}}", style="dim")
    v = value if isinstance(value, Text) else literal(value, style=style)
    for i, line in enumerate(_wrap(v, VALUE_W)):
        if i:
            t.append("\n" + " " * LABEL_W)
        t.append_text(line)
    return t


def _lines(*rows: Text) -> Text:
    return Text("\n").join(rows)


def _set(widget: Static, text: Text) -> None:
    """Update only when the text changed (while decoding, the model and runtime sections
    never do), and without a screen re-layout unless the number of lines changed (a
    layout pass costs far more than the repaint, and this runs 10 times a second)."""
    key = (text.plain, tuple(text.spans), str(text.style))  # Text == compares plain only
    if key == getattr(widget, "_kv_text", None):
        return
    lines = len(text.plain.split("\n"))
    widget.update(text, layout=lines != getattr(widget, "_kv_lines", None))
    widget._kv_lines = lines  # type: ignore[attr-defined]
    widget._kv_text = key  # type: ignore[attr-defined]


def decode_elapsed(stats: TurnStats) -> float | None:
    """Seconds between the first and the last generated token, from the stats alone:
    decode_tps = (n - 1) / span  =>  span = (n - 1) / decode_tps (docs/design.md)."""
    n = stats.generated_tokens or 0
    tps = stats.decode_tps or 0.0
    if n < 2 or tps <= 0:
        return None
    return (n - 1) / tps


class ContextGauge(Static):
    """cache_tokens / cache_capacity as a bar; yellow from 75 %, red from 90 %."""

    BAR_W = 18

    def set_fill(self, tokens: int, capacity: int, overflowed: bool = False) -> None:
        frac = tokens / capacity if capacity > 0 else 0.0
        level = context_level(tokens, capacity)
        for lvl in ("ok", "warn", "danger"):
            self.set_class(lvl == level, f"-{lvl}")
        full = round(min(1.0, frac) * self.BAR_W)
        bar = Text("█" * full, style="bold")
        bar.append("░" * (self.BAR_W - full), style="dim")
        bar.append(f" {frac * 100:3.0f}%")
        # not dim: a dimmed gauge colour falls below 4.5:1 in a light theme
        lines = [bar, Text(f"{tokens:,} / {capacity:,} tokens")]
        if overflowed:  # this chat's one lasting context notice
            lines.append(Text("window full: oldest tokens dropped", style="bold"))
        _set(self, _lines(*lines))


class StatsPanel(VerticalScroll):
    """The side panel. Fed with the engine's TurnStats and the model info."""

    can_focus = False

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.stats = TurnStats()
        self.info: dict[str, Any] = {}
        self.decode_now: float | None = None
        self.freed_bytes: int | None = None  # memory released by the last model swap
        self._dirty = True
        self._last_point: tuple[int, float] | None = None  # (generated, decode span)
        self._spark: deque[float] = deque(maxlen=SPARK_POINTS)
        self.prefill: tuple[int, int, float] | None = None  # (done, total, tok/s) while slow
        # the configured cache bound (Settings' max KV size and keep): what the first turn
        # will build, shown before it does (None: the model's context)
        self.max_kv_size: int | None = None
        self.keep = 0
        self.overflowed = False  # this chat outgrew the window (tokens were dropped)
        self.peak_scope = "at load"  # what the "peak" memory figure covers

    def compose(self) -> ComposeResult:
        yield Static("Speed", classes="section")
        yield Static(id="speed")
        yield Sparkline([], id="spark")
        yield Static("Context", classes="section")
        yield ContextGauge(id="gauge")
        yield Static("KV cache", classes="section")
        yield Static(id="cache")
        yield Static("Model", classes="section")
        yield Static(id="model")
        yield Static("Runtime", classes="section")
        yield Static(id="runtime")

    def on_mount(self) -> None:
        self._render_now()
        self.set_interval(REFRESH_S, self._tick)

    # ---- feeding ----------------------------------------------------------------------
    def start_turn(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A turn began: reset the per-turn speed numbers, keep cache and model."""
        self._reset_speed()
        self.stats = self.stats.with_(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)
        self.peak_scope = "this turn"  # the engine resets the peak counter per turn

    def _reset_speed(self) -> None:
        self.stats = self.stats.with_(**dict.fromkeys((*TURN_FIELDS, *SPECULATION_FIELDS)))
        self.decode_now = None
        self.prefill = None
        self._last_point = None
        self._spark.clear()
        self._dirty = True

    def show_prefill(self, done: int, total: int, tps: float) -> None:
        """A long prompt is being read: show tokens done / total and the rate so far."""
        self.prefill = (done, total, tps)
        self._dirty = True

    def end_turn(self, stats: TurnStats | None = None) -> None:
        self.prefill = None
        if stats:
            self.update_stats(stats)
        self._dirty = True
        self._render_now()  # final numbers at once, not up to 100 ms later

    def update_stats(self, stats: TurnStats) -> None:
        """Store the newest stats; the timer renders them (never per token)."""
        self.stats = self.stats.merged(stats)
        if self.stats.generated_tokens:
            self.prefill = None  # the prompt is read; decoding has begun
        span = decode_elapsed(self.stats)
        n = self.stats.generated_tokens or 0
        if span is not None:
            if self._last_point is not None:
                n0, span0 = self._last_point
                if n > n0 and span - span0 >= NOW_MIN_WINDOW_S:
                    self.decode_now = (n - n0) / (span - span0)
                    self._spark.append(self.decode_now)
                    self._last_point = (n, span)
            elif n >= 2:
                self.decode_now = self.stats.decode_tps
                self._spark.append(self.decode_now)
                self._last_point = (n, span)
        self._dirty = True

    def set_model(self, info: dict[str, Any]) -> None:
        self.info = dict(info)
        self.peak_scope = "at load"
        heads, kv = info.get("n_heads"), info.get("n_kv_heads")
        if info.get("gqa_saving"):  # the new model's factor, not the previous model's
            self.stats = self.stats.with_(gqa_saving=info["gqa_saving"])
        elif heads and kv:
            self.stats = self.stats.with_(gqa_saving=heads / kv)
        self._dirty = True
        self._render_now()

    def set_bound(self, max_kv_size: int | None, keep: int) -> None:
        """The configured bound. `keep` holds for the model's own context too: once that
        fills, the cache rotates keeping `keep` sinks (model/cache/kv.py, make_cache)."""
        self.max_kv_size, self.keep = max_kv_size, keep
        self._dirty = True

    def capacity(self) -> int | None:
        """The context bound: the cache's own once a turn has built it, else the
        configured max KV size, else the model's context."""
        return self.stats.cache_capacity or self.max_kv_size or self.info.get("context")

    def note_overflow(self) -> bool:
        """The chat outgrew the window; True the first time in this chat."""
        first = not self.overflowed
        self.overflowed = True
        self._dirty = True
        return first

    def held(self, tokens: int | None) -> int | None:
        """Of `tokens` reused, those the cache can hold: a rotating window keeps at most
        its capacity, however long the prefix it continues."""
        cap = self.capacity()
        return tokens if tokens is None or not cap else min(tokens, cap)

    def clear_cache_stats(self) -> None:
        """New chat (or another chat, or another model): the cache is empty again and the
        speed numbers were the last chat's. The GQA factor stays: it is the model's."""
        self._reset_speed()
        gone = [f for f in CACHE_FIELDS if f != "gqa_saving"]
        self.stats = self.stats.with_(**dict.fromkeys(gone))
        self.overflowed = False
        if self.peak_scope == "this turn":
            self.peak_scope = "last turn"
        self._dirty = True
        self._render_now()

    # ---- rendering --------------------------------------------------------------------
    def _tick(self) -> None:
        if self._dirty:
            self._render_now()

    def _render_now(self) -> None:
        if not self.is_mounted:
            return
        self._dirty = False
        s, info = self.stats, self.info
        _set(
            self.query_one("#speed", Static),
            _lines(
                _row("now", fmt_rate(self.decode_now), "bold"),
                _row("average", fmt_rate(s.decode_tps)),
                _row("prefill", fmt_rate(s.prefill_tps))
                if self.prefill is None
                else _row("prefill", f"{self.prefill[0]:,}/{self.prefill[1]:,} · "
                          f"{fmt_rate(self.prefill[2])}", "bold"),
                _row("TTFT", fmt_seconds(s.ttft_s)),
                _row("tokens", f"{fmt_count(s.generated_tokens)} generated"),
                *speculation_rows(s),
            )
        )
        spark = self.query_one("#spark", Sparkline)
        spark.data = list(self._spark)  # empty: a flat baseline, not a full block

        tokens, cap = s.cache_tokens, self.capacity()
        gauge = self.query_one("#gauge", ContextGauge)
        gauge.set_fill(tokens or 0, cap or 0, self.overflowed)

        wrapped = s.wrapped
        latent = info.get("attention") == "MLA"  # latent attention: MHA, GQA and its own
        attends = info.get("attention") != "none"  # Mamba: no layer holds K/V
        _set(
            self.query_one("#cache", Static),
            _lines(
                _row("KV", fmt_bytes(s.cache_bytes), "bold"),
                *state_rows(s, info, cap),
                *([_row("as MHA", fmt_bytes(s.mha_bytes))] if attends else []),
                *([_row("as GQA", fmt_bytes(_times(s.cache_bytes, info.get("as_gqa_factor"))))]
                  if latent else []),
                *([_row("MLA" if latent else "GQA", f"{fmt_saving(s.gqa_saving)} smaller")]
                  if attends else []),
                *quant_rows(s),
                *([_row("windows", f"{fmt_saving(s.window_saving)} smaller")]
                  if s.sliding_layers else []),
                _row("reused", f"{fmt_count(self.held(s.cached_tokens))} tokens this turn"),
                *checkpoint_rows(s),
                # before the first turn (no cache, capacity 0): the configured keep
                _row("window", f"{fmt_count(cap)} · keep "
                     f"{fmt_count(s.keep if s.cache_capacity else self.keep)}"),
                _row(
                    "evicted",
                    f"{fmt_count(s.evicted_tokens)} · "
                    f"{'wrapped' if wrapped else 'not wrapped' if wrapped is not None else '–'}",
                ),
                *(_row(label, value) for label, value in rank_rows(s)),  # split across hosts
            )
        )
        _set(self.query_one("#model", Static), _lines(*model_rows(info)))
        runtime = [
            _row("kernels", str(s.kernels_backend or "–")),
            _row("device", fmt_device(s.device)),
            # the slow one in bold (a named colour such as yellow is unreadable on light themes)
            _row("BLAS", blas.short_label(), "" if blas.active_blas()["fast"] else "bold"),
            _row("threads", threads.policy().short_label()),
            _row("active", fmt_bytes(s.active_memory)),
            _row("peak", f"{fmt_bytes(s.peak_memory)} {self.peak_scope}"
                 if s.peak_memory is not None else "–"),
        ]
        if self.freed_bytes is not None:
            runtime.append(_row("swap", f"freed {fmt_bytes(self.freed_bytes)}"))
        _set(self.query_one("#runtime", Static), _lines(*runtime))


def checkpoint_rows(s: TurnStats) -> list[Text]:
    """A model with recurrent layers: the checkpoints of their states a turn can go back
    to (docs/kv-cache.md, Checkpoints); nothing for pure K/V."""
    if not s.state_layers:
        return []
    return [_row("checkpoints", f"{fmt_count(s.checkpoints)} · {fmt_bytes(s.checkpoint_bytes)}")]


def model_rows(info: dict[str, Any]) -> list[Text]:
    """The model section: name, family, parameters and precision, weights, how a GGUF
    file stores them, shape."""
    bits = info.get("bits")
    precision = f"{bits}-bit" if bits else str(info.get("dtype") or "–")
    if bits and info.get("dequantized"):
        precision = f"{bits}-bit → {info.get('dtype')}"  # dequantized on load (CPU)
    return [
        _row("name", str(info.get("name") or "no model"), "bold"),
        _row("arch", str(info.get("architecture") or "–")),
        _row("params", f"{fmt_params(info.get('parameters'))} · {precision}"),
        _row("weights", fmt_bytes(info.get("weight_bytes"))),
        # a GGUF file: llama.cpp's name for how it is stored
        *([_row("file", f"from GGUF {info['gguf']}")] if info.get("gguf") else []),
        _row(
            "shape",
            f"{fmt_count(info.get('n_layers'))} layers · "
            f"{fmt_count(info.get('n_heads'))}/{fmt_count(info.get('n_kv_heads'))} heads",
        )
        if info
        else _row("shape", "–"),
    ]


def state_rows(s: TurnStats, info: dict[str, Any], capacity: int | None) -> list[Text]:
    """Recurrent layers (Mamba, gated delta, short conv): their states' bytes, which do
    not grow with the context ("fixed"); measured once a turn built the caches, else the
    config's formula. Beside attention layers whose window rotates (bounded below the
    model's context, or wrapped), the states are not rotated: they keep folding in every
    token (docs/kv-cache.md, "Rotation"). Nothing for a model without recurrent layers."""
    if not (s.state_layers or info.get("state_layers")):
        return []
    held = s.state_bytes or info.get("state_bytes")
    rows = [_row("state", f"{fmt_bytes(held)} · fixed", "bold")]
    context = info.get("context")
    rotates = bool(s.wrapped) or bool(capacity and context and capacity < context)
    if info.get("attention_layers") and rotates:
        rows.append(_row("", "kept through rotation"))
    return rows


def speculation_rows(s: TurnStats) -> list[Text]:
    """This reply's speculative decoding: what drafts, drafted / accepted tokens and the
    acceptance rate, tokens per forward pass; or why it is off (nothing when not asked)."""
    if s.speculation is None:
        note = s.speculation_note
        return [_row("drafts", note.removeprefix("speculation "))] if note else []
    return [
        _row("drafts", s.speculation),
        _row("accepted", f"{fmt_count(s.accepted)} / {fmt_count(s.drafted)} · "
             f"{(s.acceptance or 0) * 100:.0f}%"),
        _row("per pass", f"{s.tokens_per_forward or 0:.2f} tokens"),
    ]


def quant_rows(s: TurnStats) -> list[Text]:
    """A quantized cache: its bits and group, the float bytes the same tokens would
    take, and the saving (both from the arrays' sizes). Nothing for a float cache."""
    if s.kv_group_size is None:
        return []
    ratio = s.kv_saving or 1.0
    # a head_dim padded to the group can make the quantized cache the larger one
    change = (f"{fmt_saving(ratio)} smaller" if ratio >= 1
              else f"{fmt_saving(1 / ratio)} larger (padding)")
    return [
        _row("bits", f"{s.kv_bits}-bit K/V · group {s.kv_group_size}"),
        _row("as float", f"{fmt_bytes(s.float_bytes)} · {change}"),
    ]


def rank_rows(stats: TurnStats) -> list[tuple[str, str]]:
    """(label, value) rows for the KV panel: each rank's K/V and weight bytes, then the
    mean decode step split into each rank's compute and the rest (transfer, waiting)."""
    pipe = stats.pipeline or {}
    rows = [
        (f"rank {r['rank']}", f"{fmt_bytes(r['kv_bytes'])} KV · {fmt_bytes(r['weight_bytes'])} W")
        for r in pipe.get("ranks", [])
    ]
    if pipe.get("steps_timed"):
        split = " · ".join(f"r{r['rank']} {r['compute_ms']:.1f}" for r in pipe["ranks"])
        rows.append(("compute", f"{split} ms/token"))
        rows.append(("transfer", f"{pipe['transfer_ms']:.1f} of {pipe['step_ms']:.1f} ms/token"))
    return rows

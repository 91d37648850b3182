"""Text colours that stay readable in whichever theme is active.

Textual derives its text variables ($text-accent, $text-warning, $footer-key-foreground, …)
from each theme's palette, and in a light theme several come out below WCAG's 4.5:1
(orange headings on light grey: 1.5:1). kvchat's CSS colours text only through these
variables; `readable_variables` moves each one that falls short towards black (light
themes) or white (dark themes), just far enough to reach 4.5:1 on every background text
sits on. Colours that already pass are left exactly as the theme made them.
"""

from __future__ import annotations

from collections.abc import Mapping

from textual.color import Color, ColorParseError

MIN_CONTRAST = 4.5  # WCAG 2.x, level AA, normal-size text
# aimed for: a little above, since the colours shown are blended and rounded to 8 bits
_AIM = MIN_CONTRAST + 0.1
# the backgrounds that plain text is drawn on: the screen, dialogs and inputs, panels,
# footer, notices (Textual's toasts)
BACKGROUNDS = ("background", "surface", "panel", "footer-background", "panel-lighten-1")
# each variable that colours text (in kvchat's CSS or the Textual widgets it shows), and
# the background variables that text sits on
TEXT_ON: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("text-primary", "text-secondary", "text-accent", "text-warning", "text-error",
         "text-success", "text-muted", "foreground-muted", "footer-key-foreground",
         "footer-description-foreground", "footer-foreground"),
        BACKGROUNDS,
    ),
    "block-cursor-foreground": ("block-cursor-background",),  # a table's selected row
    "button-color-foreground": ("primary",),  # Save, Load (variant="primary")
}
_STEPS = 40


def luminance(c: Color) -> float:
    """WCAG relative luminance of an opaque colour."""

    def channel(v: int) -> float:
        s = v / 255
        return s / 12.92 if s <= 0.03928 else ((s + 0.055) / 1.055) ** 2.4

    return 0.2126 * channel(c.r) + 0.7152 * channel(c.g) + 0.0722 * channel(c.b)


def contrast(a: Color, b: Color) -> float:
    la, lb = luminance(a), luminance(b)
    return (max(la, lb) + 0.05) / (min(la, lb) + 0.05)


def on(value: str, bg: Color) -> Color | None:
    """The opaque colour a variable's value shows on `bg` ("auto 60%", "#rrggbbaa", …);
    None when the value is not a plain colour."""
    parts = value.split()
    try:
        if parts and parts[0] == "auto":
            alpha = float(parts[1].rstrip("%")) / 100 if len(parts) > 1 else 1.0
            return bg + bg.get_contrast_text(alpha)
        return bg + Color.parse(value)
    except (ColorParseError, ValueError, IndexError):
        return None


def readable(value: str, backgrounds: list[Color]) -> str:
    """`value` unchanged when it reaches MIN_CONTRAST on every background; else the first
    blend of it towards black or white (away from the backgrounds) that does."""
    shown = [on(value, bg) for bg in backgrounds]
    if any(c is None for c in shown) or all(
        contrast(c, bg) >= _AIM for c, bg in zip(shown, backgrounds, strict=True)
        if c is not None
    ):
        return value
    base = shown[0]
    assert base is not None
    # towards whichever of black and white stands out more from these backgrounds
    target = max((Color(0, 0, 0), Color(255, 255, 255)),
                 key=lambda end: min(contrast(end, bg) for bg in backgrounds))
    for step in range(1, _STEPS + 1):
        c = base.blend(target, step / _STEPS)
        if all(contrast(c, bg) >= _AIM for bg in backgrounds):
            return c.hex
    return target.hex


def readable_variables(variables: Mapping[str, str]) -> dict[str, str]:
    """The theme's CSS variables with every text colour made readable."""
    out = dict(variables)
    for name, under in TEXT_ON.items():
        backgrounds = [c for bg in under if bg in variables
                       for c in [on(variables[bg], Color(0, 0, 0))] if c is not None]
        if name in out and backgrounds:
            out[name] = readable(out[name], backgrounds)
    return out

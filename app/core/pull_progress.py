"""How a pull's progress reads: one line for the current file, one for the total.
The terminal (`kvchat pull`) and the chat's picker show the same two lines."""

from __future__ import annotations

from kvchat.app.core.hub_download import PullProgress

BAR_W = 24


def fmt_eta(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    s = int(seconds + 0.5)
    if s >= 3600:
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


def short_bytes(n: float) -> str:
    """1.3 MiB: a progress line changes ten times a second, so one decimal is plenty."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def bar(done: int, total: int, width: int = BAR_W) -> str:
    frac = min(1.0, done / total) if total > 0 else 1.0
    full = int(frac * width)
    return "█" * full + "░" * (width - full) + f" {frac * 100:3.0f}%"


def progress_lines(p: PullProgress, bar_width: int = BAR_W) -> tuple[str, str]:
    """(the current file's line, the total line): what the terminal and the picker show."""
    name = p.file if len(p.file) <= 28 else "…" + p.file[-27:]
    file_line = (f"{name:<28} {bar(p.file_done, p.file_total, bar_width)}"
                 f"  {short_bytes(p.file_done)} / {short_bytes(p.file_total)}")
    total_line = (
        f"{'total ' + str(p.files_done) + '/' + str(p.files_total) + ' files':<28}"
        f" {bar(p.bytes_done, p.bytes_total, bar_width)}  {short_bytes(p.bytes_done)} /"
        f" {short_bytes(p.bytes_total)} · {short_bytes(p.speed)}/s · ETA {fmt_eta(p.eta)}"
    )
    return file_line, total_line

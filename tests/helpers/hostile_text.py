"""Text that must stay data: markup a parser would act on and terminal control sequences a
terminal would obey, and the pattern of raw control characters that must never reach one."""

from __future__ import annotations

import re

MARKUP = "Why does Llama 2 use [INST] and [/INST]? [bold]b[/bold] [@click=app.quit]x[/] [/]"
# OSC 52 (set clipboard), OSC 0 (window title), CSI colour, BEL, a C1 CSI, DEL
CONTROLS = "\x1b]52;c;aGVsbG8=\x07\x1b]0;pwned\x07\x1b[31mred\x1b[0m\x9b2J\x7f\x00end"
# C0 but tab and newline, DEL, C1
RAW_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")

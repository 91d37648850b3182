"""Stop strings: the reply ends at the first one, and no part of one is ever shown.

Text arrives a token's worth at a time and a stop string may span tokens, so the tail
that could still become one is held back until the next piece decides it.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Cuts the text at the first stop string and holds back a tail that could still
    become one, so a stop string never reaches the client."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # the reply so far, cut at a stop string once one is found
        self.emitted = 0  # how much of `text` feed/flush have handed out

    @property
    def shown(self) -> str:
        """The text handed out so far (what the client has seen)."""
        return self.text[: self.emitted]

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string was hit)."""
        self.text += delta
        for s in self.stops:
            i = self.text.find(s, max(0, self.emitted - len(s)))
            if i >= 0:
                self.text = self.text[:i]
                return self._take(len(self.text)), True
        return self._take(len(self.text) - self.hold), False

    def flush(self) -> str:
        """The held-back tail: the reply ended without a stop string."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out


def stop_found(text: str, cut: int, stops: Sequence[str]) -> str | None:
    """The stop string that ended a reply: `text` is all its tokens decoded, `cut` the
    length of the reply kept (a StopMatcher's `text`). The stop string starting there;
    of several, the shortest, which completed first and so ended the reply."""
    hits = [s for s in stops if s and text.startswith(s, cut)]
    return min(hits, key=len) if hits else None

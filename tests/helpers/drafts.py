"""Draft sources for speculative-decoding tests (model/runtime/speculative.py's
`DraftSource` protocol)."""

from __future__ import annotations


class Corrupted:
    """Drafts the reference reply's next ids with one of them wrong every other pass: a
    pass keeps some drafts and rejects the rest, every time, whatever the model does."""

    name = "corrupted"

    def __init__(self, prompt: list[int], ids: list[int], vocab: int) -> None:
        self.full, self.passes, self.vocab = prompt + ids, 0, vocab

    def propose(self, history: list[int], k: int) -> tuple[list[int], None]:
        n = len(history)
        drafts = self.full[n : n + k]
        self.passes += 1
        if self.passes % 2 and len(drafts) > 1:
            drafts[-2] = (drafts[-2] + 1) % self.vocab
        return drafts, None

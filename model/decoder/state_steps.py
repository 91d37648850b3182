"""Each position's state, for a pass whose last tokens may be taken back (a speculative
verify pass: docs/design.md, "Speculative decoding").

A recurrent mixer folds every token of a call into one state, so a verify pass of k + 1
tokens that keeps only j + 1 of them needs the state after token j. When the cache asks
for it (`rollback` > 0: model/cache/state.py, or the compiled step's stand-in for it) the
mixers of conv.py, ssm.py and delta.py hand back every position's states, stacked on a
new leading axis, and the cache keeps them until the pass is judged:

- conv state after position i: the last K − 1 inputs ending at i (slices of the window
  the convolution already reads);
- recurrent state after position i: the one-token recurrence (the decode form) run over
  the pass token by token, keeping each step's state. For the few tokens of a pass this
  costs little more than the parallel form, and it is the very arithmetic plain decoding
  runs, so the kept state is the one plain decoding would hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

# run(tokens, h0) -> (y (b, L, ...), the state after the L tokens)
Run = Callable[[slice, Any], tuple[mx.array, mx.array]]


def keeps_steps(cache: Any, tokens: int) -> bool:
    """Whether a call of `tokens` tokens hands back every position's states."""
    return tokens > 1 and cache is not None and getattr(cache, "rollback", 0) > 0


def recurrence(run: Run, tokens: int, h0: Any, steps: bool) -> tuple[mx.array, mx.array]:
    """(y (b, T, ...), the last state; or every position's, stacked (T, b, ...) when
    `steps`): the mixer's own form over all the tokens, else its one-token form T times."""
    if not steps:
        return run(slice(0, tokens), h0)
    ys, hs = [], []
    h = h0
    for t in range(tokens):
        y, h = run(slice(t, t + 1), h)
        ys.append(y)
        hs.append(h)
    return mx.concatenate(ys, axis=1), mx.stack(hs)


def hand_back(cache: Any, tokens: int, conv: mx.array, recurrent: mx.array | None,
              steps: bool) -> None:
    """Give the cache the states after `tokens` more tokens (each position's when
    `steps`: `update_steps`)."""
    if cache is None:
        return
    if steps:
        cache.update_steps(tokens, conv, recurrent)
    else:
        cache.update(tokens, conv, recurrent)

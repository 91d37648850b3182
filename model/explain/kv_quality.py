"""What a quantized K/V cache costs in quality, measured against the float cache.

For one model, prompt and setting: greedy agreement over `n` tokens (both caches
generating freely: the first divergence and the share of equal ids; and with the float
run's ids fed to both, the share of positions where the quantized cache picks the same
next token), the mean KL divergence KL(float ‖ quantized) of those next-token
distributions, and perplexity on held-out text through each cache. With `max_kv_size`
below the tokens run, both caches rotate past their window. Used by `kvchat bench
--kv-bits` and the quality script (tests/benchmarks/kv_quality_table.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx

from kvchat.model.cache.kv import make_prompt_cache
from kvchat.model.decoder.kv_format import KVQuant
from kvchat.model.runtime.generate import decode_step, generate_step

# The prompt the greedy runs continue, and held-out text for perplexity: plain story prose
# (what stories260K and the shipped model were trained on), written for this measurement.
PROMPT_TEXT = "Once upon a time, there was a little girl named Lily. She loved to play"
HELD_OUT_TEXT = (
    "One day, a small dog named Max found a red ball in the park. He was very happy and"
    " ran to show his friend, a big cat named Tom. Tom looked at the ball and said, \"Can"
    " I play too?\" Max nodded and threw the ball high in the sky. They ran and jumped"
    " all day long. When the sun went down, Max and Tom were tired. They lay down under"
    " a tree and looked at the stars. \"This was the best day ever,\" said Max. Tom"
    " smiled and closed his eyes. The next morning, the ball was gone. Max looked"
    " everywhere, but he could not find it. Then he saw a little bird with the ball in"
    " its nest. The bird said, \"I am sorry, I wanted a bed that was red.\" Max laughed"
    " and said, \"You can keep it, little bird. We can share.\" From that day on, the"
    " dog, the cat and the bird played together every day, and they were always kind to"
    " each other."
)


def texts(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(prompt ids, held-out ids) for `tokenizer` (BOS first where it adds one)."""
    return tokenizer.encode(PROMPT_TEXT), tokenizer.encode(HELD_OUT_TEXT)


@dataclass
class Agreement:
    bits: int
    group_size: int
    tokens: int  # generated tokens compared
    max_kv_size: int | None  # None: the model's context (no rotation within the run)
    first_divergence: int | None  # index of the first differing free-running id; None: none
    free_match: float  # share of equal ids, both caches generating freely
    forced_match: float  # share of equal next-token picks on the float run's ids
    mean_kl: float  # KL(float ‖ quantized) of next-token distributions, nats, mean
    ppl_float: float | None  # perplexity on held-out text, float cache
    ppl_quant: float | None  # the same through the quantized cache

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _caches(model: Any, max_kv_size: int | None, kv: KVQuant | None) -> list[Any]:
    extra = {} if kv is None else {"kv": kv}
    return make_prompt_cache(model, max_kv_size=max_kv_size, keep=4, **extra)


def stepwise_logprobs(model: Any, caches: list[Any], prompt: Sequence[int],
                      follow: Sequence[int]) -> mx.array:
    """Log-probabilities (len(follow), V) of the next token after the prompt and after
    each of `follow`'s tokens but the last: the prompt prefilled, then one decode step
    per token (the compiled step, as a chat decodes)."""
    logits = model(mx.array([list(prompt)]), cache=caches, logits_to_keep=1)[:, -1, :]
    out = [logits]
    step = decode_step(model, caches)
    for t in follow[:-1]:
        logits = step(mx.array([t]))
        out.append(logits)
        if len(out) % 64 == 0:
            mx.eval(out[-1])
    lp = mx.concatenate(out, axis=0).astype(mx.float32)
    return lp - mx.logsumexp(lp, axis=-1, keepdims=True)


def perplexity(model: Any, caches: list[Any], text: Sequence[int]) -> float:
    """exp(mean NLL) of text[1:] given its prefix, token by token through `caches`."""
    lp = stepwise_logprobs(model, caches, text[:1], text[1:])
    nll = -mx.take_along_axis(lp, mx.array(text[1:])[:, None], axis=-1).mean()
    return float(mx.exp(nll).item())


def measure(model: Any, prompt: Sequence[int], kv: KVQuant, n: int = 512,
            max_kv_size: int | None = None, held_out: Sequence[int] | None = None,
            float_ids: list[int] | None = None) -> Agreement:
    """Compare `kv`'s cache with the float one on this model (see the module doc);
    `float_ids` reuses a float run of the same prompt, n and bound."""
    if float_ids is None:
        float_ids = list(generate_step(model, prompt, _caches(model, max_kv_size, None),
                                       max_tokens=n))
    quant_ids = list(generate_step(model, prompt, _caches(model, max_kv_size, kv),
                                   max_tokens=n))
    diverge = next((i for i, (a, b) in enumerate(zip(float_ids, quant_ids, strict=True))
                    if a != b), None)
    free = sum(a == b for a, b in zip(float_ids, quant_ids, strict=True)) / len(float_ids)
    lp_f = stepwise_logprobs(model, _caches(model, max_kv_size, None), prompt, float_ids)
    lp_q = stepwise_logprobs(model, _caches(model, max_kv_size, kv), prompt, float_ids)
    forced = (mx.argmax(lp_f, -1) == mx.argmax(lp_q, -1)).astype(mx.float32).mean()
    kl = (mx.exp(lp_f) * (lp_f - lp_q)).sum(-1).mean()
    ppl_f = ppl_q = None
    if held_out:
        ppl_f = perplexity(model, _caches(model, max_kv_size, None), held_out)
        ppl_q = perplexity(model, _caches(model, max_kv_size, kv), held_out)
    head_dim = model.config.head_dim
    return Agreement(
        bits=kv.bits, group_size=kv.group_for(head_dim), tokens=len(float_ids),
        max_kv_size=max_kv_size, first_divergence=diverge, free_match=free,
        forced_match=float(forced.item()), mean_kl=float(kl.item()), ppl_float=ppl_f,
        ppl_quant=ppl_q,
    )

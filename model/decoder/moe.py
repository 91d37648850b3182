"""Mixture-of-experts blocks: a router picks `top_k` of `experts` FFNs per token, the
chosen experts run as one gathered matmul per projection (`mx.gather_mm`, or
`mx.gather_qmm` when quantized: never a Python loop over experts), and their outputs are
summed with the router's weights; shared experts (Qwen2-MoE: behind a sigmoid gate,
DeepSeek: plain) see every token.

Parameter names follow mlx-community's layout (`mlp.gate`, `mlp.switch_mlp.{gate,up,down}_proj`
holding all experts stacked as (experts, out, in)); `stack_experts` turns transformers'
per-expert tensors (`mlp.experts.{i}.gate_proj.weight`, quantized or not) into it.
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kvchat.model.errors import ModelLoadError

from . import fast_exp
from .config import ModelConfig, MoeConfig


# ---- the router ---------------------------------------------------------------------------
def _top_k(scores: mx.array, k: int) -> mx.array:
    """Indices of the k largest scores on the last axis (order within the k irrelevant)."""
    return mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


def route(logits: mx.array, moe: MoeConfig, bias: mx.array | None = None
          ) -> tuple[mx.array, mx.array]:
    """(expert indices, weights), each (..., top_k), from router logits (..., experts),
    in float32 as transformers routes.

    softmax or sigmoid scores; `bias` (DeepSeek-V3's score correction) shifts the choice
    but not the weights; grouped top-k keeps only the `topk_groups` best groups of
    experts; weights renormalised over the chosen k when asked, then scaled."""
    if moe.score == "sparsemixer":
        return _sparsemixer(logits.astype(mx.float32), moe.top_k, moe.jitter_eps)
    scores = logits.astype(mx.float32)
    scores = mx.softmax(scores, axis=-1) if moe.score == "softmax" else mx.sigmoid(scores)
    choice = scores if bias is None else scores + bias.astype(mx.float32)
    if moe.group_score is not None:
        shape = (*choice.shape[:-1], moe.groups, moe.experts // moe.groups)
        grouped = choice.reshape(shape)
        if moe.group_score == "max":
            group = grouped.max(axis=-1)
        else:  # sum of each group's two best
            group = mx.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
        drop = mx.argpartition(group, kth=moe.groups - moe.topk_groups - 1, axis=-1)[
            ..., : moe.groups - moe.topk_groups
        ] if moe.topk_groups < moe.groups else None
        if drop is not None:
            # V2 zeroes the other groups' scores, V3 sets them to -inf: either way they lose
            fill = 0.0 if moe.group_score == "max" else -mx.inf
            grouped = mx.put_along_axis(grouped, drop[..., None], mx.array(fill), axis=-2)
        choice = grouped.reshape(choice.shape)
    idx = _top_k(choice, moe.top_k)
    w = mx.take_along_axis(scores, idx, axis=-1)
    if moe.norm_topk and moe.norm_p != 1.0:  # DBRX: ÷ the p-norm (weights are positive)
        w = w / (w.max(axis=-1, keepdims=True) if moe.norm_p == mx.inf else
                 (w**moe.norm_p).sum(axis=-1, keepdims=True) ** (1.0 / moe.norm_p))
    elif moe.norm_topk:
        w = w / (w.sum(axis=-1, keepdims=True) + (1e-20 if moe.score == "sigmoid" else 0.0))
    if moe.scaling != 1.0:
        w = w * moe.scaling
    return idx, w


def _sparsemixer(logits: mx.array, k: int, eps: float) -> tuple[mx.array, mx.array]:
    """Phi-MoE's routing at inference (transformers' `sparsemixer`, eval mode): pick the
    best remaining expert; its weight is its softmax among the experts whose logit is
    within a relative 2·eps of the pick's ((pick − l) / max(|l|, pick) ≤ 2·eps, measured
    on the raw logits); then mask the pick out and repeat, k times."""
    remaining = logits
    picks, weights = [], []
    for _ in range(k):
        best = remaining.max(axis=-1, keepdims=True)
        idx = mx.argmax(remaining, axis=-1, keepdims=True)
        far = (best - logits) / mx.maximum(mx.abs(logits), best) > 2 * eps
        gates = mx.softmax(mx.where(far, -mx.inf, remaining), axis=-1)
        picks.append(idx)
        weights.append(mx.take_along_axis(gates, idx, axis=-1))
        remaining = mx.put_along_axis(remaining, idx, mx.array(-mx.inf), axis=-1)
    return mx.concatenate(picks, axis=-1), mx.concatenate(weights, axis=-1)


class BiasedGate(nn.Module):
    """DeepSeek-V3's router: `gate.weight` and the `gate.e_score_correction_bias` that
    `route` adds to the scores when choosing (other families' gate is a plain Linear,
    which quantizes like any other)."""

    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = mx.zeros((experts, hidden))
        self.e_score_correction_bias = mx.zeros((experts,))

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.weight.T


# ---- experts as gathered matmuls --------------------------------------------------------
class SwitchLinear(nn.Module):
    """`experts` Linear layers stacked as one (experts, out, in) weight; row t of the input
    goes through expert indices[t]."""

    def __init__(self, d_in: int, d_out: int, experts: int, bias: bool = False):
        super().__init__()
        self.weight = mx.zeros((experts, d_out, d_in))
        if bias:
            self.bias = mx.zeros((experts, d_out))

    def __call__(self, x: mx.array, idx: mx.array, sorted_indices: bool = False) -> mx.array:
        y = mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=idx,
                         sorted_indices=sorted_indices)
        return y + mx.expand_dims(self.bias[idx], -2) if "bias" in self else y

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine"
                     ) -> QuantizedSwitchLinear:
        q = QuantizedSwitchLinear(self.weight.shape[2], self.weight.shape[1],
                                  self.weight.shape[0], "bias" in self, group_size, bits, mode)
        q.weight, q.scales, *rest = mx.quantize(self.weight, group_size, bits, mode=mode)
        q.biases = rest[0] if rest else None
        if "bias" in self:
            q.bias = self.bias
        return q


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with packed weights (mlx-community's quantized experts)."""

    def __init__(self, d_in: int, d_out: int, experts: int, bias: bool = False,
                 group_size: int = 64, bits: int = 4, mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight = mx.zeros((experts, d_out, d_in * bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((experts, d_out, d_in // group_size))
        self.biases = mx.zeros((experts, d_out, d_in // group_size)) if mode == "affine" else None
        if bias:
            self.bias = mx.zeros((experts, d_out))
        self.freeze()

    def __call__(self, x: mx.array, idx: mx.array, sorted_indices: bool = False) -> mx.array:
        y = mx.gather_qmm(x, self.weight, self.scales, self.get("biases"), rhs_indices=idx,
                          transpose=True, group_size=self.group_size, bits=self.bits,
                          mode=self.mode, sorted_indices=sorted_indices)
        return y + mx.expand_dims(self.bias[idx], -2) if "bias" in self else y

    def dequantized(self) -> SwitchLinear:
        """The float layer it stands for (the CPU computes faster in float32)."""
        w = mx.dequantize(self.weight, self.scales, self.get("biases"), self.group_size,
                          self.bits, mode=self.mode).astype(self.scales.dtype)
        out = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], "bias" in self)
        out.weight = w
        if "bias" in self:
            out.bias = self.bias
        return out


def clamped_swiglu(alpha: float, limit: float) -> Any:
    """gpt-oss: gate clamped above at `limit`, up to ±limit, (up + 1) · gate·σ(α·gate)."""

    def glu(gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
        return (up + 1) * (gate * fast_exp.sigmoid(alpha * gate))

    return glu


class _SwitchExperts(nn.Module):
    """What both expert kinds share: run `mlp(x, expert indices, sorted)` for the chosen
    (token, expert) pairs only."""

    def _mlp(self, x: mx.array, idx: mx.array, sort: bool) -> mx.array:
        raise NotImplementedError

    def __call__(self, x: mx.array, idx: mx.array) -> mx.array:
        """x (..., hidden), or (..., k, hidden) with one input per chosen expert (Llama 4),
        idx (..., k) -> (..., k, hidden)."""
        k = idx.shape[-1]
        per_slot = x.ndim == idx.ndim + 1
        # one row per chosen expert: (..., 1, 1, hidden) shared, or (..., k, 1, hidden)
        x = mx.expand_dims(x, -2) if per_slot else mx.expand_dims(x, (-2, -3))
        order = None
        if idx.size >= 64:
            # many tokens: sort the (token, expert) pairs by expert so each expert's
            # weights are read once (the gathered matmul's fast path)
            flat = idx.flatten()
            order = mx.argsort(flat)
            rows = order if per_slot else order // k
            x, gidx = x.flatten(0, -3)[rows], flat[order]
        else:
            gidx = idx
        y = self._mlp(x, gidx, order is not None)
        if order is not None:
            y = mx.unflatten(y[mx.argsort(order)], 0, idx.shape)
        return y.squeeze(-2)


class SwitchGLU(_SwitchExperts):
    """All experts' gated MLPs, down(act(gate(x)) · up(x)); `glu(gate, up)` replaces
    act(gate) · up where a family differs."""

    def __init__(self, hidden: int, size: int, experts: int, act: Any, bias: bool = False,
                 glu: Any = None):
        super().__init__()
        self.gate_proj = SwitchLinear(hidden, size, experts, bias)
        self.up_proj = SwitchLinear(hidden, size, experts, bias)
        self.down_proj = SwitchLinear(size, hidden, experts, bias)
        self.act = act
        self._glu = glu

    def _mlp(self, x: mx.array, idx: mx.array, sort: bool) -> mx.array:
        gate, up = self.gate_proj(x, idx, sort), self.up_proj(x, idx, sort)
        h = self._glu(gate, up) if self._glu is not None else self.act(gate) * up
        return self.down_proj(h, idx, sort)


class SwitchMLP(_SwitchExperts):
    """All experts' ungated MLPs, down(act(up(x))) (Nemotron-H's relu² experts)."""

    def __init__(self, hidden: int, size: int, experts: int, act: Any, bias: bool = False):
        super().__init__()
        self.up_proj = SwitchLinear(hidden, size, experts, bias)
        self.down_proj = SwitchLinear(size, hidden, experts, bias)
        self.act = act

    def _mlp(self, x: mx.array, idx: mx.array, sort: bool) -> mx.array:
        return self.down_proj(self.act(self.up_proj(x, idx, sort)), idx, sort)


class MoE(nn.Module):
    """The sparse FFN: routed experts plus optional shared expert(s)."""

    def __init__(self, cfg: ModelConfig, act: Any, dense_mlp: Any):
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.moe = moe
        self.gate = (BiasedGate(cfg.hidden_size, moe.experts) if moe.correction_bias
                     else nn.Linear(cfg.hidden_size, moe.experts, bias=moe.router_bias))
        glu = clamped_swiglu(*moe.clamped_swiglu) if moe.clamped_swiglu else None
        width = moe.latent or cfg.hidden_size  # what the experts read and write
        bias = cfg.mlp_bias or moe.expert_bias
        self.switch_mlp = (SwitchGLU(width, moe.expert_size, moe.experts, act, bias, glu)
                           if moe.gated else SwitchMLP(width, moe.expert_size, moe.experts, act,
                                                       bias))
        if moe.latent:  # Nemotron-H: into the experts' latent width and back
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, moe.latent, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(moe.latent, cfg.hidden_size, bias=cfg.mlp_bias)
        if moe.shared_size and moe.shared_gate:  # Qwen2-MoE
            self.shared_expert = dense_mlp(cfg, moe.shared_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        elif moe.shared_size:  # DeepSeek
            self.shared_experts = dense_mlp(cfg, moe.shared_size)

    def __call__(self, x: mx.array) -> mx.array:
        idx, w = route(self.gate(x), self.moe, self.gate.get("e_score_correction_bias"))
        w = w[..., None].astype(x.dtype)
        h = self.fc1_latent_proj(x) if "fc1_latent_proj" in self else x
        if self.moe.scale_inputs:  # Llama 4: the weight scales what each expert reads
            y = self.switch_mlp(mx.expand_dims(h, -2) * w, idx).sum(axis=-2)
        else:
            y = (self.switch_mlp(h, idx) * w).sum(axis=-2)
        if "fc2_latent_proj" in self:
            y = self.fc2_latent_proj(y)
        if "shared_expert" in self:
            y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y


# ---- checkpoint layout -------------------------------------------------------------------
def _gate_and_up(w: mx.array, layout: str) -> tuple[mx.array, mx.array]:
    if layout == "interleaved":
        return w[..., ::2], w[..., 1::2]
    gate, up = mx.split(w, 2, axis=-1)
    return gate, up


def unfuse_experts(weights: dict[str, mx.array], layout: str, experts: int
                   ) -> dict[str, mx.array]:
    """transformers' fused experts: `P.experts.gate_up_proj` (experts, in, 2·size), gate
    and up `layout` "interleaved" column by column (gpt-oss) or "halves" (Llama 4),
    `P.experts.down_proj` (experts, size, out), and their `_bias` -> our
    `P.switch_mlp.{gate,up,down}_proj.{weight,bias}`. Layout "rows" (DBRX): each of
    `P.experts.{gate,up,down}_proj` is (experts × size, hidden), every expert's
    (size, hidden) rows one after the other (down's being its transpose)."""
    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        if layout == "rows" and name.endswith(
                (".experts.gate_proj", ".experts.up_proj", ".experts.down_proj")):
            if w.ndim != 2 or w.shape[0] % experts:
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(w.shape)}; it should"
                                     f" hold {experts} experts' rows (experts × size, hidden)")
            w = w.reshape(experts, -1, w.shape[-1])  # (experts, size, hidden)
            if not name.endswith(".down_proj"):
                p, proj = name.rsplit(".experts.", 1)
                out[f"{p}.switch_mlp.{proj}.weight"] = w
                continue
        if name.endswith(".experts.gate_up_proj"):
            p = name[: -len(".experts.gate_up_proj")] + ".switch_mlp"
            gate, up = _gate_and_up(w, layout)
            out[f"{p}.gate_proj.weight"] = mx.contiguous(gate.swapaxes(-1, -2))
            out[f"{p}.up_proj.weight"] = mx.contiguous(up.swapaxes(-1, -2))
        elif name.endswith(".experts.gate_up_proj_bias"):
            p = name[: -len(".experts.gate_up_proj_bias")] + ".switch_mlp"
            out[f"{p}.gate_proj.bias"], out[f"{p}.up_proj.bias"] = _gate_and_up(w, layout)
        elif name.endswith(".experts.down_proj"):
            p = name[: -len(".experts.down_proj")] + ".switch_mlp"
            out[f"{p}.down_proj.weight"] = mx.contiguous(w.swapaxes(-1, -2))
        elif name.endswith(".experts.down_proj_bias"):
            out[name[: -len(".experts.down_proj_bias")] + ".switch_mlp.down_proj.bias"] = w
        else:
            out[name] = w
    return out


def split_gate_up(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Fused experts `P.switch_mlp.gate_up_proj.{param}` (experts, 2·size, ...), gate
    rows first (Granite-MoE's input_linear), -> gate_proj and up_proj. Splitting rows
    works for packed quantized weights and their scales alike."""
    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        if ".switch_mlp.gate_up_proj." not in name:
            out[name] = w
            continue
        gate, up = mx.split(w, 2, axis=1)
        out[name.replace(".gate_up_proj.", ".gate_proj.")] = gate
        out[name.replace(".gate_up_proj.", ".up_proj.")] = up
    return out


_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.(\w+)$")


def stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """transformers' per-expert tensors `P.experts.{i}.{proj}.{param}` -> one stacked
    `P.switch_mlp.{proj}.{param}` of shape (experts, ...); every param (weight, bias,
    and a quantized layer's scales/biases) stacks the same way. Other tensors pass."""
    groups: dict[tuple[str, str, str], dict[int, mx.array]] = {}
    out: dict[str, mx.array] = {}
    for name, arr in weights.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = arr
            continue
        prefix, i, proj, param = m.groups()
        groups.setdefault((prefix, proj, param), {})[int(i)] = arr
    for (prefix, proj, param), parts in groups.items():
        if sorted(parts) != list(range(len(parts))):
            missing = min(set(range(max(parts) + 1)) - set(parts))
            raise ModelLoadError(
                f"checkpoint lacks tensor {prefix}.experts.{missing}.{proj}.{param!r}")
        out[f"{prefix}.switch_mlp.{proj}.{param}"] = mx.stack(
            [parts[i] for i in range(len(parts))])
    return out

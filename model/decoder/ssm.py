"""State-space token mixers: Mamba's selective scan and Mamba-2's state-space duality
(SSD), each in two forms that agree: a parallel one for a prompt and the one-token
recurrence for decoding.

Both keep per layer a conv state (conv.py) and a recurrent state h of fixed size, updated
h_t = a_t · h_{t−1} + b_t with a_t = exp(Δ_t·A) ∈ (0, 1] and b_t = Δ_t·x_t ⊗ B_t, read out as
y_t = h_t · C_t + D·x_t (docs/models.md, "Recurrent layers"). The scan and its state are
float32 whatever the compute dtype (F32): a state summed over thousands of tokens in
bfloat16 would drift; on the CPU the compute dtype is float32 anyway.

- Mamba: A is (features, N) and h one N-vector per feature. A prompt runs the recurrence as
  a parallel prefix scan (Hillis–Steele: log₂ T steps of whole-array operations) over
  blocks of SCAN_BLOCK tokens, the state carried between blocks.
- Mamba-2: A is one number per head, so the decays inside a chunk form a T × T matrix and
  the chunk is one masked "attention" product (the SSD form); chunks carry the state.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import fast_exp
from .conv import CausalConv1d
from .state_config import SsmConfig
from .state_steps import hand_back, keeps_steps, recurrence

SCAN_BLOCK = 64  # tokens per parallel scan: bounds the (B, T, features, N) temporaries
F32 = mx.float32  # the scans' and the recurrent states' dtype


class GatedRMSNorm(nn.Module):
    """RMSNorm with a gate (SiLU, or Kimi's sigmoid), over `groups` equal groups of the
    features: Mamba-2 gates first (norm(y·silu(z))·w), Qwen3-Next and Kimi norm first
    (norm(y)·w·silu(z), norm(y)·w·sigmoid(z))."""

    def __init__(self, dims: int, eps: float, groups: int = 1, norm_first: bool = False,
                 sigmoid: bool = False):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps, self.groups, self.norm_first = eps, groups, norm_first
        self._gate = fast_exp.sigmoid if sigmoid else fast_exp.silu

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        if not self.norm_first:
            x = x * self._gate(gate)
        shape = x.shape
        x = mx.fast.rms_norm(x.reshape(*shape[:-1], self.groups, -1), None, self.eps)
        x = x.reshape(shape) * self.weight
        return x * self._gate(gate) if self.norm_first else x


class WeightedRMSNorm(nn.Module):
    """x / RMS(x) · w (Jamba's norms of Δ, B and C; as the checkpoint names them)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


# ---- Mamba: the selective scan ---------------------------------------------------------
def linear_scan(a: mx.array, b: mx.array, h0: mx.array | None) -> mx.array:
    """Every h_t = a_t · h_{t−1} + b_t along axis 1 (h_{−1} = h0, or 0), as a parallel
    prefix scan: after step k each position holds the composition of the 2^k maps ending
    there, (a, b) ∘ (a', b') = (a·a', a'·b + b'). One token: the recurrence itself."""
    T = a.shape[1]
    k = 1
    while k < T:
        b = mx.concatenate([b[:, :k], a[:, k:] * b[:, :-k] + b[:, k:]], axis=1)
        a = mx.concatenate([a[:, :k], a[:, k:] * a[:, :-k]], axis=1)
        k *= 2
    return b if h0 is None else b + a * h0[:, None]


def selective_scan(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array,
                   h0: mx.array | None) -> tuple[mx.array, mx.array]:
    """Mamba's scan. x, dt: (b, T, D); A: (D, N); B, C: (b, T, N); h0: (b, D, N).
    Returns (y without the D·x skip (b, T, D), the last state)."""
    ys = []
    h = h0
    for i in range(0, x.shape[1], SCAN_BLOCK):
        s = slice(i, i + SCAN_BLOCK)
        d = dt[:, s, :, None]
        hs = linear_scan(mx.exp(d * A), d * x[:, s, :, None] * B[:, s, None, :], h)
        ys.append((hs @ C[:, s, :, None])[..., 0])
        h = hs[:, -1]
    return mx.concatenate(ys, axis=1) if len(ys) > 1 else ys[0], h


class MambaMixer(nn.Module):
    """Mamba's block: x, z = in_proj(h); x = silu(conv(x)); Δ, B, C from x (Δ through a
    low-rank dt_proj); y = scan(x) + D·x; out_proj(y · silu(z)). Falcon-Mamba RMS-norms
    Δ, B and C (no weights) before use, Jamba with weights."""

    def __init__(self, cfg: SsmConfig, hidden: int):
        super().__init__()
        self.cfg = cfg
        d, n = cfg.inner, cfg.n
        self.in_proj = nn.Linear(hidden, 2 * d, bias=cfg.proj_bias)
        self.conv1d = CausalConv1d(d, cfg.conv_kernel, cfg.conv_bias)
        self.x_proj = nn.Linear(d, cfg.dt_rank + 2 * n, bias=False)
        self.dt_proj = nn.Linear(cfg.dt_rank, d, bias=True)
        self.A_log = mx.zeros((d, n))
        self.D = mx.ones((d,))
        self.out_proj = nn.Linear(d, hidden, bias=cfg.proj_bias)
        if cfg.bcdt_weights:  # Jamba: Δ, B and C RMS-normed with weights
            self.dt_layernorm = WeightedRMSNorm(cfg.dt_rank, cfg.bcdt_eps or 1e-6)
            self.b_layernorm = WeightedRMSNorm(n, cfg.bcdt_eps or 1e-6)
            self.c_layernorm = WeightedRMSNorm(n, cfg.bcdt_eps or 1e-6)

    def __call__(self, h: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        cfg = self.cfg
        T = h.shape[1]
        steps = keeps_steps(cache, T)
        x, z = mx.split(self.in_proj(h), 2, axis=-1)
        x, conv_state = self.conv1d(x, cache.conv if cache is not None else None, steps)
        x = fast_exp.silu(x)
        dt, B, C = mx.split(self.x_proj(x), [cfg.dt_rank, cfg.dt_rank + cfg.n], axis=-1)
        if cfg.bcdt_weights:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        elif cfg.bcdt_eps is not None:
            dt, B, C = (mx.fast.rms_norm(t, None, cfg.bcdt_eps) for t in (dt, B, C))
        dt = nn.softplus(self.dt_proj(dt))
        xf, dtf, Bf, Cf = (t.astype(F32) for t in (x, dt, B, C))
        A = -mx.exp(self.A_log.astype(F32))
        y, state = recurrence(
            lambda s, h0: selective_scan(xf[:, s], dtf[:, s], A, Bf[:, s], Cf[:, s], h0),
            T, cache.recurrent if cache is not None else None, steps)
        hand_back(cache, T, conv_state, state, steps)
        return self.out_proj((y.astype(x.dtype) + self.D * x) * fast_exp.silu(z))


# ---- Mamba-2: state-space duality -------------------------------------------------------
def segsum(a: mx.array) -> mx.array:
    """(..., L) -> (..., L, L): out[t, s] = a_{s+1} + … + a_t for s ≤ t, −inf above the
    diagonal. Summed from masked copies rather than as a difference of cumulative sums,
    which would cancel catastrophically over a long chunk."""
    L = a.shape[-1]
    r, s = mx.arange(L)[:, None], mx.arange(L)[None]
    x = mx.where(r > s, mx.repeat(a[..., None], L, axis=-1), 0.0)
    return mx.where(r >= s, mx.cumsum(x, axis=-2), -mx.inf)


def ssd_chunk(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array,
              h0: mx.array | None) -> tuple[mx.array, mx.array]:
    """One chunk of the SSD form. x: (b, L, H, P); dt: (b, L, H); A: (H,); B, C: (b, L,
    H, N) (already one per head); h0: (b, H, P, N). Returns (y (b, L, H, P), last state)."""
    dA = (dt * A).transpose(0, 2, 1)  # (b, H, L)
    decay = mx.exp(segsum(dA))  # (b, H, L, L): decay from s to t
    xdt = (x * dt[..., None]).transpose(0, 2, 1, 3)  # (b, H, L, P)
    Bh, Ch = B.transpose(0, 2, 1, 3), C.transpose(0, 2, 1, 3)  # (b, H, L, N)
    y = ((Ch @ Bh.swapaxes(-1, -2)) * decay) @ xdt
    h = (xdt * decay[..., -1, :, None]).swapaxes(-1, -2) @ Bh  # (b, H, P, N)
    if h0 is not None:
        from_start = mx.exp(mx.cumsum(dA, axis=-1))  # (b, H, L): decay since the chunk began
        y = y + from_start[..., None] * (Ch @ h0.swapaxes(-1, -2))
        h = h + from_start[..., -1, None, None] * h0
    return y.transpose(0, 2, 1, 3), h


def ssd_step(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array,
             h0: mx.array | None) -> tuple[mx.array, mx.array]:
    """One token of the recurrence (shapes as ssd_chunk with L = 1)."""
    h = (x * dt[..., None])[:, 0, :, :, None] * B[:, 0, :, None, :]  # (b, H, P, N)
    if h0 is not None:
        h = h + mx.exp(dt * A)[:, 0, :, None, None] * h0
    return (h @ C[:, 0, :, :, None])[..., 0][:, None], h


def ssd(x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array,
        h0: mx.array | None, chunk: int) -> tuple[mx.array, mx.array]:
    """Mamba-2's scan (shapes as ssd_chunk, B and C per group: (b, T, G, N))."""
    per_group = x.shape[2] // B.shape[2]
    if per_group > 1:  # head j reads group j // per_group (transformers' repeat_interleave)
        B, C = mx.repeat(B, per_group, axis=2), mx.repeat(C, per_group, axis=2)
    if x.shape[1] == 1:
        return ssd_step(x, dt, A, B, C, h0)
    ys = []
    h = h0
    for i in range(0, x.shape[1], chunk):
        s = slice(i, i + chunk)
        y, h = ssd_chunk(x[:, s], dt[:, s], A, B[:, s], C[:, s], h)
        ys.append(y)
    return mx.concatenate(ys, axis=1) if len(ys) > 1 else ys[0], h


class Mamba2Mixer(nn.Module):
    """Mamba-2's block (also Bamba's, Granite 4's, Nemotron-H's, Falcon-H1's): z, xBC, Δ =
    in_proj(h); xBC = silu(conv(xBC)); y = SSD(x; Δ, A, B, C) + D·x per head;
    out_proj(norm(y, z)). Falcon-H1 scales h and each part of in_proj's output (µP)."""

    def __init__(self, cfg: SsmConfig, hidden: int):
        super().__init__()
        self.cfg = cfg
        self.in_proj = nn.Linear(hidden, cfg.inner + cfg.conv_dim + cfg.heads, bias=cfg.proj_bias)
        self.conv1d = CausalConv1d(cfg.conv_dim, cfg.conv_kernel, cfg.conv_bias)
        self.dt_bias = mx.ones((cfg.heads,))
        self.A_log = mx.zeros((cfg.heads,))
        self.D = mx.ones((cfg.heads,))
        if cfg.gated_norm:
            self.norm = GatedRMSNorm(cfg.inner, cfg.norm_eps, cfg.groups, cfg.norm_first)
        out_bias = cfg.proj_bias if cfg.out_bias is None else cfg.out_bias
        self.out_proj = nn.Linear(cfg.inner, hidden, bias=out_bias)
        self._mup = None  # Falcon-H1: in_proj's output × one factor per part (not a weight)
        if cfg.proj_scales is not None:
            gn = cfg.groups * cfg.n
            widths = (cfg.inner, cfg.inner, gn, gn, cfg.heads)
            self._mup = mx.concatenate([mx.full((w,), s)
                                        for w, s in zip(widths, cfg.proj_scales, strict=True)])

    def __call__(self, h: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        cfg = self.cfg
        b, T, _ = h.shape
        steps = keeps_steps(cache, T)
        if cfg.in_scale != 1.0:
            h = h * cfg.in_scale
        proj = self.in_proj(h)
        if self._mup is not None:
            proj = proj * self._mup.astype(proj.dtype)
        z, xbc, dt = mx.split(proj, [cfg.inner, cfg.inner + cfg.conv_dim], axis=-1)
        xbc, conv_state = self.conv1d(xbc, cache.conv if cache is not None else None, steps)
        x, B, C = mx.split(fast_exp.silu(xbc), [cfg.inner, cfg.inner + cfg.groups * cfg.n], axis=-1)
        x = x.reshape(b, T, cfg.heads, cfg.head_dim)
        dt = mx.clip(nn.softplus(dt + self.dt_bias), *cfg.dt_limit).astype(F32)
        xf, A = x.astype(F32), -mx.exp(self.A_log.astype(F32))
        Bf = B.reshape(b, T, cfg.groups, cfg.n).astype(F32)
        Cf = C.reshape(b, T, cfg.groups, cfg.n).astype(F32)
        y, state = recurrence(
            lambda s, h0: ssd(xf[:, s], dt[:, s], A, Bf[:, s], Cf[:, s], h0, cfg.chunk),
            T, cache.recurrent if cache is not None else None, steps)
        hand_back(cache, T, conv_state, state, steps)
        y = (y.astype(x.dtype) + self.D[:, None] * x).reshape(b, T, cfg.inner)
        y = self.norm(y, z) if "norm" in self else y * fast_exp.silu(z)
        return self.out_proj(y)

"""The gated delta rule (Qwen3-Next, Qwen3.5): linear attention whose state S (k_dim × v_dim
per value head) decays and is corrected toward each new value,

    S_t = g_t·S_{t−1} + k_t ⊗ β_t·(v_t − g_t·S_{t−1}ᵀk_t),    y_t = S_tᵀ q_t,

with g_t = exp(−exp(A)·softplus(a_t + dt_bias)) ∈ (0, 1), β_t = sigmoid(b_t) (OLMo-hybrid:
2·sigmoid(b_t), so the update may overshoot: negative eigenvalues), q and k
L2-normed (q also × k_dim^−½). A prompt runs the chunked form (transformers' and FLA's): in
a chunk of CHUNK tokens the updates are condensed into one unit lower-triangular solve
(the "UT transform") and a few matmuls, the state carried between chunks; one token runs
the recurrence above. Both agree with transformers. The rule and its state run in float32
whatever the compute dtype (as ssm.py's scans).

The gate may also be one per key channel, g_t ∈ (0, 1)^k_dim, decaying the state's rows
apart (Kimi's KDA: S_t = diag(g_t)·S_{t−1} + …): the same two forms, with the decays inside
a chunk kept per channel. `KimiDeltaAttention` is Kimi Linear's mixer around it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import fast_exp
from .conv import CausalConv1d
from .ssm import F32, GatedRMSNorm
from .state_config import DeltaConfig
from .state_steps import hand_back, keeps_steps, recurrence

CHUNK = 64  # tokens per chunk of the prompt form (transformers' chunk_size)


def l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x / √(Σx² + eps), as the reference (FLA) norms q and k."""
    return x * mx.rsqrt(mx.sum(x * x, axis=-1, keepdims=True) + eps)


def delta_chunk(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                S: mx.array) -> tuple[mx.array, mx.array]:
    """One chunk. q, k: (b, H, L, Dk); v: (b, H, L, Dv); g (log decay): (b, H, L), or
    (b, H, L, Dk) per channel; beta: (b, H, L); S: (b, H, Dk, Dv). Returns (y (b, H, L,
    Dv), the state after the chunk)."""
    L = q.shape[2]
    cs = mx.cumsum(g, axis=2)  # log decay since the chunk began
    t, s = mx.arange(L)[:, None], mx.arange(L)[None]
    if g.ndim == 4:  # per channel: Σ_c a_t[c]·b_s[c]·exp(cs_t[c] − cs_s[c]), one L × L × Dk
        decay = mx.exp(mx.where((t >= s)[..., None],
                                cs[..., :, None, :] - cs[..., None, :, :], -mx.inf))

        def pairs(a: mx.array, b: mx.array) -> mx.array:
            return (a[..., :, None, :] * b[..., None, :, :] * decay).sum(axis=-1)
    else:
        decay = mx.exp(mx.where(t >= s, cs[..., :, None] - cs[..., None, :], -mx.inf))
        cs = cs[..., None]  # one decay for every channel, broadcast below

        def pairs(a: mx.array, b: mx.array) -> mx.array:
            return (a @ b.swapaxes(-1, -2)) * decay
    kb, vb = k * beta[..., None], v * beta[..., None]
    # (I + strictly lower part of (β k kᵀ) ⊙ decay) solves the chunk's delta updates at once
    system = mx.where(t > s, pairs(kb, k), 0.0) + mx.eye(L, dtype=q.dtype)
    u = mx.linalg.solve_triangular(system, vb, upper=False, stream=mx.cpu)
    w = mx.linalg.solve_triangular(system, kb * mx.exp(cs), upper=False, stream=mx.cpu)
    v_new = u - w @ S  # each value minus what the state before the chunk already predicts
    y = (q * mx.exp(cs)) @ S + pairs(q, k) @ v_new
    last = cs[..., -1:, :]  # (b, H, 1, Dk or 1): the decay over the whole chunk
    S = S * mx.exp(last).swapaxes(-1, -2) + (k * mx.exp(last - cs)).swapaxes(-1, -2) @ v_new
    return y, S


def delta_step(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
               S: mx.array) -> tuple[mx.array, mx.array]:
    """One token (shapes as delta_chunk with L = 1): the recurrence itself."""
    decay = mx.exp(g[:, :, 0])  # (b, H), or (b, H, Dk) per channel
    S = S * (decay[..., None, None] if decay.ndim == 2 else decay[..., None])
    k_t, q_t = k[:, :, 0, :, None], q[:, :, 0, :, None]  # (b, H, Dk, 1)
    delta = (v[:, :, 0] - (S * k_t).sum(axis=-2)) * beta[..., 0, None]  # (b, H, Dv)
    S = S + k_t * delta[:, :, None, :]
    return (S * q_t).sum(axis=-2)[:, :, None], S


def gated_delta(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                S: mx.array | None) -> tuple[mx.array, mx.array]:
    """The rule over a sequence. q, k: (b, T, Hk, Dk), normed; v: (b, T, Hv, Dv); g, beta:
    (b, T, Hv) (g per channel: (b, T, Hv, Dk)); S: (b, Hv, Dk, Dv) or None. Returns
    (y (b, T, Hv, Dv), the last state)."""
    b, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if Hv > Hk:  # value head j reads key head j // (Hv / Hk)
        q, k = mx.repeat(q, Hv // Hk, axis=2), mx.repeat(k, Hv // Hk, axis=2)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    g, beta = g.swapaxes(1, 2), beta.transpose(0, 2, 1)
    if S is None:
        S = mx.zeros((b, Hv, Dk, Dv), F32)
    if T == 1:
        y, S = delta_step(q, k, v, g, beta, S)
        return y.transpose(0, 2, 1, 3), S
    ys = []
    for i in range(0, T, CHUNK):
        s = slice(i, i + CHUNK)
        y, S = delta_chunk(q[:, :, s], k[:, :, s], v[:, :, s], g[:, :, s], beta[:, :, s], S)
        ys.append(y)
    y = mx.concatenate(ys, axis=2) if len(ys) > 1 else ys[0]
    return y.transpose(0, 2, 1, 3), S


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention: q, k, v (and the output gate z, and b, a for β and
    g) projected from the input, q|k|v through the causal convolution and SiLU, the gated
    delta rule per value head, a gated RMSNorm (norm first, then × silu(z)), out_proj.
    Qwen3-Next packs q, k, v, z (and b, a) per key head in two projections
    (in_proj_qkvz, in_proj_ba); Qwen3.5 has four (in_proj_qkv, in_proj_z, in_proj_b,
    in_proj_a) in plain order; OLMo-hybrid's q, k and v have a projection each (q_proj,
    k_proj, v_proj) and its β may reach 2 (beta_scale)."""

    def __init__(self, cfg: DeltaConfig, hidden: int):
        super().__init__()
        self.cfg = cfg
        key, value = cfg.k_heads * cfg.k_dim, cfg.v_heads * cfg.v_dim
        if cfg.proj == "fused":
            self.in_proj_qkvz = nn.Linear(hidden, 2 * key + 2 * value, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * cfg.v_heads, bias=False)
        else:
            if cfg.proj == "separate":
                self.q_proj = nn.Linear(hidden, key, bias=False)
                self.k_proj = nn.Linear(hidden, key, bias=False)
                self.v_proj = nn.Linear(hidden, value, bias=False)
            else:
                self.in_proj_qkv = nn.Linear(hidden, 2 * key + value, bias=False)
            self.in_proj_z = nn.Linear(hidden, value, bias=False)
            self.in_proj_b = nn.Linear(hidden, cfg.v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, cfg.v_heads, bias=False)
        self.conv1d = CausalConv1d(cfg.conv_dim, cfg.conv_kernel, bias=False)
        self.dt_bias = mx.ones((cfg.v_heads,))
        self.A_log = mx.zeros((cfg.v_heads,))
        self.norm = GatedRMSNorm(cfg.v_dim, cfg.norm_eps, norm_first=True)
        self.out_proj = nn.Linear(value, hidden, bias=False)

    def _project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """(q|k|v flat (b, T, conv_dim), z (b, T, Hv, Dv), b and a (b, T, Hv))."""
        cfg = self.cfg
        B, T, _ = x.shape
        if cfg.proj != "fused":
            z = self.in_proj_z(x).reshape(B, T, cfg.v_heads, cfg.v_dim)
            qkv = (self.in_proj_qkv(x) if cfg.proj == "split" else mx.concatenate(
                [self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1))
            return qkv, z, self.in_proj_b(x), self.in_proj_a(x)
        r = cfg.v_heads // cfg.k_heads  # value heads per key head
        qkvz = self.in_proj_qkvz(x).reshape(B, T, cfg.k_heads, -1)
        q, k, v, z = mx.split(qkvz, [cfg.k_dim, 2 * cfg.k_dim, 2 * cfg.k_dim + r * cfg.v_dim],
                              axis=-1)
        b, a = mx.split(self.in_proj_ba(x).reshape(B, T, cfg.k_heads, 2 * r), 2, axis=-1)
        qkv = mx.concatenate([t.reshape(B, T, -1) for t in (q, k, v)], axis=-1)
        return (qkv, z.reshape(B, T, cfg.v_heads, cfg.v_dim), b.reshape(B, T, -1),
                a.reshape(B, T, -1))

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        cfg = self.cfg
        B, T, _ = x.shape
        steps = keeps_steps(cache, T)
        qkv, z, b, a = self._project(x)
        qkv, conv_state = self.conv1d(qkv, cache.conv if cache is not None else None, steps)
        key = cfg.k_heads * cfg.k_dim
        q, k, v = mx.split(fast_exp.silu(qkv), [key, 2 * key], axis=-1)
        q = l2norm(q.reshape(B, T, cfg.k_heads, cfg.k_dim)) * cfg.k_dim**-0.5
        k = l2norm(k.reshape(B, T, cfg.k_heads, cfg.k_dim))
        g = -mx.exp(self.A_log.astype(F32)) * nn.softplus((a + self.dt_bias).astype(F32))
        v = v.reshape(B, T, cfg.v_heads, cfg.v_dim)
        qf, kf, vf = q.astype(F32), k.astype(F32), v.astype(F32)
        beta = mx.sigmoid(b.astype(F32))
        if cfg.beta_scale != 1.0:
            beta = beta * cfg.beta_scale
        y, state = recurrence(
            lambda s, S: gated_delta(qf[:, s], kf[:, s], vf[:, s], g[:, s], beta[:, s], S),
            T, cache.recurrent if cache is not None else None, steps)
        hand_back(cache, T, conv_state, state, steps)
        return self.out_proj(self.norm(y.astype(x.dtype), z).reshape(B, T, -1))


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention (Kimi Linear): q, k, v from projections of their own through
    one causal convolution (the checkpoint's q_conv1d, k_conv1d, v_conv1d, concatenated on
    load) and SiLU; the gated delta rule per head with one decay per key channel, log g =
    −exp(A_log)·softplus(f_b(f_a(x)) + dt_bias) (a low-rank forget gate); the output
    RMS-normed per head, then × sigmoid of a low-rank output gate g_b(g_a(x)) (o_norm),
    o_proj. Names as Moonshot's checkpoints (transformers saves the same)."""

    def __init__(self, cfg: DeltaConfig, hidden: int):
        super().__init__()
        self.cfg = cfg
        heads, dim = cfg.v_heads, cfg.k_dim
        width = heads * dim
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, width, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        self.conv1d = CausalConv1d(cfg.conv_dim, cfg.conv_kernel, bias=False)
        self.f_a_proj = nn.Linear(hidden, dim, bias=False)  # the forget gate's rank: head_dim
        self.f_b_proj = nn.Linear(dim, width, bias=False)
        self.dt_bias = mx.zeros((width,))
        self.A_log = mx.zeros((1, 1, heads, 1))  # one decay rate per head, as stored
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, dim, bias=False)
        self.g_b_proj = nn.Linear(dim, width, bias=False)
        self.o_norm = GatedRMSNorm(dim, cfg.norm_eps, norm_first=True, sigmoid=True)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        cfg = self.cfg
        B, T, _ = x.shape
        shape = (B, T, cfg.v_heads, cfg.k_dim)
        qkv = mx.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        qkv, conv_state = self.conv1d(qkv, cache.conv if cache is not None else None)
        q, k, v = (t.reshape(shape) for t in mx.split(fast_exp.silu(qkv), 3, axis=-1))
        q = l2norm(q) * cfg.k_dim**-0.5
        k = l2norm(k)
        a = (self.f_b_proj(self.f_a_proj(x)).astype(F32) + self.dt_bias.astype(F32))
        g = -mx.exp(self.A_log.astype(F32)) * nn.softplus(a.reshape(shape))  # (B, T, H, Dk)
        beta = mx.sigmoid(self.b_proj(x).astype(F32))
        y, state = gated_delta(q.astype(F32), k.astype(F32), v.astype(F32), g, beta,
                               cache.recurrent if cache is not None else None)
        if cache is not None:
            cache.update(T, conv_state, state)
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(shape)
        return self.o_proj(self.o_norm(y.astype(x.dtype), gate).reshape(B, T, -1))

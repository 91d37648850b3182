"""The recurrent mixers' sizes, resolved from a config.json (already under kvchat's key
names: each family's `key_aliases` map its own spellings, e.g. Bamba's `mamba_d_state`, to
the `ssm_*` / `linear_*` / `conv_*` keys read here).

One dataclass per mixer kind (families.MixerKind); `ModelConfig.mixer` holds the one its
family uses. The state each keeps per layer has a fixed size (`state_shapes`), whatever
the number of tokens: the conv state in the compute dtype, the recurrent state in float32
(RECURRENT_BYTES; ssm.py); the mixers make it, kv_math counts it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvchat.model.errors import ConfigError

from .families import DeltaProjKind, Family, MixerKind


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"config.json: {key} must be a positive integer, got {v!r:.60}")
    return v


RECURRENT_BYTES = 4  # the recurrent states are float32 whatever the compute dtype (ssm.F32)


def _number(v: Any) -> float:
    """A float from config.json; transformers 5 writes infinity as {"__float__": "Infinity"}."""
    if isinstance(v, dict) and "__float__" in v:
        v = v["__float__"]
    return float(v)


@dataclass(frozen=True)
class SsmConfig:
    """A Mamba (selective scan) or Mamba-2 (SSD) mixer: `inner` features in the scan, an
    `n`-wide state per feature (Mamba) or per head (Mamba-2), a causal convolution of
    `conv_kernel` taps in front of it."""

    kind: MixerKind  # "mamba" or "mamba2"
    inner: int  # d_inner (Mamba-2: heads × head_dim)
    n: int  # state size
    conv_kernel: int
    conv_bias: bool
    proj_bias: bool
    dt_rank: int = 0  # Mamba: width of the low-rank Δ projection
    heads: int = 0  # Mamba-2
    head_dim: int = 0
    groups: int = 1  # Mamba-2: B and C shared by heads // groups heads each
    chunk: int = 256  # Mamba-2: prefill chunk of the SSD form
    dt_limit: tuple[float, float] = (0.0, math.inf)  # Mamba-2: Δ clamped to this range
    bcdt_eps: float | None = None  # Falcon-Mamba: B, C and Δ RMS-normed (no weight)
    bcdt_weights: bool = False  # Jamba: those norms have weights
    gated_norm: bool = True  # Mamba-2: RMSNorm of y·silu(z) in `groups` groups
    norm_first: bool = False  # Falcon-H1: the gated norm is norm(y)·w·silu(z)
    norm_eps: float = 1e-5
    out_bias: bool | None = None  # out_proj's bias when not proj_bias's (Falcon-H1)
    # Falcon-H1's µP: the input × in_scale, in_proj's z, x, B, C and Δ parts × these
    in_scale: float = 1.0
    proj_scales: tuple[float, float, float, float, float] | None = None

    @property
    def conv_dim(self) -> int:
        """Channels through the convolution: x (Mamba); x, B and C (Mamba-2)."""
        return self.inner if self.kind == "mamba" else self.inner + 2 * self.groups * self.n

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """(conv state, recurrent state) of one sequence."""
        recurrent = ((self.inner, self.n) if self.kind == "mamba"
                     else (self.heads, self.head_dim, self.n))
        return (self.conv_kernel - 1, self.conv_dim), recurrent


@dataclass(frozen=True)
class DeltaConfig:
    """The gated delta rule (Qwen3-Next, Qwen3.5, OLMo-hybrid; Kimi's KDA): `k_heads`
    query/key heads of `k_dim`, `v_heads` value heads of `v_dim` (a multiple of k_heads), a
    state of k_dim × v_dim per value head, a causal convolution over q, k and v."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    norm_eps: float
    proj: DeltaProjKind  # the input projections' layout (families.DeltaProjKind)
    beta_scale: float = 1.0  # OLMo-hybrid's linear_allow_neg_eigval: β = 2·sigmoid(b)

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (self.conv_kernel - 1, self.conv_dim), (self.v_heads, self.k_dim, self.v_dim)


@dataclass(frozen=True)
class ShortConvConfig:
    """LFM2's gated short convolution over the hidden features (`kernel` taps)."""

    hidden: int
    kernel: int
    bias: bool

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.kernel - 1, self.hidden),)


@dataclass(frozen=True)
class RgLruConfig:
    """Griffin's RG-LRU (RecurrentGemma, rglru.py): `width` features (lru_width), gates
    block-diagonal over `heads` blocks, a causal convolution of `conv_kernel` taps in
    front, the other branch through `activation`."""

    width: int
    heads: int
    conv_kernel: int
    activation: str

    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return (self.conv_kernel - 1, self.width), (self.width,)


MixerConfig = SsmConfig | DeltaConfig | ShortConvConfig | RgLruConfig


def resolve_mixer(cfg: dict[str, Any], fam: Family, hidden: int, eps: float
                  ) -> MixerConfig | None:
    """The family's recurrent mixer with this config (None for an attention-only family)."""
    if fam.mixer is None:
        return None
    try:
        if fam.mixer in ("mamba", "mamba2"):
            return _ssm(cfg, fam, hidden, eps)
        if fam.mixer == "gated_delta":
            k_heads = _int(cfg, "linear_num_key_heads")
            v_heads = _int(cfg, "linear_num_value_heads")
            if v_heads % k_heads:
                raise ConfigError(f"config.json: linear_num_value_heads ({v_heads}) is not a"
                                  f" multiple of linear_num_key_heads ({k_heads})")
            return DeltaConfig(
                k_heads=k_heads, v_heads=v_heads, k_dim=_int(cfg, "linear_key_head_dim"),
                v_dim=_int(cfg, "linear_value_head_dim"),
                conv_kernel=_int(cfg, "linear_conv_kernel_dim", 4),
                # the gated norm's epsilon: the model's (Qwen3-Next), or its own (OLMo-hybrid)
                norm_eps=float(cfg.get("linear_norm_eps") or eps), proj=fam.delta_proj,
                beta_scale=2.0 if cfg.get("linear_allow_neg_eigval") else 1.0)
        if fam.mixer == "rglru":
            return _rglru(cfg, fam, hidden)
        if fam.mixer == "kda":  # Kimi: as many key heads as value heads, one head size
            heads, dim = _int(cfg, "linear_num_heads"), _int(cfg, "linear_head_dim")
            return DeltaConfig(k_heads=heads, v_heads=heads, k_dim=dim, v_dim=dim,
                               conv_kernel=_int(cfg, "linear_conv_kernel_dim", 4),
                               norm_eps=eps, proj=fam.delta_proj)
        return ShortConvConfig(hidden=hidden, kernel=_int(cfg, "conv_L_cache", 3),
                               bias=bool(cfg.get("conv_bias", False)))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.json has a malformed value: {e}") from None


def _ssm(cfg: dict[str, Any], fam: Family, hidden: int, eps: float) -> SsmConfig:
    n, kernel = _int(cfg, "ssm_state_size", 16), _int(cfg, "ssm_conv_kernel", 4)
    expand = cfg.get("ssm_expand", 2)
    inner = cfg.get("ssm_inner") or int(float(expand) * hidden)
    common = {"n": n, "conv_kernel": kernel, "inner": int(inner),
              "conv_bias": bool(cfg.get("ssm_conv_bias", True)),
              "proj_bias": bool(cfg.get("ssm_proj_bias", False)), "norm_eps": eps}
    if fam.mixer == "mamba":
        rank = cfg.get("ssm_dt_rank", "auto")
        rank = math.ceil(hidden / 16) if rank == "auto" else rank
        bcdt = fam.ssm_bcdt_norm
        bcdt_eps = eps if fam.ssm_bcdt_weights else float(cfg.get("mixer_rms_eps", 1e-6))
        return SsmConfig(kind="mamba", dt_rank=_int({"ssm_dt_rank": rank}, "ssm_dt_rank"),
                         bcdt_eps=bcdt_eps if bcdt or fam.ssm_bcdt_weights else None,
                         bcdt_weights=fam.ssm_bcdt_weights, **common)
    heads = _int(cfg, "ssm_heads")
    head_dim = cfg.get("ssm_head_dim")
    if head_dim in (None, "auto"):  # Bamba's default: the inner features split over the heads
        head_dim = common["inner"] // heads
    groups = _int(cfg, "ssm_groups", 1)
    if heads * head_dim != common["inner"]:
        common["inner"] = heads * head_dim  # the heads are what the weights hold
    if heads % groups:
        raise ConfigError(f"config.json: the {heads} SSM heads do not split into {groups}"
                          " groups (n_groups)")
    mup: dict[str, Any] = {}
    if fam.mup_multipliers:
        scales = cfg.get("ssm_multipliers") or [1.0] * 5
        if not isinstance(scales, list) or len(scales) != 5:
            raise ConfigError(f"config.json: ssm_multipliers must list 5 numbers, got"
                              f" {scales!r:.60}")
        mup = {"in_scale": float(cfg.get("ssm_in_multiplier") or 1.0),
               "proj_scales": tuple(float(x) for x in scales)}
    if cfg.get("ssm_out_bias") is not None:
        mup["out_bias"] = bool(cfg["ssm_out_bias"])
    limit = cfg.get("ssm_dt_limit") or (0.0, math.inf)
    if fam.ssm_dt_min_key is not None:  # Zamba2
        limit = (cfg.get(fam.ssm_dt_min_key), math.inf)
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise ConfigError(f"config.json: time_step_limit must be [min, max], got {limit!r:.60}")
    return SsmConfig(kind="mamba2", heads=heads, head_dim=int(head_dim), groups=groups,
                     chunk=_int(cfg, "ssm_chunk_size", 256),
                     dt_limit=(_number(limit[0]), _number(limit[1])),
                     gated_norm=bool(cfg.get("ssm_gated_norm", True)),
                     norm_first=bool(cfg.get("ssm_norm_first", False)), **mup, **common)


def _rglru(cfg: dict[str, Any], fam: Family, hidden: int) -> RgLruConfig:
    width = _int({"lru_width": cfg.get("lru_width") or hidden}, "lru_width")  # null: hidden
    heads = _int(cfg, "num_attention_heads")
    if width % heads:
        raise ConfigError(f"config.json: lru_width ({width}) does not split into the"
                          f" {heads} heads (num_attention_heads)")
    return RgLruConfig(width=width, heads=heads, conv_kernel=_int(cfg, "conv1d_width", 4),
                       activation=str(cfg.get(fam.activation_key) or "gelu_pytorch_tanh"))

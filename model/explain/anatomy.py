"""The loaded model's decoder block, explained with its own numbers.

The design teaches four swaps inside the 2017 transformer (LayerNorm -> RMSNorm with
pre-norm, ReLU FFN -> SwiGLU, sinusoidal positions -> RoPE, MHA -> GQA on a KV cache)
with worked numbers. `explain()` builds one JSON-ready dict for a model: each stage of
its block annotated from the config, the design's worked numbers computed through the
same `metal_kernels` entry points and `layers` code the model runs (on the active
backend), the cache the block implies (kv_math's one byte formula) and what it would
cost with MHA or MQA. `text_sections()` renders it for `kvchat explain` and the chat's
Anatomy screen alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kvchat import metal_kernels
from kvchat.model.cache.kv_math import (
    attention_name,
    attention_table,
    cached_widths,
    human_bytes,
    kv_bytes_at,
    kv_bytes_by_kind,
    kv_bytes_per_token,
    state_bytes,
)
from kvchat.model.cache.layer_kinds import MIXER_NAMES, kinds_line, layer_kinds, layer_ranges
from kvchat.model.decoder.activations import ACTIVATIONS
from kvchat.model.decoder.config import ModelConfig
from kvchat.model.decoder.layers import RoPE
from kvchat.model.decoder.rope import RopeConfig
from kvchat.model.decoder.state_config import (
    RECURRENT_BYTES,
    DeltaConfig,
    RgLruConfig,
    SsmConfig,
)

# ---- the design's worked examples ---------------------------------------------------------
SEED_X = (2.4, -1.2, 0.8, 3.1)
SEED_EPS = 1e-6
SEED_ROPE_DIMS, SEED_ROPE_BASE = 8, 10000.0
DEFAULT_GAP = 3
QK_POSITIONS = ((2, 5), (102, 105))
# a Llama-70B-class model: 80 layers, 64 query heads, 8 KV heads of 128, fp16
LLAMA_70B = {"layers": 80, "heads": 64, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2}
CONTEXTS_70B = (8192, 131072)
RECENT = 64  # the attention view's "last 64 tokens" (model/explain/attention_view.py)

ATTENTION_NAMES = {"MHA": "multi-head", "GQA": "grouped-query", "MQA": "multi-query",
                   "MLA": "multi-head latent", "none": "none (every layer recurrent)"}
NORM_NAMES = {  # families.NormKind -> (name, gain)
    "rms": ("RMSNorm", "w"), "rms_noparam": ("RMSNorm without a gain", "none"),
    "offset": ("offset RMSNorm", "(1 + w)"), "layer": ("LayerNorm", "w, bias b"),
    "layer_nobias": ("LayerNorm without bias", "w"), "layer1p": ("LayerNorm1P", "(1 + w), b"),
    "layer_noparam": ("LayerNorm without parameters", "none"),
}


def attention_kind(heads: int, kv_heads: int) -> str:
    """MHA, GQA or MQA, named by G (the number of K/V heads, i.e. query groups)."""
    return "MHA" if kv_heads == heads else "MQA" if kv_heads == 1 else "GQA"


# ---- worked numbers (computed by the app's kernels) -----------------------------------------
def _stats(v: list[float]) -> dict[str, float]:
    n = len(v)
    return {"mean": sum(v) / n, "rms": math.sqrt(sum(a * a for a in v) / n)}


def norm_demo(x: tuple[float, ...] = SEED_X, eps: float = SEED_EPS) -> dict[str, Any]:
    """RMSNorm and LayerNorm (γ = 1, β = 0) of x through `metal_kernels.rms_norm`:
    LayerNorm is RMSNorm of the centred vector (its variance is the centred mean square)."""
    xa = mx.array(x, dtype=mx.float32)
    ones = mx.ones((len(x),), dtype=mx.float32)
    rms = metal_kernels.rms_norm(xa, ones, eps).tolist()
    layer = metal_kernels.rms_norm(xa - mx.mean(xa), ones, eps).tolist()
    return {
        "x": list(x), "eps": eps, "input": _stats(list(x)),
        "rmsnorm": {"y": rms, **_stats(rms), "formula": "x / sqrt(mean(x²) + eps) · γ"},
        "layernorm": {"y": layer, **_stats(layer),
                      "formula": "(x − mean(x)) / sqrt(var(x) + eps) · γ + β"},
    }


def rope_dials(dims: int, rope: RopeConfig, gap: int = DEFAULT_GAP) -> dict[str, Any]:
    """θ_i of each rotated pair and cos(gap·θ_i), read back from the RoPE kernel: a unit
    vector (1 on the first feature of every pair) rotated to position p comes out as
    (cos pθ_i, sin pθ_i). `rope` is the schedule (scaled variants included)."""
    r = RoPE(dims, rope)
    unit = mx.concatenate([mx.ones((dims // 2,)), mx.zeros((dims - dims // 2,))])
    unit = unit.reshape(1, 1, 1, dims)
    one, at_gap = r.rotate(unit, offset=1), r.rotate(unit, offset=gap)
    half = dims // 2
    c1, s1 = one[0, 0, 0, :half].tolist(), one[0, 0, 0, half:].tolist()
    cg = at_gap[0, 0, 0, :half].tolist()
    rows = []
    for i in range(half):
        theta = math.atan2(s1[i], c1[i])
        rows.append({
            "i": i, "theta": theta, "theta_formula": rope.theta ** (-2 * i / dims),
            "wavelength": 2 * math.pi / theta if theta else math.inf, "cos_gap": cg[i],
        })
    return {"dims": dims, "base": rope.theta, "type": rope.type, "gap": gap, "pairs": rows,
            "formula": "θ_i = base^(−2i/d)"}


def _first_rope_layer(cfg: ModelConfig) -> int | None:
    return next((i for i, s in enumerate(cfg.layers) if s.rope is not None), None)


def relative_demo(cfg: ModelConfig, model: Any = None) -> dict[str, Any] | None:
    """q·k after RoPE at positions (2, 5) and (102, 105) of one sequence: equal, since the
    score depends only on the gap. The token is rotated at every position 0..105 in one
    call, as the model does for a sequence that long (so longrope and dynamic NTK use one
    schedule for both pairs). With a loaded model, q and k are its own (the first RoPE
    layer's projections of one token's embedding, through `Attention.rotated_qkv`);
    otherwise seeded vectors rotated by the config's schedule."""
    layer = _first_rope_layer(cfg)
    if layer is None:
        return None
    T = max(p for pair in QK_POSITIONS for p in pair) + 1
    blocks = getattr(getattr(model, "model", None), "layers", None)
    if blocks is not None and hasattr(blocks[layer], "self_attn"):
        bos = cfg.raw.get("bos_token_id", 1)
        token = int(bos[0] if isinstance(bos, list) and bos else bos if bos is not None else 1)
        x = blocks[layer].attention_input(model.embed(mx.array([[token] * T])), None)
        q, k, _ = blocks[layer].self_attn.rotated_qkv(x, 0)
        exact = q.dtype == mx.float32
        q, k = q[0, 0].astype(mx.float32), k[0, 0].astype(mx.float32)  # head 0, KV head 0
        source = f"layer {layer}'s own q (head 0) and k (KV head 0) of token {token}"
    else:
        spec = cfg.layers[layer]
        assert spec.rope is not None
        r = RoPE(spec.rope.rotary_dims(cfg.head_dim), spec.rope)
        q0, k0 = mx.random.normal((2, 1, 1, 1, cfg.head_dim), key=mx.random.key(0))
        ones = mx.ones((1, 1, T, 1))
        q, k = r.rotate(q0 * ones)[0, 0], r.rotate(k0 * ones)[0, 0]
        exact = True
        source = "seeded random q and k through the model's RoPE schedule"
    rows = [{"q_pos": qp, "k_pos": kp, "dot": float((q[qp] * k[kp]).sum().item())}
            for qp, kp in QK_POSITIONS]
    diff = abs(rows[0]["dot"] - rows[1]["dot"])
    # float32 rotation at position ~100 loses ~1e-5 of the angle; half precision far more
    tol = (1e-4 if exact else 1e-2) * max(1.0, abs(rows[0]["dot"]))
    return {"layer": layer, "source": source, "pairs": rows, "difference": diff,
            "tolerance": tol, "equal": diff <= tol}


def activation_minimum(name: str) -> dict[str, Any]:
    """The minimum of the model's gate activation (SiLU's ≈ −0.278 at x ≈ −1.278), of the
    same function the MLP calls: a grid brackets it, then bisection on the sign of its
    derivative (the values alone are too flat there for float32 to place it)."""
    fn: Callable[[mx.array], mx.array] = ACTIVATIONS[name]
    slope = mx.grad(lambda x: fn(x).sum())
    xs = mx.linspace(-6.0, 0.0, 6001)
    i = int(mx.argmin(fn(xs)).item())
    lo, hi = float(xs[max(i - 1, 0)].item()), float(xs[min(i + 1, 6000)].item())
    for _ in range(40):
        mid = (lo + hi) / 2
        if slope(mx.array([mid])).item() < 0:
            lo = mid
        else:
            hi = mid
    x = (lo + hi) / 2
    return {"activation": name, "x": x, "y": float(fn(mx.array([x])).item())}


def cache_figures(layers: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                  contexts: tuple[int, ...]) -> dict[str, Any]:
    """Bytes per token and at each context, this wiring and as MHA (kv_math's formula)."""
    per = kv_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes)
    mha = kv_bytes_per_token(layers, heads, head_dim, dtype_bytes)
    return {
        "layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "dtype_bytes": dtype_bytes, "bytes_per_token": per, "mha_bytes_per_token": mha,
        "at": [{"context": c, "bytes": per * c, "mha_bytes": mha * c} for c in contexts],
        "wiring": [{"name": attention_kind(heads, g), "G": g, "queries_per_group": heads // g,
                    "bytes_per_token": kv_bytes_per_token(layers, g, head_dim, dtype_bytes)}
                   for g in (heads, kv_heads, 1)],
    }


# ---- annotations (from the config) ----------------------------------------------------------
# how this block differs from Llama's (pre-RMSNorm, SwiGLU, RoPE, GQA): one row per quirk
DIFFERENCES: tuple[tuple[Callable[[ModelConfig], bool], Callable[[ModelConfig], str]], ...] = (
    (lambda c: c.norm == "layer",
     lambda c: "LayerNorm (mean subtracted, with a bias) instead of RMSNorm (2017)"),
    (lambda c: c.block == "post_ln",
     lambda c: "post-LN: LayerNorm of each residual sum, after the branch (2017)"),
    (lambda c: c.mlp == "plain",
     lambda c: f"plain FFN: down({c.activation}(up(x))), no gate (as in 2017)"),
    (lambda c: c.moe is not None,
     lambda c: "mixture of experts: a router sends each token to a few FFNs"),
    (lambda c: c.mla is not None,
     lambda c: "latent attention (MLA): the cache holds one compressed latent per token"),
    (lambda c: c.attention_sinks,
     lambda c: "attention sinks: a learned logit per head takes a share of attention"),
    (lambda c: c.positions == "sinusoidal",
     lambda c: "sinusoidal positions added to the embeddings, no RoPE (2017)"),
    (lambda c: c.norm == "offset",
     lambda c: "offset RMSNorm: the checkpoint stores w − 1, the gain is (1 + w) (Gemma)"),
    (lambda c: c.block == "sandwich",
     lambda c: "sandwich norms: each branch normed on the way in and on the way out (4 norms)"),
    (lambda c: c.block == "post",
     lambda c: "post-norm: no norm on the way in, each branch's output normed before the add"),
    (lambda c: c.mlp != "plain" and c.activation != "silu",
     lambda c: f"GeGLU: the gate path uses {c.activation}, not SiLU"),
    (lambda c: c.fused_proj,
     lambda c: "fused projections: one qkv_proj and one gate_up_proj matmul (Phi-3)"
     if c.moe is None else "fused projections: one qkv_proj matmul (DBRX's Wqkv)"),
    (lambda c: c.qk_norm is not None,
     lambda c: "q/k RMSNorm " + ("per head" if c.qk_norm == "head" else "over the projection")),
    (lambda c: c.attn_softcap is not None,
     lambda c: f"attention logits soft-capped: {c.attn_softcap:g}·tanh(s / {c.attn_softcap:g})"),
    (lambda c: c.final_softcap is not None,
     lambda c: f"final logits soft-capped at {c.final_softcap:g}"),
    (lambda c: c.attn_scale is not None,
     lambda c: f"attention scale {c.attn_scale:.6g} instead of 1/√head_dim"),
    (lambda c: c.embed_scale != 1.0,
     lambda c: f"embeddings multiplied by {c.embed_scale:.6g}"),
    (lambda c: c.residual_scale != 1.0,
     lambda c: f"each branch multiplied by {c.residual_scale:g} before the add"),
    (lambda c: c.logits_divisor != 1.0,
     lambda c: f"logits divided by {c.logits_divisor:g}"),
    (lambda c: c.qkv_bias, lambda c: "biases on the q, k, v projections"),
    (lambda c: any(s.window is not None for s in c.layers),
     lambda c: f"sliding-window attention on {sum(s.window is not None for s in c.layers)}"
               f" of {len(c.layers)} layers"),
    (lambda c: c.positions == "rope" and any(s.rope is None for s in c.layers if s.attends),
     lambda c: f"no RoPE (NoPE) on {sum(s.rope is None for s in c.layers if s.attends)}"
               " attention layers"),
    (lambda c: c.recurrent_layers > 0,
     lambda c: f"recurrent layers: {c.recurrent_layers} of {len(c.layers)} keep a fixed-size"
               f" state ({', '.join(sorted({MIXER_NAMES[s.mixer] for s in c.layers if s.mixer}))})"
               + (" beside K/V" if any(s.mixer and s.attends for s in c.layers)
                  else " instead of K/V")),
    (lambda c: c.positions == "none", lambda c: "no positions at all: attention without RoPE"),
    (lambda c: c.rope.type != "default", lambda c: f"{c.rope.type} RoPE scaling"),
    (lambda c: c.rope.partial_rotary_factor < 1,
     lambda c: f"partial rotary: {c.rope.rotary_dims(c.head_dim)} of {c.head_dim} dims"),
)

PIPELINES = {
    "pre": ["x", "norm", "RoPE", "attention", "+", "norm", "FFN", "+"],
    "sandwich": ["x", "norm", "RoPE", "attention", "norm", "+", "norm", "FFN", "norm", "+"],
    "post": ["x", "RoPE", "attention", "norm", "+", "FFN", "norm", "+"],
    "post_ln": ["x + sinusoid", "attention", "+", "LayerNorm", "FFN", "+", "LayerNorm"],
    "parallel": ["x", "norm", "RoPE", "attention ∥ FFN", "+"],
    "parallel2": ["x", "norm ∥ norm", "RoPE", "attention ∥ FFN", "+"],
    "mixer_only": ["x", "norm", "mixer", "+"],
    "parallel_mixer": ["x", "norm", "RoPE", "attention ∥ mixer", "+", "norm", "FFN", "+"],
    "shared_block": ["x", "[x, embeddings]", "shared block", "linear", "+", "norm", "mixer", "+"],
}
PLACEMENTS = {
    "pre": "pre-norm: normed on the way into each branch, the residual stays un-normed",
    "sandwich": "sandwich: normed on the way into and out of each branch",
    "post": "post-norm: each branch's output normed before the residual add",
    "post_ln": "post-LN (2017): the residual sum itself is normed after each branch",
    "parallel": "parallel: attention and FFN read the same normed input, both added at once",
    "parallel2": "parallel: attention and FFN each read their own norm of x, added at once",
    "mixer_only": "one branch per layer: x + mixer(norm(x)), the mixer recurrent (Mamba),"
                  " attention or a feed-forward",
    "parallel_mixer": "attention and the recurrent mixer read the same normed input, both"
                      " added at once; then a pre-norm FFN",
    "shared_block": "x + mixer(norm(x)); some layers first add a shared transformer block's"
                    " output over [x, the embeddings] to the mixer's input",
}


def _rope_factors(rope: RopeConfig) -> dict[str, Any]:
    keys = {
        "linear": ("factor",), "dynamic": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                   "original_max_position_embeddings"),
        "yarn": ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings"),
        "longrope": ("original_max_position_embeddings",),
    }.get(rope.type, ())
    return {k: getattr(rope, k) for k in keys}


def _gated_ffn(cfg: ModelConfig) -> dict[str, str]:
    d, f, act = cfg.hidden_size, cfg.intermediate_size, cfg.activation
    return {"gate": f"gate_proj {d} → {f}, then {act} (the gate path only)",
            "value": f"up_proj {d} → {f} (no activation)",
            "output": f"down_proj {f} → {d} of {act}(gate) ⊙ up"}


def _plain_ffn(cfg: ModelConfig) -> dict[str, str]:
    d, f, act = cfg.hidden_size, cfg.intermediate_size, cfg.activation
    out = {"gate": "none (2017: no gated path)",
           "value": f"up_proj {d} → {f}, then {act}",
           "output": f"down_proj {f} → {d}"}
    if cfg.model_type == "kvchat2017":  # a model's 2017 block: its FFN widened 1.5x
        swiglu = round(f * 2 / 3)  # config.as_2017_block: intermediate_size * 3 // 2
        out["size"] = (f"{f} = 1.5 × the loaded model's SwiGLU width {swiglu}"
                       f" (the 2017 paper used 4 × d_model = {4 * d})")
        out["size_why"] = (f"so 2 matrices of {d} × {f} hold as many weights as SwiGLU's 3"
                           f" of {d} × {swiglu}")
    return out


def _pipeline(cfg: ModelConfig) -> list[str]:
    """The block's stages; in a hybrid whose layers share one block, the token mixer is
    attention in some layers and the recurrent mixer in the others."""
    stages = list(PIPELINES[cfg.block])
    if not any(s.rope is not None for s in cfg.layers):  # no layer rotates (Kimi Linear)
        stages = [st for st in stages if st != "RoPE"]
    mixer = next((s.mixer for s in cfg.layers if s.mixer is not None), None)
    if mixer is None or "attention" not in stages:
        return stages
    name = MIXER_NAMES[mixer]
    return [(f"attention or {name}" if cfg.attention_layers else name) if st == "attention"
            else st for st in stages]


def annotate(cfg: ModelConfig) -> dict[str, Any]:
    """Each stage of the block, from the resolved config."""
    h, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    kind = attention_name(cfg)  # MLA for latent attention, else named by G
    ffn = ("SwiGLU" if cfg.activation == "silu" else "GeGLU") if cfg.mlp != "plain" else (
        "ReLU FFN" if cfg.activation == "relu" else f"{cfg.activation} FFN")
    ropes = sorted({(s.rope.theta, s.rope.type) for s in cfg.layers if s.rope is not None})
    windows: dict[str, dict[str, Any]] = {}
    for i, s in enumerate(cfg.layers):
        if not s.attends:  # a recurrent or mixer-less layer: `recurrent_state` says what it keeps
            continue
        name = ("sliding" if s.window is not None else "global") + ("" if s.rope else " NoPE")
        row = windows.setdefault(name, {"kind": name, "window": s.window, "layers": []})
        row["layers"].append(i)
    scale = cfg.attn_scale if cfg.attn_scale is not None else hd**-0.5
    return {
        "pipeline": _pipeline(cfg),
        "differences_from_llama": [text(cfg) for when, text in DIFFERENCES if when(cfg)],
        "norm": {
            "kind": NORM_NAMES.get(cfg.norm, (cfg.norm, "w"))[0],
            "gain": NORM_NAMES.get(cfg.norm, (cfg.norm, "w"))[1],
            "eps": cfg.rms_norm_eps, "placement": cfg.block, "why": PLACEMENTS[cfg.block],
            "qk_norm": cfg.qk_norm,
        },
        "ffn": {
            "kind": ffn, "activation": cfg.activation, "hidden": cfg.hidden_size,
            "intermediate": cfg.intermediate_size, "fused": cfg.fused_proj,
            **(_gated_ffn(cfg) if cfg.mlp != "plain" else _plain_ffn(cfg)),
        },
        "positions": {
            "kind": "RoPE" if cfg.positions == "rope" else cfg.positions,
            "base": cfg.rope.theta, "scaling": cfg.rope.type,
            "factors": _rope_factors(cfg.rope),
            "rotary_dims": cfg.rope.rotary_dims(hd), "head_dim": hd,
            "bases": [{"base": b, "type": t} for b, t in ropes],
            "nope_layers": [i for i, s in enumerate(cfg.layers) if s.rope is None],
        },
        "attention": {
            "kind": kind, "name": ATTENTION_NAMES[kind], "query_heads": h, "kv_heads": kv,
            "G": kv, "queries_per_group": h // kv, "head_dim": hd, "scale": scale,
            "softcap": cfg.attn_softcap, "layer_kinds": list(windows.values()),
        },
    }


def what_if(cfg: ModelConfig, dtype_bytes: int, context: int) -> list[dict[str, Any]]:
    """The same model with MHA (G = query heads), its own G and MQA (G = 1) — for latent
    attention MHA, GQA and its latent — in bytes per token, at `context` and at the
    model's maximum (sliding windows counted): kv_math's attention table."""
    top = cfg.max_position_embeddings
    rows = []
    for now, most in zip(attention_table(cfg, dtype_bytes, context),
                         attention_table(cfg, dtype_bytes, top), strict=True):
        own = now.name.endswith("(this model)")
        rows.append({
            "name": now.name.removesuffix(" (this model)"), "G": now.kv_heads,
            "this_model": own, "bytes_per_token": now.bytes_per_token,
            "context": context, "bytes_at_context": now.bytes_at_context,
            "max_context": top, "bytes_at_max": most.bytes_at_context,
        })
    return rows


def _mixer_formulas(cfg: ModelConfig) -> tuple[str, str | None, str | None]:
    """(the conv state's shape, the recurrent state's, what the recurrent state is) as
    formulas with the model's numbers (state_config.py's `state_shapes`)."""
    m = cfg.mixer
    if isinstance(m, SsmConfig) and m.kind == "mamba":
        return (f"(K − 1) × inner = {m.conv_kernel - 1} × {m.inner}",
                f"inner × N = {m.inner} × {m.n}",
                "an N-wide state per feature of the selective scan")
    if isinstance(m, SsmConfig):
        return (f"(K − 1) × (inner + 2 × groups × N) = {m.conv_kernel - 1} ×"
                f" ({m.inner} + 2 × {m.groups} × {m.n})",
                f"heads × head_dim × N = {m.heads} × {m.head_dim} × {m.n}",
                "a head_dim × N state per head, SSD")
    if isinstance(m, DeltaConfig):
        return (f"(K − 1) × (2 × k_heads × k_dim + v_heads × v_dim) = {m.conv_kernel - 1} ×"
                f" (2 × {m.k_heads} × {m.k_dim} + {m.v_heads} × {m.v_dim})",
                f"v_heads × k_dim × v_dim = {m.v_heads} × {m.k_dim} × {m.v_dim}",
                f"a {m.k_dim} × {m.v_dim} matrix per value head, rewritten by the delta rule")
    if isinstance(m, RgLruConfig):
        return (f"(K − 1) × width = {m.conv_kernel - 1} × {m.width}", f"width = {m.width}",
                "one number per feature, decayed and refilled by the RG-LRU's gates")
    assert m is not None
    return f"(K − 1) × hidden = {m.kernel - 1} × {m.hidden}", None, None


def recurrent_state(cfg: ModelConfig, dtype_bytes: int, context: int) -> dict[str, Any] | None:
    """What one recurrent layer keeps (its conv state at `dtype_bytes`, its recurrent
    state in float32), the same at every token, against what one full-context attention
    layer of this model holds at `context` and at the model's maximum, and the context
    from which that attention layer holds more. None for a model without recurrent layers."""
    m = cfg.mixer
    layers = [i for i, s in enumerate(cfg.layers) if s.mixer is not None]
    if m is None or not layers:
        return None
    conv_shape, *rest = m.state_shapes()
    conv_elems = math.prod(conv_shape)
    rec_elems = sum(math.prod(shape) for shape in rest)
    per_layer = conv_elems * dtype_bytes + rec_elems * RECURRENT_BYTES
    conv_f, rec_f, rec_what = _mixer_formulas(cfg)
    kind = cfg.layers[layers[0]].mixer
    assert kind is not None
    top = cfg.max_position_embeddings
    attention = None
    if cfg.attention_layers:
        per_token = cached_widths(cfg).bytes_per_token(1, dtype_bytes)
        attention = {
            "bytes_per_token": per_token, "context": context,
            "bytes_at_context": per_token * context, "max_context": top,
            "bytes_at_max": per_token * top,
            # the first context at which one attention layer's K/V outgrows one state
            "more_from": per_layer // per_token + 1,
        }
    return {
        "kind": MIXER_NAMES[kind], "mixer": kind, "layers": layers,
        "conv": {"shape": list(conv_shape), "formula": conv_f, "elements": conv_elems,
                 "dtype_bytes": dtype_bytes, "bytes": conv_elems * dtype_bytes},
        "recurrent": None if rec_f is None else {
            "shape": list(rest[0]), "formula": rec_f, "what": rec_what,
            "elements": rec_elems, "dtype_bytes": RECURRENT_BYTES,
            "bytes": rec_elems * RECURRENT_BYTES},
        "bytes_per_layer": per_layer, "bytes": state_bytes(cfg, dtype_bytes),
        "attention_layer": attention,
    }


def explain(cfg: ModelConfig, *, dtype_bytes: int, context: int | None = None,
            model: Any = None, gap: int = DEFAULT_GAP, name: str = "",
            path: str = "") -> dict[str, Any]:
    """Everything `kvchat explain --json` prints and the Anatomy screen shows. `context`:
    the tokens in the cache now (default: the model's maximum); `model`: the loaded
    Transformer, whose own q and k show RoPE's relative property."""
    top = cfg.max_position_embeddings
    ctx = top if context is None else max(0, context)
    first = _first_rope_layer(cfg)
    model_rope = cfg.layers[first].rope if first is not None else None
    model_dials = None
    if model_rope is not None:
        model_dials = rope_dials(model_rope.rotary_dims(cfg.head_dim), model_rope, gap)
    silu = activation_minimum("silu")
    kinds = kv_bytes_by_kind(cfg, ctx, dtype_bytes)
    # the worked norm uses the model's own eps (a config without one: the seed's)
    eps = cfg.rms_norm_eps if cfg.rms_norm_eps and cfg.rms_norm_eps > 0 else None
    return {
        "model": {"name": name, "path": path, "architecture": cfg.model_type,
                  "layers": cfg.num_hidden_layers,
                  # each layer's kind (model/cache/layer_kinds.py), as Ctrl+L names it
                  "layer_kinds": layer_kinds(cfg)},
        "kernels": metal_kernels.backend(),
        "block": annotate(cfg),
        "worked": {
            "norms": {**norm_demo(eps=eps or SEED_EPS),
                      "eps_from": "model" if eps else "seed"},
            "rope_seed": rope_dials(SEED_ROPE_DIMS, RopeConfig(theta=SEED_ROPE_BASE), gap),
            "rope_model": model_dials,
            "rope_relative": relative_demo(cfg, model),
            "silu_minimum": silu,
            # a learned activation (xIELU) has no fixed curve to minimise
            "activation_minimum": silu if cfg.activation == "silu"
            else activation_minimum(cfg.activation) if cfg.activation in ACTIVATIONS else None,
            "cache_70b": cache_figures(**LLAMA_70B, contexts=CONTEXTS_70B),
            # the layers that attend (a hybrid's recurrent layers hold no K/V)
            "cache_model": {
                **cache_figures(cfg.attention_layers, cfg.num_attention_heads,
                                cfg.num_key_value_heads, cfg.head_dim, dtype_bytes,
                                (ctx, top)),
                # what this model's cache holds per token (latent attention: its latent)
                "bytes_per_token": cached_widths(cfg).bytes_per_token(cfg.attention_layers,
                                                                      dtype_bytes),
                "layer_kinds": [{"kind": r.kind, "layers": r.layers, "window": r.window,
                                 "tokens": r.tokens, "bytes": r.bytes} for r in kinds],
                "bytes_at_context": kv_bytes_at(cfg, ctx, dtype_bytes),
                "bytes_at_max": kv_bytes_at(cfg, top, dtype_bytes),
            },
        },
        "recurrent": recurrent_state(cfg, dtype_bytes, ctx),
        "what_if": what_if(cfg, dtype_bytes, ctx),
    }


# ---- text (the CLI and the Anatomy screen) ------------------------------------------------
def _v(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:+.3f}" for x in xs) + "]"


def _dial_lines(d: dict[str, Any], limit: int = 8) -> list[str]:
    lines = [f"  d = {d['dims']}, base {d['base']:g}, {d['type']}: {d['formula']},"
             f" gap {d['gap']}"]
    pairs = d["pairs"]
    shown = pairs if len(pairs) <= limit else pairs[: limit // 2] + pairs[-limit // 2 :]
    for r in shown:
        if len(pairs) > limit and r is shown[limit // 2]:
            lines.append(f"    … {len(pairs) - limit} more pairs")
        lines.append(f"    i={r['i']:<3} θ={r['theta']:.6g}  wavelength {r['wavelength']:.4g}"
                     f" tokens  cos({d['gap']}θ)={r['cos_gap']:+.4f}")
    return lines


def text_sections(data: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(title, lines) per section of an explain() dict."""
    b, w = data["block"], data["worked"]
    m = data["model"]
    n, f, p, a = b["norm"], b["ffn"], b["positions"], b["attention"]
    diffs = b["differences_from_llama"] or ["none: this is the Llama block"]
    out: list[tuple[str, list[str]]] = [
        (f"{m['name'] or m['architecture']}: the decoder block ({m['layers']} layers,"
         f" kernels: {data['kernels']})",
         ["  " + " → ".join(b["pipeline"])] + _kind_lines(m.get("layer_kinds") or [])
         + ["  differences from the Llama block:"] + [f"    · {d}" for d in diffs]),
        ("norm", [f"  {n['kind']} (gain {n['gain']}), eps {n['eps']:g}", f"  {n['why']}"]
         + ([f"  q/k norm: {n['qk_norm']}"] if n["qk_norm"] else [])),
        ("FFN", [f"  {f['kind']}" + (" (one fused gate_up_proj)" if f["fused"] else ""),
                 f"  gate:   {f['gate']}", f"  value:  {f['value']}",
                 f"  output: {f['output']}"]
         + ([f"  size:   {f['size']}", f"          {f['size_why']}"] if f.get("size")
            else [])),
        ("positions", [f"  {p['kind']} positions added to the embeddings, no RoPE"]
         if p["kind"] != "RoPE" else [
            f"  RoPE base {p['base']:g}, scaling {p['scaling']}"
            + (f" {p['factors']}" if p["factors"] else ""),
            f"  rotates {p['rotary_dims']} of head_dim {p['head_dim']}"]
            + (["  bases per layer kind: " + ", ".join(
                f"{r['base']:g} ({r['type']})" for r in p["bases"])] if len(p["bases"]) > 1
               else [])
            + ([f"  layers without RoPE: {p['nope_layers']}"] if p["nope_layers"] else [])),
        ("attention", [
            f"  {a['kind']} ({a['name']}): {a['query_heads']} query heads, G = {a['G']} K/V"
            f" heads, {_count(a['queries_per_group'], 'query', 'queries')} per group,"
            f" head_dim {a['head_dim']}",
            f"  scale {a['scale']:.6g}" + (f", soft-cap {a['softcap']:g}" if a["softcap"] else "")]
            + [f"  {k['kind']}: layers {k['layers']}"
               + (f", window {k['window']}" if k["window"] else "") for k in a["layer_kinds"]]),
    ]
    if data.get("recurrent"):
        out.append(("recurrent layers: a state of fixed size", _recurrent_lines(data["recurrent"])))
    nd = w["norms"]
    out.append(("worked: RMSNorm vs LayerNorm", [
        f"  x = {_v(nd['x'])}, γ = 1, eps {nd['eps']:g}"
        + (" (the model's)" if nd.get("eps_from") == "model" else ""),
        f"  RMSNorm   {_v(nd['rmsnorm']['y'])}  mean {nd['rmsnorm']['mean']:+.4f}"
        f"  RMS {nd['rmsnorm']['rms']:.4f}   {nd['rmsnorm']['formula']}",
        f"  LayerNorm {_v(nd['layernorm']['y'])}  mean {nd['layernorm']['mean']:+.4f}"
        f"  RMS {nd['layernorm']['rms']:.4f}   {nd['layernorm']['formula']}",
        "  LayerNorm centres (mean ≈ 0); RMSNorm only rescales to unit RMS",
    ]))
    rope_lines = _dial_lines(w["rope_seed"])
    if w["rope_model"]:
        rope_lines += ["  the loaded model:"] + _dial_lines(w["rope_model"])
    rel = w["rope_relative"]
    if rel:
        (a1, a2) = rel["pairs"]
        rope_lines.append(
            f"  q·k at ({a1['q_pos']}, {a1['k_pos']}) = {a1['dot']:.6g}, at ({a2['q_pos']},"
            f" {a2['k_pos']}) = {a2['dot']:.6g}: difference {rel['difference']:.2g}"
            f" ({'equal' if rel['equal'] else 'NOT equal'} within {rel['tolerance']:.1g};"
            f" {rel['source']})")
    out.append(("worked: RoPE dials", rope_lines))
    s, am = w["silu_minimum"], w["activation_minimum"]
    act = [f"  SiLU(x) = x·σ(x): minimum {s['y']:.4f} at x = {s['x']:.4f}"]
    if am is not None and am["activation"] != "silu":
        act.append(f"  {am['activation']}: minimum {am['y']:.4f} at x = {am['x']:.4f}")
    out.append(("worked: the gate activation", act))
    c70, cm = w["cache_70b"], w["cache_model"]
    out.append(("worked: KV cache", [
        f"  70B-class: 2 × {c70['layers']} layers × {c70['kv_heads']} KV heads ×"
        f" {c70['head_dim']} × {c70['dtype_bytes']} B = {c70['bytes_per_token']:,} B/token",
        *(f"    at {r['context']:,} tokens: {human_bytes(r['bytes'])}"
          f" (MHA {human_bytes(r['mha_bytes'])})" for r in c70["at"]),
        "    the same wiring at G = " + ", ".join(
            f"{r['G']} ({r['name']}: {r['bytes_per_token']:,} B/token)" for r in c70["wiring"]),
        f"  this model ({_count(cm['layers'], 'layer', 'layers')}"
        f"{_that_attend(cm['layers']) if cm['layers'] != m['layers'] else ''},"
        f" G = {cm['kv_heads']},"
        f" head_dim {cm['head_dim']},"
        f" {cm['dtype_bytes']} B): {cm['bytes_per_token']:,} B/token",
        f"    at {cm['at'][0]['context']:,} tokens: {human_bytes(cm['bytes_at_context'])}"
        + (" (its maximum context)" if cm["at"][0]["context"] == cm["at"][1]["context"] else
           f", at {cm['at'][1]['context']:,} (its maximum): {human_bytes(cm['bytes_at_max'])}"),
    ]))
    out.append(("what if: the same model with another G", _what_if_lines(data["what_if"])))
    return out


def _kind_lines(kinds: list[str]) -> list[str]:
    """One line naming the layers of each kind, where a model has more than one."""
    line = kinds_line(kinds)
    return [f"  layers: {line}"] if line else []


def _recurrent_lines(r: dict[str, Any]) -> list[str]:
    """A recurrent layer's state from its formula, and what an attention layer of the
    same model holds instead (docs/explain.md, "Recurrent layers")."""
    c, rec = r["conv"], r["recurrent"]
    n = len(r["layers"])
    keeps = ("each keeps only the last K − 1 inputs of its convolution" if rec is None
             else "each folds every token into the same numbers, keeping no token itself")
    lines = [f"  {r['kind']} on {_count(n, 'layer', 'layers')} ({layer_ranges(r['layers'])}):"
             f" {keeps}",
             f"  conv state:      {c['formula']} = {c['elements']:,} values ×"
             f" {c['dtype_bytes']} B = {c['bytes']:,} B"]
    if rec is not None:
        lines.append(f"  recurrent state: {rec['formula']} = {rec['elements']:,} float32 ="
                     f" {rec['bytes']:,} B ({rec['what']})")
    lines.append(f"  per layer {r['bytes_per_layer']:,} B; {_count(n, 'layer', 'layers')}:"
                 f" {human_bytes(r['bytes'])}, the same at every context length")
    a = r["attention_layer"]
    if a is None:
        lines.append("  no layer attends: nothing grows with the context")
        return lines
    at_ctx = (f"at {a['context']:,} tokens {human_bytes(a['bytes_at_context'])}"
              if a["context"] != a["max_context"] else "")
    lines.append(
        f"  one attention layer of this model instead: {a['bytes_per_token']:,} B/token, "
        + (f"{at_ctx}, " if at_ctx else "")
        + f"at {a['max_context']:,} (its maximum) {human_bytes(a['bytes_at_max'])};"
        f" it holds more than a {r['kind']} state from {a['more_from']:,} tokens")
    return lines


def _that_attend(n: int) -> str:
    return " that attends" if n == 1 else " that attend"


def _count(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def _what_if_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The what-if table: bytes per token, at the context and at the model's maximum (one
    column when they are the same context)."""
    if not rows:
        return []
    both = rows[0]["context"] != rows[0]["max_context"]
    head = f"  {'':4}{'G':>4} {'B/token':>10} {'at ' + format(rows[0]['context'], ','):>14}"
    if both:
        head += f" {'at ' + format(rows[0]['max_context'], ',') + ' (max)':>20}"
    else:
        head += " (the maximum context)"
    return [head] + [
        f"  {r['name']:4}{r['G']:>4} {r['bytes_per_token']:>10,}"
        f" {human_bytes(r['bytes_at_context']):>14}"
        + (f" {human_bytes(r['bytes_at_max']):>20}" if both else "")
        + ("  ← this model" if r["this_model"] else "") for r in rows]


def render_text(data: dict[str, Any]) -> str:
    lines: list[str] = []
    for title, body in text_sections(data):
        lines += [title, *body, ""]
    return "\n".join(lines).rstrip() + "\n"

"""How a quantized K/V cache stores a token: bits, group size along head_dim, padding.

The setting itself, light (no MLX): the CLI, settings and the K/V arithmetic read it;
`kv_quant.py` packs and attends with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.model.errors import KVChatError

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


class KVQuantError(KVChatError):
    """A K/V quantization setting mx.quantize cannot do."""


@dataclass(frozen=True)
class KVQuant:
    """`bits` per element in groups of `group_size` along head_dim; quantize once the
    cache holds `start` tokens (mlx-lm's quantized_kv_start; 0 = from the first token).
    `group_size` None picks 64 or 32 per head_dim (`group_for`)."""

    bits: int
    group_size: int | None = None
    start: int = 0

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise KVQuantError(f"--kv-bits must be 4 or 8, got {self.bits}")
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise KVQuantError(f"--kv-group-size must be 32, 64 or 128, got {self.group_size}")
        if self.start < 0:
            raise KVQuantError(f"--quantized-kv-start must be >= 0, got {self.start}")

    def group_for(self, head_dim: int) -> int:
        if self.group_size is not None:
            return self.group_size
        return 64 if head_dim % 64 == 0 else 32

    def padded_dim(self, head_dim: int) -> int:
        g = self.group_for(head_dim)
        return -(-head_dim // g) * g

    def row_bytes(self, head_dim: int, scale_bytes: int) -> int:
        """Bytes of one token's head_dim features, stored: the packed bits of the padded
        row, plus a scale and a bias (at `scale_bytes`, the compute dtype) per group."""
        dim = self.padded_dim(head_dim)
        return dim * self.bits // 8 + 2 * (dim // self.group_for(head_dim)) * scale_bytes

    def describe(self, head_dim: int) -> str:
        pad = self.padded_dim(head_dim)
        extra = f", head_dim {head_dim} padded to {pad}" if pad != head_dim else ""
        return f"{self.bits}-bit, group {self.group_for(head_dim)}{extra}"


def kv_quant(bits: int | None, group_size: int | None = None, start: int = 0) -> KVQuant | None:
    """The setting from the CLI / settings values: None when bits is None (float cache)."""
    return None if bits is None else KVQuant(bits, group_size, start)

"""The K/V quantization flags (--kv-bits, --kv-group-size, --quantized-kv-start), shared
by every face that makes a cache: generate, bench, inspect, serve."""

from __future__ import annotations

import argparse

from kvchat.app.core.errors import UsageError
from kvchat.model.decoder.kv_format import BITS, GROUP_SIZES, KVQuant, kv_quant
from kvchat.model.errors import KVChatError


def add_kv_arguments(p: argparse.ArgumentParser, start: bool = True) -> None:
    """--kv-bits / --kv-group-size (and --quantized-kv-start where a run fills a cache)."""
    p.add_argument("--kv-bits", type=int, choices=BITS, default=None, metavar="{4,8}",
                   help="store the K/V cache in 4 or 8 bits (default: the float dtype)")
    p.add_argument("--kv-group-size", type=int, choices=GROUP_SIZES, default=None,
                   metavar="{32,64,128}", help="elements sharing a scale and bias (default:"
                   " 64 where head_dim allows, else 32; head_dim is padded to the group)")
    if start:
        p.add_argument("--quantized-kv-start", type=int, default=0, metavar="N",
                       help="keep K/V in floats until the cache holds N tokens (default 0)")


def kv_quant_from_args(args: argparse.Namespace) -> KVQuant | None:
    """The K/V quantization the flags ask for; UsageError when it cannot be done."""
    start = getattr(args, "quantized_kv_start", 0) or 0
    if args.kv_bits is None and (args.kv_group_size is not None or start):
        raise UsageError("--kv-group-size and --quantized-kv-start need --kv-bits 4 or 8")
    try:
        return kv_quant(args.kv_bits, args.kv_group_size, start)
    except KVChatError as e:
        raise UsageError(str(e)) from None

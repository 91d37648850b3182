"""What the saved K/V cache's checksum (model/cache/integrity.checksum) costs, against
plain sha256 of the same bytes, and what the model fingerprint's full-file hash costs the
first time and again (a stat per file): python -m tests.benchmarks.cache_checksum"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from kvchat.model.cache import integrity
from kvchat.model.cache.integrity import checksum


def main() -> None:
    for mib in (16, 128):
        per = mib * 2**20 // 4 // 4  # float32 values per array, 4 arrays
        arrays = {f"{i}.0": mx.random.normal((1, 8, per // (8 * 128), 128)) for i in range(4)}
        mx.eval(list(arrays.values()))
        total = sum(a.nbytes for a in arrays.values()) / 2**20
        t = time.perf_counter()
        checksum(arrays, {"0.kvchat_ids": "[1, 2, 3]"})
        ours = time.perf_counter() - t
        raw = [bytes(memoryview(a)) for a in arrays.values()]
        t = time.perf_counter()
        h = hashlib.sha256()
        for b in raw:
            h.update(b)
        plain = time.perf_counter() - t
        print(f"{total:.0f} MiB: checksum {ours * 1e3:.0f} ms ({total / ours:.0f} MiB/s),"
              f" plain sha256 {plain * 1e3:.0f} ms ({total / plain:.0f} MiB/s)")
    with tempfile.TemporaryDirectory() as d:
        weights = Path(d) / "model.safetensors"
        mib = 512
        with open(weights, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(2**20))
        t = time.perf_counter()
        integrity.file_digest(weights)
        first = time.perf_counter() - t
        t = time.perf_counter()
        integrity.file_digest(weights)
        again = time.perf_counter() - t
        print(f"fingerprint of a {mib} MiB weight file: first {first * 1e3:.0f} ms"
              f" ({mib / first:.0f} MiB/s, page cache warm), again {again * 1e6:.0f} µs")


if __name__ == "__main__":
    main()

"""What the saved K/V cache's checksum (model/cache_integrity.checksum) costs, against
plain sha256 of the same bytes, in one run: python -m tests.benchmarks.cache_checksum"""

from __future__ import annotations

import hashlib
import time

import mlx.core as mx

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


if __name__ == "__main__":
    main()

"""Checksum speed on this machine: XXH3-64 (xxhash, what `serve_rft.weights.verify` uses for the
bytes of a version) against zlib's CRC-32, over one buffer in memory (best of ``--reps``).

    .venv/bin/python benchmarks/checksum_speed.py --out benchmarks/results/checksum_speed.json
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from pathlib import Path

import numpy as np
import xxhash

from provenance import record  # benchmarks/ (the script's folder)


def gbps(fn, data, reps: int) -> float:
    """Bytes of ``data`` / the best of ``reps`` timings of ``fn(data)``, in GB/s."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(data)
        best = min(best, time.perf_counter() - t0)
    return data.nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", type=int, default=1 << 30, help="buffer size, bytes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/checksum_speed.json")
    a = ap.parse_args()
    data = np.random.default_rng(0).integers(0, 256, size=a.bytes, dtype=np.uint8)
    rows = {"xxh3_64": round(gbps(xxhash.xxh3_64_hexdigest, data, a.reps), 2),
            "crc32_zlib": round(gbps(zlib.crc32, data, a.reps), 2)}
    out = {**record(),
           "bytes": a.bytes, "reps": a.reps, "gb_per_s": rows}
    print(json.dumps(out))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

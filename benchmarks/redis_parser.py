"""The Python client's CPU per Redis call with hiredis (C) and redis-py's own (Python) RESP3 parser.

One fresh embedded redis-server (``everysec``); in alternating rounds, one asyncio client per
parser (``parser_class``: redis-py's ``_AsyncHiredisParser`` or ``_AsyncRESP3Parser``) makes the
same calls, one at a time, and the Python process's CPU per call is reported (median over the
rounds):

- ``xrange_256``: one page of 256 ready entries of the shape the trainer reads (an experience's
  2,000-byte JSON, reward, member, prompt_ref, v);
- ``log_batch_16``: one script call the size of a LOG batch of 16 one-choice completions
  (35,000 bytes of arguments) answered with 16 integers;
- ``ping``: the fixed cost of a call.

    .venv/bin/python benchmarks/redis_parser.py [--rounds 5] [--calls 300]
        [--out benchmarks/results/redis_parser.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis
from redis._parsers import _AsyncHiredisParser, _AsyncRESP3Parser

from serve_rft.buffer.redis_server import start_redis

from provenance import record  # benchmarks/ (the script's folder)

PARSERS = {"hiredis": _AsyncHiredisParser, "python": _AsyncRESP3Parser}


async def cpu_per_call(url: str, parser, calls: int) -> dict:
    """Python CPU per call in µs for each kind of call, with ``parser``."""
    r = aioredis.Redis.from_url(url, protocol=3, parser_class=parser)
    batch = r.register_script("local out = {} for j = 1, 16 do out[j] = 1 end return out")
    kinds = {
        "xrange_256": lambda: r.xrange("bench:ready", count=256),
        "log_batch_16": lambda: batch(args=["bench", 600, 3600, 64, "x" * 35_000]),
        "ping": lambda: r.ping(),
    }
    out = {}
    for name, call in kinds.items():
        await call()  # (connection, script load)
        t0 = time.process_time()
        for _ in range(calls):
            await call()
        out[name] = 1e6 * (time.process_time() - t0) / calls
    await r.aclose()
    return out


async def fill(url: str) -> None:
    r = aioredis.Redis.from_url(url, protocol=3)
    for i in range(256):
        await r.xadd("bench:ready", {"exp": "x" * 2000, "reward": "1.0", "member": f"chatcmpl-{i}:0",
                                     "prompt_ref": f"chatcmpl-{i}", "v": "3"})
    await r.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=300, help="calls of each kind per round and parser")
    ap.add_argument("--out", default="benchmarks/results/redis_parser.json")
    a = ap.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = start_redis(Path(tmp) / "redis", appendfsync="everysec")
        try:
            asyncio.run(fill(server.url))
            for k in range(a.rounds):
                order = list(PARSERS) if k % 2 == 0 else list(reversed(PARSERS))
                for name in order:
                    row = {"round": k + 1, "parser": name, **asyncio.run(cpu_per_call(server.url, PARSERS[name], a.calls))}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        finally:
            server.stop()
    kinds = [k for k in rows[0] if k not in ("round", "parser")]
    summary = {p: {k: statistics.median(r[k] for r in rows if r["parser"] == p) for k in kinds} for p in PARSERS}
    out = {**record(), "args": vars(a), "unit": "µs of Python CPU per call",
           "median": summary, "rounds": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

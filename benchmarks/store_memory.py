"""Redis memory per logged completion: ``used_memory`` growth and keys per one-choice completion
(40 prompt + 64 response tokens with logprobs, the experience of `store_throughput.py`), for the
working tree's ``serve_rft`` and, with ``--before REV``, for another git revision's (``git
archive REV serve_rft``, first on ``PYTHONPATH`` of a child process), each on its own fresh
embedded redis-server; also each of one completion's own keys with its encoding and ``MEMORY
USAGE``; and the same with the tenants' ledger kept (``with_tenant_ledger``: what a configured
``per_tenant.max_stored_bytes`` costs, `serve_rft.buffer.ledger`).

    .venv/bin/python benchmarks/store_memory.py [--completions 5000] [--before REV]
        [--out benchmarks/results/store_memory.json]

With ``--before`` the result names the earlier code by REV: a record of a change, kept out of
``benchmarks/results/`` (tests/unit/test_results.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import serve_rft
from serve_rft.buffer.redis_server import start_redis
from serve_rft.buffer.store import ExperienceStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import code_version, command, date, machine  # noqa: E402  (benchmarks/, the script's folder)
from other_revision import env_importing, export  # noqa: E402
from store_throughput import _experience  # noqa: E402


async def _grow(url: str, completions: int, tenant_ledger: bool = False) -> dict:
    s = ExperienceStore(url, prefix="mem", tenant_ledger=tenant_ledger)
    await s.log_experiences([_experience("chatcmpl-warm", 0, 40, 64)])  # loads the script
    m0, k0 = int((await s.redis.info("memory"))["used_memory"]), await s.redis.dbsize()
    for j in range(0, completions, 100):
        await asyncio.gather(*(s.log_experiences([_experience(f"chatcmpl-{i}", 0, 40, 64)])
                               for i in range(j, min(j + 100, completions))))
    m1, k1 = int((await s.redis.info("memory"))["used_memory"]), await s.redis.dbsize()
    keys = sorted(await s.redis.keys("mem:*:chatcmpl-0*"))  # one completion's own keys
    per_key = {k: {"encoding": await s.redis.object("encoding", k), "memory_usage_bytes": await s.redis.memory_usage(k)}
               for k in keys}
    await s.close()
    return {"code_version": code_version(Path(serve_rft.__file__).resolve().parents[1]), "completions": completions,
            "used_memory_bytes_per_completion": (m1 - m0) / completions, "keys_per_completion": (k1 - k0) / completions,
            "one_completions_keys": per_key}


def measure(completions: int, tenant_ledger: bool = False) -> dict:
    """One fresh redis-server (``everysec``), ``completions`` logged 100 at a time (by a store
    that keeps the tenants' ledger, with ``tenant_ledger``: `serve_rft.buffer.ledger`)."""
    with tempfile.TemporaryDirectory() as tmp:
        server = start_redis(Path(tmp) / "redis", appendfsync="everysec")
        try:
            return asyncio.run(_grow(server.url, completions, tenant_ledger))
        finally:
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--completions", type=int, default=5000)
    ap.add_argument("--before", help="git revision to measure too")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="benchmarks/results/store_memory.json")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.completions)))
        return
    now = measure(a.completions)
    out: dict = {"command": command(), "machine": machine(), "code_version": now["code_version"], "date": date(),
                 "now": now, "with_tenant_ledger": measure(a.completions, tenant_ledger=True)}
    if a.before:
        with tempfile.TemporaryDirectory() as tmp:
            child = subprocess.run([sys.executable, __file__, "--child", "--completions", str(a.completions)],
                                   env=env_importing(export(a.before, Path(tmp))), check=True,
                                   capture_output=True, text=True)
            out["before"] = json.loads(child.stdout.strip().splitlines()[-1])
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

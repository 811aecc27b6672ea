"""What a Lua script's arguments cost Redis: a script that only returns, called with growing arguments.

One fresh embedded redis-server (``everysec``); ``EVALSHA`` of ``return 1`` with one argument of
each size, ``--calls`` calls per size; Redis's microseconds per call from ``INFO commandstats``
(``cmdstat_evalsha``, reset before each size), with ``ECHO`` of the same argument beside it (what
the command itself costs without Lua). What one LOG call's 35 KB of arguments cost before its
script does anything (`serve_rft/buffer/scripts.py`).

    .venv/bin/python benchmarks/script_args.py [--calls 1000] [--out benchmarks/results/script_args.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import redis

from serve_rft.buffer.redis_server import start_redis

from provenance import record  # benchmarks/ (the script's folder)

SIZES = (1_000, 8_000, 35_000, 70_000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--out", default="benchmarks/results/script_args.json")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = start_redis(Path(tmp) / "redis", appendfsync="everysec")
        try:
            r = redis.Redis.from_url(server.url)
            sha = r.script_load("return 1")
            for size in SIZES:
                arg = "x" * size
                row = {"argument_bytes": size}
                for cmd, stat in ((("EVALSHA", sha, 0, arg), "cmdstat_evalsha"), (("ECHO", arg), "cmdstat_echo")):
                    r.config_resetstat()
                    for _ in range(a.calls):
                        r.execute_command(*cmd)
                    row[f"{cmd[0].lower()}_usec_per_call"] = float(r.info("commandstats")[stat]["usec_per_call"])
                print(json.dumps(row), flush=True)
                rows.append(row)
            r.close()
        finally:
            server.stop()
    out = {**record(), "args": vars(a), "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

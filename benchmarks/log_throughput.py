"""Experience logging against Redis's own XADD rate: the same payload, the same concurrency, side by side.

One freshly started embedded redis-server (AOF on, ``--durability always`` as the service runs it
by default, or ``everysec``: ``buffer.durability``), and in alternating rounds (A B, B A, ...):

A. ``redis-benchmark`` XADD of one field the size of one logged experience's JSON (the whole
   `Experience`, prompt included), ``--clients`` connections, no pipelining (``-P 1``): the
   ceiling of this Redis on this machine for that payload.
B. ``ExperienceStore.log_experiences`` with one choice (``n`` = 1), the call a replica's
   `serve_rft.explorer.engine.experience_log.ExperienceLog` awaits before a response ends, from
   ``--clients`` concurrent asyncio tasks in one Python process (as one replica serves
   concurrent requests): experiences logged per second, each acknowledged by Redis (and with
   ``always`` fsynced) before its call returns.

Both sides run against the same server with the same config; the keys are flushed between
rounds. Reported per round and as median / min / max over the rounds: both rates, their ratio,
the store's script calls and Redis's microseconds per call (``INFO commandstats``), Redis's CPU
and the Python process's CPU per 1,000 experiences, Redis's CPU per 1,000 XADDs; then the p50 / p99 of one call with 1 and
with ``--clients`` callers (2,000 calls each). ``--profile`` adds the Python side's top
functions by own time (cProfile, one extra round, not timed).

    .venv/bin/python benchmarks/log_throughput.py --rounds 3 --durability always --out always.json

(`benchmarks/results/log_throughput_always.json` and ``..._everysec.json`` are such runs.)

The store measured is the ``serve_rft`` package Python imports (its ``code_version`` in the JSON
is that package's): to measure another version of it, put that version's source first on
``PYTHONPATH`` (``git archive <rev> serve_rft | tar -x -C /tmp/rev`` and
``PYTHONPATH=/tmp/rev``).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import serve_rft
from serve_rft.buffer.redis_server import start_redis
from serve_rft.buffer.store import ExperienceStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from store_throughput import _experience  # (the same experience as the store benchmark)
from provenance import code_version, command, date, machine  # noqa: E402


def _redis_cpu_s(port: int) -> float:
    """redis-server's CPU seconds so far (INFO cpu: used_cpu_user + used_cpu_sys)."""
    text = subprocess.run(["redis-cli", "-p", str(port), "INFO", "cpu"], capture_output=True, text=True,
                          check=True).stdout
    return sum(float(v) for k, v in re.findall(r"(used_cpu_user|used_cpu_sys):([\d.]+)", text))


def xadd_rate(port: int, requests: int, clients: int, value_bytes: int) -> tuple[float, float]:
    """redis-benchmark's XADD with one ``value_bytes`` field, no pipelining: (requests per second,
    Redis's CPU per 1,000 requests in ms)."""
    cmd = ["redis-benchmark", "-p", str(port), "-n", str(requests), "-c", str(clients), "-P", "1", "-q",
           "XADD", "bench:stream", "*", "exp", "x" * value_bytes]
    cpu0 = _redis_cpu_s(port)
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    cpu = _redis_cpu_s(port) - cpu0
    return float(re.findall(r"([\d.]+) requests per second", text)[-1]), 1e6 * cpu / requests


async def _server_cpu(store: ExperienceStore) -> float:
    cpu = await store.redis.info("cpu")
    return cpu["used_cpu_user"] + cpu["used_cpu_sys"]


async def log_rate(url: str, calls: int, clients: int, prompt_tokens: int, response_tokens: int,
                   tag: str, profiler: cProfile.Profile | None = None) -> dict:
    """Experiences per second through `ExperienceStore.log_experiences` (``n`` = 1), ``clients``
    concurrent callers; every experience checked logged afterwards. ``profiler``: enabled
    around the logging calls only."""
    store = ExperienceStore(url, prefix=f"bench{tag}")
    exps = [[_experience(f"chatcmpl-{tag}-{k}", 0, prompt_tokens, response_tokens)] for k in range(calls)]
    await store.log_experiences([_experience(f"warm{tag}", 0, prompt_tokens, response_tokens)])  # load the script
    await store.redis.config_resetstat()
    cpu0, py0 = await _server_cpu(store), time.process_time()
    queue = list(reversed(exps))

    async def worker():
        while queue:
            await store.log_experiences(queue.pop())

    if profiler:
        profiler.enable()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    if profiler:
        profiler.disable()
    py_cpu = time.process_time() - py0
    cpu = await _server_cpu(store) - cpu0
    stats = await store.redis.info("commandstats")
    script = stats.get("cmdstat_evalsha", {"calls": 0, "usec_per_call": 0.0})
    logged = int(await store.redis.hget(f"bench{tag}:stat", "logged") or 0)
    await store.close()
    assert logged == calls + 1, (logged, calls)
    return {"experiences_per_s": calls / wall, "wall_s": wall, "script_calls": int(script["calls"]),
            "script_usec_per_call": float(script["usec_per_call"]),
            "redis_cpu_ms_per_1000": 1e6 * cpu / calls, "python_cpu_ms_per_1000": 1e6 * py_cpu / calls}


async def call_latency(url: str, calls: int, clients: int, prompt_tokens: int, response_tokens: int) -> dict:
    """p50 / p99 of one ``log_experiences`` call (``n`` = 1) with ``clients`` callers at once, ms:
    what logging adds to a request (the replica awaits it before the response ends)."""
    store = ExperienceStore(url, prefix=f"lat{clients}")
    queue = [[_experience(f"chatcmpl-lat{clients}-{k}", 0, prompt_tokens, response_tokens)] for k in range(calls)]
    await store.log_experiences([_experience(f"warmlat{clients}", 0, prompt_tokens, response_tokens)])
    lat: list[float] = []

    async def worker():
        while queue:
            exps = queue.pop()
            t0 = time.perf_counter()
            await store.log_experiences(exps)
            lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker() for _ in range(clients)))
    await store.close()
    lat.sort()
    return {"callers": clients, "calls": calls, "p50_ms": 1000 * lat[len(lat) // 2],
            "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


def profile_round(url: str, calls: int, clients: int, prompt_tokens: int, response_tokens: int) -> list[str]:
    """The Python side's top 15 functions by own time over one untimed round (cProfile)."""
    prof = cProfile.Profile()
    asyncio.run(log_rate(url, calls, clients, prompt_tokens, response_tokens, "profile", prof))
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
    return [line for line in out.getvalue().splitlines() if line.strip()][-16:]


def _summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10000, help="log_experiences calls per round")
    ap.add_argument("--bench-requests", type=int, default=50000, help="redis-benchmark -n per round")
    ap.add_argument("--clients", type=int, default=32, help="concurrent callers / connections, both sides")
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--response-tokens", type=int, default=64)
    ap.add_argument("--durability", choices=["everysec", "always"], default="always",
                    help="the AOF's appendfsync (buffer.durability), both sides")
    ap.add_argument("--profile", action="store_true", help="add cProfile's top functions of one extra round")
    ap.add_argument("--out", default="benchmarks/results/log_throughput_always.json")
    a = ap.parse_args()

    value_bytes = len(_experience("chatcmpl-size", 0, a.prompt_tokens, a.response_tokens).model_dump_json())
    load0 = os.getloadavg()[0]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        server = start_redis(Path(tmp) / "redis", appendfsync=a.durability)
        try:
            flush = ["redis-cli", "-p", str(server.port), "FLUSHALL"]
            for r in range(a.rounds):
                row: dict = {"round": r + 1, "order": "xadd first" if r % 2 == 0 else "store first"}
                for side in (("xadd", "store") if r % 2 == 0 else ("store", "xadd")):
                    subprocess.run(flush, check=True, capture_output=True)
                    if side == "xadd":
                        row["xadd_per_s"], row["xadd_redis_cpu_ms_per_1000"] = xadd_rate(
                            server.port, a.bench_requests, a.clients, value_bytes)
                    else:
                        row["store"] = asyncio.run(log_rate(server.url, a.calls, a.clients, a.prompt_tokens,
                                                           a.response_tokens, str(r)))
                row["ratio"] = row["store"]["experiences_per_s"] / row["xadd_per_s"]
                print(json.dumps(row), flush=True)
                rounds.append(row)
            subprocess.run(flush, check=True, capture_output=True)
            latency = [asyncio.run(call_latency(server.url, 2000, c, a.prompt_tokens, a.response_tokens))
                       for c in (1, a.clients)]
            print(json.dumps(latency), flush=True)
            subprocess.run(flush, check=True, capture_output=True)
            profile = (profile_round(server.url, a.calls, a.clients, a.prompt_tokens, a.response_tokens)
                       if a.profile else None)
        finally:
            server.stop()
    out = {
        "command": command(), "args": vars(a), "machine": machine(),
        "code_version": code_version(Path(serve_rft.__file__).resolve().parents[1]), "date": date(),
        "load_average_1min_at_start_and_end": [load0, os.getloadavg()[0]],
        "durability": a.durability,
        "clients": a.clients,
        "experience_json_bytes": value_bytes,
        "xadd_per_s": _summary([r["xadd_per_s"] for r in rounds]),
        "store_experiences_per_s": _summary([r["store"]["experiences_per_s"] for r in rounds]),
        "ratio": _summary([r["ratio"] for r in rounds]),
        "redis_cpu_ms_per_1000": _summary([r["store"]["redis_cpu_ms_per_1000"] for r in rounds]),
        "python_cpu_ms_per_1000": _summary([r["store"]["python_cpu_ms_per_1000"] for r in rounds]),
        "xadd_redis_cpu_ms_per_1000": _summary([r["xadd_redis_cpu_ms_per_1000"] for r in rounds]),
        "log_call_latency": latency,
        "rounds": rounds,
    }
    if profile:
        out["python_profile_tottime"] = profile
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("xadd_per_s", "store_experiences_per_s", "ratio")}, indent=2))


if __name__ == "__main__":
    main()

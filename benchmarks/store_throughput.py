"""Experience store throughput and the latency logging and rewards add to a request.

In one run, on one freshly started embedded redis-server (AOF on, ``--durability always`` as
the service runs it by default, or ``everysec``: ``buffer.durability``):

1. ``redis-benchmark`` raw rates: SET and XADD with a value the size of one logged experience,
   ``--clients`` connections, no pipelining: the ceiling of this Redis on this machine.
2. ``ExperienceStore.log_experiences`` (the LOG Lua script: experience JSON, choice state,
   group, pending deadline, counters) from one Python process with ``--clients`` concurrent
   asyncio tasks: experiences logged per second, for ``n`` = 1 and ``n`` = 4 answers per call.
3. ``ExperienceStore.post_reward`` (the REWARD script, which also releases groups to the ready
   stream) the same way: rewards posted per second.
4. Latency of one ``log_experiences`` call, p50/p99, with 1 and with ``--clients`` callers at
   once. The explorer awaits this call before it returns a non-streaming response (before the
   last chunk of a stream), so it is exactly the time logging adds to a request.
5. Latency of one ``post_reward`` call the same way: what the store adds to ``POST /v1/rewards``
   (with ``always`` it includes the AOF's fsync: Redis answers after it).

Compare the two durabilities on the same machine in one sitting (the fsync cost is the disk's).

One Python process drives the store, as one explorer replica does; redis-benchmark is C. The
experience is realistic for the embedded model's traffic: ``--prompt-tokens`` prompt ids and
``--response-tokens`` response ids with their logprobs.

    .venv/bin/python benchmarks/store_throughput.py --durability always --out runs/store_always.json

`store_durability.py` runs it in alternating rounds of both settings and writes the published
result (benchmarks/results/store_throughput_durability.json, every run in full inside).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import tempfile
import time
from pathlib import Path

from serve_rft.buffer.redis_server import start_redis
from serve_rft.buffer.store import ExperienceStore
from serve_rft.types import Experience, SamplingInfo

from provenance import code_version, command, date, machine  # benchmarks/ (the script's folder)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _experience(cid: str, i: int, prompt_tokens: int, response_tokens: int) -> Experience:
    rnd = random.Random(f"{cid}:{i}")
    return Experience(
        completion_id=cid, choice_index=i, group_id=cid, replica_id="bench",
        prompt_token_ids=[rnd.randrange(4000) for _ in range(prompt_tokens)],
        response_token_ids=[rnd.randrange(4000) for _ in range(response_tokens)],
        behaviour_logprobs=[-rnd.random() * 8 for _ in range(response_tokens)],
        token_versions=[(3, 0, response_tokens)],
        sampling=SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=response_tokens),
        finish_reason="length")


def redis_benchmark(port: int, requests: int, clients: int, value_bytes: int) -> dict[str, float]:
    """Requests per second of redis-benchmark's SET and of XADD with a ``value_bytes`` field."""
    out = {}
    base = ["redis-benchmark", "-p", str(port), "-n", str(requests), "-c", str(clients), "-q"]
    text = subprocess.run(base + ["-t", "set", "-d", str(value_bytes)], capture_output=True, text=True,
                          check=True).stdout
    out["SET"] = float(re.search(r"SET: ([\d.]+) requests per second", text).group(1))
    value = "x" * value_bytes
    text = subprocess.run(base + ["XADD", "bench:stream", "*", "exp", value], capture_output=True,
                          text=True, check=True).stdout
    out["XADD"] = float(re.search(r"([\d.]+) requests per second", text).group(1))
    return out


async def _run_concurrently(clients: int, jobs: list, fn) -> tuple[float, list[float]]:
    """Run ``fn(job)`` for every job with ``clients`` workers; (wall seconds, per-call seconds)."""
    queue = list(reversed(jobs))
    lat: list[float] = []

    async def worker():
        while queue:
            job = queue.pop()
            t0 = time.perf_counter()
            await fn(job)
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return time.perf_counter() - t0, lat


async def _server_cost(store: ExperienceStore, wall_s: float) -> dict:
    """Redis-side cost since the last reset: script calls, microseconds per call, and the share
    of the wall time the server was busy (used_cpu_user + used_cpu_sys) -- what is not the
    server is the Python client."""
    stats = await store.redis.info("commandstats")
    cpu = await store.redis.info("cpu")
    script = stats.get("cmdstat_evalsha", {"calls": 0, "usec_per_call": 0.0})
    busy = cpu["used_cpu_user"] + cpu["used_cpu_sys"]
    return {"script_calls": int(script["calls"]), "script_usec_per_call": float(script["usec_per_call"]),
            "server_cpu_s": busy, "server_busy_share": busy / wall_s if wall_s else None}


async def _reset(store: ExperienceStore) -> float:
    await store.redis.config_resetstat()
    cpu = await store.redis.info("cpu")
    return cpu["used_cpu_user"] + cpu["used_cpu_sys"]


async def store_rates(url: str, calls: int, clients: int, n: int, prompt_tokens: int,
                      response_tokens: int) -> dict:
    """Experiences logged/s and rewards posted/s through `ExperienceStore`, ``n`` per completion."""
    store = ExperienceStore(url, prefix=f"bench{n}")
    cids = [f"chatcmpl-{n}-{k}" for k in range(calls)]
    batches = {cid: [_experience(cid, i, prompt_tokens, response_tokens) for i in range(n)] for cid in cids}
    await store.log_experiences([_experience("warm", 0, prompt_tokens, response_tokens)])  # load scripts
    cpu0 = await _reset(store)
    wall_log, lat_log = await _run_concurrently(clients, cids, lambda cid: store.log_experiences(batches[cid]))
    log_cost = await _server_cost(store, wall_log)
    log_cost["server_cpu_s"] -= cpu0
    log_cost["server_busy_share"] = log_cost["server_cpu_s"] / wall_log
    rewards = [(cid, i) for cid in cids for i in range(n)]
    cpu0 = await _reset(store)
    wall_rw, _ = await _run_concurrently(clients, rewards, lambda ci: store.post_reward(ci[0], ci[1], 1.0))
    rw_cost = await _server_cost(store, wall_rw)
    rw_cost["server_cpu_s"] -= cpu0
    rw_cost["server_busy_share"] = rw_cost["server_cpu_s"] / wall_rw
    counts = await store.counts()
    await store.close()
    assert counts.logged == calls * n + 1 and counts.rewarded == calls * n and counts.ready == calls * n, counts
    return {"n": n, "completions": calls, "experiences": calls * n,
            "redis_log": log_cost, "redis_reward": rw_cost,
            "experiences_per_s": calls * n / wall_log, "log_calls_per_s": calls / wall_log,
            "rewards_per_s": len(rewards) / wall_rw,
            "log_call_p50_ms": 1000 * _pct(lat_log, 0.5), "log_call_p99_ms": 1000 * _pct(lat_log, 0.99)}


def _latency(clients: int, lat: list[float]) -> dict:
    return {"concurrent_callers": clients, "calls": len(lat),
            "p50_ms": 1000 * _pct(lat, 0.5), "p99_ms": 1000 * _pct(lat, 0.99), "mean_ms": 1000 * sum(lat) / len(lat)}


async def call_latency(url: str, calls: int, clients: int, prompt_tokens: int, response_tokens: int
                       ) -> tuple[dict, dict]:
    """p50/p99 of one ``log_experiences`` call (one answer), then of one ``post_reward`` call
    for each of them, with ``clients`` callers at once: (log latency, reward latency)."""
    store = ExperienceStore(url, prefix=f"lat{clients}")
    cids = [f"chatcmpl-lat{clients}-{k}" for k in range(calls)]
    exps = {cid: [_experience(cid, 0, prompt_tokens, response_tokens)] for cid in cids}
    _, lat = await _run_concurrently(clients, cids, lambda cid: store.log_experiences(exps[cid]))
    _, lat_rw = await _run_concurrently(clients, cids, lambda cid: store.post_reward(cid, 0, 1.0))
    await store.close()
    return _latency(clients, lat), _latency(clients, lat_rw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000, help="log_experiences calls per measurement")
    ap.add_argument("--clients", type=int, default=32, help="concurrent callers / connections")
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--response-tokens", type=int, default=64)
    ap.add_argument("--bench-requests", type=int, default=100000, help="redis-benchmark -n")
    ap.add_argument("--durability", choices=["everysec", "always"], default="always",
                    help="the AOF's appendfsync (buffer.durability)")
    ap.add_argument("--out", default="runs/store_throughput.json")
    a = ap.parse_args()

    one = _experience("chatcmpl-size", 0, a.prompt_tokens, a.response_tokens)
    value_bytes = len(one.model_dump_json())
    load0 = os.getloadavg()[0]  # other work on the machine: fsync and CPU timings vary with it
    with tempfile.TemporaryDirectory() as tmp:
        server = start_redis(Path(tmp) / "redis", appendfsync=a.durability)
        try:
            raw = redis_benchmark(server.port, a.bench_requests, a.clients, value_bytes)
            print("redis-benchmark", raw, flush=True)
            rates = [asyncio.run(store_rates(server.url, a.calls // n, a.clients, n, a.prompt_tokens,
                                             a.response_tokens)) for n in (1, 4)]
            for r in rates:
                print("store", r, flush=True)
            both = [asyncio.run(call_latency(server.url, 2000, c, a.prompt_tokens, a.response_tokens))
                    for c in (1, a.clients)]
            latency, reward_latency = [b[0] for b in both], [b[1] for b in both]
            for r in latency:
                print("log latency", r, flush=True)
            for r in reward_latency:
                print("reward latency", r, flush=True)
        finally:
            server.stop()
    out = {
        "command": command(), "args": vars(a), "machine": machine(), "code_version": code_version(), "date": date(),
        "load_average_1min_at_start_and_end": [load0, os.getloadavg()[0]],
        "durability": a.durability,
        "experience_json_bytes": value_bytes,
        "redis_benchmark_requests_per_s": raw,
        "store": rates,
        "log_latency": latency,
        "reward_latency": reward_latency,
        "ratios": {
            "experiences_per_s_n1_over_xadd": rates[0]["experiences_per_s"] / raw["XADD"],
            "rewards_per_s_over_set": rates[0]["rewards_per_s"] / raw["SET"],
        },
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out["ratios"], indent=2))


if __name__ == "__main__":
    main()

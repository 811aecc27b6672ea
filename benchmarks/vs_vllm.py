"""serve_rft side by side with plain vLLM: same model, same machine, same load
generator and concurrency levels, runs interleaved A B A B so the machine's drift cancels.

A = ``serve-rft up --mode serve`` with one explorer replica (``--ingress haproxy``, the default:
HAProxy -> the replica's own HTTP server -> vLLM `AsyncLLM`; ``--ingress proxy``: Ray Serve's
Python proxy -> replica; every choice logged to Redis with its behaviour logprobs; no trainer).
B = vLLM's own OpenAI server from the same install with the engine settings our replica uses
(`plain_vllm.start_vllm`).

The load generator (`run_load`): ``concurrency`` asyncio workers, each sending chat requests
(streaming or not: ``--modes``) back to back for ``duration`` seconds (``max_tokens`` fixed, usage included); per request
TTFT (first content chunk), end-to-end seconds and completion tokens. Reported per level: output
tokens/s, requests/s, TTFT and e2e p50/p99, and ours / vLLM's per A-B pair (median of pairs).

    .venv/bin/python benchmarks/vs_vllm.py [--levels 1 4 16] [--rounds 3] [--duration 20] [--ingress proxy]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_vllm import pct, start_vllm, stop  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Say something nice.", "Tell me a story about the sea.", "Name an animal.",
           "Describe a grey sky over a quiet town in a few words."]


def start_ours(run_dir: Path, log: Path, ingress: str = "haproxy",
               overrides: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """``serve-rft up --mode serve`` with one replica (its own embedded redis-server) behind
    ``ingress`` (``service.ingress``: haproxy or proxy), plus ``overrides`` (``section.field=value``)."""
    cmd = [sys.executable, "-m", "serve_rft.cli", "up", "--mode", "serve", "--port", "0",
           "--set", "explorer.num_replicas=1", "--set", f"service.run_dir={run_dir}",
           "--set", "service.metrics_port=0", "--set", f"service.ingress={ingress}"]
    for o in overrides:
        cmd += ["--set", o]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                            start_new_session=True, cwd=ROOT)
    for line in proc.stdout:
        if line.startswith('{"url"'):
            return proc, json.loads(line)["url"]
    raise RuntimeError(f"serve-rft up exited with {proc.wait()} (see {log})")


async def run_load(url: str, concurrency: int, duration: float, max_tokens: int, stream: bool = True,
                   logprobs: bool = False) -> dict:
    """Closed-loop load: ``concurrency`` workers, requests back to back for ``duration`` seconds
    (streaming with usage, or not; ``logprobs``: ask for the sampled tokens' logprobs, which our
    replica computes for every request anyway). Returns tokens/s, requests/s, TTFT (streaming
    only) and e2e p50/p99 (seconds), errors."""
    rows: list[tuple[float, float, int]] = []
    errors: list[str] = []
    stop_at = time.monotonic() + duration

    async def worker(k: int, client: httpx.AsyncClient) -> None:
        i = k
        while time.monotonic() < stop_at:
            i += concurrency
            body = {"model": "serve-rft", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                    "max_tokens": max_tokens, "temperature": 1.0, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            if logprobs:
                body["logprobs"] = True
            t0 = time.perf_counter()
            ttft, tokens = None, 0
            if not stream:
                try:
                    r = await client.post("/v1/chat/completions", json=body)
                except httpx.HTTPError as e:
                    errors.append(repr(e))
                    continue
                if r.status_code != 200:
                    errors.append(f"{r.status_code}: {r.text[:200]}")
                    continue
                e2e = time.perf_counter() - t0
                rows.append((e2e, None, r.json()["usage"]["completion_tokens"]))
                continue
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        errors.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            errors.append(chunk["error"]["message"])
                            break
                        if ttft is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                            ttft = time.perf_counter() - t0
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
            except httpx.HTTPError as e:
                errors.append(repr(e))
                continue
            rows.append((time.perf_counter() - t0, ttft if ttft is not None else time.perf_counter() - t0, tokens))

    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        await asyncio.gather(*(worker(k, c) for k in range(concurrency)))
    secs = time.monotonic() - t0
    e2e, ttfts = [r[0] for r in rows], [r[1] for r in rows if r[1] is not None]
    return {"seconds": secs, "requests": len(rows), "errors": len(errors), "error_samples": errors[:3],
            "output_tokens_per_s": sum(r[2] for r in rows) / secs, "requests_per_s": len(rows) / secs,
            "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
            "e2e_p50_s": pct(e2e, 0.5), "e2e_p99_s": pct(e2e, 0.99),
            "mean_completion_tokens": statistics.mean(r[2] for r in rows) if rows else 0.0}


def summarize(pairs: list[tuple[dict, dict]]) -> dict:
    """Medians over rounds for each server, and the median per-pair ratio ours / vLLM."""
    keys = ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s")
    keys = tuple(k for k in keys if all(a[k] is not None and b[k] for a, b in pairs))
    out = {"ours": {k: statistics.median(a[k] for a, _ in pairs) for k in keys},
           "vllm": {k: statistics.median(b[k] for _, b in pairs) for k in keys},
           "ratio_ours_to_vllm": {k: statistics.median(a[k] / b[k] for a, b in pairs) for k in keys},
           "errors": {"ours": sum(a["errors"] for a, _ in pairs), "vllm": sum(b["errors"] for _, b in pairs)}}
    return out


def main() -> None:
    from serve_rft.buffer.redis_server import free_port
    from serve_rft.config import ModelConfig
    from serve_rft.model.embedded import ensure_embedded_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=["stream", "non_stream"])
    ap.add_argument("--vllm-threads", type=int, default=1,
                    help="OMP_NUM_THREADS of the vLLM server (ours: 1, Ray's default for a 1-CPU replica)")
    ap.add_argument("--logprobs", action="store_true",
                    help="both servers return the sampled tokens' logprobs (equal engine work)")
    ap.add_argument("--ingress", choices=["haproxy", "proxy"], default="haproxy",
                    help="our front door (service.ingress)")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="A run-config override for our side (section.field=value); repeatable.")
    ap.add_argument("--out", default="benchmarks/results/vs_vllm.json")
    a = ap.parse_args()
    model = str(ensure_embedded_model(ModelConfig().cache_dir))
    work = Path(tempfile.mkdtemp(prefix="srft-vs-vllm-"))
    vllm_proc, vllm_url = start_vllm(model, free_port(), work / "vllm.log", a.vllm_threads)
    ours_proc = None
    try:
        ours_proc, ours_url = start_ours(work / "run", work / "ours.log", a.ingress, tuple(a.sets))
        for url in (ours_url, vllm_url):  # warm-up
            asyncio.run(run_load(url, max(a.levels), 5.0, a.max_tokens))
        results = {}
        for mode in a.modes:
            for level in a.levels:
                pairs = []
                for r in range(a.rounds):  # A B A B ...
                    ours = asyncio.run(run_load(ours_url, level, a.duration, a.max_tokens, mode == "stream",
                                                a.logprobs))
                    plain = asyncio.run(run_load(vllm_url, level, a.duration, a.max_tokens, mode == "stream",
                                                 a.logprobs))
                    pairs.append((ours, plain))
                    print(json.dumps({"mode": mode, "concurrency": level, "round": r,
                                      "ours_tok_s": round(ours["output_tokens_per_s"], 1),
                                      "vllm_tok_s": round(plain["output_tokens_per_s"], 1)}), flush=True)
                results[f"{mode}/c{level}"] = {**summarize(pairs), "runs": [{"ours": x, "vllm": y} for x, y in pairs]}
    finally:
        if ours_proc is not None:
            stop(ours_proc)
        stop(vllm_proc)
    out = {"command": f".venv/bin/python benchmarks/vs_vllm.py --levels {' '.join(map(str, a.levels))} "
                      f"--rounds {a.rounds} --duration {a.duration:g} --max-tokens {a.max_tokens} "
                      f"--modes {' '.join(a.modes)} "
                      f"--vllm-threads {a.vllm_threads} --ingress {a.ingress} --out {a.out}"
                      + (" --logprobs" if a.logprobs else "") + "".join(f" --set {o}" for o in a.sets),
           "model": model, "cpus": os.cpu_count(), "results": results}
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "runs"} for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()

"""serve_rft side by side with plain vLLM: same model, same machine, same load generator and
concurrency levels, runs interleaved in pairs so the machine's drift cancels, with CPU per process
tree measured in every run.

A = ``serve-rft up --mode serve`` with one explorer replica (``--ingress haproxy``, the default:
HAProxy -> the replica's own HTTP server -> vLLM `AsyncLLM`; ``--ingress proxy``: Ray Serve's
Python proxy -> replica; every choice logged to Redis with its behaviour logprobs; no trainer).
B = vLLM's own OpenAI server from the same install with the engine settings our replica uses
(`plain_vllm.start_vllm`).

Work (``--work``): ``logprobs`` = both sides asked for the sampled tokens' logprobs (the work our
replica does for every request anyway: the same work on both sides), ``plain`` = none asked.
Modes (``--modes``): streaming (with usage) and non-streaming. For every work, mode and level,
``--rounds`` pairs; a pair runs A then B in even rounds and B then A in odd rounds (so neither side
always runs second).

The load generator (`run_load`): ``concurrency`` asyncio workers, each sending chat requests back
to back for ``duration`` seconds (``max_tokens`` fixed); per request TTFT (first content chunk),
end-to-end seconds and completion tokens. While each run lasts, `proc_cpu.Sampler` snapshots every
process on the machine (both servers' trees, the load generator, the rest), so each run carries
CPU seconds per class (front end, engine, logging, Ray system, other) of both trees.

Per work/mode/level: output tokens/s, TTFT and e2e p50/p99 of each side (medians over pairs);
ratios ours / vLLM per pair (output tokens/s; TTFT p50 difference in ms; our front end + logging
CPU per token / vLLM's API server's) with their median and a percentile-bootstrap 95 % interval
over the pairs (`bootstrap_median`); CPU seconds per 1,000 output tokens per class. Before and
after the runs an idle window (nothing sent) gives each class's CPU seconds per second of idle.
The JSON records the command line, the machine, the load average and the busiest other processes
of every run and of the whole run, and every raw pair.

    .venv/bin/python benchmarks/vs_vllm.py [--levels 1 4 16 64] [--rounds 5] [--duration 15]
        [--work logprobs plain] [--modes stream non_stream] [--idle 10] [--ingress proxy]
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
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain_vllm import pct, start_vllm, stop
from proc_cpu import CLASSES, Sampler, snapshot, window_usage
from provenance import record

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Say something nice.", "Tell me a story about the sea.", "Name an animal.",
           "Describe a grey sky over a quiet town in a few words."]


def start_ours(run_dir: Path, log: Path, ingress: str = "haproxy", overrides: tuple[str, ...] = (),
               env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """``serve-rft up --mode serve`` with one replica (its own embedded redis-server) behind
    ``ingress`` (``service.ingress``: haproxy or proxy), plus ``overrides`` (``section.field=value``)
    and ``env`` (variables added to this process's environment: the Ray cluster it starts reads
    them; an operator's setting wins over serve_rft's, `serve_rft.service.ingress.haproxy_env`)."""
    cmd = [sys.executable, "-m", "serve_rft.cli", "up", "--mode", "serve", "--port", "0",
           "--set", "explorer.num_replicas=1", "--set", f"service.run_dir={run_dir}",
           "--set", "service.metrics_port=0", "--set", f"service.ingress={ingress}"]
    for o in overrides:
        cmd += ["--set", o]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,  # noqa: SIM115
                            start_new_session=True, cwd=ROOT, env={**os.environ, **(env or {})})
    for line in proc.stdout:
        if line.startswith('{"url"'):
            return proc, json.loads(line)["url"]
    raise RuntimeError(f"serve-rft up exited with {proc.wait()} (see {log})")


async def sse_lines(r: httpx.Response):
    """The lines of a server-sent event stream, split at LF only (a CR before it dropped).
    ``httpx``'s ``aiter_lines`` splits like ``str.splitlines``, so a JSON string holding a raw
    U+2028 or U+0085 (valid in JSON, sampled by a random-init model) would break a chunk apart."""
    buf = ""
    async for text in r.aiter_text():
        buf += text
        *lines, buf = buf.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if buf:
        yield buf.removesuffix("\r")


async def run_load(url: str, concurrency: int, duration: float, max_tokens: int, stream: bool = True,
                   logprobs: bool = False) -> dict:
    """Closed-loop load: ``concurrency`` workers, requests back to back for ``duration`` seconds
    (streaming with usage, or not; ``logprobs``: ask for the sampled tokens' logprobs, which our
    replica computes for every request anyway). Requests in flight when ``duration`` ends are
    finished and counted. Returns output tokens and tokens/s, requests/s, TTFT (streaming only) and
    e2e p50/p99 (seconds), errors (count and up to 3 samples)."""
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
                    async for line in sse_lines(r):
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
            "output_tokens": sum(r[2] for r in rows),
            "output_tokens_per_s": sum(r[2] for r in rows) / secs, "requests_per_s": len(rows) / secs,
            "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
            "e2e_p50_s": pct(e2e, 0.5), "e2e_p99_s": pct(e2e, 0.99),
            "mean_completion_tokens": statistics.mean(r[2] for r in rows) if rows else 0.0}


def bootstrap_median(xs: list[float], n_boot: int = 10_000, seed: int = 0) -> dict:
    """The median of ``xs`` (one value per A-B pair) and its 95 % percentile-bootstrap interval
    (Efron & Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 13): ``n_boot`` resamples
    of the pairs with replacement (numpy, seeded), the 2.5th and 97.5th percentiles of their
    medians. With 5 pairs or fewer the interval is the range of the pairs.

    Returns:
        ``median``, ``ci95`` ([low, high]), ``n``, ``values`` (as given); None figures for no values.
    """
    a = np.asarray(xs, dtype=float)
    if a.size == 0:
        return {"median": None, "ci95": [None, None], "n": 0, "values": []}
    meds = np.median(np.random.default_rng(seed).choice(a, size=(n_boot, a.size), replace=True), axis=1)
    lo, hi = np.percentile(meds, [2.5, 97.5])
    return {"median": float(np.median(a)), "ci95": [float(lo), float(hi)], "n": int(a.size),
            "values": [float(x) for x in a]}


def measure(url: str, side: str, roots: dict[str, int], level: int, a: argparse.Namespace, stream: bool,
            logprobs: bool) -> dict:
    """One `run_load` run against ``url`` while `proc_cpu.Sampler` watches the machine: the
    load figures, ``cpu`` (`proc_cpu.window_usage`: both trees, the load generator, the rest) and
    ``cpu_s_per_1k_tokens`` of ``side``'s tree per class (None when no token came back)."""
    with Sampler(roots, a.sample_interval) as s:
        load = asyncio.run(run_load(url, level, a.duration, a.max_tokens, stream, logprobs))
    mine, tokens = s.usage["trees"][side]["by_class"], load["output_tokens"]
    return {**load, "cpu": s.usage,
            "cpu_s_per_1k_tokens": {c: 1000 * mine[c] / tokens if tokens else None for c in CLASSES}}


def summarize(pairs: list[tuple[dict, dict]], n_boot: int = 10_000, seed: int = 0) -> dict:
    """For ``pairs`` of (ours, vLLM) runs: medians per side, the median per-pair ratio of each
    figure, `bootstrap_median` of the output tokens/s ratio, of the TTFT p50 difference (ms,
    streaming) and of our front end + logging CPU per token over vLLM's API server's; CPU seconds
    per 1,000 output tokens per class (medians over pairs); failed requests per side."""
    keys = ("output_tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s")
    keys = tuple(k for k in keys if all(x[k] is not None and y[k] for x, y in pairs))
    out = {"ours": {k: statistics.median(x[k] for x, _ in pairs) for k in keys},
           "vllm": {k: statistics.median(y[k] for _, y in pairs) for k in keys},
           "ratio_ours_to_vllm": {k: statistics.median(x[k] / y[k] for x, y in pairs) for k in keys},
           "errors": {"ours": sum(x["errors"] for x, _ in pairs), "vllm": sum(y["errors"] for _, y in pairs)}}
    out["output_tokens_per_s_ratio"] = bootstrap_median(
        [x["output_tokens_per_s"] / y["output_tokens_per_s"] for x, y in pairs if y["output_tokens_per_s"]],
        n_boot, seed)
    if "ttft_p50_s" in keys:
        out["ttft_p50_diff_ms"] = bootstrap_median([1000 * (x["ttft_p50_s"] - y["ttft_p50_s"]) for x, y in pairs],
                                                   n_boot, seed)
    per_1k = {side: [r["cpu_s_per_1k_tokens"] for r in runs] for side, runs in
              (("ours", [x for x, _ in pairs]), ("vllm", [y for _, y in pairs]))}
    out["cpu_s_per_1k_tokens"] = {side: {c: statistics.median(v[c] for v in vs) for c in CLASSES}
                                  for side, vs in per_1k.items() if all(v["engine"] is not None for v in vs)}
    fe = [(x["front_end"] + x["logging"]) / y["front_end"] for x, y in zip(per_1k["ours"], per_1k["vllm"])
          if x["front_end"] is not None and y["front_end"]]
    out["front_end_plus_logging_to_vllm_front_end"] = bootstrap_median(fe, n_boot, seed)
    return out


def idle_window(roots: dict[str, int], seconds: float, interval_s: float) -> dict:
    """Nothing sent for ``seconds``: `proc_cpu.window_usage` of the machine plus ``cpu_s_per_s``
    (tree -> class -> CPU seconds per second of idle: what spins with no load)."""
    with Sampler(roots, interval_s) as s:
        time.sleep(seconds)
    u = s.usage
    return {**u, "cpu_s_per_s": {t: {c: v / u["seconds"] for c, v in tr["by_class"].items()}
                                 for t, tr in u["trees"].items()}}


def main() -> None:
    from serve_rft.buffer.redis_server import free_port
    from serve_rft.config import ModelConfig, load_config
    from serve_rft.model.embedded import ensure_embedded_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=5, help="A-B pairs per work, mode and level")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds of load per run")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--modes", nargs="+", choices=["stream", "non_stream"], default=["stream", "non_stream"])
    ap.add_argument("--work", nargs="+", choices=["logprobs", "plain"], default=["logprobs", "plain"],
                    help="logprobs: both sides return the sampled tokens' logprobs (the same work); plain: none")
    ap.add_argument("--logprobs", action="store_true", help="same as --work logprobs")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of each idle window (before and after)")
    ap.add_argument("--sample-interval", type=float, default=1.0, help="seconds between process snapshots")
    ap.add_argument("--boot", type=int, default=10_000, help="bootstrap resamples")
    ap.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    ap.add_argument("--vllm-threads", type=int, default=1,
                    help="OMP_NUM_THREADS of the vLLM server (ours: 1, Ray's default for a 1-CPU replica)")
    ap.add_argument("--ingress", choices=["haproxy", "proxy"], default="haproxy",
                    help="our front door (service.ingress)")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="A run-config override for our side (section.field=value); repeatable.")
    ap.add_argument("--out", default="benchmarks/results/vs_vllm.json")
    a = ap.parse_args()
    if a.logprobs:
        a.work = ["logprobs"]
    model = str(ensure_embedded_model(ModelConfig().cache_dir))
    work = Path(tempfile.mkdtemp(prefix="srft-vs-vllm-"))
    out: dict = {**record(), "args": vars(a), "model": Path(model).name, "complete": False}
    ours_stats = load_config(None, a.sets).explorer.log_stats  # as our side reads the overrides
    vllm_proc, vllm_url = start_vllm(model, free_port(), work / "vllm.log", a.vllm_threads, log_stats=ours_stats)
    ours_proc = None
    try:
        ours_proc, ours_url = start_ours(work / "run", work / "ours.log", a.ingress, tuple(a.sets))
        roots, urls = {"ours": ours_proc.pid, "vllm": vllm_proc.pid}, {"ours": ours_url, "vllm": vllm_url}
        for url in (ours_url, vllm_url):  # warm-up, both modes, both works
            for stream in (True, False):
                asyncio.run(run_load(url, max(a.levels), 4.0, a.max_tokens, stream, "logprobs" in a.work))
        out["idle_before"] = idle_window(roots, a.idle, a.sample_interval)
        first, results = snapshot(), {}
        out["results"] = results
        for wk in a.work:
            for mode in a.modes:
                for level in a.levels:
                    pairs = []
                    for r in range(a.rounds):  # A B, B A, A B, ...
                        order = ("ours", "vllm") if r % 2 == 0 else ("vllm", "ours")
                        run = {side: measure(urls[side], side, roots, level, a, mode == "stream", wk == "logprobs")
                               for side in order}
                        pairs.append((run["ours"], run["vllm"]))
                        print(json.dumps({"work": wk, "mode": mode, "concurrency": level, "round": r,
                                          "ours_tok_s": round(run["ours"]["output_tokens_per_s"], 1),
                                          "vllm_tok_s": round(run["vllm"]["output_tokens_per_s"], 1)}), flush=True)
                    results[f"{wk}/{mode}/c{level}"] = {
                        **summarize(pairs, a.boot, a.seed),
                        "runs": [{"first": "ours" if i % 2 == 0 else "vllm", "ours": x, "vllm": y}
                                 for i, (x, y) in enumerate(pairs)]}
                    Path(a.out).write_text(json.dumps(out, indent=1))  # partial results survive a stop
        out["whole_run"] = window_usage([first, snapshot()], roots, os.getpid(), top=10)
        out["idle_after"] = idle_window(roots, a.idle, a.sample_interval)
        out["complete"] = True
    finally:
        if ours_proc is not None:
            stop(ours_proc)
        stop(vllm_proc)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "runs"} for k, v in out["results"].items()},
                     indent=1))


if __name__ == "__main__":
    main()

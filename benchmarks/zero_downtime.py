"""Zero-downtime proof: steady locust load while the trainer publishes and versions roll.

For each drain mode: start the real stack (two vLLM-CPU replicas, trainer, synchronizer), run
`loadtests/locustfile.py` headless at a steady request rate (its users post the rewards that
drive training), sample `/v1/status` every 0.2 s, then report: failed requests (non-2xx or a
stream without [DONE]), rolling syncs completed, the minimum number of RUNNING replicas over
all samples, and p50/p99 latency of requests that overlapped a sync vs those that did not.

    .venv/bin/python benchmarks/zero_downtime.py --duration 90 --users 6 --rate 1 \
        --out benchmarks/results/zero_downtime.json

``--set KEY=VALUE`` adds a stack setting, e.g. tensor-parallel replicas of two workers each::

    .venv/bin/python benchmarks/zero_downtime.py --duration 90 --users 6 --rate 1 --modes wait \
        --set explorer.tensor_parallel_size=2 --out benchmarks/results/zero_downtime_tp2.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from plain_vllm import pct  # noqa: E402
from provenance import record  # noqa: E402


def _sync_windows(events: list[dict]) -> list[tuple[float, float]]:
    """[start, end) of every replica's REQUIRE_SYNC period (drain + pause + load)."""
    open_at: dict[str, float] = {}
    windows = []
    for e in sorted(events, key=lambda e: e["t"]):
        if e["component"] == "trainer":
            continue
        if e["state"] == "REQUIRE_SYNC":
            open_at[e["component"]] = e["t"]
        elif e["component"] in open_at:
            windows.append((open_at.pop(e["component"]), e["t"]))
    return windows


def run_mode(drain_mode: str, duration: float, users: int, rate: float, run_dir: Path,
             ingress: str = "haproxy", settings: list[str] = ()) -> dict:
    from serve_rft.config import load_config
    from serve_rft.service.launcher import ServiceStack, quiet_env

    quiet_env()
    cfg = load_config(None, [f"synchronizer.drain_mode={drain_mode}", "service.port=0",
                             f"service.run_dir={run_dir}", "synchronizer.sync_style=trainer_driven",
                             "trainer.min_batch_size=16", "trainer.batch_wait_s=2.0",
                             f"service.ingress={ingress}", *settings])
    with ServiceStack(cfg) as stack:
        samples: list[tuple[float, int, int]] = []
        stop = threading.Event()

        def sample():
            with httpx.Client(base_url=stack.url, timeout=10) as c:
                while not stop.is_set():
                    st = c.get("/v1/status").json()
                    samples.append((time.time(), sum(r["state"] == "RUNNING" for r in st["replicas"]),
                                    st["policy_version"]))
                    time.sleep(0.2)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        log = run_dir / f"requests-{drain_mode}.jsonl"
        log.unlink(missing_ok=True)
        t0 = time.time()
        env = {**os.environ, "SERVE_RFT_RATE": str(rate), "SERVE_RFT_REQUEST_LOG": str(log),
               "SERVE_RFT_REWARD_SKIP": "0.0"}
        proc = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless",
             "-u", str(users), "-r", str(users), "-t", f"{int(duration)}s", "--host", stack.url,
             "--csv", str(run_dir / f"locust-{drain_mode}"), "--only-summary"],
            env=env, capture_output=True, text=True, timeout=duration + 120)
        time.sleep(1.0)
        stop.set()
        sampler.join()
        events = httpx.get(f"{stack.url}/v1/sync/events", params={"since": t0}).json()["events"]
        status = httpx.get(f"{stack.url}/v1/status").json()
    reqs = [json.loads(line) for line in log.read_text().splitlines()]
    chats = [r for r in reqs if r["name"] in ("chat", "chat_stream")]
    windows = _sync_windows(events)

    def overlaps(r):
        a, b = r["start"], r["start"] + r["seconds"]
        return any(a < we and b > ws for ws, we in windows)

    during = [r["seconds"] for r in chats if r["ok"] and overlaps(r)]
    outside = [r["seconds"] for r in chats if r["ok"] and not overlaps(r)]
    p = {k: pct(v, q) for k, v, q in [("during_p50", during, 0.5), ("during_p99", during, 0.99),
                                        ("outside_p50", outside, 0.5), ("outside_p99", outside, 0.99)]}
    return {
        "drain_mode": drain_mode,
        "duration_s": duration, "users": users, "rate_per_user": rate,
        "requests": len(chats), "rewards_posts": sum(r["name"] == "rewards" for r in reqs),
        "failed": sum(not r["ok"] for r in reqs),
        "failures": [r for r in reqs if not r["ok"]][:10],
        "locust_exit_code": proc.returncode,
        "rolling_syncs": len(windows),
        "versions_published": len({e["policy_version"] for e in events if e["component"] == "trainer"}),
        "min_running_replicas_sampled": min(n for _, n, _ in samples) if samples else None,
        "status_samples": len(samples),
        "sync_window_s": {"p50": pct([b - a for a, b in windows], 0.5), "max": max((b - a for a, b in windows), default=None)},
        "latency_s": p,
        "p50_ratio_during_vs_outside": (p["during_p50"] / p["outside_p50"]) if during and outside else None,
        "p99_ratio_during_vs_outside": (p["during_p99"] / p["outside_p99"]) if during and outside else None,
        "requests_during_sync": len(during), "requests_outside_sync": len(outside),
        "version_lag_s": {"median": statistics.median(status["version_lag_s"].values()) if status["version_lag_s"] else None,
                          "max": max(status["version_lag_s"].values(), default=None)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=90)
    ap.add_argument("--users", type=int, default=6)
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s per user")
    ap.add_argument("--modes", default="wait,keep")
    ap.add_argument("--ingress", choices=["haproxy", "proxy"], default="haproxy", help="service.ingress")
    ap.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                    help="another setting of the stack (serve-rft's --set), e.g. explorer.tensor_parallel_size=2")
    ap.add_argument("--run-dir", default="runs/bench-zero-downtime",
                    help="each mode's folder under it is deleted and recreated (a fresh store)")
    ap.add_argument("--out", default="benchmarks/results/zero_downtime.json")
    a = ap.parse_args()
    results = []
    for mode in a.modes.split(","):
        run_dir = Path(a.run_dir).resolve() / mode
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh store: an earlier run's Redis data may
        run_dir.mkdir(parents=True)                 # have another schema (WRONGTYPE in the scripts)
        # each mode starts from this process's environment as the first did: a ServiceStack
        # leaves the variables it set (RAY_SERVE_HAPROXY_BINARY_PATH naming the HAProxy wrapper
        # its stop removed), and a second HAProxy stack in the same process then finds no binary
        environ = dict(os.environ)
        try:
            results.append(run_mode(mode, a.duration, a.users, a.rate, run_dir, a.ingress, a.settings))
        finally:
            os.environ.clear()
            os.environ.update(environ)
        print(json.dumps(results[-1], indent=2), flush=True)
    out = {**record(), "ingress": a.ingress, "settings": a.settings, "results": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    bad = [r for r in results if r["failed"] or r["rolling_syncs"] < 10 or r["min_running_replicas_sampled"] < 1]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

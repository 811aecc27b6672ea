"""Canary promotion and automatic rollback on the live service (``synchronizer.rollout=canary``).

Closed-loop chat users post a reward for every answer. The rewards are an *oracle keyed by policy
version* (the response header ``x-serve-rft-policy-version``): answers of the first candidate
version get rewards around 0.05 (a version whose reward collapsed), every other version's answers
around 0.85. The synchronizer knows nothing of this: it sees rewards filed by version and
generation time. Expected timeline: the first candidate reaches one canary replica, its window
closes, it is rolled back and its canary returns to the incumbent; the next candidate (the
trainer went on publishing) gets its own canary, is promoted, and rolls to every replica.

    .venv/bin/python benchmarks/canary_run.py --out benchmarks/results/canary_run.json

tests/integration/test_stack_canary.py runs the same `scenario` against its stack in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CANARY_OVERRIDES = [
    "synchronizer.rollout=canary", "synchronizer.sync_style=trainer_driven",
    "synchronizer.canary={replicas: 1, window_s: 20, min_rewards: 15, reward_wait_s: 30, min_requests: 10}",
]
TIMELINE_KINDS = {"published", "candidate", "canary_started", "promoted", "rolled_back", "synced", "granted"}


def scenario(url: str, admin: dict | None = None, users: int = 3, timeout_s: float = 600.0) -> dict:
    """Run the oracle load until a good candidate was promoted everywhere after a bad one was
    rolled back (or ``timeout_s``).

    Returns:
        ``timeline`` (rollout events, seconds from the start), ``served`` (version -> replicas
        that answered with it), ``bad``/``good`` versions, request counts and failures.
    """
    admin = admin or {}
    state = {"bad": None, "good": None, "done": False}
    served: dict[int, set[str]] = {}
    outcomes = {"ok": 0, "failed": 0, "errors": []}
    stop = threading.Event()
    t0 = time.time()

    def reward(version: int, rng: random.Random) -> float:
        return rng.uniform(0.0, 0.1) if version == state["bad"] else rng.uniform(0.8, 0.9)

    async def user(i: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(i)
        k = 0
        while not stop.is_set():
            k += 1
            try:
                r = await http.post("/v1/chat/completions", json={
                    "model": "serve-rft", "messages": [{"role": "user", "content": f"u{i} {k}"}],
                    "max_tokens": 8, "n": 2})
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code} {r.text[:200]}")
                version = int(r.headers["x-serve-rft-policy-version"])
                served.setdefault(version, set()).add(r.headers["x-serve-rft-replica"])
                outcomes["ok"] += 1
                body = r.json()
                p = await http.post("/v1/rewards", json={"completion_id": body["id"], "rewards": [
                    reward(version, rng) for _ in body["choices"]]})
                if p.status_code != 200:
                    raise RuntimeError(f"reward {p.status_code} {p.text[:200]}")
            except (httpx.HTTPError, RuntimeError) as e:
                outcomes["failed"] += 1
                outcomes["errors"].append(repr(e)[:300])

    def watch() -> None:
        while not stop.is_set() and time.time() - t0 < timeout_s:
            ro = httpx.get(f"{url}/v1/sync/rollout", headers=admin, timeout=30).json()
            if state["bad"] is None and ro["candidate"] is not None:
                state["bad"] = ro["candidate"]  # the first candidate is the bad one
            for v in ro["verdicts"]:
                if v["decision"] == "promote" and v["version"] != state["bad"] and state["bad"] is not None:
                    state["good"] = v["version"]
            if state["good"] is not None:
                st = httpx.get(f"{url}/v1/status", headers=admin, timeout=30).json()
                live = [r for r in st["replicas"] if r["alive"] and r["state"] != "STOPPED"]
                if live and all(r["policy_version"] >= state["good"] for r in live):
                    state["done"] = True
                    break
            time.sleep(0.5)
        stop.set()

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120, headers=admin) as http:
            await asyncio.gather(*[user(i, http) for i in range(users)])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    asyncio.run(run())
    watcher.join()
    events = httpx.get(f"{url}/v1/sync/events", params={"since": t0}, headers=admin, timeout=30).json()["events"]
    rollout = httpx.get(f"{url}/v1/sync/rollout", headers=admin, timeout=30).json()
    timeline = [{"t": round(e["t"] - t0, 2), "component": e["component"], "kind": e["kind"],
                 "version": e["policy_version"], "detail": e["detail"]}
                for e in events if e["kind"] in TIMELINE_KINDS]
    return {"done": state["done"], "bad": state["bad"], "good": state["good"],
            "served": {str(v): sorted(r) for v, r in sorted(served.items())},
            "requests_ok": outcomes["ok"], "requests_failed": outcomes["failed"],
            "errors": outcomes["errors"][:5], "verdicts": rollout["verdicts"], "timeline": timeline,
            "seconds": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=3)
    ap.add_argument("--run-dir", type=Path, default=Path("runs/canary_run"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from serve_rft.config import load_config
    from serve_rft.service.launcher import ServiceStack, quiet_env

    quiet_env()
    cfg = load_config(None, [*CANARY_OVERRIDES, "service.port=0", f"service.run_dir={args.run_dir}",
                             "trainer.min_batch_size=8", "trainer.batch_wait_s=1.0"])
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from provenance import record  # the script's folder: benchmarks/provenance.py

    provenance = record(None if argv is None else [__file__, *argv])
    with ServiceStack(cfg) as stack:
        result = {**provenance, **scenario(stack.url, users=args.users)}
    print(json.dumps({k: v for k, v in result.items() if k not in ("timeline", "machine")}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

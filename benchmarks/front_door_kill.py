"""kill -9 of the front door: how long a one-node `serve-rft up` answers nothing after its HAProxy
is killed, until Ray Serve replaces it.

Two users chat (and reward every answer) on a `serve-rft up` stack; after a warm-up the HAProxy
process that listens on the service port gets SIGKILL. Nothing else is touched. Serve's
controller health-checks each node's proxy actor every ``RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S``
(10 s by default) and replaces it after three failed checks; the new proxy starts a new HAProxy on
the same port. Recorded: every request's start, end and outcome, the outage (kill -> first answer
after it), failures by kind, and whether every reward accepted before the kill is still in the
store afterwards.

    .venv/bin/python benchmarks/front_door_kill.py --out benchmarks/results/front_door_kill.json
    .venv/bin/python benchmarks/front_door_kill.py --env RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S=2 \\
        --out benchmarks/results/front_door_kill_period2.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.conftest import kill_all, launch, stack_command  # noqa: E402


def haproxy_on(port: int) -> int | None:
    """Pid of the haproxy process listening on ``port``, or None."""
    for p in psutil.process_iter(["name"]):
        try:
            if "haproxy" in (p.info["name"] or "") and any(
                    c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in p.net_connections()):
                return p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return None


class Users:
    """``n`` users chatting and rewarding in a loop; each request kept as (start, end, outcome)."""

    def __init__(self, url: str, n: int = 2):
        self.url, self.events, self.rewarded = url, [], []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    r = c.post("/v1/chat/completions", json={
                        "model": "serve-rft", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]})
                    self.events.append((t, time.monotonic(), str(r.status_code)))
                    if r.status_code == 200:
                        cid = r.json()["id"]
                        if c.post("/v1/rewards", json={"completion_id": cid, "rewards": [1.0]}).status_code == 200:
                            self.rewarded.append((time.monotonic(), cid))
                    else:
                        time.sleep(0.2)
                except httpx.HTTPError as e:
                    self.events.append((t, time.monotonic(), type(e).__name__))
                    time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=40)


def run(env: dict[str, str], warm_s: float, wait_s: float) -> dict:
    """Start a stack with ``env`` added, kill its HAProxy after ``warm_s`` of load, wait up to
    ``wait_s`` for five answers after the kill. Returns the summary (module docstring)."""
    run_dir = Path(tempfile.mkdtemp(prefix="front-door-"))
    cmd = stack_command("", run_dir, "fd", ["trainer.min_batch_size=4"])
    proc, _, info = launch(cmd, run_dir / "up.log", env=env)
    try:
        url = info["url"]
        port = int(url.rsplit(":", 1)[1])
        users = Users(url)
        time.sleep(warm_s)
        old = haproxy_on(port)
        t_kill = time.monotonic()
        os.kill(old, signal.SIGKILL)
        while time.monotonic() - t_kill < wait_s:
            if sum(1 for s, _, o in users.events if s > t_kill and o == "200") >= 5:
                break
            time.sleep(0.5)
        users.stop()
        new = haproxy_on(port)
        after = [(s - t_kill, e - t_kill, o) for s, e, o in users.events]
        first_ok = min((e for s, e, o in after if s > 0 and o == "200"), default=None)
        failed = [(s, e, o) for s, e, o in after if o != "200"]
        kinds: dict[str, dict] = {}
        for s, e, o in failed:
            k = kinds.setdefault(o, {"count": 0, "first_start_s": s, "last_end_s": e})
            k["count"] += 1
            k["first_start_s"], k["last_end_s"] = min(k["first_start_s"], s), max(k["last_end_s"], e)
        kept = 0
        accepted = [cid for t, cid in users.rewarded if t < t_kill]
        with httpx.Client(base_url=url, timeout=30) as c:
            for cid in accepted:
                r = c.get(f"/v1/experiences/{cid}")
                kept += r.status_code == 200 and r.json()["choices"][0]["reward"] == 1.0
        return {"env": env, "haproxy_pid_killed": old, "haproxy_pid_after": new,
                "outage_s": first_ok, "requests": len(after), "failed": len(failed),
                "failed_by_kind": {k: {kk: round(vv, 2) if isinstance(vv, float) else vv for kk, vv in v.items()}
                                   for k, v in kinds.items()},
                "rewards_accepted_before_kill": len(accepted), "rewards_kept": kept}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except Exception:
            kill_all(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE added to the stack's environment")
    ap.add_argument("--warm-s", type=float, default=8.0)
    ap.add_argument("--wait-s", type=float, default=120.0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    result = run(dict(e.split("=", 1) for e in a.env), a.warm_s, a.wait_s)
    result["command"] = " ".join([".venv/bin/python", "benchmarks/front_door_kill.py", *sys.argv[1:]])
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

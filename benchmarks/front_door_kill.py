"""kill -9 of the front door: how long a one-node `serve-rft up` answers nothing after its HAProxy
is killed, until Ray Serve replaces it.

Closed-loop users (`tests.support.load.Users`: chat with n=2, reward both answers, a 0.2 s
pause after a failed chat) run on a `serve-rft up` stack; after a warm-up the HAProxy process that
listens on the service port gets SIGKILL. Nothing else is touched. Serve's controller
health-checks each node's proxy actor every ``RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S`` (Ray's
default 10 s; `serve-rft up` sets 2 s, `serve_rft.service.ingress.PROXY_HEALTH_CHECK_PERIOD_S`)
and replaces it after three failed checks; the new proxy starts a new HAProxy on the same port.
Recorded: the outage (kill -> the first 200 to a one-token probe chat sent every 0.1 s; the
users may sit in their reward re-sends meanwhile), the users' failed chats by kind with their
first start and last end, and whether every reward answered 2xx (before, during and after
the outage; the users re-send a reward that failed) is in the store with its value afterwards.

    .venv/bin/python benchmarks/front_door_kill.py --out benchmarks/results/front_door_kill.json
    .venv/bin/python benchmarks/front_door_kill.py --env RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S=10 \\
        --out benchmarks/results/front_door_kill_period10.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.load import Users, haproxy_on  # noqa: E402
from tests.support.stack import launch, stack_command, stop  # noqa: E402


def _kind(chat: dict) -> str:
    """A failed chat's kind: the openai error's class (``APIConnectionError``, ``NotFoundError``...)."""
    return chat["error"].split("(", 1)[0]


def _probe(url: str, since: float, wait_s: float) -> tuple[float | None, dict[str, int]]:
    """One-token chats every 0.1 s (2 s timeout each) until one is answered 200 or ``wait_s``
    passes. Returns (seconds from ``since`` to the end of that answer, or None; outcomes seen)."""
    seen: dict[str, int] = {}
    body = {"model": "serve-rft", "max_tokens": 1, "messages": [{"role": "user", "content": "probe"}]}
    with httpx.Client(base_url=url, timeout=2.0) as client:
        while time.time() - since < wait_s:
            try:
                outcome = str(client.post("/v1/chat/completions", json=body).status_code)
            except httpx.HTTPError as e:
                outcome = type(e).__name__
            seen[outcome] = seen.get(outcome, 0) + 1
            if outcome == "200":
                return time.time() - since, seen
            time.sleep(0.1)
    return None, seen


def run(env: dict[str, str], warm_s: float, wait_s: float, users: int) -> dict:
    """Start a stack with ``env`` added, kill its HAProxy after ``warm_s`` of load, probe until
    it answers again (at most ``wait_s``), keep the load 5 s more. Returns the summary (module
    docstring): times in seconds from the kill."""
    run_dir = Path(tempfile.mkdtemp(prefix="front-door-"))
    cmd = stack_command("", run_dir, "fd", ["trainer.min_batch_size=4"])
    proc, _, info = launch(cmd, run_dir / "up.log", env=env)
    try:
        url = info["url"]
        port = int(url.rsplit(":", 1)[1])
        with Users(url, users=users, backoff_s=0.2) as load:
            time.sleep(warm_s)
            old = haproxy_on(port)
            t_kill = time.time()
            os.kill(old, signal.SIGKILL)
            first_ok, probes = _probe(url, t_kill, wait_s)
            time.sleep(5)  # traffic through the new HAProxy
        new = haproxy_on(port)
        chats = list(load.chats)
        kinds: dict[str, dict] = {}
        for c in chats:
            if c["ok"]:
                continue
            s, e = round(c["t"] - t_kill, 2), round(c["end"] - t_kill, 2)
            k = kinds.setdefault(_kind(c), {"count": 0, "first_start_s": s, "last_end_s": e})
            k["count"] += 1
            k["first_start_s"], k["last_end_s"] = min(k["first_start_s"], s), max(k["last_end_s"], e)
        accepted = {key: r for key, r in load.accepted.items()}
        before = sum(t < t_kill for t in load.accepted_at)
        kept = 0
        with httpx.Client(base_url=url, timeout=30) as c:
            for (cid, i), reward in accepted.items():
                r = c.get(f"/v1/experiences/{cid}")
                kept += r.status_code == 200 and r.json()["choices"][i]["reward"] == reward
        return {"env": env, "users": users, "haproxy_pid_killed": old, "haproxy_pid_after": new,
                "outage_s": round(first_ok, 2) if first_ok is not None else None, "probes": probes,
                "chats": len(chats), "failed": sum(not c["ok"] for c in chats), "failed_by_kind": kinds,
                "reward_posts_answered_before_kill": before, "reward_retries": len(load.reward_errors),
                "rewards_accepted": len(accepted), "rewards_kept": kept}
    finally:
        stop(proc, timeout_s=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE added to the stack's environment")
    ap.add_argument("--warm-s", type=float, default=8.0)
    ap.add_argument("--wait-s", type=float, default=120.0, help="give up probing after this long")
    ap.add_argument("--users", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    result = run(dict(e.split("=", 1) for e in a.env), a.warm_s, a.wait_s, a.users)
    sys.path.insert(0, str(Path(__file__).parent))
    from provenance import record

    result = {**record(), **result}
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

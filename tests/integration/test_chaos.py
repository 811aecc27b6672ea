"""Chaos on the real stack under load with rewards: kill -9 of a replica, the trainer and the
embedded redis-server in turn (issue 14).

The stack runs its own supervised redis-server (``buffer.redis_url`` empty) with
``buffer.durability=always``, the setting whose promise is that no acknowledged reward is lost.
Afterwards: every reward answered 2xx is in the store with its value and ends trained, ready or
dropped with a counted reason; no entry was trained twice (the store's trained counter moved by
exactly the number of choices in state ``trained``); after each kill the service answers again
within 30 s; the failed requests per kill are reported (a replica's kill may fail those in
flight on it, the others none).
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.integration.conftest import start_stack
from tests.integration.load import Users, every_accepted_reward_is_kept, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(embedded_model, tmp_path_factory):
    yield from start_stack("", embedded_model, tmp_path_factory.mktemp("chaos"),
                           ["buffer.durability=always", "trainer.min_batch_size=4"])


def _status(stack) -> dict:
    return httpx.get(f"{stack.url}/v1/status", timeout=60).json()


def test_kill_9_of_a_replica_the_trainer_and_redis_in_turn_under_load(stack):
    assert stack.redis_pid and stack.redis_url
    before = _status(stack)["experiences"]
    report: dict[str, dict] = {}
    with Users(stack.url) as users:
        wait_for(lambda: _status(stack)["policy_version"] >= 1, 240, "a first trained version")

        def kill(what: str, pid: int) -> float:
            t = time.time()
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: users.answered_after(t), 30, f"an answer after killing the {what}", period_s=0.2)
            return t

        st = _status(stack)
        replica = next(r for r in st["replicas"] if r["alive"] and r.get("pid"))
        t = kill("replica", replica["pid"])
        wait_for(lambda: sum(r["alive"] and r["state"] == "RUNNING" for r in _status(stack)["replicas"]) >= 2
                 and replica["id"] not in {r["id"] for r in _status(stack)["replicas"] if r["alive"]}, 300,
                 "Serve's replacement replica")
        report["replica"] = {"t": t, "failed": len(users.failed(t - 1, t + 30))}

        old = _status(stack)["trainer"]["pid"]
        t = kill("trainer", old)
        wait_for(lambda: (tr := _status(stack)["trainer"])["pid"] != old and tr["resumed_from"] is not None, 240,
                 "Ray to restart the trainer")
        report["trainer"] = {"t": t, "failed": len(users.failed(t - 1, t + 30))}

        t = kill("redis-server", stack.redis_pid)
        wait_for(lambda: (_status(stack).get("experiences") or {}).get("redis_restarts", 0) >= 1, 60,
                 "the supervisor to restart redis-server")
        report["redis"] = {"t": t, "failed": len(users.failed(t - 1, t + 30))}
        time.sleep(10)  # traffic on the restarted store
    summary = {"failed_per_kill": {k: v["failed"] for k, v in report.items()},
               "chat_requests": len(users.chats), "rewards_accepted": len(users.accepted),
               "reward_retries": len(users.reward_errors)}
    (stack.run_dir / "chaos.json").write_text(json.dumps(summary, indent=2))  # the figures of this run
    print("chaos:", summary)
    assert report["trainer"]["failed"] == 0 and report["redis"]["failed"] == 0, report
    assert report["replica"]["failed"] <= users.users, report  # at most those in flight on it

    every_accepted_reward_is_kept(stack.url, users, before)

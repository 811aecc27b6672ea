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
import threading
import time

import httpx
import openai
import pytest

from tests.integration.conftest import start_stack

pytestmark = pytest.mark.integration
FINAL = {"trained", "ready", "stale-dropped", "backlog-dropped", "dead-letter"}


@pytest.fixture(scope="module")
def stack(embedded_model, tmp_path_factory):
    yield from start_stack("", embedded_model, tmp_path_factory.mktemp("chaos"),
                           ["buffer.durability=always", "trainer.min_batch_size=4"])


class Users:
    """Closed-loop users: chat (n=2), then both rewards, re-sent on 504 / 507 (Retry-After) a bounded
    number of times. Keeps every chat outcome and every reward answered 2xx."""

    def __init__(self, url: str, users: int = 3):
        self.url, self.users = url, users
        self.chats: list[dict] = []
        self.accepted: dict[tuple[str, int], float] = {}
        self.reward_errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._user, args=(i,), daemon=True) for i in range(users)]

    def __enter__(self) -> "Users":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)

    def _user(self, i: int) -> None:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=120)
        k = 0
        while not self._stop.is_set():
            k += 1
            t0 = time.time()
            try:
                comp = client.chat.completions.create(
                    model="serve-rft", messages=[{"role": "user", "content": f"user {i} turn {k}"}],
                    max_tokens=8, n=2, temperature=1.0)
            except openai.APIError as e:
                self.chats.append({"ok": False, "t": t0, "end": time.time(), "error": repr(e)})
                continue
            self.chats.append({"ok": True, "t": t0, "end": time.time()})
            rewards = [float(k % 3 == j) for j in range(len(comp.choices))]
            for _try in range(30):
                try:
                    r = httpx.post(f"{self.url}/v1/rewards", timeout=60,
                                   json={"completion_id": comp.id, "rewards": rewards})
                except httpx.HTTPError as e:
                    self.reward_errors.append(repr(e))
                    time.sleep(1)
                    continue
                if r.status_code == 200:
                    for d in r.json()["data"]:
                        if d["status"] in ("recorded", "duplicate"):
                            self.accepted[(d["completion_id"], d["choice_index"])] = d["reward"]
                    break
                if r.status_code == 404:  # served while the store was away: never logged
                    break
                self.reward_errors.append(f"{r.status_code} {r.text[:120]}")
                time.sleep(float(r.headers.get("retry-after", "1")))

    def failed(self, since: float, until: float) -> list[dict]:
        return [c for c in self.chats if not c["ok"] and since <= c["t"] <= until]

    def answered_after(self, t: float) -> bool:
        return any(c["ok"] and c["t"] > t for c in self.chats)


def _status(stack) -> dict:
    return httpx.get(f"{stack.url}/v1/status", timeout=60).json()


def _wait(pred, timeout_s: float, what: str, period_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = pred()
        except httpx.HTTPError:
            got = None
        if got:
            return got
        time.sleep(period_s)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what() if callable(what) else what}")


def test_kill_9_of_a_replica_the_trainer_and_redis_in_turn_under_load(stack):
    assert stack.redis_pid and stack.redis_url
    before = _status(stack)["experiences"]
    report: dict[str, dict] = {}
    with Users(stack.url) as users:
        _wait(lambda: _status(stack)["policy_version"] >= 1, 240, "a first trained version")

        def kill(what: str, pid: int) -> float:
            t = time.time()
            os.kill(pid, signal.SIGKILL)
            _wait(lambda: users.answered_after(t), 30, f"an answer after killing the {what}", period_s=0.2)
            return t

        st = _status(stack)
        replica = next(r for r in st["replicas"] if r["alive"] and r.get("pid"))
        t = kill("replica", replica["pid"])
        _wait(lambda: sum(r["alive"] and r["state"] == "RUNNING" for r in _status(stack)["replicas"]) >= 2
              and replica["id"] not in {r["id"] for r in _status(stack)["replicas"] if r["alive"]}, 300,
              "Serve's replacement replica")
        report["replica"] = {"t": t, "failed": len(users.failed(t - 1, t + 30))}

        old = _status(stack)["trainer"]["pid"]
        t = kill("trainer", old)
        _wait(lambda: (tr := _status(stack)["trainer"])["pid"] != old and tr["resumed_from"] is not None, 240,
              "Ray to restart the trainer")
        report["trainer"] = {"t": t, "failed": len(users.failed(t - 1, t + 30))}

        t = kill("redis-server", stack.redis_pid)
        _wait(lambda: (_status(stack).get("experiences") or {}).get("redis_restarts", 0) >= 1, 60,
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

    seen: dict = {}

    def settled():
        st = _status(stack)
        seen.update(experiences=st.get("experiences"), trainer=st.get("trainer"))
        c = st["experiences"]
        return c if c and c["ready"] == 0 and c["held"] == 0 else None
    after = _wait(settled, 300, lambda: f"every rewarded experience to be trained or dropped (last seen: {seen})",
                  period_s=2.0)
    assert users.accepted, "no reward was accepted"
    trained = 0
    for (cid, i), reward in users.accepted.items():
        choice = httpx.get(f"{stack.url}/v1/experiences/{cid}", timeout=30).json()["choices"][i]
        assert choice["reward"] == reward and choice["state"] in FINAL, (cid, i, choice)
        trained += choice["state"] == "trained"
    assert after["trained"] - before["trained"] == trained, (before, after, trained)  # none twice

"""Load and bookkeeping for tests and benchmarks that run a service: closed-loop users that chat
and reward (`Users`: the fault tests that kill parts of a running service,
tests/integration/test_stack_faults.py and test_multinode.py, and benchmarks/front_door_kill.py), a
``/v1/status`` read with a bounded retry, a bounded wait, and the end-of-run check that every
accepted reward was kept and none trained twice."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

FINAL = {"trained", "ready", "stale-dropped", "backlog-dropped", "dead-letter"}


class Users:
    """Closed-loop users: chat (n=2), then both rewards, re-sent a bounded number of times on a
    connection error, 504 / 507 (after Retry-After) or the front door's own 404 (`_ours`). Keeps every chat outcome (its time, end and replica) and every reward
    answered 2xx (with when it was answered). ``max_tokens`` per chat: how long each user's
    request stays in flight at a replica; ``backoff_s``: a user's pause after a failed chat (with
    nothing listening, a refused connection fails at once)."""

    def __init__(self, url: str, users: int = 3, max_tokens: int = 8, backoff_s: float = 0.0):
        self.url, self.users, self.max_tokens, self.backoff_s = url, users, max_tokens, backoff_s
        self.chats: list[dict] = []
        self.accepted: dict[tuple[str, int], float] = {}
        self.accepted_at: list[float] = []
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
                raw = client.chat.completions.with_raw_response.create(
                    model="serve-rft", messages=[{"role": "user", "content": f"user {i} turn {k}"}],
                    max_tokens=self.max_tokens, n=2, temperature=1.0)
                comp = raw.parse()
            except openai.APIError as e:
                self.chats.append({"ok": False, "t": t0, "end": time.time(), "error": repr(e)})
                self._stop.wait(self.backoff_s)
                continue
            self.chats.append({"ok": True, "t": t0, "end": time.time(),
                               "replica": raw.headers.get("x-serve-rft-replica")})
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
                    self.accepted_at.append(time.time())
                    break
                if r.status_code == 404 and _ours(r):  # served while the store was away: never logged
                    break
                self.reward_errors.append(f"{r.status_code} {r.text[:120]}")
                time.sleep(float(r.headers.get("retry-after", "1")))

    def failed(self, since: float, until: float) -> list[dict]:
        """The failed chats in flight at any moment of [since, until] (started before its end,
        ended after its start): a request sent seconds before a kill and cut by it belongs to the
        kill (a chat may be in flight for several seconds before the kill cuts it)."""
        return [c for c in self.chats if not c["ok"] and c["t"] <= until and c["end"] >= since]

    def answered_after(self, t: float) -> bool:
        """Whether a chat sent after ``t`` (``time.time()``, s) was answered."""
        return any(c["ok"] and c["t"] > t for c in self.chats)


def _ours(r: httpx.Response) -> bool:
    """Whether ``r`` is the service's own answer (OpenAI error JSON), not the front door's: a new
    HAProxy answers 404 in text for the moment it has no routes yet (Ray Serve's HAProxy
    template), and a reward re-sent into that moment may already have been recorded by the
    request the kill cut, so it is re-sent again."""
    try:
        return "error" in r.json()
    except ValueError:
        return False


def haproxy_on(port: int) -> int | None:
    """Pid of the haproxy process listening on ``port`` (the service's front door), or None."""
    for p in psutil.process_iter(["name"]):
        try:
            if "haproxy" in (p.info["name"] or "") and any(
                    c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in p.net_connections()):
                return p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return None


def get_status(url: str, headers: dict | None = None, deadline_s: float = 180.0) -> dict:
    """``GET /v1/status`` as a patient client reads it: a 504 (the synchronizer did not answer
    within ``explorer.peer_wait_s``: restarting, its node lost, a loaded machine) is retried after
    its Retry-After, and so is an answer whose trainer did not answer (``answered: false``: Ray
    restarting it, or busy), until ``deadline_s``; then the last answer is returned as it is.

    Raises:
        AssertionError: any other status, or a 504 at the deadline.
    """
    deadline = time.monotonic() + deadline_s
    while True:
        r = httpx.get(f"{url}/v1/status", headers=headers, timeout=120)
        late = time.monotonic() > deadline
        if r.status_code == 200:
            st = r.json()
            if st.get("trainer", {}).get("answered") is not False or late:
                return st
            time.sleep(1.0)
            continue
        assert r.status_code == 504 and not late, (r.status_code, r.text[:300])
        time.sleep(float(r.headers.get("retry-after", "1")))


def live_replicas(status: dict) -> list[dict]:
    """The replicas of a ``/v1/status`` answer that are alive and not STOPPED."""
    return [r for r in status["replicas"] if r["alive"] and r["state"] != "STOPPED"]


def wait_for(pred, timeout_s: float, what: str, period_s: float = 0.5):
    """``pred()``'s first truthy value, polled every ``period_s`` s for up to ``timeout_s`` s (an
    ``httpx.HTTPError`` counts as not yet). Fails the test naming ``what`` (a string, or a
    callable giving one) when the time runs out. A wait over 5 s is printed with its seconds and
    the caller's line (pytest shows it with ``-s`` or on failure: where a test's time goes)."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while time.monotonic() < deadline:
        try:
            got = pred()
        except httpx.HTTPError:
            got = None
        if got:
            if (waited := time.monotonic() - t0) > 5:
                caller = sys._getframe(1)
                label = what if isinstance(what, str) else f"{Path(caller.f_code.co_filename).name}:{caller.f_lineno}"
                print(f"waited {waited:.1f} s for {label}", flush=True)
            return got
        time.sleep(period_s)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what() if callable(what) else what}")


def settled_counts(url: str, settle_s: float = 300) -> dict:
    """``/v1/status``'s ``experiences`` once nothing is ready or held: a test's starting point
    that an earlier test's rewarded experiences, still training, do not move afterwards."""
    def settled():
        c = get_status(url)["experiences"]
        return c if c and c["ready"] == 0 and c["held"] == 0 else None
    return wait_for(settled, settle_s, "the earlier tests' rewarded experiences to be trained or dropped",
                    period_s=2.0)


def every_accepted_reward_is_kept(url: str, users: Users, before: dict, settle_s: float = 300) -> dict:
    """Wait until nothing is ready or held, then check each reward answered 2xx: in the store with
    its value, in a final state; the store's trained counter moved by exactly the choices in state
    ``trained`` (none twice). ``before``: ``/v1/status``'s ``experiences`` at the start.

    Returns:
        ``experiences`` at the end.
    """
    seen: dict = {}

    def settled():
        st = get_status(url)
        seen.update(experiences=st.get("experiences"), trainer=st.get("trainer"))
        c = st["experiences"]
        return c if c and c["ready"] == 0 and c["held"] == 0 else None
    after = wait_for(settled, settle_s, lambda: f"every rewarded experience to be trained or dropped (last seen: {seen})",
                     period_s=2.0)
    assert users.accepted, "no reward was accepted"
    trained = 0
    for (cid, i), reward in users.accepted.items():
        choice = httpx.get(f"{url}/v1/experiences/{cid}", timeout=30).json()["choices"][i]
        assert choice["reward"] == reward and choice["state"] in FINAL, (cid, i, choice)
        trained += choice["state"] == "trained"
    assert after["trained"] - before["trained"] == trained, (before, after, trained)  # none twice
    return after

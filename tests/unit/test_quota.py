"""Per-key quotas: the token-bucket script against a real redis-server (burst, refusal with the
right wait, refill by Redis TIME, independent keys, expiry, byte cost), and the check a replica
runs after the key check (429 + Retry-After as OpenAI error JSON over the replica's app, the
body cost of a chunked request, 256 checks at once, the replica's share while Redis is away or
slow, 429 while every quota connection is in use).

The buckets refill by the Redis server's clock while a test runs, and a loaded host can take
seconds between two takes. So every expected wait or TTL is "the value at the first take, less
the time the client measured around the takes" (``elapsed``; ``SLACK`` covers the client's
monotonic clock against Redis ``TIME``), and the rates are small enough that no realistic delay
refills a whole token during the takes. Only `test_refill_by_elapsed_time` needs its three takes
within 1 s."""

from __future__ import annotations

import asyncio
from asyncio import run
import math
import socket
import time
import uuid
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from serve_rft.buffer.quota import Decision, LocalBuckets, QuotaBuckets, Rates, key_identity
from serve_rft.config.service import QuotasConfig
from serve_rft.explorer.http.auth import ApiKeys
from serve_rft.explorer.http.body import read_body
from serve_rft.explorer.http.protocol import ApiError
from serve_rft.explorer.http.quota import AWAY_AFTER_S, PAUSE_AFTER_FAILURE_S, QuotaCheck
from tests.support.rewards_flow import QuotaMetrics as Metrics

SLACK = 0.01
"""s: the client's monotonic clock against the Redis server's ``TIME`` over one test."""


@pytest.fixture
def prefix():
    return f"q{uuid.uuid4().hex[:8]}"


async def _timed(buckets, n, rates, identity="k", costs=None, scope="inference"):
    """``n`` takes (or one per cost in ``costs``, bytes) and the seconds the client measured
    around them (an upper bound on the Redis time that passed between the first and the last)."""
    costs = [0] * n if costs is None else costs
    t0 = time.monotonic()
    out = [await buckets.take(scope, identity, rates, c) for c in costs]
    return out, time.monotonic() - t0


def _takes(buckets, n, rates, identity="k", cost=0, scope="inference"):
    async def go():
        out = await _timed(buckets, n, rates, identity, [cost] * n, scope)
        await buckets.close()
        return out
    return run(go())


def test_burst_then_refusal_with_the_wait_until_one_token(redis_server, prefix):
    """A full bucket of 3 allows 3 at once; the 4th waits 1/rate (0.01/s: 100 s) less what
    refilled since the first take (the time the takes took, at most ``elapsed``)."""
    rates = Rates(0.01, 3, 0.0, 0)
    d, elapsed = _takes(QuotaBuckets(redis_server.url, prefix), 4, rates)
    assert [x.allowed for x in d] == [True, True, True, False]
    assert d[3].limit == "requests" and not d[3].too_large
    assert 100.0 - elapsed - SLACK <= d[3].wait_s <= 100.0, (d[3].wait_s, elapsed)


def test_refill_by_elapsed_time(redis_server, prefix):
    """At 1/s with a burst of 2: two takes empty the bucket and a third within 1 s is refused
    with the wait until one token; after that wait (by Redis TIME) the next take is allowed."""
    rates = Rates(1.0, 2, 0.0, 0)

    async def go():
        b = QuotaBuckets(redis_server.url, prefix)
        first, elapsed = await _timed(b, 3, rates)
        await asyncio.sleep(first[2].wait_s + 0.05)
        later = await b.take("inference", "k", rates, 0)
        await b.close()
        return first, elapsed, later

    first, elapsed, later = run(go())
    assert [x.allowed for x in first] == [True, True, False], elapsed  # needs the 3 takes within 1 s
    assert 1.0 - elapsed - SLACK <= first[2].wait_s <= 1.0, (first[2].wait_s, elapsed)
    assert later.allowed


def test_refill_stops_at_the_burst(redis_server, prefix):
    """An empty bucket whose last take is moved 1000 s into the past (at 0.01/s, 10 tokens owed)
    holds its burst of 2, no more: two takes, then the wait for one token (100 s)."""
    rates = Rates(0.01, 2, 0.0, 0)

    async def go():
        b = QuotaBuckets(redis_server.url, prefix)
        emptied, _ = await _timed(b, 2, rates)
        key = b.key("inference", "k")
        last = float(await b.redis.hget(key, "t"))
        await b.redis.hset(key, "t", f"{last - 1000.0:.6f}")
        later, elapsed = await _timed(b, 3, rates)
        await b.close()
        return emptied, later, elapsed

    emptied, later, elapsed = run(go())
    assert [x.allowed for x in emptied] == [True, True]
    assert [x.allowed for x in later] == [True, True, False]
    assert 100.0 - elapsed - SLACK <= later[2].wait_s <= 100.0, (later[2].wait_s, elapsed)


def test_two_keys_and_two_scopes_are_independent(redis_server, prefix):
    rates = Rates(0.01, 1, 0.0, 0)  # no realistic delay refills a token between the takes

    async def go():
        b = QuotaBuckets(redis_server.url, prefix)
        out = [(await b.take(s, i, rates, 0)).allowed
               for s, i in (("inference", "a"), ("inference", "a"), ("inference", "b"), ("rewards", "a"))]
        await b.close()
        return out

    assert run(go()) == [True, False, True, True]


def test_a_bucket_expires_when_it_would_be_full_again(redis_server, prefix):
    """The key's TTL: time to refill what was taken (+1 s), less the time since the first take;
    the key holds a hash, never the API key."""
    rates = Rates(0.0625, 4, 0.0, 0)

    async def go():
        b = QuotaBuckets(redis_server.url, prefix)
        ident = key_identity("secret-key")
        t0 = time.monotonic()
        for _ in range(3):
            assert (await b.take("inference", ident, rates, 0)).allowed
        ttl = await b.redis.pttl(b.key("inference", ident))
        elapsed = time.monotonic() - t0
        keys = await b.redis.keys(f"{prefix}:*")
        await b.close()
        return ttl, elapsed, keys, ident

    ttl, elapsed, keys, ident = run(go())
    # 3 tokens at 1/16 per s = 48 s, + 1 s
    assert 49000 - 1000 * (elapsed + SLACK) <= ttl <= 49000, (ttl, elapsed)
    assert keys == [f"{prefix}:quota:inference:{ident}"]
    assert "secret-key" not in ident and len(ident) == 32


def test_bytes_cost_and_a_body_over_the_burst(redis_server, prefix):
    """Bytes: 10 B/s, burst 1500 B: 1000 then 600 is short by 100 B (10 s, less the time since
    the first take); all or nothing (the request token is not taken either); a body over the
    burst is never allowed."""
    rates = Rates(0.001, 100, 10.0, 1500)

    async def go():
        b = QuotaBuckets(redis_server.url, prefix)
        out, elapsed = await _timed(b, 0, rates, costs=[1000, 600, 400, 1501], scope="rewards")
        left = await b.redis.hget(b.key("rewards", "k"), "r")
        await b.close()
        return out, elapsed, float(left)

    out, elapsed, request_tokens = run(go())
    assert out[0].allowed and not out[1].allowed and out[2].allowed
    assert out[1].limit == "bytes" and 10.0 - elapsed - SLACK <= out[1].wait_s <= 10.0, (out[1], elapsed)
    assert 97.9 < request_tokens < 98.1  # two takes, not three (0.001/s refills 0.1 in 100 s)
    assert not out[3].allowed and out[3].too_large


def test_the_longer_wait_of_the_two_buckets_is_answered(redis_server, prefix):
    """Both buckets short: 1 request at 0.1/s (10 s) and 100 B at 1 B/s (100 s): the 100 s."""
    rates = Rates(0.1, 1, 1.0, 100)
    d, elapsed = _takes(QuotaBuckets(redis_server.url, prefix), 2, rates, cost=100)
    assert d[0].allowed and not d[1].allowed
    assert d[1].limit == "bytes" and 100.0 - elapsed - SLACK <= d[1].wait_s <= 100.0, (d[1], elapsed)


# -- the check a replica runs ------------------------------------------------------------
KEYS = ApiKeys(["inf", "inf2"], ["adm", "adm2"], ["rew"])


def _quotas(**scopes) -> QuotasConfig:
    return QuotasConfig.model_validate(scopes)


def _request(path, key="adm", body=b"", chunked=False, method="POST") -> Request:
    headers = [(b"authorization", f"Bearer {key}".encode())]
    if not chunked:
        headers.append((b"content-length", str(len(body)).encode()))
    chunks = [body[i:i + 7] for i in range(0, len(body), 7)] or [b""]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0)

    return Request({"type": "http", "method": method, "path": path, "headers": headers,
                    "query_string": b""}, receive)


def test_429_with_retry_after_and_openai_rate_limit_json(redis_server, prefix):
    metrics = Metrics()
    quotas = _quotas(inference={"requests_per_s": 0.01, "request_burst": 1})
    check = QuotaCheck(quotas, KEYS, QuotaBuckets(redis_server.url, prefix), metrics)

    async def go():
        t0 = time.monotonic()
        await check.check(_request("/v1/chat/completions", "inf"))
        with pytest.raises(ApiError) as e:
            await check.check(_request("/v1/chat/completions", "inf"))
        elapsed = time.monotonic() - t0
        await check.check(_request("/v1/chat/completions", "inf2"))  # another key: served
        await check.check(_request("/v1/rewards", "inf"))  # another scope: unlimited
        await check.close()
        return e.value, elapsed

    e, elapsed = run(go())
    # 1 token at 0.01/s: 100 s less the time since the first request, in whole seconds rounded up
    assert e.status == 429 and math.ceil(100.0 - elapsed - SLACK) <= e.retry_after <= 100, (e.retry_after, elapsed)
    assert e.body()["error"]["code"] == "rate_limit_exceeded" and e.body()["error"]["type"] == "requests"
    assert metrics.calls == [("inference", "requests")]


def test_chunked_body_is_charged_as_read_and_the_route_reads_it_again(redis_server, prefix):
    quotas = _quotas(rewards={"bytes_per_s": 0.25, "bytes_burst": 40})
    check = QuotaCheck(quotas, KEYS, QuotaBuckets(redis_server.url, prefix), Metrics())
    body = b'{"completion_id": "c", "reward": 1.0}'  # 37 bytes, in chunks of 7

    async def go():
        t0 = time.monotonic()
        first = _request("/v1/rewards", "rew", body, chunked=True)
        await check.check(first)
        again = await read_body(first)
        with pytest.raises(ApiError) as e:
            await check.check(_request("/v1/rewards", "rew", body, chunked=True))
        elapsed = time.monotonic() - t0
        await check.close()
        return again, e.value, elapsed

    again, e, elapsed = run(go())
    assert again == body
    # 3 B left, 37 B asked: 34 B short at 0.25 B/s = 136 s, less the time since the first body
    assert e.status == 429 and e.type == "bytes"
    assert math.ceil(136.0 - elapsed - SLACK) <= e.retry_after <= 136, (e.retry_after, elapsed)


class FixedBuckets:
    """Buckets that answer every take with ``decision`` and count the takes (no clock involved)."""

    def __init__(self, decision=None, error=None):
        self.decision, self.error, self.takes = decision, error, 0

    async def take(self, scope, identity, rates, cost_bytes):
        self.takes += 1
        if self.error is not None:
            raise self.error
        return self.decision

    def overlap(self):
        """No call overlaps another here."""
        return SimpleNamespace(others=0)

    async def close(self):
        pass


@pytest.mark.parametrize("wait_s, retry_after", [(3.2, 4), (7.0, 7), (0.004, 1)])
def test_retry_after_is_the_wait_rounded_up_to_whole_seconds(wait_s, retry_after):
    quotas = _quotas(rewards={"bytes_per_s": 10.0})
    check = QuotaCheck(quotas, KEYS, FixedBuckets(Decision(False, wait_s, "bytes")), Metrics())
    with pytest.raises(ApiError) as e:
        run(check.check(_request("/v1/rewards", "rew", b"x" * 5)))
    assert e.value.status == 429 and e.value.retry_after == retry_after and e.value.type == "bytes"


def test_a_body_over_the_byte_burst_is_413(redis_server, prefix):
    quotas = _quotas(rewards={"bytes_per_s": 10.0, "bytes_burst": 20})
    check = QuotaCheck(quotas, KEYS, QuotaBuckets(redis_server.url, prefix), Metrics())
    with pytest.raises(ApiError) as e:
        run(check.check(_request("/v1/rewards", "rew", b"x" * 21)))
    assert e.value.status == 413 and e.value.code == "body_over_quota"


def test_no_keys_no_limits_or_an_open_path_cost_nothing(redis_server, prefix):
    """Without keys there is no identity; default quotas are off; /health is open: nothing is
    stored in Redis for any of them."""
    limited = _quotas(inference={"requests_per_s": 0.001, "request_burst": 1},
                      admin={"requests_per_s": 0.001, "request_burst": 1})
    assert not QuotasConfig().limited

    async def go():
        b = QuotaBuckets(redis_server.url, prefix)
        for check in (QuotaCheck(limited, ApiKeys([], []), b, Metrics()),
                      QuotaCheck(QuotasConfig(), KEYS, b, Metrics())):
            for _ in range(3):
                await check.check(_request("/v1/chat/completions", "inf"))
        for _ in range(3):
            await QuotaCheck(limited, KEYS, b, Metrics()).check(_request("/health", "adm", method="GET"))
        keys = await b.redis.keys(f"{prefix}:*")
        await b.close()
        return keys

    assert run(go()) == []


class CountingBuckets(QuotaBuckets):
    """Real buckets that count the takes tried."""

    takes = 0

    async def take(self, *args):
        self.takes += 1
        return await super().take(*args)


def test_redis_away_holds_each_key_to_this_replicas_share_then_redis_is_tried_again():
    """A Redis that accepts the connection and never answers (a listening socket nobody reads):
    a lone check that times out finds Redis slow, not this replica busy (no other check was in
    flight with it): it falls back to the replica's share (1 request/s with a burst of 4 over 2
    replicas: a burst of 2 at 0.5/s), counted as unchecked, and pauses Redis; every key, not only
    the one whose check failed, is held to its share meanwhile; after ``PAUSE_AFTER_FAILURE_S`` (on
    the check's clock, stepped by the test) Redis is tried again."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    clock = SimpleNamespace(now=1000.0)
    metrics = Metrics()
    quotas = _quotas(inference={"requests_per_s": 1.0, "request_burst": 4}, timeout_s=0.2)
    buckets = CountingBuckets(f"redis://127.0.0.1:{silent.getsockname()[1]}", "x", 0.2)
    check = QuotaCheck(quotas, KEYS, buckets, metrics, replicas=2, clock=lambda: clock.now)

    async def attempt(key):
        try:
            await check.check(_request("/v1/chat/completions", key))
            return "ok"
        except ApiError as e:
            return (e.status, e.code, e.retry_after)

    async def go():
        t0 = time.monotonic()
        first = await attempt("inf")  # tries Redis, times out alone: the share decides
        took = time.monotonic() - t0
        paused = [await attempt("inf"), await attempt("inf"), await attempt("inf2"), await attempt("inf2"),
                  await attempt("inf2")]
        tries = [buckets.takes]
        clock.now += 2.0  # past the pause, and one share token refilled (0.5/s)
        again = await attempt("inf")
        tries.append(buckets.takes)
        await check.close()
        return first, paused, again, took, tries

    try:
        first, paused, again, took, tries = run(go())
    finally:
        silent.close()
    refused = (429, "rate_limit_exceeded", 2)  # one request at 0.5/s
    assert first == "ok" and paused == ["ok", refused, "ok", "ok", refused]
    assert again == "ok" and tries == [1, 2]  # tried once, paused, tried again (and failed again)
    assert took < 10.0  # bounded by the timeout, not hung (no speed target)
    unchecked = [c for c in metrics.calls if c[1] is None]
    assert len(unchecked) == 7 and ("inference", "requests") in metrics.calls
    assert ("inference", "busy") not in metrics.calls


def _config_256(redis_url, prefix, **over):
    from serve_rft.config import load_config

    sets = {"service.api_keys": "[inf,inf2]", "service.admin_keys": "[adm]",
            "service.quotas.inference.requests_per_s": "1", "service.quotas.inference.request_burst": "1",
            "service.quotas.timeout_s": "2.0", "explorer.max_ongoing_requests": "256",
            "buffer.redis_url": redis_url, "buffer.key_prefix": prefix, **over}
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


async def _concurrent(check, n, key="inf"):
    """``n`` checks at once: how many passed, were refused (429) and the seconds they took."""
    async def one():
        try:
            await check.check(_request("/v1/chat/completions", key))
            return True
        except ApiError as e:
            assert e.status == 429 and e.code == "rate_limit_exceeded", e.body()
            return False

    t0 = time.monotonic()
    out = await asyncio.gather(*(one() for _ in range(n)))
    return sum(out), time.monotonic() - t0


def test_256_concurrent_checks_of_a_1_per_s_key_let_its_burst_through(redis_server, prefix):
    """A replica configured for 256 requests at once (`QuotaCheck.from_config`): 256 concurrent
    checks of a key at 1 request/s with a burst of 1 pass its burst (plus what refilled while they
    ran, at 1/s) and are every one checked against Redis (redis-py's default pool of 100 would
    raise on the 101st connection and let the rest through unchecked).

    What this asks is the pool's size, not the machine's speed: the away decision reads a clock
    that stands still, and each check waits up to the longest ``quotas.timeout_s`` (5 s). With
    real time and 2 s, a loaded CI machine timed 96 of the checks out until `RedisHealth` judged
    Redis away, and those passed on the replica's share unchecked."""
    metrics = Metrics()
    now = time.monotonic()
    check = QuotaCheck.from_config(_config_256(redis_server.url, prefix, **{"service.quotas.timeout_s": "5.0"}),
                                   KEYS, metrics, clock=lambda: now)

    async def go():
        out = await _concurrent(check, 256)
        await check.close()
        return out

    passed, elapsed = run(go())
    assert 1 <= passed <= 1 + math.floor(elapsed), (passed, elapsed)
    assert [c for c in metrics.calls if c[1] is None] == []
    assert metrics.calls.count(("inference", "requests")) == 256 - passed


def test_a_slow_redis_is_busy_at_first_then_holds_keys_to_the_replicas_share(redis_server, prefix):
    """Redis paused (``CLIENT PAUSE``) past the check's timeout: 256 concurrent checks of a key at
    1 request/s with a burst of 1 on one replica, right after an answered check, are refused as
    busy (429 ``quota_check_busy``: a replica whose own loop is slow looks the same, and must not
    pass anything); once nothing was answered for ``AWAY_AFTER_S``, 256 more pass the share's
    burst of 1 and no more.

    The away decision reads a simulated clock that stands still during each wave: on a loaded
    CI machine the first wave's 256 timeouts took longer than ``AWAY_AFTER_S`` of real time, and
    its last checks rightly found Redis away. Without `RedisHealth`'s busy branch (``away``
    always true) the first wave passes 1 and refuses the rest as rate-limited.

    The pause holds writes and scripts only (``CLIENT PAUSE ... WRITE``): the test's own
    connection ends it with ``CLIENT UNPAUSE`` once both waves ran, so its bound (60 s) is far
    above what the waves take on a loaded machine (a pause of 8 s of every client, which held
    ``CLIENT UNPAUSE`` too, once ran out during the second wave)."""
    import redis

    metrics = Metrics()
    now = [time.monotonic()]
    cfg = _config_256(redis_server.url, prefix, **{"service.quotas.timeout_s": "0.2",
                                                   "explorer.num_replicas": "1"})
    check = QuotaCheck.from_config(cfg, KEYS, metrics, clock=lambda: now[0])
    admin = redis.Redis.from_url(redis_server.url)

    async def wave(n):
        async def one():
            try:
                await check.check(_request("/v1/chat/completions", "inf"))
                return "ok"
            except ApiError as e:
                return e.code
        return await asyncio.gather(*(one() for _ in range(n)))

    async def go():
        await check.check(_request("/v1/chat/completions", "inf2"))  # answered: Redis is there
        admin.execute_command("CLIENT", "PAUSE", int(PAUSE_S * 1000), "WRITE")  # the check is a script
        paused_until[0] = time.monotonic() + PAUSE_S
        first = await wave(256)
        now[0] += AWAY_AFTER_S + 0.2
        second = await wave(256)
        assert time.monotonic() < paused_until[0], "both waves ran while Redis was paused"
        await check.close()
        return first, second

    PAUSE_S, paused_until = 60.0, [time.monotonic()]
    try:
        first, second = run(go())
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
    assert set(first) == {"quota_check_busy"}, {c: first.count(c) for c in set(first)}
    assert second.count("ok") == 1, {c: second.count(c) for c in set(second)}
    assert set(second) == {"ok", "rate_limit_exceeded"}
    assert len([c for c in metrics.calls if c[1] is None]) == 256


def test_all_quota_connections_in_use_is_429_busy_not_redis_away(redis_server, prefix):
    """A replica whose every quota connection stays in use past the wait answers 429
    ``quota_check_busy`` with Retry-After 1; nothing passes unchecked."""
    metrics = Metrics()
    quotas = _quotas(inference={"requests_per_s": 1.0}, timeout_s=0.1)
    buckets = QuotaBuckets(redis_server.url, prefix, 0.1, max_connections=2)
    check = QuotaCheck(quotas, KEYS, buckets, metrics)

    async def go():
        for _ in range(2):  # both connections taken by checks still in flight
            await buckets._slots.acquire()
        with pytest.raises(ApiError) as e:
            await check.check(_request("/v1/chat/completions", "inf"))
        buckets._slots.release()
        await check.check(_request("/v1/chat/completions", "inf"))  # a slot free again: checked
        await check.close()
        return e.value

    e = run(go())
    assert (e.status, e.code, e.retry_after) == (429, "quota_check_busy", 1)
    assert e.body()["error"]["type"] == "requests"
    assert metrics.calls == [("inference", "busy")]


def test_the_share_of_a_body_larger_than_it_is_allowed_on_a_full_bucket():
    """While Redis is away a body within the byte burst but over the replica's share still passes
    on a full bucket (then the share's debt refills at its rate); over the burst: too large."""
    clock = SimpleNamespace(now=0.0)
    local = LocalBuckets(4, clock=lambda: clock.now)
    rates = Rates(0.0, 0, 100.0, 1000)  # share: 25 B/s, 250 B
    assert local.take("rewards", "k", rates, 900).allowed
    d = local.take("rewards", "k", rates, 10)
    assert not d.allowed and d.limit == "bytes" and d.wait_s == pytest.approx((650 + 10) / 25)
    clock.now += (650 + 10) / 25
    assert local.take("rewards", "k", rates, 10).allowed
    assert local.take("rewards", "k", rates, 1001).too_large


def test_over_the_replicas_app_a_throttled_key_gets_429_json_and_another_key_is_served(redis_server, prefix):
    """The replica's app with its dependency answered by the key check then the quota check (no
    Serve replica): the third admin request of a burst of 2 gets 429 with Retry-After; the
    second admin key is served. (``/docs``: an admin page that needs no replica and leaves the
    app's cached API document alone.)"""
    from fastapi.testclient import TestClient

    from serve_rft.explorer.http import app as http

    check = QuotaCheck(_quotas(admin={"requests_per_s": 0.001, "request_burst": 2}), KEYS,
                       QuotaBuckets(redis_server.url, prefix), Metrics())

    async def authorize(request: Request) -> None:
        KEYS.check(request.url.path, request.headers.get("authorization"))
        await check.check(request)

    http.app.dependency_overrides[http.authorize] = authorize
    try:
        with TestClient(http.app) as client:  # one event loop for every request (the Redis client's)
            adm = {"Authorization": "Bearer adm"}
            t0 = time.monotonic()
            assert [client.get("/docs", headers=adm).status_code for _ in range(2)] == [200, 200]
            r = client.get("/docs", headers=adm)
            elapsed = time.monotonic() - t0
            # 1 token at 0.001/s: 1000 s less the time since the first request, rounded up
            assert r.status_code == 429
            assert math.ceil(1000.0 - elapsed - SLACK) <= int(r.headers["retry-after"]) <= 1000, elapsed
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert client.get("/docs", headers={"Authorization": "Bearer adm2"}).status_code == 200
            assert client.get("/docs").status_code == 401  # the key check comes first
    finally:
        http.app.dependency_overrides.clear()


def test_quota_settings_are_bounded_and_a_burst_of_0_is_one_seconds_worth():
    from pydantic import ValidationError

    from serve_rft.config import load_config

    cfg = load_config(None, ["service.quotas.inference.requests_per_s=2.5",
                             "service.quotas.rewards.bytes_per_s=1000", "service.quotas.rewards.bytes_burst=4096"])
    q = cfg.service.quotas
    assert q.limited and not q.admin.limited
    assert (q.inference.request_capacity, q.rewards.bytes_capacity, q.rewards.request_capacity) == (3, 4096, 1)
    for bad in ({"requests_per_s": -1}, {"bytes_burst": -5}, {"requests_per_s": 1e9}, {"rps": 1}):
        with pytest.raises(ValidationError):
            QuotasConfig.model_validate({"inference": bad})
    with pytest.raises(ValidationError):
        QuotasConfig.model_validate({"timeout_s": 0})


def test_the_quota_still_refuses_when_redis_is_past_maxmemory(tmp_path, prefix):
    """A key that fills the store (noeviction, past maxmemory) is still held to its quota: the
    bucket script runs with ``allow-oom`` (its hash is tiny and expires), so it neither raises
    OutOfMemoryError (which would fail the check open) nor lets the key pass unchecked."""
    import redis

    from serve_rft.buffer.redis_server import start_redis

    server = start_redis(tmp_path / "redis", maxmemory_bytes=4 * 1024 * 1024)
    try:
        r = redis.Redis.from_url(server.url)
        pipe = r.pipeline(transaction=False)
        for i in range(400):  # ~1.7 MB, then small writes until one is refused
            pipe.set(f"big:{i}", b"x" * 4096)
        pipe.execute()
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(10_000):
                pipe = r.pipeline(transaction=False)
                for j in range(100):
                    pipe.set(f"fill:{i}:{j}", b"x" * 16)
                pipe.execute()
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            r.hset("one-more", "r", "1")
        r.close()
        rates = Rates(requests_per_s=0.001, request_burst=2, bytes_per_s=0, bytes_burst=0)
        d, _ = _takes(QuotaBuckets(server.url, prefix, timeout_s=5.0), 3, rates)
        assert [x.allowed for x in d] == [True, True, False]
        assert d[2].limit == "requests" and d[2].wait_s > 900
    finally:
        server.stop()


def test_a_tenants_own_buckets_hold_its_keys_and_no_other_keys(redis_server, prefix):
    """``service.tenants.<t>.scope_quotas``: dave's keys get his 1-request burst on the inference
    scope; a key of the default tenant (no inference quota) is never held."""
    from serve_rft.config import Config

    cfg = Config.model_validate({"buffer": {"redis_url": redis_server.url, "key_prefix": prefix}, "service": {
        "api_keys": ["inf"], "tenants": {"dave": {"api_keys": ["d1"], "scope_quotas": {
            "inference": {"requests_per_s": 0.01, "request_burst": 1}}}}}})
    keys = ApiKeys.from_config(cfg.service)
    check = QuotaCheck.from_config(cfg, keys, Metrics())

    def asked(key):
        r = _request("/v1/chat/completions", key)
        r.state.identity = keys.check("/v1/chat/completions", f"Bearer {key}")
        return r

    async def go():
        await check.check(asked("d1"))
        with pytest.raises(ApiError) as e:
            await check.check(asked("d1"))
        for _ in range(3):
            await check.check(asked("inf"))
        await check.close()
        return e.value

    e = run(go())
    assert e.status == 429 and e.body()["error"]["code"] == "rate_limit_exceeded"


class _StallOnce:
    """Quota buckets whose first call times out while another check overlaps it (the replica's
    event loop stalled), then answer: the shape of a replica loading weights beside its engine."""

    def __init__(self, stalls: int):
        self.stalls, self.calls = stalls, 0

    def overlap(self):
        return SimpleNamespace(others=1)

    async def take(self, scope, identity, rates, cost):
        self.calls += 1
        if self.calls <= self.stalls:
            raise TimeoutError
        return Decision(True)


@pytest.mark.parametrize("stalls, outcome", [(1, "ok"), (2, "quota_check_busy")])
def test_a_check_slow_once_while_redis_answers_is_asked_again_and_slow_twice_is_busy(stalls, outcome):
    """A check slower than the timeout while Redis answered this replica's other checks is asked
    of Redis again once (`BUSY_RETRIES`): a stall of the replica's own loop answers the caller,
    two in a row refuse it as busy (429 ``quota_check_busy``), and nothing passes unchecked.
    Shown failing with ``BUSY_RETRIES = 0``: the once-slow check was refused as busy (the keyed
    stack's reward poster got that 429 while its replica loaded a version)."""
    metrics = Metrics()
    buckets = _StallOnce(stalls)
    check = QuotaCheck(_quotas(inference={"requests_per_s": 1.0}), KEYS, buckets, metrics)

    async def go():
        try:
            await check.check(_request("/v1/chat/completions", "inf"))
            return "ok"
        except ApiError as e:
            assert e.status == 429 and e.retry_after == 1
            return e.code

    assert run(go()) == outcome
    assert buckets.calls == 2
    assert [c for c in metrics.calls if c[1] is None] == []  # none unchecked

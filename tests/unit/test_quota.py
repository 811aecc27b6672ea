"""Per-key quotas: the token-bucket script against a real redis-server (burst, refusal with the
right wait, refill by Redis TIME, independent keys, expiry, byte cost), and the check a replica
runs after the key check (429 + Retry-After as OpenAI error JSON over the replica's app, the
body cost of a chunked request, fail open when Redis is away)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from starlette.requests import Request

from serve_rft.buffer.quota import QuotaBuckets, Rates, key_identity
from serve_rft.config.service import QuotasConfig
from serve_rft.explorer.auth import ApiKeys
from serve_rft.explorer.body import read_body
from serve_rft.explorer.protocol import ApiError
from serve_rft.explorer.quota import QuotaCheck


def run(coro):
    return asyncio.run(coro)


class Metrics:
    """Records ``quota(scope, limit)`` calls (the replica's are Ray metrics)."""

    def __init__(self):
        self.calls: list[tuple[str, str | None]] = []

    def quota(self, scope, limit):
        self.calls.append((scope, limit))


@pytest.fixture
def prefix():
    return f"q{uuid.uuid4().hex[:8]}"


def _takes(buckets, n, rates, identity="k", cost=0, scope="inference"):
    async def go():
        out = [await buckets.take(scope, identity, rates, cost) for _ in range(n)]
        await buckets.close()
        return out
    return run(go())


def test_burst_then_refusal_with_the_wait_until_one_token(redis_server, prefix):
    """A full bucket of 3 allows 3 at once; the 4th waits about 1/rate (1/s: ~1 s)."""
    rates = Rates(1.0, 3, 0.0, 0)
    d = _takes(QuotaBuckets(redis_server.url, prefix), 4, rates)
    assert [x.allowed for x in d] == [True, True, True, False]
    assert d[3].limit == "requests" and not d[3].too_large
    assert 0.9 < d[3].wait_s <= 1.0


def test_refill_by_elapsed_time(redis_server, prefix):
    """At 5/s with a burst of 2: empty, then 0.5 s later 2.5 tokens are owed but at most 2 refill."""
    rates = Rates(5.0, 2, 0.0, 0)

    async def go():
        b = QuotaBuckets(redis_server.url, prefix)
        first = [(await b.take("inference", "k", rates, 0)).allowed for _ in range(3)]
        await asyncio.sleep(0.5)
        later = [(await b.take("inference", "k", rates, 0)).allowed for _ in range(3)]
        await b.close()
        return first, later

    first, later = run(go())
    assert first == [True, True, False]
    assert later == [True, True, False]  # refilled to the burst, no further


def test_two_keys_and_two_scopes_are_independent(redis_server, prefix):
    rates = Rates(1.0, 1, 0.0, 0)

    async def go():
        b = QuotaBuckets(redis_server.url, prefix)
        out = [(await b.take(s, i, rates, 0)).allowed
               for s, i in (("inference", "a"), ("inference", "a"), ("inference", "b"), ("rewards", "a"))]
        await b.close()
        return out

    assert run(go()) == [True, False, True, True]


def test_a_bucket_expires_when_it_would_be_full_again(redis_server, prefix):
    """The key's TTL: time to refill what was taken (+1 s); the key holds a hash, never the API key."""
    rates = Rates(2.0, 4, 0.0, 0)

    async def go():
        b = QuotaBuckets(redis_server.url, prefix)
        ident = key_identity("secret-key")
        for _ in range(3):
            assert (await b.take("inference", ident, rates, 0)).allowed
        ttl = await b.redis.pttl(b.key("inference", ident))
        keys = await b.redis.keys(f"{prefix}:*")
        await b.close()
        return ttl, keys, ident

    ttl, keys, ident = run(go())
    assert 2000 < ttl <= 2500  # 3 tokens at 2/s = 1.5 s, + 1 s
    assert keys == [f"{prefix}:quota:inference:{ident}"]
    assert "secret-key" not in ident and len(ident) == 32


def test_bytes_cost_and_a_body_over_the_burst(redis_server, prefix):
    """Bytes: 100 B/s, burst 1500 B: 1000 then 600 is short by 100 B (1 s); all or nothing (the
    request token is not taken either); a body over the burst is never allowed."""
    rates = Rates(0.001, 100, 100.0, 1500)

    async def go():
        b = QuotaBuckets(redis_server.url, prefix)
        out = [await b.take("rewards", "k", rates, c) for c in (1000, 600, 400, 1501)]
        left = await b.redis.hget(b.key("rewards", "k"), "r")
        await b.close()
        return out, float(left)

    out, request_tokens = run(go())
    assert out[0].allowed and not out[1].allowed and out[2].allowed
    assert out[1].limit == "bytes" and 0.9 < out[1].wait_s <= 1.0
    assert 97.9 < request_tokens < 98.1  # two takes, not three
    assert not out[3].allowed and out[3].too_large


def test_the_longer_wait_of_the_two_buckets_is_answered(redis_server, prefix):
    rates = Rates(1.0, 1, 10.0, 100)
    d = _takes(QuotaBuckets(redis_server.url, prefix), 2, rates, cost=100)
    assert d[0].allowed and not d[1].allowed
    assert d[1].limit == "bytes" and 9.9 < d[1].wait_s <= 10.0  # 100 B at 10 B/s beats 1 s


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
    quotas = _quotas(inference={"requests_per_s": 0.5, "request_burst": 1})
    check = QuotaCheck(quotas, KEYS, QuotaBuckets(redis_server.url, prefix), metrics)

    async def go():
        await check.check(_request("/v1/chat/completions", "inf"))
        with pytest.raises(ApiError) as e:
            await check.check(_request("/v1/chat/completions", "inf"))
        await check.check(_request("/v1/chat/completions", "inf2"))  # another key: served
        await check.check(_request("/v1/rewards", "inf"))  # another scope: unlimited
        await check.close()
        return e.value

    e = run(go())
    assert e.status == 429 and e.retry_after == 2  # 1 token at 0.5/s: 2 s, whole seconds
    assert e.body()["error"]["code"] == "rate_limit_exceeded" and e.body()["error"]["type"] == "requests"
    assert metrics.calls == [("inference", "requests")]


def test_chunked_body_is_charged_as_read_and_the_route_reads_it_again(redis_server, prefix):
    quotas = _quotas(rewards={"bytes_per_s": 10.0, "bytes_burst": 40})
    check = QuotaCheck(quotas, KEYS, QuotaBuckets(redis_server.url, prefix), Metrics())
    body = b'{"completion_id": "c", "reward": 1.0}'  # 38 bytes, in chunks of 7

    async def go():
        first = _request("/v1/rewards", "rew", body, chunked=True)
        await check.check(first)
        again = await read_body(first)
        with pytest.raises(ApiError) as e:
            await check.check(_request("/v1/rewards", "rew", body, chunked=True))
        await check.close()
        return again, e.value

    again, e = run(go())
    assert again == body
    assert e.status == 429 and e.retry_after == 4 and e.type == "bytes"  # 36 B short at 10 B/s: 3.6 s


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


def test_redis_away_fails_open_within_the_timeout_and_is_counted():
    """An unreachable Redis: the request passes, counted, within ``timeout_s``; the next second's
    requests pass without trying Redis again."""
    metrics = Metrics()
    quotas = _quotas(inference={"requests_per_s": 1.0}, timeout_s=0.2)
    # a non-routable address (RFC 5737 TEST-NET-1): the connect hangs until the timeout
    check = QuotaCheck(quotas, KEYS, QuotaBuckets("redis://192.0.2.1:6379", "x", 0.2), metrics)

    async def go():
        t0 = time.monotonic()
        await check.check(_request("/v1/chat/completions", "inf"))
        first = time.monotonic() - t0
        t0 = time.monotonic()
        await check.check(_request("/v1/chat/completions", "inf"))
        return first, time.monotonic() - t0

    first, second = run(go())
    assert first < 0.5 and second < 0.05
    assert metrics.calls == [("inference", None), ("inference", None)]


def test_over_the_replicas_app_a_throttled_key_gets_429_json_and_another_key_is_served(redis_server, prefix):
    """The replica's app with its dependency answered by the key check then the quota check (no
    Serve replica): the third admin request of a burst of 2 gets 429 with Retry-After; the
    second admin key is served. (``/docs``: an admin page that needs no replica and leaves the
    app's cached API document alone.)"""
    from fastapi.testclient import TestClient

    from serve_rft.explorer import http

    check = QuotaCheck(_quotas(admin={"requests_per_s": 0.001, "request_burst": 2}), KEYS,
                       QuotaBuckets(redis_server.url, prefix), Metrics())

    async def authorize(request: Request) -> None:
        KEYS.check(request.url.path, request.headers.get("authorization"))
        await check.check(request)

    http.app.dependency_overrides[http.authorize] = authorize
    try:
        with TestClient(http.app) as client:  # one event loop for every request (the Redis client's)
            adm = {"Authorization": "Bearer adm"}
            assert [client.get("/docs", headers=adm).status_code for _ in range(2)] == [200, 200]
            r = client.get("/docs", headers=adm)
            assert r.status_code == 429 and 900 < int(r.headers["retry-after"]) <= 1000  # ~1 token at 0.001/s
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

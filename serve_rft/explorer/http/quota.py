"""The per-key quota check of every keyed route: after the key check, before the body is parsed
or anything is generated.

Each API key has, per scope of route (`serve_rft.explorer.http.auth`: inference, rewards, admin), a
request bucket and a byte bucket (`serve_rft.buffer.quota`, in the store's Redis, shared by every
replica), sized by ``service.quotas.<scope>`` (`serve_rft.config.service.QuotasConfig`; off by
default). A request costs one request and its body's bytes: ``Content-Length``, or for a body sent
without one (chunked) the body as read, bounded first (`serve_rft.explorer.http.body.read_body`) and
kept for the route. A key short of either gets 429 with ``Retry-After`` (whole seconds, rounded
up) and OpenAI's rate-limit error JSON: ``type`` the limit reached (``requests``; ``bytes`` where
OpenAI says ``tokens``), ``code`` ``rate_limit_exceeded`` (OpenAI's error codes guide,
https://platform.openai.com/docs/guides/error-codes, "429 - Rate limit reached for requests"; the
body's shape as OpenAI sends it is quoted in github.com/Huanshere/VideoLingo/issues/34). A body
larger than the byte burst can never fit: 413 ``body_over_quota``.

Redis away: fail safe. While the shared buckets cannot be reached (unreachable or refusing, or
slower than ``quotas.timeout_s`` alone or with no check answered for `AWAY_AFTER_S`; a slow check
that others overlapped while Redis answered is asked again (`BUSY_RETRIES`), and slow again it is
a busy replica: 429 ``quota_check_busy``) each replica holds every key to its share of the quota
(the quota divided by the replicas, `serve_rft.buffer.quota.LocalBuckets`) from memory, counted
(``serve_rft_quota_unchecked_total``: not checked against the shared buckets); after a failure the
replica stays on its share for a second before trying Redis again, so an outage adds at most one
timeout per second per replica to the latency. Refusing every request instead would turn a store
outage into a service outage; passing every request would let one key take every replica (and
did, past redis-py's default pool of 100 connections). A replica whose quota connections are all
in use (``explorer.max_ongoing_requests`` of them) is busy, not cut off from Redis: a request that
finds none free within ``quotas.timeout_s`` gets 429 ``quota_check_busy`` with ``Retry-After: 1``.
"""

from __future__ import annotations

import logging
import math
import time

from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.requests import Request

from serve_rft.buffer.quota import LocalBuckets, QuotaBuckets, QuotaBusy, Rates, key_identity
from serve_rft.explorer.http.auth import ApiKeys, required_scope
from serve_rft.explorer.http.body import MAX_BODY_BYTES, read_body
from serve_rft.explorer.http.protocol import ApiError

log = logging.getLogger("serve_rft.explorer.http.quota")
PAUSE_AFTER_FAILURE_S = 1.0
"""After a failed check, requests are held to the replica's share this long before Redis is tried
again, s."""
AWAY_AFTER_S = 2.0
"""A check that times out finds Redis away only when no check of this replica got an answer for
this long; before that it is a busy check (429 ``quota_check_busy``), s."""


BUSY_RETRIES = 1
"""A check that was slow while Redis answered this replica's other checks is asked of Redis again
this many times before it is refused as busy: a replica whose event loop stalled for a moment
(its engine loading a version beside it on a small machine) answers the request instead of
refusing it. The late answer of the first call may have charged the bucket already, so such a
request may cost its key twice: the error is on the quota's side, never the caller's gain."""


class RedisHealth:
    """Whether a failed check means Redis is away: unreachable or refusing, at once; slower than
    ``quotas.timeout_s``, only once no check got an answer for `AWAY_AFTER_S`. A replica whose own
    event loop is slow (starved of CPU, hundreds of requests at once) times out while Redis answers
    its other checks; that replica is busy, and its checks must not pass on its share.

    Args:
        clock: monotonic seconds (it starts as if Redis had just answered).
    """

    def __init__(self, clock):
        self.clock, self.last_answer = clock, clock()

    def answered(self) -> None:
        """A check got Redis's answer now."""
        self.last_answer = self.clock()

    def away(self, e: Exception, others_in_flight: int = 0) -> bool:
        """Whether ``e`` (a failed check's error) means Redis is away (else: busy). A slow check is
        a busy replica only while other checks are in flight with it (``others_in_flight``) and
        Redis answered one within `AWAY_AFTER_S`; a lone slow check is a slow Redis."""
        slow = isinstance(e, (TimeoutError, RedisTimeoutError))
        return (not slow or others_in_flight == 0
                or self.clock() - self.last_answer >= AWAY_AFTER_S)


def busy(scope: str, metrics) -> ApiError:
    """The 429 of a check that found no quota connection free, or no answer, in time (counted)."""
    metrics.quota(scope, "busy")
    return ApiError(429, "This replica's quota checks are all in use; please try again in 1s.",
                    type_="requests", code="quota_check_busy", retry_after=1)


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (None: no bearer key)."""
    scheme, _, key = (authorization or "").partition(" ")
    return (key.strip() or None) if scheme.lower() == "bearer" else None


async def body_bytes(request: Request, max_bytes: int = MAX_BODY_BYTES) -> int:
    """The request body's size, bytes: its ``Content-Length``; without one, the body is read
    (at most ``max_bytes``) and kept where the route reads it again (Starlette's `Request.body`
    cache, which `Request.stream` replays).

    Raises:
        ApiError: 413 larger than ``max_bytes`` (declared or streamed).
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit():
        if int(declared) > max_bytes:
            raise ApiError(413, f"request body is larger than {max_bytes} bytes", code="body_too_large")
        return int(declared)
    if request.method in ("GET", "HEAD", "DELETE", "OPTIONS"):
        return 0
    raw = await read_body(request, max_bytes)
    request._body = raw  # Starlette's own body cache: the route's read gets these bytes
    return len(raw)


class QuotaCheck:
    """Takes each keyed request's cost from its key's buckets or refuses it.

    Args:
        quotas: `serve_rft.config.service.QuotasConfig`.
        keys: the service's keys (no keys: no caller identity, no quota).
        buckets: the shared buckets (None: no quota).
        metrics: has ``quota(scope, limit)`` (`serve_rft.observability.explorer_metrics`).
        replicas: the divisor of a key's share while Redis is away.
        clock: monotonic seconds (the pause and the replica's share).
        tenant_scopes: tenant -> scope -> its own ``ScopeQuota`` (``service.tenants.<t>.scope_quotas``).
    """

    def __init__(self, quotas, keys: ApiKeys, buckets: QuotaBuckets | None, metrics, replicas: int = 1,
                 clock=time.monotonic, tenant_scopes: dict | None = None):
        self.quotas, self.keys, self.buckets, self.metrics = quotas, keys, buckets, metrics
        self.tenant_scopes = tenant_scopes or {}
        self.local = LocalBuckets(replicas, clock)
        self.clock = clock
        self.health = RedisHealth(clock)
        self._paused_until = 0.0

    @classmethod
    def from_config(cls, cfg, keys: ApiKeys, metrics, clock=time.monotonic) -> "QuotaCheck":
        """The check of a `serve_rft.config.Config`: buckets on ``buffer.redis_url`` when keys
        and a limit are configured, with one connection per request a replica runs at once
        (``explorer.max_ongoing_requests``). A key's share while Redis is away divides by the
        most replicas the deployment may run (``explorer.autoscaling.max_replicas``, else
        ``explorer.num_replicas``): the config is what every replica knows without asking Redis
        or Serve, and the largest count keeps the replicas together within the quota (with
        fewer running, a key gets less than its quota during the outage, never more). ``clock``:
        as in `QuotaCheck`."""
        quotas, ecfg = cfg.service.quotas, cfg.explorer
        tenants = cfg.service.tenants
        tiers = [q for t in tenants.values() for q in (t.quota, t.key_quota, *t.scope_quotas.values())
                 if q is not None]
        on = keys.enabled and (quotas.limited or any(q.limited for q in tiers))
        buckets = QuotaBuckets(cfg.buffer.redis_url, cfg.buffer.key_prefix, quotas.timeout_s,
                               max_connections=ecfg.max_ongoing_requests) if on else None
        replicas = ecfg.autoscaling.max_replicas if ecfg.autoscaling is not None else ecfg.num_replicas
        own = {name: t.scope_quotas for name, t in tenants.items() if t.scope_quotas}
        return cls(quotas, keys, buckets, metrics, replicas=replicas, clock=clock, tenant_scopes=own)

    def rates(self, scope: str, tenant: str | None = None) -> Rates:
        """The limits of ``scope`` for a key of ``tenant``: the tenant's own (``service.tenants.
        <tenant>.scope_quotas``), else the service's."""
        q = self.tenant_scopes.get(tenant, {}).get(scope) or self.quotas.scope(scope)
        return Rates(q.requests_per_s, q.request_capacity, q.bytes_per_s, q.bytes_capacity)

    async def check(self, request: Request) -> None:
        """Charge ``request`` to its key (call after `ApiKeys.check` allowed it).

        Raises:
            ApiError: 429 ``rate_limit_exceeded`` with ``retry_after`` (a bucket is short, or this
                replica's share of it while Redis is away); 429 ``quota_check_busy`` (no quota
                connection free in time); 413 ``body_too_large`` / ``body_over_quota`` (larger
                than any request / than the byte burst).
        """
        scope = required_scope(request.url.path)
        key = bearer_key(request.headers.get("authorization"))
        if self.buckets is None or scope is None or key is None or not self.keys.enabled:
            return
        who = getattr(request.state, "identity", None)
        rates = self.rates(scope, who.tenant if who is not None else None)
        if not rates.limited:
            return
        cost = await body_bytes(request) if rates.bytes_per_s > 0 else 0
        identity = key_identity(key)
        if self.clock() < self._paused_until:
            decision = self._local(scope, identity, rates, cost)
        else:
            decision = None
            for attempt in range(1 + BUSY_RETRIES):
                overlap = self.buckets.overlap()
                try:
                    decision = await self.buckets.take(scope, identity, rates, cost)
                    self.health.answered()
                    break
                except QuotaBusy:
                    raise busy(scope, self.metrics) from None
                except (RedisError, TimeoutError) as e:
                    if self.health.away(e, overlap.others):
                        self._paused_until = self.clock() + PAUSE_AFTER_FAILURE_S
                        log.warning("quota store unreachable (%r); keys are held to this replica's share "
                                    "for %.0f s", e, PAUSE_AFTER_FAILURE_S)
                        decision = self._local(scope, identity, rates, cost)
                        break
                    if attempt == BUSY_RETRIES:  # slow again: a busy replica
                        raise busy(scope, self.metrics) from None
        if decision.allowed:
            return
        self.metrics.quota(scope, decision.limit)
        if decision.too_large:
            raise ApiError(413, f"request body of {cost} bytes is larger than this key's {scope} byte "
                           f"burst ({rates.bytes_burst:.0f} bytes)", code="body_over_quota")
        retry = max(1, math.ceil(decision.wait_s))
        what = "requests" if decision.limit == "requests" else "request bytes"
        rate = rates.requests_per_s if decision.limit == "requests" else rates.bytes_per_s
        raise ApiError(429, f"Rate limit reached for {what} on the {scope} scope of this key: "
                       f"{rate:g}/s. Please try again in {decision.wait_s:.3g}s.",
                       type_=decision.limit, code="rate_limit_exceeded", retry_after=retry)

    def _local(self, scope: str, identity: str, rates: Rates, cost: int):
        """This replica's share decides (Redis away), counted as unchecked."""
        self.metrics.quota(scope, None)
        return self.local.take(scope, identity, rates, cost)

    async def close(self) -> None:
        if self.buckets is not None:
            await self.buckets.close()

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

Redis away: fail open. The quota keeps one caller from filling the store the tenants share and
from starving them; while Redis is unreachable nothing is being stored (chat is answered unlogged,
rewards get 504), and refusing every request then would turn a store outage into a service
outage. The check is bounded (``quotas.timeout_s``), counted (``serve_rft_quota_unchecked_total``)
and skipped for a second after a failure, so an outage adds at most one timeout per second per
replica to the latency.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from redis.exceptions import RedisError
from starlette.requests import Request

from serve_rft.buffer.quota import QuotaBuckets, Rates, key_identity
from serve_rft.explorer.http.auth import ApiKeys, required_scope
from serve_rft.explorer.http.body import MAX_BODY_BYTES, read_body
from serve_rft.explorer.http.protocol import ApiError

log = logging.getLogger("serve_rft.explorer.http.quota")
PAUSE_AFTER_FAILURE_S = 1.0
"""After a failed check, requests pass unchecked this long before Redis is tried again, s."""


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
    """

    def __init__(self, quotas, keys: ApiKeys, buckets: QuotaBuckets | None, metrics):
        self.quotas, self.keys, self.buckets, self.metrics = quotas, keys, buckets, metrics
        self._paused_until = 0.0

    @classmethod
    def from_config(cls, cfg, keys: ApiKeys, metrics) -> "QuotaCheck":
        """The check of a `serve_rft.config.Config`: buckets on ``buffer.redis_url`` when keys
        and a limit are configured."""
        quotas = cfg.service.quotas
        on = keys.enabled and quotas.limited
        buckets = QuotaBuckets(cfg.buffer.redis_url, cfg.buffer.key_prefix, quotas.timeout_s) if on else None
        return cls(quotas, keys, buckets, metrics)

    def rates(self, scope: str) -> Rates:
        """The limits of ``scope`` from the config."""
        q = self.quotas.scope(scope)
        return Rates(q.requests_per_s, q.request_capacity, q.bytes_per_s, q.bytes_capacity)

    async def check(self, request: Request) -> None:
        """Charge ``request`` to its key (call after `ApiKeys.check` allowed it).

        Raises:
            ApiError: 429 ``rate_limit_exceeded`` with ``retry_after`` (a bucket is short); 413
                ``body_too_large`` / ``body_over_quota`` (larger than any request / than the
                byte burst).
        """
        scope = required_scope(request.url.path)
        key = bearer_key(request.headers.get("authorization"))
        if self.buckets is None or scope is None or key is None or not self.keys.enabled:
            return
        rates = self.rates(scope)
        if not rates.limited:
            return
        cost = await body_bytes(request) if rates.bytes_per_s > 0 else 0
        if time.monotonic() < self._paused_until:
            self.metrics.quota(scope, None)
            return
        try:
            decision = await asyncio.wait_for(self.buckets.take(scope, key_identity(key), rates, cost),
                                              self.quotas.timeout_s)
        except (RedisError, asyncio.TimeoutError) as e:
            self._paused_until = time.monotonic() + PAUSE_AFTER_FAILURE_S
            self.metrics.quota(scope, None)
            log.warning("quota check skipped (Redis: %r); requests pass unchecked for %.0f s",
                        e, PAUSE_AFTER_FAILURE_S)
            return
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

    async def close(self) -> None:
        if self.buckets is not None:
            await self.buckets.close()

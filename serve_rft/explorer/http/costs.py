"""Charge a chat or completion request what it costs, to its key and its tenant: a slot in flight
while it runs and a token budget taken up front and settled when it ends
(`serve_rft.buffer.usage`; limits ``service.quotas.per_key`` / ``per_tenant``, off by default).

The check runs after the request is parsed (its ``n`` and ``max_tokens`` are known) and before
anything is generated. A caller short of either gets 429 with ``Retry-After`` and OpenAI's
rate-limit error JSON (``type`` ``requests`` for slots, ``tokens`` for the budget; ``code``
``in_flight_limit_exceeded`` / ``rate_limit_exceeded``); a request larger than the whole budget
gets 413 ``tokens_over_quota`` (waiting never helps). Each refusal says whether the key's or the
tenant's limit was reached, so one key at its limit never refuses another key's request unless
the tenant's shared limit is reached.

The replica renews its requests' leases every ``quotas.lease_s / 3``; a replica that dies stops
renewing, and its slots come free within ``lease_s``. Redis away: as `serve_rft.explorer.http.quota`,
each replica holds every caller to its share from memory (counted as unchecked), never passes all;
a slow check while Redis answers others is a busy replica (`serve_rft.explorer.http.quota.RedisHealth`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from serve_rft.buffer.quota import QuotaBusy
from serve_rft.buffer.usage import CostLeases, CostLimits, LocalCosts, upfront_tokens
from serve_rft.explorer.http.protocol import ApiError
from serve_rft.explorer.http.quota import RedisHealth, busy

log = logging.getLogger("serve_rft.explorer.http.costs")


@dataclass(frozen=True)
class TenantLimits:
    """What a tenant's keys may each hold (``key``), what the tenant may hold (``tenant``), and
    the bytes it may keep in the store (0: unlimited)."""

    key: CostLimits
    tenant: CostLimits
    max_stored_bytes: int

    @classmethod
    def of(cls, key_quota, tenant_quota) -> "TenantLimits":
        """From a `serve_rft.config.service.CostQuota` and a ``TenantQuota``."""
        return cls(CostLimits.of(key_quota), CostLimits.of(tenant_quota), tenant_quota.max_stored_bytes)

    @property
    def charges(self) -> bool:
        """Whether a request is charged slots or tokens at all."""
        return any(x.max_in_flight > 0 or x.tokens_per_s > 0 for x in (self.key, self.tenant))


@dataclass
class Lease:
    """A request's slots and the tokens it was charged up front (``charged``); ``local``: taken
    from this replica's share (Redis was away)."""

    id: str
    identity: str
    tenant: str
    charged: int
    local: bool
    started: float = field(default_factory=time.monotonic)
    settled: bool = False


class CostCheck:
    """Admits and settles requests against their key's and tenant's limits.

    Args:
        quotas: `serve_rft.config.service.QuotasConfig`.
        buckets: the replica's `serve_rft.buffer.quota.QuotaBuckets` (None: no quotas at all).
        prefix: ``buffer.key_prefix``.
        max_model_len: the engine's context length, tokens (what ``max_tokens`` absent may use).
        metrics: has ``quota(scope, limit)``.
        replicas: the divisor of a caller's share while Redis is away.
        clock: monotonic seconds.
        store: the `serve_rft.buffer.store.ExperienceStore` whose ledger `check_storage` reads.
        store_wait_s: bound of that read, s.
        tenants: ``service.tenants`` (a tenant's ``quota`` / ``key_quota`` replace the defaults).
    """

    def __init__(self, quotas, buckets, prefix: str, max_model_len: int, metrics, replicas: int = 1,
                 clock=time.monotonic, store=None, store_wait_s: float = 2.0, tenants=None):
        tenants = tenants or {}
        self.tiers = {name: TenantLimits.of(t.key_quota or quotas.per_key, t.quota or quotas.per_tenant)
                      for name, t in tenants.items()}
        self.default = TenantLimits.of(quotas.per_key, quotas.per_tenant)
        every = [self.default, *self.tiers.values()]
        on = buckets is not None and any(t.charges for t in every)
        self.leases = CostLeases(buckets, prefix, quotas.lease_s) if on else None
        self.stores_limited = buckets is not None and any(t.max_stored_bytes for t in every)
        self.local = LocalCosts(replicas, clock)
        self.max_model_len, self.metrics, self.clock = max_model_len, metrics, clock
        self.live: dict[str, Lease] = {}
        self.store, self.store_wait_s = store, store_wait_s
        self._paused_until = 0.0
        self.health = RedisHealth(clock)
        self._renewer: asyncio.Task | None = None
        self._settling: set[asyncio.Task] = set()

    def limits(self, tenant: str) -> "TenantLimits":
        """The limits of ``tenant``'s keys and of the tenant (its own, else the defaults)."""
        return self.tiers.get(tenant, self.default)

    async def admit(self, identity: str, tenant: str, body_bytes: int, n: int, max_tokens: int | None
                    ) -> Lease | None:
        """Charge a request of ``n`` answers of at most ``max_tokens`` (a ``body_bytes`` body) to
        key ``identity`` and ``tenant``; None: nothing to charge (no limits, or no key).

        Raises:
            ApiError: 429 (slots or budget short; ``quota_check_busy`` no quota connection free),
                413 ``tokens_over_quota``.
        """
        lim = self.limits(tenant)
        if self.leases is None or not identity or not lim.charges:
            return None
        cost = upfront_tokens(body_bytes, n, max_tokens, self.max_model_len)
        lease = Lease(uuid.uuid4().hex, identity, tenant, cost, local=False)
        if self.clock() < self._paused_until:
            lease.local = True
        else:
            overlap = self.leases.buckets.overlap()
            try:
                decision = await self.leases.admit(lease.id, identity, tenant, lim.key, lim.tenant, cost)
                self.health.answered()
            except QuotaBusy:
                raise busy("inference", self.metrics) from None
            except (RedisError, TimeoutError) as e:
                if not self.health.away(e, overlap.others):
                    raise busy("inference", self.metrics) from None
                self._unreachable(e)
                lease.local = True
        if lease.local:
            self.metrics.quota("inference", None)
            decision = self.local.admit(identity, tenant, lim.key, lim.tenant, cost)
        if not decision.allowed:
            self._refuse(decision, cost, lim)
        self.live[lease.id] = lease
        self._start_renewing()
        return lease

    async def check_storage(self, tenant: str, scope: str) -> None:
        """Refuse a request of ``tenant`` (on ``scope``: inference / rewards) while the tenant
        keeps ``per_tenant.max_stored_bytes`` or more in the store (`serve_rft.buffer.ledger`).
        A store that does not answer within ``store_wait_s`` refuses nothing here (the request
        meets the store's own answer: served unlogged, or 504).

        Raises:
            ApiError: 429 ``storage_quota_exceeded``, ``Retry-After`` when the first of the
                tenant's bytes expire (at most an hour).
        """
        most = self.limits(tenant).max_stored_bytes
        if not self.stores_limited or not most or self.store is None:
            return
        try:
            async with asyncio.timeout(self.store_wait_s):
                kept = (await self.store.tenant_bytes(tenant))[tenant]
        except (RedisError, TimeoutError):
            return
        if kept.bytes < most:
            return
        self.metrics.quota(scope, "tenant_storage")
        wait = kept.next_free_s if kept.next_free_s is not None else 1.0
        raise ApiError(429, f"This key's tenant keeps {kept.bytes} bytes in the experience store, its limit "
                       f"is {most}. Please try again in {wait:.0f}s, when some expire, or "
                       "reward or stop logging (store: false) fewer answers.", type_="storage",
                       code="storage_quota_exceeded", retry_after=min(3600, max(1, math.ceil(wait))))

    def _refuse(self, decision, cost: int, lim: TenantLimits):
        limits = lim.key if decision.who == "key" else lim.tenant
        self.metrics.quota("inference", f"{decision.who}_{decision.limit}")
        whose = "this key" if decision.who == "key" else "this key's tenant"
        if decision.too_large:
            raise ApiError(413, f"this request may use {cost} tokens (its prompt's bytes plus n x max_tokens), "
                           f"more than {whose}'s whole token budget ({limits.tokens_burst:.0f}); lower n or "
                           "max_tokens", code="tokens_over_quota")
        retry = max(1, math.ceil(decision.wait_s))
        if decision.limit == "in_flight":
            raise ApiError(429, f"Rate limit reached for requests in flight of {whose}: at most "
                           f"{limits.max_in_flight} at once. Please try again when one ends.",
                           type_="requests", code="in_flight_limit_exceeded", retry_after=retry)
        raise ApiError(429, f"Rate limit reached for tokens of {whose}: {limits.tokens_per_s:g}/s. "
                       f"Requested {cost}. Please try again in {decision.wait_s:.3g}s.",
                       type_="tokens", code="rate_limit_exceeded", retry_after=retry)

    async def settle(self, lease: Lease | None, used_tokens: int) -> None:
        """Free ``lease``'s slots and give back what it did not use of its charge (once; a
        second call does nothing). Redis away: its slots come free when the lease runs out, the
        tokens are not given back."""
        if lease is None or lease.settled:
            return
        lease.settled = True
        self.live.pop(lease.id, None)
        back = lease.charged - max(0, int(used_tokens))
        lim = self.limits(lease.tenant)
        if lease.local:
            self.local.settle(lease.identity, lease.tenant, lim.key, lim.tenant, back)
            return
        try:
            await self.leases.settle(lease.id, lease.identity, lease.tenant, lim.key, lim.tenant, back)
        except (QuotaBusy, RedisError, TimeoutError) as e:  # the lease runs out on its own
            log.warning("could not settle a request's quota lease (%r); its slot comes free within %.0f s",
                        e, self.leases.lease_s)

    def settle_soon(self, lease: Lease | None, used_tokens: int) -> None:
        """`settle` in a task of its own: what a cancelled request (its client went away) calls,
        where an await would be cancelled before Redis answers."""
        if lease is None or lease.settled:
            return
        task = asyncio.get_running_loop().create_task(self.settle(lease, used_tokens))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def _unreachable(self, e: Exception) -> None:
        self._paused_until = self.clock() + 1.0
        log.warning("quota store unreachable (%r); callers are held to this replica's share for 1 s", e)

    def _start_renewing(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def _renew_forever(self) -> None:
        """Every ``lease_s / 3``: push the deadline of this replica's leases in flight (stops
        when none are left; the next admission starts it again)."""
        period = self.leases.lease_s / 3
        while self.live:
            await asyncio.sleep(period)
            held = [(x.id, x.identity, x.tenant) for x in self.live.values() if not x.local]
            try:
                await self.leases.renew(held)
            except (QuotaBusy, RedisError, TimeoutError) as e:  # next period; a lease outlives 2 misses
                log.warning("could not renew %d quota leases (%r)", len(held), e)

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()

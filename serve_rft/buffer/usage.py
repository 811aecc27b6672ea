"""What a chat or completion request holds of the engines while it runs, charged to its key and its
tenant in the shared Redis: a slot in flight and a token budget (`serve_rft.config.service.CostQuota`).

A request is admitted by one Lua script (`ADMIT`) that checks, for the key and for the tenant,
the slots in flight and the token budget, and takes all of them or none. Its cost up front is
what it may use at most (`upfront_tokens`); when it ends, `SETTLE` frees its slots and gives back
what it did not use (or takes what it used beyond the estimate: the budget may go into debt, which
refills at its rate). The budget is the token bucket of RFC 2697 §1 (as `serve_rft.buffer.quota`'s
request buckets), counted in tokens, which is how OpenAI meters requests ("tokens per minute",
platform.openai.com/docs/guides/rate-limits).

Keys (``P`` = ``buffer.key_prefix``; ``{who}`` = ``key:{key identity}`` or ``tenant:{name}``):

=======================  ======  ===========================================================
key                      type    meaning
=======================  ======  ===========================================================
``P:lease:{who}``        zset    Slots in flight: lease id scored by its deadline (Redis
                                 ``TIME``, unix s). The replica running the request renews it
                                 (`RENEW`); a lease past its deadline (a replica that died) is
                                 dropped by the next admission, so a slot is never lost for
                                 longer than ``quotas.lease_s``.
``P:tok:{who}``          hash    Token budget: ``b`` tokens at ``t`` (unix s); expires when
                                 full again (a full budget and a missing one are the same).
=======================  ======  ===========================================================
"""

from __future__ import annotations

from dataclasses import dataclass

ADMIT = """#!lua flags=allow-oom
-- KEYS: the key's leases, the tenant's leases, the key's budget, the tenant's budget
-- ARGV: lease id, lease_s, key max in flight, tenant max in flight, key tokens/s, key burst,
--       tenant tokens/s, tenant burst, cost (tokens)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local id, lease_s, cost = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[9])
local function level(k, rate, burst)
  local st = redis.call('HMGET', k, 'b', 't')
  local x = tonumber(st[1])
  if x == nil then return burst end
  return math.min(burst, x + math.max(0, now - (tonumber(st[2]) or now)) * rate)
end
-- every check before the first take: all or nothing
for j = 1, 2 do
  local most = tonumber(ARGV[2 + j])
  if most > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[j], '-inf', now)  -- leases of replicas that died
    if redis.call('ZCARD', KEYS[j]) >= most then return {0, 1000, j} end
  end
end
local levels = {}
for j = 1, 2 do
  local rate, burst = tonumber(ARGV[3 + 2 * j]), tonumber(ARGV[4 + 2 * j])
  if rate > 0 then
    if cost > burst then return {0, 0, 4 + j} end
    local b = level(KEYS[2 + j], rate, burst)
    if b < cost then return {0, math.ceil((cost - b) / rate * 1000), 2 + j} end
    levels[j] = b
  end
end
for j = 1, 2 do
  if tonumber(ARGV[2 + j]) > 0 then
    redis.call('ZADD', KEYS[j], now + lease_s, id)
    redis.call('PEXPIRE', KEYS[j], math.ceil(lease_s * 1000) + 1000)
  end
  if levels[j] then
    local rate, burst = tonumber(ARGV[3 + 2 * j]), tonumber(ARGV[4 + 2 * j])
    local b = levels[j] - cost
    redis.call('HSET', KEYS[2 + j], 'b', string.format('%.17g', b), 't', string.format('%.6f', now))
    redis.call('PEXPIRE', KEYS[2 + j], math.ceil((burst - b) / rate * 1000) + 1000)
  end
end
return {1, 0, 0}
"""
"""Returns ``{1, 0, 0}`` admitted; ``{0, wait_ms, which}`` refused, nothing taken: ``which`` 1 / 2
the key's / the tenant's slots are all in flight, 3 / 4 the key's / the tenant's budget is short
(enough in ``wait_ms``), 5 / 6 the cost exceeds the key's / the tenant's whole budget (never
admitted). Runs with ``allow-oom`` (as `serve_rft.buffer.quota.QUOTA`): a full store still holds
every caller to its limits."""

SETTLE = """#!lua flags=allow-oom
-- KEYS: as ADMIT's. ARGV: lease id, key tokens/s, key burst, tenant tokens/s, tenant burst,
--       tokens given back (negative: taken beyond the estimate)
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local back = tonumber(ARGV[6])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
for j = 1, 2 do
  local rate, burst = tonumber(ARGV[2 * j]), tonumber(ARGV[1 + 2 * j])
  if rate > 0 and back ~= 0 then
    local k = KEYS[2 + j]
    local st = redis.call('HMGET', k, 'b', 't')
    local x = tonumber(st[1]) or burst
    local b = math.min(burst, math.min(burst, x + math.max(0, now - (tonumber(st[2]) or now)) * rate) + back)
    if b >= burst then
      redis.call('DEL', k)
    else
      redis.call('HSET', k, 'b', string.format('%.17g', b), 't', string.format('%.6f', now))
      redis.call('PEXPIRE', k, math.ceil((burst - b) / rate * 1000) + 1000)
    end
  end
end
return 1
"""
"""Frees a request's slots and gives its budget back what it did not use (capped at the burst)."""

RENEW = """#!lua flags=allow-oom
-- KEYS: lease sets; ARGV: lease_s, then one lease id per key (KEYS[j] holds ARGV[j + 1])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lease_s = tonumber(ARGV[1])
for j = 1, #KEYS do
  redis.call('ZADD', KEYS[j], 'XX', now + lease_s, ARGV[j + 1])
  redis.call('PEXPIRE', KEYS[j], math.ceil(lease_s * 1000) + 1000)
end
return #KEYS
"""
"""Pushes the deadline of leases still in flight ``lease_s`` past now (``XX``: a lease already
dropped stays dropped)."""

REFUSALS = {1: ("in_flight", "key"), 2: ("in_flight", "tenant"), 3: ("tokens", "key"),
            4: ("tokens", "tenant"), 5: ("tokens", "key"), 6: ("tokens", "tenant")}


@dataclass(frozen=True)
class CostLimits:
    """One caller's limits: ``max_in_flight`` requests, ``tokens_per_s`` refill and
    ``tokens_burst`` size of its budget (tokens); 0: unlimited."""

    max_in_flight: int = 0
    tokens_per_s: float = 0.0
    tokens_burst: float = 0.0

    @classmethod
    def of(cls, quota) -> "CostLimits":
        """From a `serve_rft.config.service.CostQuota`."""
        return cls(quota.max_in_flight, quota.tokens_per_s, quota.tokens_capacity if quota.tokens_per_s > 0 else 0)


@dataclass(frozen=True)
class Admission:
    """`admit`'s answer: ``allowed``; if not, ``limit`` (``in_flight`` / ``tokens``), ``who``
    (``key`` / ``tenant``), ``wait_s`` until it may pass (s) and ``too_large`` (the cost exceeds
    the whole budget: waiting never helps)."""

    allowed: bool
    limit: str | None = None
    who: str | None = None
    wait_s: float = 0.0
    too_large: bool = False


def upfront_tokens(body_bytes: int, n: int, max_tokens: int | None, max_model_len: int) -> int:
    """What a request may use at most, tokens: its prompt, estimated by its body's bytes (a
    byte-level BPE token covers at least one byte of text; at most ``max_model_len``), plus ``n``
    answers of ``max_tokens`` each (None: up to ``max_model_len``, vLLM's default). Settled
    against what it used when it ends."""
    prompt = min(max(0, int(body_bytes)), max_model_len)
    answer = max_model_len if max_tokens is None else min(int(max_tokens), max_model_len)
    return prompt + max(1, int(n)) * max(0, answer)


def lease_keys(prefix: str, identity: str, tenant: str) -> list[str]:
    """ADMIT's and SETTLE's KEYS for the key of identity ``identity`` of ``tenant``."""
    return [f"{prefix}:lease:key:{identity}", f"{prefix}:lease:tenant:{tenant}",
            f"{prefix}:tok:key:{identity}", f"{prefix}:tok:tenant:{tenant}"]


class CostLeases:
    """`ADMIT`, `SETTLE` and `RENEW` on the quota client's Redis (its bounded pool and waits:
    `serve_rft.buffer.quota.QuotaBuckets.call`, whose errors these raise).

    Args:
        buckets: the replica's `serve_rft.buffer.quota.QuotaBuckets`.
        prefix: key prefix (``buffer.key_prefix``).
        lease_s: how long a slot stays taken without a renewal, s.
    """

    def __init__(self, buckets, prefix: str, lease_s: float):
        self.buckets, self.p, self.lease_s = buckets, prefix, float(lease_s)
        self._admit, self._settle, self._renew = (buckets.script(ADMIT), buckets.script(SETTLE),
                                                  buckets.script(RENEW))

    async def admit(self, lease_id: str, identity: str, tenant: str, key: CostLimits, group: CostLimits,
                    cost: int) -> Admission:
        """Take a slot and ``cost`` tokens from the key of identity ``identity`` (``key``'s
        limits) and from its tenant (``group``'s), all or nothing."""
        allowed, wait_ms, which = await self.buckets.call(
            self._admit, lease_keys(self.p, identity, tenant),
            [lease_id, repr(self.lease_s), str(key.max_in_flight), str(group.max_in_flight),
             repr(float(key.tokens_per_s)), repr(float(key.tokens_burst)),
             repr(float(group.tokens_per_s)), repr(float(group.tokens_burst)), str(int(cost))])
        if allowed:
            return Admission(True)
        limit, who = REFUSALS[int(which)]
        return Admission(False, limit, who, int(wait_ms) / 1000.0, too_large=int(which) >= 5)

    async def settle(self, lease_id: str, identity: str, tenant: str, key: CostLimits, group: CostLimits,
                     back: int) -> None:
        """Free the slots of ``lease_id`` and give ``back`` tokens (negative: take) to both budgets."""
        await self.buckets.call(
            self._settle, lease_keys(self.p, identity, tenant),
            [lease_id, repr(float(key.tokens_per_s)), repr(float(key.tokens_burst)),
             repr(float(group.tokens_per_s)), repr(float(group.tokens_burst)), str(int(back))])

    async def renew(self, leases: list[tuple[str, str, str]]) -> None:
        """Push the deadline of every ``(lease id, identity, tenant)`` in flight ``lease_s`` on."""
        keys, ids = [], []
        for lease_id, identity, tenant in leases:
            k = lease_keys(self.p, identity, tenant)
            keys += k[:2]
            ids += [lease_id, lease_id]
        if keys:
            await self.buckets.call(self._renew, keys, [repr(self.lease_s), *ids])


class LocalCosts:
    """One replica's share of every caller's slots and budget, in memory: what holds callers while
    Redis is away (as `serve_rft.buffer.quota.LocalBuckets` for the request buckets). A share is
    the limit divided by ``replicas``, at least one slot and one request's cost.

    Args:
        replicas: the divisor.
        clock: monotonic seconds.
    """

    def __init__(self, replicas: int, clock):
        self.replicas, self.clock = max(1, int(replicas)), clock
        self.in_flight: dict[str, int] = {}
        self._levels: dict[str, tuple[float, float]] = {}

    def _level(self, who: str, lim: CostLimits, now: float) -> float:
        burst, rate = lim.tokens_burst / self.replicas, lim.tokens_per_s / self.replicas
        b, t = self._levels.get(who, (burst, now))
        return min(burst, b + max(0.0, now - t) * rate)

    def admit(self, identity: str, tenant: str, key: CostLimits, group: CostLimits, cost: int) -> Admission:
        """`CostLeases.admit` against this replica's shares."""
        now = self.clock()
        pairs = [(f"key:{identity}", key, "key"), (f"tenant:{tenant}", group, "tenant")]
        for who, lim, name in pairs:
            if lim.max_in_flight > 0 and self.in_flight.get(who, 0) >= max(1, lim.max_in_flight // self.replicas):
                return Admission(False, "in_flight", name, 1.0)
        for who, lim, name in pairs:
            if lim.tokens_per_s > 0:
                if cost > lim.tokens_burst:
                    return Admission(False, "tokens", name, too_large=True)
                b = self._level(who, lim, now)
                need = min(cost, lim.tokens_burst / self.replicas)  # a share always admits one request
                if b < need:
                    return Admission(False, "tokens", name, (need - b) / (lim.tokens_per_s / self.replicas))
        for who, lim, _ in pairs:
            if lim.max_in_flight > 0:
                self.in_flight[who] = self.in_flight.get(who, 0) + 1
            if lim.tokens_per_s > 0:
                self._levels[who] = (self._level(who, lim, now) - cost, now)
        return Admission(True)

    def settle(self, identity: str, tenant: str, key: CostLimits, group: CostLimits, back: int) -> None:
        """`CostLeases.settle` against this replica's shares."""
        now = self.clock()
        for who, lim in ((f"key:{identity}", key), (f"tenant:{tenant}", group)):
            if lim.max_in_flight > 0:
                left = self.in_flight.get(who, 0) - 1
                if left > 0:
                    self.in_flight[who] = left
                else:
                    self.in_flight.pop(who, None)
            if lim.tokens_per_s > 0:
                self._levels[who] = (min(lim.tokens_burst / self.replicas, self._level(who, lim, now) + back), now)

"""Per-key token buckets in the shared Redis: every replica draws on the same bucket, so a
quota does not multiply by the replica count.

One bucket per (scope, key identity) is the hash ``P:quota:{scope}:{identity}`` (``P`` =
``buffer.key_prefix``; ``identity`` = `key_identity`, a SHA-256 prefix: the API key itself is
never stored) with fields ``r`` (request tokens), ``b`` (byte tokens) and ``t`` (Redis ``TIME``
of the last take, unix s). A bucket holds at most ``burst`` tokens and refills at ``rate``
tokens per second by the time elapsed on the Redis server's clock (the token bucket of RFC 2697
§1 / RFC 4115: a burst of ``burst`` at once, ``rate`` per second sustained). `QUOTA` takes a
request's cost from both buckets or from neither, atomically (one Lua script). A bucket's key
expires when it would be full again, so an idle key leaves nothing behind (a full bucket and a
missing one are the same).

The client's connections are a blocking pool of a fixed size (the replica's concurrency) behind a
semaphore of the same size: a take waits a bounded time for a free connection and then raises
`QuotaBusy`, which is not a `RedisError` (a busy replica is not an unreachable Redis; redis-py's
own pool would raise ``MaxConnectionsError``, a ``ConnectionError``, past its size). While Redis is
away a replica holds each key to its share of the quota in `LocalBuckets`.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

QUOTA = """#!lua flags=allow-oom
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rr, rb = tonumber(ARGV[1]), tonumber(ARGV[2])
local br, bb = tonumber(ARGV[3]), tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
if br > 0 and cost > bb then return {0, 0, 3} end
local st = redis.call('HMGET', KEYS[1], 'r', 'b', 't')
local elapsed = math.max(0, now - (tonumber(st[3]) or now))
local function level(v, rate, burst)
  local x = tonumber(v)
  if x == nil then return burst end
  return math.min(burst, x + elapsed * rate)
end
local r, b = 0, 0
if rr > 0 then r = level(st[1], rr, rb) end
if br > 0 then b = level(st[2], br, bb) end
local wait, which = 0, 0
if rr > 0 and r < 1 then wait = (1 - r) / rr; which = 1 end
if br > 0 and b < cost then
  local w = (cost - b) / br
  if w > wait then wait = w; which = 2 end
end
if which ~= 0 then return {0, math.ceil(wait * 1000), which} end
local full = 0
if rr > 0 then r = r - 1; full = math.max(full, (rb - r) / rr) end
if br > 0 then b = b - cost; full = math.max(full, (bb - b) / br) end
redis.call('HSET', KEYS[1], 'r', string.format('%.17g', r), 'b', string.format('%.17g', b),
           't', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil(full * 1000) + 1000)
return {1, 0, 0}
"""
"""KEYS: the bucket. ARGV: requests/s, request burst, bytes/s, byte burst, this request's bytes
(a rate of 0: that dimension is unlimited). Returns ``{allowed, wait_ms, limit}``: ``{1, 0, 0}``
taken; ``{0, wait_ms, 1 | 2}`` refused, nothing taken, enough tokens in ``wait_ms`` ms (1: the
request bucket is short, 2: the byte bucket); ``{0, 0, 3}`` the bytes exceed the byte burst (never
allowed). Expiry: when both buckets would be full again, plus 1 s. Runs with ``allow-oom`` (Redis
docs, "Scripting with Lua", script flags): past ``maxmemory`` (noeviction) the bucket, a small hash
with a TTL, is still written, so a key that fills the store is still held to its quota rather than
the check failing open."""

LIMITS = {1: "requests", 2: "bytes", 3: "bytes"}


def key_identity(api_key: str) -> str:
    """The bucket name of ``api_key``: the first 32 hex digits (128 bits) of its SHA-256."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Rates:
    """One scope's limits: ``requests_per_s`` / ``bytes_per_s`` refill rates (0: unlimited) and
    ``request_burst`` / ``bytes_burst`` bucket sizes (requests, bytes)."""

    requests_per_s: float
    request_burst: float
    bytes_per_s: float
    bytes_burst: float

    @property
    def limited(self) -> bool:
        return self.requests_per_s > 0 or self.bytes_per_s > 0


@dataclass(frozen=True)
class Decision:
    """What `QuotaBuckets.take` answered: ``allowed``; if not, ``wait_s`` until the cost would be
    available (s) and ``limit`` the bucket that is short (``requests`` / ``bytes``);
    ``too_large``: the bytes exceed the byte burst, so waiting never helps."""

    allowed: bool
    wait_s: float = 0.0
    limit: str | None = None
    too_large: bool = False


class Overlap:
    """The calls of a `QuotaBuckets` that overlapped one call: those in flight when it started and
    those started while it ran (`QuotaBuckets.overlap`, taken just before the call)."""

    def __init__(self, buckets, started: int, in_flight: int):
        self.buckets, self.started, self.in_flight = buckets, started, in_flight

    @property
    def others(self) -> int:
        """How many other calls overlapped it (read after it ended)."""
        return self.in_flight + max(0, self.buckets.started - self.started - 1)


class QuotaBusy(Exception):
    """Every connection of this client stayed in use for the whole wait: the replica is busy,
    Redis is not away (deliberately not a `RedisError`)."""


class QuotaBuckets:
    """The buckets on one Redis server, through a client of its own that never waits long: at
    most ``timeout_s`` for a free connection, then at most ``timeout_s`` for Redis, never retried
    (the caller decides what an unreachable Redis means: `serve_rft.explorer.http.quota`).

    Args:
        url: ``redis://[:PASSWORD@]host:port/db`` (``buffer.redis_url``; the embedded
            redis-server's carries its password).
        prefix: key prefix (``buffer.key_prefix``).
        timeout_s: bound of the wait for a connection and of one take's Redis call
            (connect and command), s.
        max_connections: connections to Redis at most, and takes in flight at most (the
            replica's concurrency, ``explorer.max_ongoing_requests``).
    """

    def __init__(self, url: str, prefix: str = "srft", timeout_s: float = 0.25, max_connections: int = 64):
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_s, decode_responses=True,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        self.redis = aioredis.Redis(connection_pool=pool)
        self.redis.auto_close_connection_pool = True  # `close` closes the pool too
        self.p = prefix
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(max_connections)
        self.in_flight = 0  # calls waiting for a connection or for Redis now
        self.started = 0  # calls ever started (with in_flight: which calls overlapped one)
        self._take = self.redis.register_script(QUOTA)

    def key(self, scope: str, identity: str) -> str:
        """The Redis key of a bucket."""
        return f"{self.p}:quota:{scope}:{identity}"

    async def take(self, scope: str, identity: str, rates: Rates, cost_bytes: int) -> Decision:
        """Take one request and ``cost_bytes`` bytes from the bucket of (``scope``, ``identity``),
        both or neither.

        Raises:
            QuotaBusy: no connection came free within ``timeout_s`` (nothing was asked of Redis).
            redis.exceptions.RedisError: Redis unreachable or refusing.
            TimeoutError: Redis took longer than ``timeout_s``.
        """
        allowed, wait_ms, which = await self.call(
            self._take, [self.key(scope, identity)],
            [repr(float(rates.requests_per_s)), repr(float(rates.request_burst)),
             repr(float(rates.bytes_per_s)), repr(float(rates.bytes_burst)), str(int(cost_bytes))])
        if allowed:
            return Decision(True)
        return Decision(False, int(wait_ms) / 1000.0, LIMITS[int(which)], too_large=int(which) == 3)

    def overlap(self) -> "Overlap":
        """Start counting the calls that overlap the next one (read `Overlap.others` after it)."""
        return Overlap(self, self.started, self.in_flight)

    def script(self, source: str):
        """A Lua script registered on this client (for `call`)."""
        return self.redis.register_script(source)

    async def call(self, script, keys: list[str], args: list):
        """Run ``script`` with the bounds of `take`: at most ``timeout_s`` for a free connection,
        then at most ``timeout_s`` for Redis.

        Raises:
            QuotaBusy: no connection came free within ``timeout_s`` (nothing was asked of Redis).
            redis.exceptions.RedisError: Redis unreachable or refusing.
            TimeoutError: Redis took longer than ``timeout_s``.
        """
        self.in_flight += 1
        self.started += 1
        try:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise QuotaBusy(f"no quota connection free within {self.timeout_s} s") from None
            try:
                async with asyncio.timeout(self.timeout_s):
                    return await script(keys=keys, args=args)
            finally:
                self._slots.release()
        finally:
            self.in_flight -= 1

    async def close(self) -> None:
        await self.redis.aclose()


class LocalBuckets:
    """One replica's share of every quota, in memory: what holds a key while Redis is away.

    A key's share is its rates and bursts divided by ``replicas`` (so the replicas together allow
    at most the quota). A share smaller than one request (or than a body the full byte burst
    admits) would never allow it, so a full bucket always allows one request of any admissible
    size and goes into debt by the rest, which refills at the share's rate. Entries are kept per
    (scope, key identity): keys are the configured ones (the check runs after the key check), so
    they are bounded.

    Args:
        replicas: the divisor (`serve_rft.explorer.http.quota.QuotaCheck.from_config` says which
            count).
        clock: monotonic seconds.
    """

    def __init__(self, replicas: int, clock=time.monotonic):
        self.replicas, self.clock = max(1, int(replicas)), clock
        self._levels: dict[tuple[str, str], list[float]] = {}

    def take(self, scope: str, identity: str, rates: Rates, cost_bytes: int) -> Decision:
        """Take one request and ``cost_bytes`` bytes from this replica's share of the bucket of
        (``scope``, ``identity``), both or neither; the same answers as `QuotaBuckets.take`
        (``rates``: the whole quota, divided here)."""
        if rates.bytes_per_s > 0 and cost_bytes > rates.bytes_burst:
            return Decision(False, 0.0, "bytes", too_large=True)
        n, now = self.replicas, self.clock()
        rr, br = rates.requests_per_s / n, rates.bytes_per_s / n
        rsize, bsize = rates.request_burst / n, rates.bytes_burst / n
        level = self._levels.get((scope, identity))
        if level is None:
            r, b = rsize, bsize
        else:
            elapsed = max(0.0, now - level[2])
            r, b = min(rsize, level[0] + elapsed * rr), min(bsize, level[1] + elapsed * br)
        wait, which = 0.0, None
        if rr > 0 and r < min(1.0, rsize):
            wait, which = (min(1.0, rsize) - r) / rr, "requests"
        if br > 0 and b < min(cost_bytes, bsize):
            w = (min(cost_bytes, bsize) - b) / br
            if w > wait:
                wait, which = w, "bytes"
        if which is not None:
            return Decision(False, wait, which)
        self._levels[(scope, identity)] = [r - 1 if rr > 0 else r, b - cost_bytes if br > 0 else b, now]
        return Decision(True)

"""The experience store: Redis keys, the reward transaction and the trainer's ready stream.

Owns every Redis key of the service. Explorer replicas call `log_experiences`; the rewards API
calls `post_reward`; the trainer calls `read_ready` and `ack`. Nothing else touches Redis.

Schema (``P`` = ``buffer.key_prefix``):

========================  ======  ==========================================================
key                       type    meaning
========================  ======  ==========================================================
``P:exp:{cid}:{i}``       string  Experience JSON. TTL ``reward_timeout_s`` while pending,
                                  ``trained_ttl_s`` once rewarded.
``P:cmp:{cid}``           string  Number of choices of completion ``cid`` (404 vs 410).
``P:rw:{cid}``            hash    choice index -> recorded reward (repr of a float).
``P:pending``             zset    ``{cid}:{i}`` scored by its reward deadline (unix s).
``P:ready``               stream  Rewarded experiences (fields ``exp``, ``reward``); consumer
                                  group ``trainer``; entries are XACK+XDEL'ed once trained.
``P:stat``                hash    Counters: logged, rewarded, trained, expired.
========================  ======  ==========================================================

A reward moves an experience from pending to the ready stream in one Lua script, so the trainer
never sees a half-rewarded experience and a reward is recorded exactly once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from serve_rft.types import Experience, RewardedExperience

TRAINER_GROUP = "trainer"

_REWARD_LUA = """
-- KEYS: exp, rw, pending, ready, stat, cmp ; ARGV: index, reward, member, ttl
local n = redis.call('GET', KEYS[6])
if not n then return {404, ''} end
if tonumber(ARGV[1]) >= tonumber(n) then return {404, ''} end
local prev = redis.call('HGET', KEYS[2], ARGV[1])
if prev then
  if prev == ARGV[2] then return {200, prev} end
  return {409, prev}
end
local exp = redis.call('GET', KEYS[1])
if not exp then return {410, ''} end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[4]))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
redis.call('ZREM', KEYS[3], ARGV[3])
redis.call('XADD', KEYS[4], '*', 'exp', exp, 'reward', ARGV[2])
redis.call('HINCRBY', KEYS[5], 'rewarded', 1)
return {201, ARGV[2]}
"""

_EXPIRE_LUA = """
-- KEYS: pending, stat ; ARGV: now
local n = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if n > 0 then redis.call('HINCRBY', KEYS[2], 'expired', n) end
return n
"""


class RewardError(Exception):
    """A reward that cannot be recorded; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class StoreCounts:
    """Experience counts: pending reward, ready for training, trained, expired, logged."""

    pending: int
    ready: int
    trained: int
    expired: int
    logged: int
    rewarded: int


class ExperienceStore:
    """Async access to the experience schema above on one Redis server."""

    def __init__(self, url: str, prefix: str = "srft", reward_timeout_s: float = 3600.0,
                 trained_ttl_s: float = 86400.0):
        self.redis = aioredis.from_url(url, decode_responses=True)
        self.p = prefix
        self.reward_timeout_s = reward_timeout_s
        self.trained_ttl_s = trained_ttl_s
        self._reward = self.redis.register_script(_REWARD_LUA)
        self._expire = self.redis.register_script(_EXPIRE_LUA)

    def _k(self, *parts: str) -> str:
        return ":".join((self.p, *parts))

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def log_experiences(self, experiences: list[Experience], num_choices: int) -> None:
        """Write the experiences of one completion (all its choices) in one transaction.

        Called before the response is returned, so a reward may be posted at once.
        """
        if not experiences:
            return
        cid = experiences[0].completion_id
        now = time.time()
        timeout = max(1, math.ceil(self.reward_timeout_s))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self._k("cmp", cid), num_choices, ex=max(timeout, math.ceil(self.trained_ttl_s)))
            for e in experiences:
                pipe.set(self._k("exp", cid, str(e.choice_index)), e.model_dump_json(), ex=timeout)
                pipe.zadd(self._k("pending"), {f"{cid}:{e.choice_index}": now + self.reward_timeout_s})
            pipe.hincrby(self._k("stat"), "logged", len(experiences))
            await pipe.execute()

    async def get_experience(self, completion_id: str, choice_index: int) -> Experience | None:
        raw = await self.redis.get(self._k("exp", completion_id, str(choice_index)))
        return Experience.model_validate_json(raw) if raw else None

    async def post_reward(self, completion_id: str, choice_index: int, reward: float) -> bool:
        """Record a reward and make the experience ready for training, atomically.

        Returns:
            True if recorded now, False if the same reward was already recorded (idempotent).
        Raises:
            RewardError: 422 not finite, 404 unknown completion/choice, 409 a different reward
            is recorded, 410 the experience expired before its reward came.
        """
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise RewardError(422, f"reward must be a finite number, got {reward!r}")
        if choice_index < 0:
            raise RewardError(404, f"no choice {choice_index} in completion {completion_id!r}")
        cid, idx = completion_id, str(choice_index)
        status, prev = await self._reward(
            keys=[self._k("exp", cid, idx), self._k("rw", cid), self._k("pending"),
                  self._k("ready"), self._k("stat"), self._k("cmp", cid)],
            args=[idx, repr(float(reward)), f"{cid}:{idx}", max(1, math.ceil(self.trained_ttl_s))],
        )
        status = int(status)
        if status == 201:
            return True
        if status == 200:
            return False
        if status == 404:
            raise RewardError(404, f"no choice {choice_index} in completion {completion_id!r}")
        if status == 409:
            raise RewardError(409, f"choice {choice_index} of {completion_id!r} already has reward {prev}")
        raise RewardError(410, f"choice {choice_index} of {completion_id!r} expired before its reward")

    async def expire_pending(self, now: float | None = None) -> int:
        """Drop pending experiences whose reward deadline passed; returns how many (counted)."""
        return int(await self._expire(keys=[self._k("pending"), self._k("stat")],
                                      args=[now if now is not None else time.time()]))

    async def counts(self) -> StoreCounts:
        await self.expire_pending()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zcard(self._k("pending"))
            pipe.xlen(self._k("ready"))
            pipe.hgetall(self._k("stat"))
            pending, ready, stat = await pipe.execute()
        s = {k: int(v) for k, v in stat.items()}
        return StoreCounts(pending=pending, ready=ready, trained=s.get("trained", 0),
                           expired=s.get("expired", 0), logged=s.get("logged", 0),
                           rewarded=s.get("rewarded", 0))

    async def ensure_group(self) -> None:
        """Create the trainer's consumer group on the ready stream (idempotent)."""
        try:
            await self.redis.xgroup_create(self._k("ready"), TRAINER_GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def read_ready(self, consumer: str, count: int, block_ms: int,
                         redeliver: bool = False) -> list[RewardedExperience]:
        """Read up to ``count`` rewarded experiences for ``consumer`` of the trainer group.

        ``redeliver=True`` re-reads entries delivered to this consumer but never acknowledged
        (a trainer that died mid-step).
        """
        res = await self.redis.xreadgroup(
            TRAINER_GROUP, consumer, {self._k("ready"): "0" if redeliver else ">"},
            count=count, block=None if redeliver else block_ms,
        )
        out: list[RewardedExperience] = []
        for _stream, entries in res or []:
            for entry_id, fields in entries:
                if not fields:  # deleted while pending
                    continue
                out.append(RewardedExperience(
                    experience=Experience.model_validate_json(fields["exp"]),
                    reward=float(fields["reward"]), stream_id=entry_id))
        return out

    async def ack(self, stream_ids: list[str]) -> None:
        """Mark entries trained: XACK + XDEL + count, in one transaction."""
        if not stream_ids:
            return
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self._k("ready"), TRAINER_GROUP, *stream_ids)
            pipe.xdel(self._k("ready"), *stream_ids)
            pipe.hincrby(self._k("stat"), "trained", len(stream_ids))
            await pipe.execute()

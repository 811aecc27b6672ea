"""The experience store: Redis keys, the reward transaction and the trainer's ready stream.

Owns every Redis key of the service. Explorer replicas call `log_experiences`; the rewards API
calls `post_reward`; the trainer calls `read_ready` and `ack`. Nothing else touches Redis.
Every state change is one Lua script (`serve_rft.buffer.scripts`), so it is atomic.

Schema (``P`` = ``buffer.key_prefix``; ``{cid}`` a completion id, ``{i}`` a choice index,
``{gid}`` a group id):

=====================  ======  =============================================================
key                    type    meaning
=====================  ======  =============================================================
``P:exp:{cid}:{i}``    string  Experience JSON. TTL ``reward_timeout_s`` while pending,
                               ``trained_ttl_s`` once rewarded; deleted when it expires.
``P:cmp:{cid}``        hash    ``n`` choices, ``group`` id, ``conv`` conversation id,
                               ``created`` (unix s). Tells 404 (never logged) from 410.
``P:st:{cid}``         hash    Per choice: ``{i}`` state (pending / rewarded / ready /
                               trained / expired / stale-dropped), ``r{i}`` reward (repr of
                               a float), ``info{i}`` the reward's info JSON, ``v{i}`` the
                               policy version that trained (or dropped) it.
``P:grp:{gid}``        hash    Group: ``size`` expected answers (0 = unknown), ``logged``,
                               ``rewarded``, ``expired``, ``first`` reward time,
                               ``released`` (1 once its members went to the ready stream).
``P:gm:{gid}``         set     Rewarded members ``{cid}:{i}`` held until the group is released.
``P:gdl``              zset    Group ids scored by their timeout (first reward +
                               ``group_timeout_s``; then + ``reward_timeout_s``).
``P:pending``          zset    ``{cid}:{i}`` awaiting a reward, scored by its deadline.
``P:conv:{conv}``      list    Completion ids of a conversation's turns, in order.
``P:ready``            stream  Released experiences (fields ``exp``, ``reward``, ``member``);
                               consumer group ``trainer``; XACK + XDEL once trained.
``P:stat``             hash    Counters: logged, rewarded, ready, trained, expired,
                               stale_dropped, groups_timed_out.
=====================  ======  =============================================================

Groups (GRPO compares the answers of one group): a completion with ``n`` choices is a group of
``n``; a client can put several requests in one group with the ``group_id`` request field
(``group_size`` = the number of answers to expect, optional). A group's rewarded members are
*held* (state ``rewarded``) and released to the ready stream together when every member is
rewarded or expired, or ``group_timeout_s`` after the first reward if at least two are
rewarded, or at the latest ``reward_timeout_s`` after the first reward. A reward for a member
of an already released group makes it ready at once.

Pending experiences with no reward by ``reward_timeout_s`` expire (state ``expired``, counted);
their reward then gets 410. Expiry and group timeouts run in `sweep`, which the trainer calls
on every read and `counts` calls on every status.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from serve_rft.buffer import scripts
from serve_rft.types import Experience, RewardedExperience

TRAINER_GROUP = "trainer"


class RewardError(Exception):
    """A reward that cannot be recorded; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class StoreCounts:
    """Experience counts. ``pending``: awaiting a reward; ``held``: rewarded, waiting for the
    rest of their group; ``ready``: in the ready stream (incl. delivered, not yet acked); the
    rest are totals since the store was created."""

    pending: int
    held: int
    ready: int
    logged: int
    rewarded: int
    trained: int
    expired: int
    stale_dropped: int
    groups_timed_out: int


@dataclass
class ChoiceState:
    """One choice as `GET /v1/experiences/{completion_id}` shows it."""

    choice_index: int
    state: str
    reward: float | None
    info: dict | None
    trained_version: int | None
    token_versions: list | None


def _parse(entries: list[tuple[str, dict]]) -> list[RewardedExperience]:
    """Stream entries -> experiences (an entry deleted while pending has no fields: skipped)."""
    return [RewardedExperience(experience=Experience.model_validate_json(f["exp"]),
                               reward=float(f["reward"]), stream_id=entry_id)
            for entry_id, f in entries if f]


def _member(cid: str, i: int | str) -> str:
    return f"{cid}:{i}"


class ExperienceStore:
    """Async access to the experience schema above on one Redis server.

    Args:
        url: ``redis://host:port``.
        prefix: key prefix (``buffer.key_prefix``).
        reward_timeout_s: a pending experience expires this long after it was logged, s.
        trained_ttl_s: how long rewarded / trained experiences stay readable, s.
        group_timeout_s: a group with >= 2 rewarded members is released this long after its
            first reward even if other members are still pending, s.
    """

    def __init__(self, url: str, prefix: str = "srft", reward_timeout_s: float = 3600.0,
                 trained_ttl_s: float = 86400.0, group_timeout_s: float = 60.0,
                 reconnect_s: float = 30.0):
        # A Redis restart (AOF reload) must not kill a replica's logging or the trainer's loop:
        # redis-py retries a command on a dropped connection with exponential backoff for
        # about ``reconnect_s`` seconds, then raises.
        retries = max(1, math.ceil(reconnect_s))
        self.redis = aioredis.from_url(
            url, decode_responses=True,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
            retry_on_error=[RedisConnectionError, RedisTimeoutError])
        # New-entry reads are not idempotent (a read re-sent after a lost reply would deliver
        # the next entries and strand the first in the pending list): never retried.
        self._reader = aioredis.from_url(url, decode_responses=True, retry=Retry(ExponentialBackoff(), 0))
        self.p = prefix
        self.reward_timeout_s = reward_timeout_s
        self.trained_ttl_s = trained_ttl_s
        self.group_timeout_s = group_timeout_s
        self._log = self.redis.register_script(scripts.LOG)
        self._reward = self.redis.register_script(scripts.REWARD)
        self._sweep = self.redis.register_script(scripts.SWEEP)
        self._ack = self.redis.register_script(scripts.ACK)

    @classmethod
    def from_config(cls, buffer_cfg) -> "ExperienceStore":
        """A store for a `serve_rft.config.BufferConfig` (its ``redis_url`` must be set)."""
        return cls(buffer_cfg.redis_url, buffer_cfg.key_prefix, buffer_cfg.reward_timeout_s,
                   buffer_cfg.trained_ttl_s, buffer_cfg.group_timeout_s, buffer_cfg.reconnect_s)

    def _k(self, *parts: str) -> str:
        return ":".join((self.p, *parts))

    def _long_ttl(self) -> int:
        return max(1, math.ceil(max(self.trained_ttl_s, self.reward_timeout_s)))

    async def close(self) -> None:
        await self.redis.aclose()
        await self._reader.aclose()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def log_experiences(self, experiences: list[Experience], group_size: int | None = None,
                              conversation_id: str | None = None) -> None:
        """Write the experiences of one completion (all its choices, indices 0..n-1) in one script.

        Called before the response is returned, so a reward may be posted at once.

        Args:
            experiences: the choices, all with the same ``completion_id`` and ``group_id``.
            group_size: answers the group should have (None: ``len(experiences)`` when the group
                is the completion itself, else unknown).
            conversation_id: the conversation this completion is a turn of, if any.
        """
        if not experiences:
            return
        e0 = experiences[0]
        cid, gid = e0.completion_id, e0.group_id
        if group_size is None:
            group_size = len(experiences) if gid == cid else 0
        now = time.time()
        exps = sorted(experiences, key=lambda e: e.choice_index)
        await self._log(args=[self.p, cid, len(exps), gid, group_size,
                              max(1, math.ceil(self.reward_timeout_s)), self._long_ttl(), now,
                              now + self.reward_timeout_s, conversation_id or "",
                              *[e.model_dump_json() for e in exps]])

    async def get_experience(self, completion_id: str, choice_index: int) -> Experience | None:
        raw = await self.redis.get(self._k("exp", completion_id, str(choice_index)))
        return Experience.model_validate_json(raw) if raw else None

    async def post_reward(self, completion_id: str, choice_index: int, reward: float,
                          info: dict | None = None) -> bool:
        """Record a reward (and its free-form ``info``) atomically; the experience becomes ready
        for training when its group is released (see the module docstring).

        Returns:
            True if recorded now, False if the same reward was already recorded (idempotent).
        Raises:
            RewardError: 422 not finite, 404 unknown completion/choice, 409 a different reward
            is recorded, 410 the experience expired before its reward came.
        """
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise RewardError(422, f"reward must be a finite number, got {reward!r}")
        if choice_index < 0:
            raise RewardError(404, f"no choice {choice_index} in completion {completion_id!r}")
        status, prev = await self._reward(args=[
            self.p, completion_id, str(choice_index), repr(float(reward)),
            json.dumps(info) if info is not None else "", time.time(), self.group_timeout_s,
            self._long_ttl()])
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

    async def num_choices(self, completion_id: str) -> int | None:
        """Choices of a logged completion, or None if unknown."""
        n = await self.redis.hget(self._k("cmp", completion_id), "n")
        return int(n) if n is not None else None

    async def completion_group(self, completion_id: str) -> str | None:
        return await self.redis.hget(self._k("cmp", completion_id), "group")

    async def conversation_turns(self, conversation_id: str) -> list[str]:
        """Completion ids of a conversation's assistant turns, oldest first."""
        return await self.redis.lrange(self._k("conv", conversation_id), 0, -1)

    async def choices(self, completion_id: str) -> list[ChoiceState] | None:
        """Every choice's state, reward, info and version, or None for an unknown completion."""
        n = await self.num_choices(completion_id)
        if n is None:
            return None
        st = await self.redis.hgetall(self._k("st", completion_id))
        out = []
        for i in range(n):
            exp = await self.get_experience(completion_id, i)
            r, info, v = st.get(f"r{i}"), st.get(f"info{i}"), st.get(f"v{i}")
            out.append(ChoiceState(
                choice_index=i, state=st.get(str(i), "expired"),
                reward=float(r) if r is not None else None,
                info=json.loads(info) if info else None,
                trained_version=int(v) if v is not None else None,
                token_versions=[list(t) for t in exp.token_versions] if exp else None))
        return out

    async def sweep(self, now: float | None = None) -> tuple[int, int]:
        """Expire pending experiences past their deadline and release timed-out groups.

        Returns:
            (experiences expired, groups released by timeout) in this call; both counted.
        """
        expired, released = await self._sweep(args=[self.p, now if now is not None else time.time(),
                                                     self.reward_timeout_s])
        return int(expired), int(released)

    async def counts(self) -> StoreCounts:
        await self.sweep()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zcard(self._k("pending"))
            pipe.xlen(self._k("ready"))
            pipe.hgetall(self._k("stat"))
            pending, ready, stat = await pipe.execute()
        s = {k: int(v) for k, v in stat.items()}
        rewarded = s.get("rewarded", 0)
        return StoreCounts(pending=pending, held=max(0, rewarded - s.get("ready", 0)), ready=ready,
                           logged=s.get("logged", 0), rewarded=rewarded, trained=s.get("trained", 0),
                           expired=s.get("expired", 0), stale_dropped=s.get("stale_dropped", 0),
                           groups_timed_out=s.get("groups_timed_out", 0))

    async def ensure_group(self) -> None:
        """Create the trainer's consumer group on the ready stream (idempotent)."""
        try:
            await self.redis.xgroup_create(self._k("ready"), TRAINER_GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def read_ready(self, consumer: str, count: int, block_ms: int,
                         exclude: set[str] | None = None) -> list[RewardedExperience]:
        """Read up to ``count`` new released experiences for ``consumer`` of the trainer group
        (after a `sweep`), waiting up to ``block_ms`` ms for them. Entries delivered earlier and
        never acknowledged are re-read with `delivered`.

        If the connection drops during the read, Redis may have delivered entries with the reply
        lost: then every delivered, unacknowledged entry whose stream id is not in ``exclude``
        (what the caller already holds) is returned instead, possibly more than ``count``.
        """
        await self.sweep()
        try:
            return _parse(await self._read(self._reader, consumer, ">", count, block_ms))
        except (RedisConnectionError, RedisTimeoutError):
            held = exclude or set()
            return [e for e in await self.delivered(consumer) if e.stream_id not in held]

    async def delivered(self, consumer: str) -> list[RewardedExperience]:
        """Every entry delivered to ``consumer`` and not yet acknowledged (its pending entries
        list), oldest first, paged so none is left behind however many there are. A restarted
        trainer reads these before new ones."""
        out: list[RewardedExperience] = []
        start = "0"
        while True:
            raw = await self._read(self.redis, consumer, start, 256, None)
            out.extend(_parse(raw))
            if len(raw) < 256:
                return out
            start = raw[-1][0]

    async def _read(self, client, consumer: str, start: str, count: int, block_ms: int | None
                    ) -> list[tuple[str, dict]]:
        res = await client.xreadgroup(TRAINER_GROUP, consumer, {self._k("ready"): start},
                                          count=count, block=block_ms)
        return res[0][1] if res else []

    async def ack(self, entries: list[RewardedExperience], version: int,
                  state: str = "trained") -> tuple[int, int]:
        """Acknowledge ready entries: XACK + XDEL and mark each choice ``state`` (``trained`` or
        ``stale-dropped``) with ``version``, in one script. Entries already acknowledged are
        skipped, so a retried ack counts nothing twice.

        Returns:
            (newly trained, newly stale-dropped).
        """
        return await self.ack_entries([(e.stream_id, e.member, version) for e in entries], state)

    async def ack_entries(self, entries: list[tuple[str, str, int]], state: str = "trained"
                          ) -> tuple[int, int]:
        """`ack` by ``(stream id, member "{cid}:{i}", version)`` triples (what a trainer state
        records), each with its own version.

        Returns:
            (newly trained, newly stale-dropped).
        """
        if not entries:
            return 0, 0
        args: list = [self.p, len(entries)]
        for stream_id, member, version in entries:
            args += [stream_id, member, state, version]
        trained, dropped = await self._ack(args=args)
        return int(trained), int(dropped)

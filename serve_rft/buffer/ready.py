"""The trainer's side of the experience store: the ready stream ``P:ready`` and its consumer group.

A component of `ExperienceStore` (``store.ready``; schema in `serve_rft.buffer.store`), and all
the trainer holds of the store: the trainer reads released experiences (`read_ready`; after a
restart `delivered`), acknowledges them once trained or dropped (`ack`, `ack_entries`), counts
step attempts (`begin_attempt`) and moves what cannot be trained to the dead-letter stream
(`dead_letter`). Every state change is one Lua script (`serve_rft.buffer.scripts_ready`).
"""

from __future__ import annotations

import math
from typing import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from serve_rft.buffer import scripts_ready
from serve_rft.buffer.records import DeadLetter, parse_entries
from serve_rft.types import RewardedExperience

TRAINER_GROUP = "trainer"
SWEEP_BATCH = 1000
"""Expiries (and group releases) per SWEEP script call; stale drops per DROP_STALE call."""
DEAD_LETTER_MAXLEN = 10_000
"""About this many newest dead letters are kept in ``P:dead`` (XADD MAXLEN ~); all are counted."""


class ReadyStream:
    """The trainer's reads and acknowledgements of ``P:ready`` (see the module docstring).

    Args:
        redis: the store's client (a command is retried on a dropped connection).
        reader: a client that never retries (new-entry reads are not idempotent).
        prefix: key prefix (``buffer.key_prefix``).
        trained_ttl_s: how long acknowledged experiences stay readable, s.
        sweep: the store's `ExperienceStore.sweep` (expiries, group releases and the ready
            bound), run with the ids the trainer holds before each read.
    """

    def __init__(self, redis: aioredis.Redis, reader: aioredis.Redis, prefix: str, trained_ttl_s: float,
                 sweep: Callable[..., Awaitable[tuple[int, int]]]):
        self.redis, self._reader, self.p, self.trained_ttl_s, self.sweep = redis, reader, prefix, trained_ttl_s, sweep
        self._ack = redis.register_script(scripts_ready.ACK)
        self._read_script = redis.register_script(scripts_ready.READ)
        self._drop_stale = redis.register_script(scripts_ready.DROP_STALE)
        self._dead_letter = redis.register_script(scripts_ready.DEAD_LETTER)

    def _k(self, *parts: str) -> str:
        return ":".join((self.p, *parts))

    async def ensure_group(self) -> None:
        """Create the trainer's consumer group on the ready stream (idempotent)."""
        try:
            await self.redis.xgroup_create(self._k("ready"), TRAINER_GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def read_ready(self, consumer: str, count: int, block_ms: int,
                         exclude: set[str] | None = None, newest_first: bool = True
                         ) -> list[RewardedExperience]:
        """Deliver to ``consumer`` of the trainer group up to ``count`` released experiences that
        no consumer holds (after a `sweep`), the newest first (``newest_first``: a trainer
        slower than the traffic trains the freshest data, and what waits grows older until the
        trainer's staleness bound drops it) or the oldest first; waits up to ``block_ms`` ms for
        one when there is none. Entries delivered earlier and never acknowledged are re-read
        with `delivered`.

        ``exclude`` (the stream ids the caller already holds) is never returned, on every path:
        the READ script skips them besides the consumer group's pending entries list, so an
        entry is not handed out twice when Redis lost that list (an AOF restored to an earlier
        point, a failover to a lagging replica, an external Redis).

        If the connection drops during the read, Redis may have delivered entries with the reply
        lost: then every delivered, unacknowledged entry not in ``exclude`` is returned instead,
        possibly more than ``count``.
        """
        held = exclude or set()
        await self.sweep(exclude=held)
        try:
            raw, last = await self._read_free(consumer, count, newest_first, held)
            if not raw and block_ms > 0:  # nothing free: wait for an entry newer than the newest
                await self._reader.xread({self._k("ready"): last}, count=1, block=block_ms)
                raw, _ = await self._read_free(consumer, count, newest_first, held)
            return [e for e in await self._parsed(raw) if e.stream_id not in held]
        except (RedisConnectionError, RedisTimeoutError):
            return [e for e in await self.delivered(consumer) if e.stream_id not in held]

    async def _read_free(self, consumer: str, count: int, newest_first: bool, held: set[str]
                         ) -> tuple[list[tuple[str, dict]], str]:
        """The READ script on the never-retried connection, skipping the ids in ``held``:
        (entries as (id, fields), the stream's newest id)."""
        entries, last = await self._read_script(
            args=[self.p, consumer, count, int(newest_first), *sorted(held)], client=self._reader)
        return [(eid, dict(zip(f[::2], f[1::2]))) for eid, f in entries], last

    async def drop_stale(self, threshold: int, version: int, limit: int = SWEEP_BATCH,
                         exclude: set[str] | None = None) -> int:
        """Drop the waiting experiences (ready, held by no trainer) whose oldest token's policy
        version is below ``threshold``, among the ``limit`` oldest: state ``stale-dropped`` with
        ``version``, counted in ``stale_dropped``. A trainer that reads the freshest first calls
        this so that what falls past its staleness bound leaves the store instead of waiting
        for the ready bound (``max_ready``). ``exclude``: stream ids the caller holds, never
        dropped even when the consumer group's pending entries list lost them (as `read_ready`).

        Returns:
            How many were dropped.
        """
        return int(await self._drop_stale(args=[self.p, threshold, version,
                                                 max(1, math.ceil(self.trained_ttl_s)), limit,
                                                 *sorted(exclude or ())]))

    async def _parsed(self, raw: list[tuple[str, dict]]) -> list[RewardedExperience]:
        """Entries as (id, fields) -> their experiences, each joined with its completion's shared
        fields (``P:rp:{cid}``, named by the entry's ``prompt_ref``; an entry that carries its
        own copy in ``prompt`` as it is); what does not parse is dead-lettered."""
        cids = sorted({f["prompt_ref"] for _, f in raw if f and "prompt" not in f and f.get("prompt_ref")})
        if cids:
            async with self.redis.pipeline(transaction=False) as pipe:
                for cid in cids:
                    pipe.hget(self._k("rp", cid), "payload")
                payloads = dict(zip(cids, await pipe.execute()))
            raw = [(eid, {**f, "prompt": payloads[f["prompt_ref"]]}
                    if f and "prompt" not in f and payloads.get(f.get("prompt_ref")) is not None else f)
                   for eid, f in raw]
        good, bad = parse_entries(raw)
        await self.dead_letter(bad)
        return good

    async def delivered(self, consumer: str) -> list[RewardedExperience]:
        """Every entry delivered to ``consumer`` and not yet acknowledged (its pending entries
        list), oldest first, paged so none is left behind however many there are. A restarted
        trainer reads these before new ones."""
        out: list[RewardedExperience] = []
        start = "0"
        while True:
            raw = await self._read(self.redis, consumer, start, 256, None)
            out.extend(await self._parsed(raw))
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
        """Acknowledge ready entries: XACK + XDEL and mark each choice ``state`` (``trained``,
        ``stale-dropped``, ``greedy`` (sampled below ``trainer.min_train_temperature``), or
        ``constrained``: sampled under a grammar the trainer does not
        apply, left out of the loss) with ``version``, in one script. Entries already acknowledged are
        skipped, so a retried ack counts nothing twice; an entry still in the stream whose
        delivery Redis lost (in no pending entries list: an AOF restored to an earlier point) is
        acknowledged all the same if it is of the same member; one a sweep shed after its
        delivery (``backlog-dropped``) is counted as ``state`` and no longer as backlog-dropped.

        Returns:
            (newly trained, newly acknowledged untrained: stale-dropped or constrained).
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
        args: list = [self.p, max(1, math.ceil(self.trained_ttl_s)), len(entries)]
        for stream_id, member, version in entries:
            args += [stream_id, member, state, version]
        trained, dropped = await self._ack(args=args)
        return int(trained), int(dropped)

    async def dead_letter(self, letters: list[DeadLetter]) -> int:
        """Move ready entries that cannot be trained to the dead-letter stream ``P:dead``
        (acknowledged, choice state ``dead-letter``, counted as ``dead_lettered``); entries
        already acknowledged are skipped. A letter whose ``exp`` is not ``whole`` carries its
        completion's shared fields in ``prompt`` (copied from the entry); a whole one does not.

        Returns:
            Entries moved now.
        """
        if not letters:
            return 0
        args: list = [self.p, DEAD_LETTER_MAXLEN, max(1, math.ceil(self.trained_ttl_s)), len(letters)]
        for d in letters:
            args += [d.stream_id, d.member, d.reason, d.exp, d.reward, int(d.whole)]
        return int(await self._dead_letter(args=args))

    async def dead_letters(self, count: int = 100) -> list[dict[str, str]]:
        """The newest ``count`` dead letters, newest first (fields as in ``P:dead``)."""
        return [f for _, f in await self.redis.xrevrange(self._k("dead"), count=count)]

    async def begin_attempt(self, stream_ids: list[str]) -> list[int]:
        """Count one more training step begun with each entry (``P:attempts``; cleared by
        `ack`, `dead_letter` and, once a step with the entry succeeded, `clear_attempts`).

        Returns:
            Each entry's attempts so far, this one included.
        """
        if not stream_ids:
            return []
        async with self.redis.pipeline(transaction=True) as pipe:
            for sid in stream_ids:
                pipe.hincrby(self._k("attempts"), sid, 1)
            return [int(n) for n in await pipe.execute()]

    async def clear_attempts(self, stream_ids: list[str]) -> None:
        """Forget the step attempts of entries whose step succeeded (``P:attempts``): a trainer
        process that dies later, before a saved state covers them, did not die in their step, so
        its restart must not count against them (`begin_attempt` counts only crashed steps)."""
        if stream_ids:
            await self.redis.hdel(self._k("attempts"), *stream_ids)

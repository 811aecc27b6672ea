"""Experience logging in batches: concurrent completions written by one LOG script call.

A replica serves many requests at once and each awaits `ExperienceStore.log_experiences`
before its response ends. One script call (one round trip, one AOF write and, with
``buffer.durability`` ``always``, one fsync) per completion costs far more than the writes
themselves; `LogBatcher` collects the calls that arrive while the event loop runs the same
tick, or while earlier batches are in flight, and writes up to ``max_items`` completions (at
most ``max_bytes``) in one call: group commit, as databases batch commits into one log flush
(Gray and Reuter, *Transaction Processing*, 9.4.7 "group commit"). Each caller's call returns
only after Redis acknowledged the batch that holds its completion, so "an experience is in
Redis before its response ends" holds as with one call each.

The completions travel as one MessagePack array (`msgpack`; Redis's Lua has ``cmsgpack``):
one argument per batch instead of about a dozen per completion, each encoded once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable

import msgpack
from redis.exceptions import OutOfMemoryError, ResponseError

from serve_rft.buffer.records import StoreFull, conversation_key, shared_names
from serve_rft.config.service import DEFAULT_TENANT
from serve_rft.types import Experience

LOG_BATCH_ITEMS = 64
"""Completions per LOG script call at most."""
LOG_BATCH_BYTES = 1 << 20
"""Encoded bytes per LOG script call at most (a larger single completion goes alone): one call
never holds Redis for long."""


class LogBatcher:
    """Writes items submitted concurrently in batches; each submitter gets its own item's result.

    Args:
        write: writes a batch of encoded items in one round trip and returns one result per
            item, in order: a value, or an exception instance for that item alone.
        max_items: items per batch at most.
        max_bytes: encoded bytes per batch at most (an item larger than this goes alone).
        max_in_flight: batches written at once at most; what arrives meanwhile waits for the
            next batch.

    Guarantees: an item's `submit` returns only after ``write`` returned for its batch; an
    exception raised by ``write`` fails every submitter of that batch (none is dropped); an
    item whose submitter was cancelled before its batch was formed is not written.
    """

    def __init__(self, write: Callable[[list[bytes]], Awaitable[list]], max_items: int = LOG_BATCH_ITEMS,
                 max_bytes: int = LOG_BATCH_BYTES, max_in_flight: int = 2):
        self._write, self.max_items, self.max_bytes = write, max_items, max_bytes
        self.max_in_flight = max_in_flight
        self._queue: deque[tuple[bytes, asyncio.Future]] = deque()
        self._tasks: set[asyncio.Task] = set()  # (strong references to the flushers)
        self._flushers = 0  # running `_flush` loops: each checks the queue once more before it ends
        self._writing = 0  # of them, those awaiting ``write``

    async def submit(self, item: bytes):
        """Queue ``item`` and wait for its result.

        Raises:
            whatever ``write`` raised for its batch, or returned for this item.
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append((item, fut))
        if self._flushers < self.max_in_flight:
            self._flushers += 1
            task = loop.create_task(self._flush())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await fut

    def _next_batch(self) -> list[tuple[bytes, asyncio.Future]]:
        """The oldest queued items, shared evenly among the flushers not writing (so batches
        overlap: Redis runs one while the callers of another encode their next items), at most
        ``max_items`` and ``max_bytes``."""
        idle = max(1, self._flushers - self._writing)
        limit = min(self.max_items, -(-len(self._queue) // idle))
        batch, size = [], 0
        while self._queue and len(batch) < limit:
            item, fut = self._queue[0]
            if batch and size + len(item) > self.max_bytes:
                break
            self._queue.popleft()
            if not fut.done():  # a cancelled submitter's item is not written
                batch.append((item, fut))
                size += len(item)
        return batch

    async def _flush(self) -> None:
        try:
            await asyncio.sleep(0)  # the callers of this tick join the batch
            while self._queue:  # (no await between this check and the end: see `submit`)
                batch = self._next_batch()
                if batch:
                    await self._write_batch(batch)
        finally:
            self._flushers -= 1

    async def _write_batch(self, batch: list[tuple[bytes, asyncio.Future]]) -> None:
        self._writing += 1
        try:
            results = await self._write([item for item, _ in batch])
        except Exception as e:  # noqa: BLE001 (not swallowed: every caller of the batch raises it)
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            return
        except BaseException:  # cancelled (the loop is closing): so are its callers
            for _, fut in batch:
                fut.cancel()
            raise
        finally:
            self._writing -= 1
        if len(results) != len(batch):
            results = [RuntimeError(f"{len(results)} results for a batch of {len(batch)}")] * len(batch)
        for (_, fut), result in zip(batch, results):
            if fut.done():
                continue
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)


class CompletionLog:
    """The explorer's side of the experience store: `log_experiences`, batched by `LogBatcher`.

    A mixin of `serve_rft.buffer.store.ExperienceStore`; uses its ``redis``, ``p``,
    ``reward_timeout_s``, ``_long_ttl``, ``max_conversation_turns`` and ``_log`` (the LOG script).
    """

    def _init_log_batcher(self, max_items: int = LOG_BATCH_ITEMS) -> None:
        self._log_batcher = LogBatcher(self._write_log_batch, max_items=max_items)

    async def log_experiences(self, experiences: list[Experience], group_size: int | None = None,
                              conversation_id: str | None = None, tenant: str = DEFAULT_TENANT) -> None:
        """Write the experiences of one completion (all its choices, indices 0..n-1), atomically,
        in one LOG script call with the completions other callers log at the same time.

        Called before the response is returned, so a reward may be posted at once: returns once
        Redis acknowledged the write (with ``buffer.durability`` ``always``: fsynced).

        Args:
            experiences: the choices, all with the same ``completion_id`` and ``group_id``.
            group_size: answers the group should have (None: ``len(experiences)`` when the group
                is the completion itself, else unknown).
            conversation_id: the conversation this completion is a turn of, if any (the
                client's id: namespaced by ``tenant`` here).
            tenant: whose keys may reward and read it; its group ids must already be the tenant's
                (`serve_rft.buffer.records.client_group`).
        Raises:
            StoreFull: Redis is past ``maxmemory``; nothing of the completion was written.
            redis.exceptions.RedisError: Redis refused this completion (nothing of it written)
                or the call failed (its batch may have landed: a retry is counted once).
        """
        if not experiences:
            return
        item = self._encode_completion(sorted(experiences, key=lambda e: e.choice_index), group_size,
                                       conversation_id, tenant)
        try:
            await self._log_batcher.submit(item)
        except OutOfMemoryError as e:
            raise StoreFull(str(e)) from None

    def _encode_completion(self, exps: list[Experience], group_size: int | None, conversation_id: str | None,
                           tenant: str) -> bytes:
        """One completion as the LOG script reads it (a MessagePack array of strings)."""
        e0 = exps[0]
        cid, gid = e0.completion_id, e0.group_id
        if group_size is None:
            group_size = len(exps) if gid == cid else 0
        now = time.time()
        shared = shared_names(exps)
        conv = conversation_key(tenant, conversation_id) if conversation_id else ""
        return msgpack.packb([cid, str(len(exps)), gid, str(group_size), repr(now), repr(now + self.reward_timeout_s),
                              conv, str(min(e.min_version for e in exps)), e0.model_dump_json(include=shared),
                              tenant, *[e.model_dump_json(exclude=shared) for e in exps]])

    async def _write_log_batch(self, items: list[bytes]) -> list:
        """One LOG script call for ``items``; per item its experience count or its error."""
        packer = msgpack.Packer()
        results = await self._log(args=[self.p, max(1, math.ceil(self.reward_timeout_s)), self._long_ttl(),
                                        self.max_conversation_turns,
                                        packer.pack_array_header(len(items)) + b"".join(items)])
        return [OutOfMemoryError(r) if isinstance(r, str) and r.startswith("OOM")
                else ResponseError(r) if isinstance(r, str) else int(r) for r in results]

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

Each completion is encoded once: its small fields (ids, times, version, tenant) as one
MessagePack array (`msgpack`; Redis's Lua has ``cmsgpack``), all heads of a batch in one argument
instead of about a dozen arguments per completion; its JSON (the shared fields and each choice)
as arguments of their own, which Lua reads without copying them out of the MessagePack again.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sized

import msgpack
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

from serve_rft.buffer.records import StoreFull, conversation_index, conversation_key, shared_names
from serve_rft.config.service import DEFAULT_TENANT
from serve_rft.types import Experience

LOG_BATCH_ITEMS = 64
"""Completions per LOG script call at most."""
LOG_BATCH_BYTES = 1 << 20
"""Encoded bytes per LOG script call at most (a larger single completion goes alone): one call
never holds Redis for long."""
LOG_HELD_BYTES = 64 << 20
"""Encoded bytes a `LogBatcher` holds at most (queued and in flight): while Redis stalls, what
callers submit past it is refused at once (`LogQueueFull`) instead of growing the replica's memory."""


class LogQueueFull(RedisError):
    """The batcher already holds ``max_held_bytes`` of items Redis has not acknowledged (Redis is
    slow or away): this item was refused at once, nothing of it written. A `RedisError`, so a
    replica counts its completion unlogged as ``store_unavailable``."""


def _own_copy(e: BaseException) -> BaseException:
    """A copy of ``e`` for one caller, chained to it (``__cause__``): raising one exception object
    in many tasks would append every task's frames to its one traceback."""
    c = type(e).__new__(type(e), *e.args)
    c.args = e.args
    c.__dict__.update(vars(e))
    c.__cause__ = e
    return c


class _Entry:
    """One submitted item (encoded: ``len(item)`` is its size in bytes), its caller's future, and
    the batch it was sent in (None while queued)."""

    __slots__ = ("item", "fut", "batch")

    def __init__(self, item: Sized, fut: asyncio.Future):
        self.item, self.fut, self.batch = item, fut, None


class _Batch:
    """Entries written by one ``write`` call; ``waiting``: how many of their callers still wait
    (at 0 the write task is cancelled: nobody would learn its outcome)."""

    __slots__ = ("entries", "waiting", "task")

    def __init__(self, entries: list[_Entry]):
        self.entries, self.waiting, self.task = entries, len(entries), None


class LogBatcher:
    """Writes items submitted concurrently in batches; each submitter gets its own item's result.

    Args:
        write: writes a batch of encoded items (each `Sized`: its ``len`` is its size in bytes)
            in one round trip and returns one result per item, in order: a value, or an
            exception instance for that item alone.
        max_items: items per batch at most.
        max_bytes: encoded bytes per batch at most (an item larger than this goes alone).
        max_in_flight: batches written at once at most; what arrives meanwhile waits for the
            next batch.
        max_held_bytes: encoded bytes queued or in flight at most; past it `submit` raises
            `LogQueueFull` at once (an item larger than this is taken only when nothing is held).

    Guarantees: an item's `submit` returns only after ``write`` returned for its batch; an
    exception raised by ``write`` fails every submitter of that batch (each with its own copy,
    chained to it; none is dropped). A submitter cancelled while its item is queued takes the
    item out of the queue at once (never written); a batch whose submitters were all cancelled
    has its ``write`` cancelled (with redis-py: the command is abandoned and no longer retried;
    one already sent may still have run). A submitter cancelled while others of its batch still
    wait leaves the batch written: its item may land although its submitter gave up.
    ``write`` runs in a task with an empty `contextvars.Context`, not a submitter's.
    """

    def __init__(self, write: Callable[[list], Awaitable[list]], max_items: int = LOG_BATCH_ITEMS,
                 max_bytes: int = LOG_BATCH_BYTES, max_in_flight: int = 2, max_held_bytes: int = LOG_HELD_BYTES):
        self._write, self.max_items, self.max_bytes = write, max_items, max_bytes
        self.max_in_flight, self.max_held_bytes = max_in_flight, max_held_bytes
        self._queue: OrderedDict[int, _Entry] = OrderedDict()  # by submission order; O(1) removal
        self._held = 0  # bytes of the queued entries and of the batches in flight
        self._tasks: set[asyncio.Task] = set()  # (strong references to the flushers)
        self._flushers = 0  # running `_flush` loops: each checks the queue once more before it ends
        self._writing = 0  # of them, those awaiting ``write``

    @property
    def held_bytes(self) -> int:
        """Encoded bytes queued or in flight (bytes)."""
        return self._held

    @property
    def queued(self) -> int:
        """Items waiting for a batch."""
        return len(self._queue)

    async def submit(self, item: Sized):
        """Queue ``item`` and wait for its result.

        Raises:
            LogQueueFull: ``max_held_bytes`` already held (nothing queued).
            whatever ``write`` raised for its batch, or returned for this item.
        """
        if self._held and self._held + len(item) > self.max_held_bytes:
            raise LogQueueFull(f"{self._held} bytes of completions wait for the store: "
                               f"its limit is {self.max_held_bytes}")
        loop = asyncio.get_running_loop()
        entry = _Entry(item, loop.create_future())
        self._queue[id(entry)] = entry
        self._held += len(item)
        if self._flushers < self.max_in_flight:
            self._flushers += 1
            task = loop.create_task(self._flush(), context=contextvars.Context())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            return await entry.fut
        finally:  # answered, failed or cancelled
            self._caller_done(entry)

    def _caller_done(self, entry: _Entry) -> None:
        """A caller stopped waiting (answered or cancelled): a queued entry leaves the queue;
        the last waiting caller of a batch in flight cancels its write."""
        if self._queue.pop(id(entry), None) is not None:
            self._held -= len(entry.item)
            return
        batch = entry.batch
        if batch is not None:
            batch.waiting -= 1
            if batch.waiting == 0 and batch.task is not None:
                batch.task.cancel()  # (no-op once the write returned)

    def _next_batch(self) -> list[_Entry]:
        """The oldest queued items, shared evenly among the flushers not writing (so batches
        overlap: Redis runs one while the callers of another encode their next items), at most
        ``max_items`` and ``max_bytes``."""
        idle = max(1, self._flushers - self._writing)
        limit = min(self.max_items, -(-len(self._queue) // idle))
        batch, size = [], 0
        while self._queue and len(batch) < limit:
            entry = next(iter(self._queue.values()))
            if batch and size + len(entry.item) > self.max_bytes:
                break
            self._queue.popitem(last=False)
            if entry.fut.done():  # cancelled, its caller not yet resumed: not written
                self._held -= len(entry.item)
                continue
            batch.append(entry)
            size += len(entry.item)
        return batch

    async def _flush(self) -> None:
        try:
            await asyncio.sleep(0)  # the callers of this tick join the batch
            while self._queue:  # (no await between this check and the end: see `submit`)
                entries = self._next_batch()
                if entries:
                    await self._write_batch(_Batch(entries))
        finally:
            self._flushers -= 1

    async def _write_batch(self, batch: _Batch) -> None:
        for entry in batch.entries:
            entry.batch = batch
        batch.task = asyncio.get_running_loop().create_task(self._write([e.item for e in batch.entries]),
                                                            context=contextvars.Context())
        self._writing += 1
        try:
            await asyncio.wait([batch.task])
        except BaseException:  # this flusher was cancelled (the loop is closing): so are its callers
            batch.task.cancel()
            for entry in batch.entries:
                entry.fut.cancel()
            raise
        finally:
            self._writing -= 1
            self._held -= sum(len(e.item) for e in batch.entries)
        if batch.task.cancelled():  # every caller gave up (or ``write`` cancelled itself)
            for entry in batch.entries:
                if not entry.fut.done():
                    entry.fut.set_exception(RedisError("the batch's write was cancelled"))
            return
        error = batch.task.exception()
        if error is not None:
            for entry in batch.entries:
                if not entry.fut.done():
                    entry.fut.set_exception(_own_copy(error))
            return
        results = batch.task.result()
        if not isinstance(results, list) or len(results) != len(batch.entries):
            got = len(results) if isinstance(results, list) else type(results).__name__
            results = [ResponseError(f"{got} results for a batch of {len(batch.entries)}") for _ in batch.entries]
        for entry, result in zip(batch.entries, results):
            if entry.fut.done():
                continue
            if isinstance(result, BaseException):
                entry.fut.set_exception(result)
            else:
                entry.fut.set_result(result)


class EncodedCompletion:
    """One completion encoded for the LOG script (`serve_rft.buffer.scripts.LOG`).

    Attributes:
        head: MessagePack array of strings: cid, n, gid, group_size, now (unix s), reward
            deadline (unix s), conversation key ('' for none), oldest policy version, tenant,
            conversation index ('' for none: `serve_rft.buffer.records.conversation_index`),
            '1' to charge it to its tenant's ledger (`serve_rft.buffer.ledger`), else ''.
        json: its shared fields' JSON object, then each choice's JSON without them (``1 + n``).
    ``len()`` is its size in bytes (what `LogBatcher` bounds).
    """

    __slots__ = ("head", "json", "nbytes")

    def __init__(self, head: bytes, json: list[bytes]):
        self.head, self.json = head, json
        self.nbytes = len(head) + sum(len(j) for j in json)

    def __len__(self) -> int:
        return self.nbytes


class CompletionLog:
    """The explorer's side of the experience store: `log_experiences`, batched by `LogBatcher`.
    A component of `serve_rft.buffer.store.ExperienceStore`, given what it writes with.

    Args:
        log_script: the registered LOG script (`serve_rft.buffer.scripts.LOG`).
        prefix: the store's key prefix.
        reward_timeout_s: seconds an unrewarded experience is kept.
        long_ttl_s: seconds a completion's record outlives its reward window (integer, >= 1).
        max_conversation_turns: turns a conversation may have.
        max_items: completions per LOG call at most.
        tenant_ledger: charge each completion to its tenant's ledger (`serve_rft.buffer.ledger`).
    """

    def __init__(self, log_script, prefix: str, reward_timeout_s: float, long_ttl_s: int,
                 max_conversation_turns: int, max_items: int = LOG_BATCH_ITEMS, tenant_ledger: bool = False):
        self._log, self.p, self.reward_timeout_s = log_script, prefix, reward_timeout_s
        self.tenant_ledger = tenant_ledger
        self.long_ttl_s, self.max_conversation_turns = long_ttl_s, max_conversation_turns
        self.batcher = LogBatcher(self._write_log_batch, max_items=max_items)

    async def log_experiences(self, experiences: list[Experience], group_size: int | None = None,
                              conversation_id: str | None = None, tenant: str = DEFAULT_TENANT,
                              owner: str = "") -> None:
        """Write the experiences of one completion (all its choices, indices 0..n-1), atomically,
        in one LOG script call with the completions other callers log at the same time.

        Called before the response is returned, so a reward may be posted at once: returns once
        Redis acknowledged the write (with ``buffer.durability`` ``always``: fsynced).

        Args:
            experiences: the choices, all with the same ``completion_id`` and ``group_id``.
            group_size: answers the group should have (None: ``len(experiences)`` when the group
                is the completion itself, else unknown).
            conversation_id: the conversation this completion is a turn of, if any (the
                client's id: namespaced by ``tenant`` and ``owner`` here).
            tenant: whose keys may reward and read it; its group ids must already be the tenant's
                and the owner's (`serve_rft.buffer.records.client_group`).
            owner: the `key_identity` of the key that sent it ('' without keys): its
                conversation is that key's own (`serve_rft.buffer.records.conversation_key`).
        Raises:
            StoreFull: Redis is past ``maxmemory``; nothing of the completion was written.
            redis.exceptions.RedisError: Redis refused this completion (nothing of it written)
                or the call failed (its batch may have landed: a retry is counted once);
                `LogQueueFull`: ``LOG_HELD_BYTES`` of completions already wait for a slow or
                absent Redis (nothing written).

        Cancelled (e.g. by ``asyncio.wait_for``): the completion leaves the queue at once; if
        its batch is in flight, that batch's write is cancelled once none of its callers waits
        (not retried; a command already sent may still land), else it may still be written.
        """
        if not experiences:
            return
        item = self._encode_completion(sorted(experiences, key=lambda e: e.choice_index), group_size,
                                       conversation_id, tenant, owner)
        try:
            await self.batcher.submit(item)
        except OutOfMemoryError as e:
            raise StoreFull(str(e)) from None

    def _encode_completion(self, exps: list[Experience], group_size: int | None, conversation_id: str | None,
                           tenant: str, owner: str = "") -> EncodedCompletion:
        """One completion as the LOG script reads it: its head and its JSON (`EncodedCompletion`)."""
        e0 = exps[0]
        cid, gid = e0.completion_id, e0.group_id
        if group_size is None:
            group_size = len(exps) if gid == cid else 0
        now = time.time()
        shared = shared_names(exps)
        conv = conversation_key(tenant, conversation_id, owner) if conversation_id else ""
        index = conversation_index(tenant, conversation_id) if conversation_id and owner else ""
        to_json = e0.__pydantic_serializer__.to_json
        head = msgpack.packb([cid, str(len(exps)), gid, str(group_size), repr(now), repr(now + self.reward_timeout_s),
                              conv, str(min(e.min_version for e in exps)), tenant, index,
                              "1" if self.tenant_ledger else ""])
        return EncodedCompletion(head, [to_json(e0, include=shared), *[to_json(e, exclude=shared) for e in exps]])

    async def _write_log_batch(self, items: list[EncodedCompletion]) -> list:
        """One LOG script call for ``items``; per item its experience count or its error.

        Raises:
            redis.exceptions.RedisError: the call failed; ResponseError for a reply that is not
                one integer or error message per item.
        """
        heads = msgpack.Packer().pack_array_header(len(items)) + b"".join(c.head for c in items)
        results = await self._log(args=[self.p, max(1, math.ceil(self.reward_timeout_s)), self.long_ttl_s,
                                        self.max_conversation_turns, heads,
                                        *[j for c in items for j in c.json]])
        if not isinstance(results, list):
            raise ResponseError(f"the LOG script answered a {type(results).__name__}, not a list")
        return [OutOfMemoryError(r) if isinstance(r, str) and r.startswith("OOM")
                else ResponseError(r) if isinstance(r, str)
                else r if isinstance(r, int) and not isinstance(r, bool)
                else ResponseError(f"the LOG script answered a {type(r).__name__} for a completion")
                for r in results]

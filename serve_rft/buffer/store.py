"""The experience store: Redis keys, the reward transaction and the trainer's ready stream.

Owns every Redis key of the service. Explorer replicas call `log_experiences` (batched across
concurrent callers: `serve_rft.buffer.log_batch`); the rewards API calls `post_reward`; the
trainer holds ``store.ready`` alone (the ready stream's side, `serve_rft.buffer.ready.ReadyStream`: `read_ready`, `ack`, ...). Nothing else touches Redis. Every state change is one Lua script
(`serve_rft.buffer.scripts`), so it is atomic. Records and domain errors: `serve_rft.buffer.records`.

Schema (``P`` = ``buffer.key_prefix``; ``{cid}`` a completion id, ``{i}`` a choice index,
``{gid}`` a group id):

=====================  ======  =============================================================
key                    type    meaning
=====================  ======  =============================================================
``P:exp:{cid}:{i}``    string  Experience JSON without the shared fields (``pr`` of
                               ``P:cmp:{cid}``).
                               TTL ``reward_timeout_s`` while pending,
                               ``reward_timeout_s + trained_ttl_s`` from its reward (a
                               held member outlives its group's longest hold); deleted when it
                               expires.
``P:cmp:{cid}``        hash    The completion's record, one key for all its choices: ``n``
                               choices, ``group`` id, ``conv`` its conversation's key,
                               ``created`` (unix s), ``ver``, ``tenant`` (whose keys may reward
                               and read it; none: the default tenant); ``pr`` the fields its
                               choices share, once for all of them (a JSON object with the
                               prompt token ids and, when every choice has the same,
                               ``sampling`` (its grammar included), ``user`` and ``metadata``:
                               `records.shared_names`); per choice ``{i}`` its state
                               (pending / rewarded / ready / trained / expired /
                               stale-dropped / backlog-dropped / dead-letter / constrained / greedy),
                               ``r{i}`` reward (repr of a float), ``info{i}`` the reward's
                               info: ``@{h}``, naming ``P:info:{h}`` (a record written
                               before has the JSON itself), ``v{i}`` the policy version that trained (or
                               dropped) it. Kept as long as its longest-kept choice. Tells
                               404 (never logged, or another tenant's) from 410. A record an
                               earlier schema wrote has the choices' fields in ``P:st:{cid}``
                               and the shared fields in ``P:pr:{cid}``: read and written there
                               (`serve_rft.buffer.scripts.COMPLETION_HELPERS`).
``P:info:{h}``         string  A reward's ``info`` JSON, once however many choices a request
                               rewards with it (a conversation's every turn and choice, a
                               completion's every choice) and for every request that sends the
                               same; ``h`` = the first 32 hex digits of its SHA-256. Kept as long
                               as the longest-kept record that names it.
``P:grp:{gid}``        hash    Group: ``size`` expected answers (0 = unknown), ``logged``,
                               ``rewarded``, ``expired``, ``first`` reward time,
                               ``released`` (1 once its members went to the ready stream).
``P:gm:{gid}``         set     Rewarded members ``{cid}:{i}`` held until the group is released.
``P:gdl``              zset    Group ids scored by their timeout (first reward +
                               ``group_timeout_s``; then + ``reward_timeout_s``).
``P:pending``          zset    ``{cid}:{i}`` awaiting a reward, scored by its deadline.
``P:conv:{conv}``      list    Completion ids of a conversation's turns, in order, at most
                               ``max_conversation_turns`` (without keys, default tenant;
                               another tenant's: ``P:tconv:{tenant}/{conv}``; a key's own:
                               ``P:kconv:{tenant}/{owner}/{conv}``, `records.conversation_key`).
``P:convidx:{t}/{c}``  set     The turn-list keys that tenant ``t``'s keys made under id ``c``
                               (how a reward key finds them); TTL as the lists'.
``P:ready``            stream  Released experiences (fields ``exp``, ``reward``, ``member``,
                               ``prompt_ref`` its completion id, naming ``P:rp:{cid}``; an
                               entry without shared fields, or written by an older version,
                               has ``prompt`` instead: its own copy, '' for none; ``v`` the
                               policy version of the oldest token);
                               consumer group ``trainer`` (entries delivered by XCLAIM
                               FORCE, newest or oldest first); XACK + XDEL once trained.
                               Entries leave only by XDEL in a script (ACK, DEAD_LETTER,
                               DROP_STALE, SWEEP past ``max_ready``).
``P:rp:{cid}``         hash    The ready entries' copy of the shared fields (which may expire
                               first), once per completion: ``payload`` the JSON, ``refs``
                               how many ready entries name it. No TTL: every XDEL that
                               removes such an entry takes one reference, the last deletes
                               the key; the trainer's reads join ``payload`` back.
``P:stat``             hash    Counters: logged, rewarded, ready, trained, expired,
                               stale_dropped, groups_timed_out, dead_lettered,
                               backlog_dropped (ready entries past ``max_ready``).
``P:dead``             stream  Dead letters: ready entries that cannot be trained (fields ``id``,
                               ``member``, ``reason``, ``exp``, ``reward``, ``prompt`` a copy
                               of the shared fields, '' for none), about
                               ``DEAD_LETTER_MAXLEN`` newest kept.
``P:attempts``         hash    Stream id -> training steps begun with that entry (a trainer
                               that crashed on it restarts and tries again; bounded).
``P:vr:{v}:{h}``       hash    Rewards of completions generated by policy version ``v`` in hour
                               ``h = floor(created / 3600)``: ``{b}:n`` count, ``{b}:s`` sum,
                               ``{b}:q`` sum of squares for ``b = floor(created /
                               REWARD_BUCKET_S)`` (canary verdicts, `version_rewards`); TTL
                               ``trained_ttl_s``.
``P:sync:rollout``     string  The synchronizer's rollout (incumbent, candidate, pins, rejected
                               and quarantined versions) as JSON, for its restart.
``P:tled:{t}``,        zset,   The bytes tenant ``t`` keeps in the store, with when each
``P:tsz:{t}``,         hash,   part expires (`serve_rft.buffer.ledger`); `tenant_bytes` reads
``P:tbytes``           hash    them.
=====================  ======  =============================================================

Groups (GRPO compares the answers of one group): a completion with ``n`` choices is a group of
``n``; a client can put several requests in one group with the ``group_id`` request field
(``group_size`` = the number of answers to expect, optional), stored per tenant
(`serve_rft.buffer.records.client_group`: ``k:{tenant}/{owner}/{id}`` for a key's group, and without
keys ``u:{id}`` for the default tenant, ``t:{tenant}/{id}`` for another, so two keys or two
tenants naming the same group stay apart). A group's rewarded members are
*held* (state ``rewarded``) and released to the ready stream together when every member is
rewarded or expired, or ``group_timeout_s`` after the first reward if at least two are
rewarded, or at the latest ``reward_timeout_s`` after the first reward. A reward for a member
of an already released group makes it ready at once.

Pending experiences with no reward by ``reward_timeout_s`` expire (state ``expired``, counted);
their reward then gets 410. Expiry and group timeouts run in `sweep`, which the trainer's reads call
on every read and `counts` calls on every status.
"""

from __future__ import annotations

import hashlib
import json
import math
import time

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from serve_rft.buffer import ledger, scripts
from serve_rft.buffer.log_batch import LOG_BATCH_ITEMS, CompletionLog
from serve_rft.buffer.ready import SWEEP_BATCH, ReadyStream
from serve_rft.buffer.records import (ChoiceState, ConversationFull, GroupSizeConflict, RewardConflict,
                                      RewardExpired, RewardNotFinite, RewardOutOfRange, StoreCounts, StoreFull,
                                      TenantBytes, UnknownChoice, conversation_index, conversation_key, experience_from)
from serve_rft.config.service import DEFAULT_TENANT
from serve_rft.types import Experience

SOCKET_TIMEOUT_S = 10.0
"""Seconds the store's client waits for a reply: a stalled Redis (a hung host, a frozen
process) counts as a dropped connection, retried like one (``reconnect_s``), instead of a
command that never returns."""
REWARD_BUCKET_S = 5
"""Seconds of generation time per bucket of ``P:vr:{version}`` (the REWARD script's 5)."""


class ExperienceStore:
    """Async access to the experience schema above on one Redis server.

    Args:
        url: ``redis://host:port``.
        prefix: key prefix (``buffer.key_prefix``).
        reward_timeout_s: a pending experience expires this long after it was logged, s.
        trained_ttl_s: how long rewarded / trained experiences stay readable, s.
        group_timeout_s: a group with >= 2 rewarded members is released this long after its
            first reward even if other members are still pending, s.
        max_ready: bound of the ready stream (None: none); past it, `sweep` drops the oldest
            entries not yet delivered to the trainer.
        reward_range: rewards accepted, (low, high) inclusive (None: any finite reward whose
            square is finite); `post_reward` refuses the rest before anything is written.
        max_conversation_turns: turns one conversation's list keeps (`check_request` refuses a
            request past it; a turn that raced past that check is logged outside the list).
        log_batch_items: completions one LOG script call writes at most (`log_experiences`
            batches concurrent callers, `serve_rft.buffer.log_batch`).
        tenant_ledger: charge what each tenant's completions and rewards store to its ledger
            (`serve_rft.buffer.ledger`; what ``per_tenant.max_stored_bytes`` is checked against):
            on where a stored-bytes limit is configured, off elsewhere (it costs ~370 bytes of
            Redis per completion).
    """

    def __init__(self, url: str, prefix: str = "srft", reward_timeout_s: float = 3600.0,
                 trained_ttl_s: float = 86400.0, group_timeout_s: float = 60.0,
                 reconnect_s: float = 30.0, max_ready: int | None = None,
                 reward_range: tuple[float, float] | None = None, max_conversation_turns: int = 256,
                 log_batch_items: int = LOG_BATCH_ITEMS, tenant_ledger: bool = False):
        # A Redis restart (AOF reload) must not kill a replica's logging or the trainer's loop:
        # redis-py retries a command on a dropped connection with exponential backoff for
        # about ``reconnect_s`` seconds, then raises; a reply later than SOCKET_TIMEOUT_S is
        # retried the same way.
        retries = max(1, math.ceil(reconnect_s))
        self.redis = aioredis.from_url(
            url, decode_responses=True, socket_timeout=SOCKET_TIMEOUT_S,
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
            retry_on_error=[RedisConnectionError, RedisTimeoutError])
        # New-entry reads are not idempotent (a read re-sent after a lost reply would deliver
        # the next entries and strand the first in the pending list): never retried.
        self._reader = aioredis.from_url(url, decode_responses=True, retry=Retry(ExponentialBackoff(), 0))
        self.p = prefix
        self.reward_timeout_s = reward_timeout_s
        self.trained_ttl_s = trained_ttl_s
        self.group_timeout_s = group_timeout_s
        self.max_ready = max_ready
        self.reward_range = reward_range
        self.max_conversation_turns = max_conversation_turns
        self._log = self.redis.register_script(scripts.LOG)
        self._reward = self.redis.register_script(scripts.REWARD)
        self._sweep = self.redis.register_script(scripts.SWEEP)
        self._tenant_bytes = self.redis.register_script(ledger.TENANT_BYTES)
        self.ready = ReadyStream(self.redis, self._reader, prefix, trained_ttl_s, self.sweep)
        self.tenant_ledger = tenant_ledger
        self.completions = CompletionLog(self._log, prefix, reward_timeout_s, self._long_ttl(),
                                         max_conversation_turns, log_batch_items, tenant_ledger)

    @classmethod
    def from_config(cls, buffer_cfg, tenant_ledger: bool = False) -> "ExperienceStore":
        """A store for a `serve_rft.config.BufferConfig` (its ``redis_url`` must be set)."""
        return cls(buffer_cfg.redis_url, buffer_cfg.key_prefix, buffer_cfg.reward_timeout_s,
                   buffer_cfg.trained_ttl_s, buffer_cfg.group_timeout_s, buffer_cfg.reconnect_s,
                   buffer_cfg.max_ready, tuple(buffer_cfg.reward_range), buffer_cfg.max_conversation_turns,
                   tenant_ledger=tenant_ledger)

    def _k(self, *parts: str) -> str:
        return ":".join((self.p, *parts))

    def _long_ttl(self) -> int:
        return max(1, math.ceil(max(self.trained_ttl_s, self.reward_timeout_s)))

    async def log_experiences(self, experiences: list[Experience], group_size: int | None = None,
                              conversation_id: str | None = None, tenant: str = DEFAULT_TENANT,
                              owner: str = "") -> None:
        """The explorer's call: `serve_rft.buffer.log_batch.CompletionLog.log_experiences` (its
        arguments, errors and batching)."""
        await self.completions.log_experiences(experiences, group_size, conversation_id, tenant, owner)

    async def close(self) -> None:
        await self.redis.aclose()
        await self._reader.aclose()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def check_request(self, tenant: str, group: str | None, group_size: int | None,
                            conversation_id: str | None, owner: str = "") -> None:
        """Refuse, before anything is generated, a request whose answers the store would not
        take as asked: a ``group_size`` other than the size recorded for its group, or one more
        turn of a conversation that has ``max_conversation_turns``.

        Args:
            tenant: the caller's tenant.
            group: the stored group id (`serve_rft.buffer.records.client_group`), or None.
            group_size: the request's ``group_size``, or None.
            conversation_id: the client's conversation id, or None.
            owner: the caller's key (`serve_rft.buffer.quota.key_identity`; '' without keys).
        Raises:
            GroupSizeConflict: the group was logged with another (non-zero) size.
            ConversationFull: the conversation has ``max_conversation_turns`` turns.
        """
        if group is not None and group_size is not None:
            recorded = int(await self.redis.hget(self._k("grp", group), "size") or 0)
            if recorded and recorded != group_size:
                raise GroupSizeConflict(f"group_size {group_size} conflicts with the size {recorded} "
                                        "recorded for this group_id")
        if conversation_id is not None:
            turns = await self.redis.llen(self._k(conversation_key(tenant, conversation_id, owner)))
            if turns >= self.max_conversation_turns:
                raise ConversationFull(f"conversation has {turns} turns, at most "
                                       f"buffer.max_conversation_turns={self.max_conversation_turns}")

    async def get_experience(self, completion_id: str, choice_index: int) -> Experience | None:
        """One choice's experience (its prompt joined back in), or None once it expired."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(self._k("exp", completion_id, str(choice_index)))
            pipe.hget(self._k("cmp", completion_id), "pr")
            pipe.get(self._k("pr", completion_id))  # a record an earlier schema wrote
            raw, prompt, old_prompt = await pipe.execute()
        return experience_from(raw, prompt or old_prompt) if raw else None

    async def post_reward(self, completion_id: str, choice_index: int, reward: float,
                          info: dict | None = None, tenant: str | None = None) -> bool:
        """Record a reward (and its free-form ``info``) atomically; the experience becomes ready
        for training when its group is released (see the module docstring). ``tenant``: the
        caller's (a completion of another tenant is unknown to it); None: any (an admin).

        Returns:
            True if recorded now, False if the same reward was already recorded (idempotent).
        Raises:
            RewardNotFinite (not a number, not finite, or its square not finite), RewardOutOfRange
            (outside ``reward_range``), UnknownChoice (also another tenant's), RewardConflict (a different reward is
            recorded), RewardExpired (before its reward came), StoreFull (nothing recorded; retry).
            Whatever is refused, nothing is written.
        """
        self.check_reward(reward)
        if choice_index < 0:
            raise UnknownChoice(f"no choice {choice_index} in completion {completion_id!r}")
        text = json.dumps(info) if info is not None else ""
        try:
            status, prev = await self._reward(args=[
                self.p, completion_id, str(choice_index), repr(float(reward)), text, time.time(),
                self.group_timeout_s, max(1, math.ceil(self.reward_timeout_s + self.trained_ttl_s)),
                tenant or "", hashlib.sha256(text.encode()).hexdigest()[:32], "1" if self.tenant_ledger else ""])
        except OutOfMemoryError:
            raise StoreFull("the experience store is full (maxmemory); the reward was not "
                            "recorded: retry later") from None
        status = int(status)  # the REWARD script's outcome codes
        if status == 201:
            return True
        if status == 200:
            return False
        if status == 422:
            raise RewardNotFinite(f"reward {reward!r} would make the per-version reward sums non-finite")
        if status == 404:
            raise UnknownChoice(f"no choice {choice_index} in completion {completion_id!r}")
        if status == 409:
            raise RewardConflict(f"choice {choice_index} of {completion_id!r} already has reward {prev}")
        raise RewardExpired(f"choice {choice_index} of {completion_id!r} expired before its reward")

    def check_reward(self, reward: float) -> None:
        """Refuse a reward the store would not record, before anything is written.

        Raises:
            RewardNotFinite: not an int or float (a bool is not a reward), not finite, or its
                square (summed per version for canary verdicts) not finite.
            RewardOutOfRange: outside ``reward_range``.
        """
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise RewardNotFinite(f"reward must be a number, got {reward!r}")
        try:
            value = float(reward)
        except OverflowError:  # an int past the float range
            raise RewardNotFinite("reward must be a finite number, got an integer past the float range") from None
        if not math.isfinite(value):
            raise RewardNotFinite(f"reward must be a finite number, got {reward!r}")
        if self.reward_range is not None:
            low, high = self.reward_range
            if not low <= value <= high:
                raise RewardOutOfRange(f"reward {reward!r} is outside buffer.reward_range [{low:g}, {high:g}]")
        if not math.isfinite(value * value):
            raise RewardNotFinite(f"reward must be a number whose square is finite, got {reward!r}")

    async def version_rewards(self, versions: list[int], start: float, end: float
                              ) -> dict[int, tuple[int, float, float]]:
        """Rewards recorded so far for completions generated by each of ``versions`` between
        ``start`` and ``end`` (unix s, rounded to `REWARD_BUCKET_S`), whenever they arrived.

        Returns:
            ``{version: (count, sum, sum of squares)}``.
        """
        lo, hi = math.floor(start / REWARD_BUCKET_S), math.floor(end / REWARD_BUCKET_S)
        hours = range(math.floor(start / 3600), math.floor(end / 3600) + 1)
        out = {}
        for v in versions:
            n, s, q = 0, 0.0, 0.0
            fields: dict[str, str] = {}
            for h in hours:
                fields.update(await self.redis.hgetall(self._k("vr", str(v), str(h))))
            for field, value in fields.items():
                b, kind = field.split(":")
                if lo <= int(b) < hi:
                    if kind == "n":
                        n += int(value)
                    elif kind == "s":
                        s += float(value)
                    else:
                        q += float(value)
            out[v] = (n, s, q)
        return out

    async def load_rollout(self) -> str | None:
        """The synchronizer's saved rollout JSON (`save_rollout`), or None."""
        return await self.redis.get(self._k("sync", "rollout"))

    async def save_rollout(self, snapshot: str) -> None:
        await self.redis.set(self._k("sync", "rollout"), snapshot)

    async def num_choices(self, completion_id: str) -> int | None:
        """Choices of a logged completion, or None if unknown."""
        n = await self.redis.hget(self._k("cmp", completion_id), "n")
        return int(n) if n is not None else None

    async def completion_meta(self, completion_id: str) -> tuple[int, str, str | None] | None:
        """A logged completion's (choices, tenant, stored group key) in one read, or None if
        unknown (a record logged without a tenant is the default tenant's)."""
        n, tenant, group = await self.redis.hmget(self._k("cmp", completion_id), ["n", "tenant", "group"])
        return None if n is None else (int(n), tenant or DEFAULT_TENANT, group)

    async def conversation_turns(self, conversation_id: str, tenant: str = DEFAULT_TENANT,
                                 owner: str = "") -> list[str]:
        """Completion ids of the assistant turns of ``owner``'s conversation of ``tenant``
        (`serve_rft.buffer.records.conversation_key`), oldest first (at most
        ``max_conversation_turns``)."""
        return await self.turns_of(conversation_key(tenant, conversation_id, owner))

    async def turns_of(self, conversation: str) -> list[str]:
        """Completion ids of the turns of the conversation stored as ``conversation`` (a
        `serve_rft.buffer.records.conversation_key`), oldest first."""
        return await self.redis.lrange(self._k(conversation), 0, -1)

    async def conversations(self, conversation_id: str, tenant: str = DEFAULT_TENANT) -> list[str]:
        """The stored conversations (`serve_rft.buffer.records.conversation_key`) of ``tenant``
        named ``conversation_id`` that still have turns: the one logged without keys, and each
        key's own, in sorted order."""
        keyed = sorted(await self.redis.smembers(self._k(conversation_index(tenant, conversation_id))))
        names = [conversation_key(tenant, conversation_id), *keyed]
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.exists(self._k(name))
            found = await pipe.execute()
        return [name for name, there in zip(names, found) if there]

    async def conversation_of(self, completion_id: str) -> str | None:
        """The stored conversation (`serve_rft.buffer.records.conversation_key`) a logged
        completion is a turn of; None for none or an unknown completion."""
        return await self.redis.hget(self._k("cmp", completion_id), "conv") or None

    async def choices(self, completion_id: str) -> list[ChoiceState] | None:
        """Every choice's state, reward, info and version, or None for an unknown completion."""
        n = await self.num_choices(completion_id)
        if n is None:
            return None
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._k("cmp", completion_id))
            pipe.hgetall(self._k("st", completion_id))  # a record an earlier schema wrote
            record, old = await pipe.execute()
        st = old or record
        # each choice's own record has its token versions: the shared fields (the record's
        # ``pr``, up to the request's grammar and metadata) are not read
        raws = await self.redis.mget([self._k("exp", completion_id, str(i)) for i in range(n)]) if n else []
        refs = sorted({x for i in range(n) if (x := st.get(f"info{i}") or "").startswith("@")})
        infos = dict(zip(refs, await self.redis.mget([self._k("info", x[1:]) for x in refs]))) if refs else {}
        out = []
        for i, raw in enumerate(raws):
            r, info, v = st.get(f"r{i}"), st.get(f"info{i}"), st.get(f"v{i}")
            info = infos.get(info) if info and info.startswith("@") else info
            out.append(ChoiceState(
                choice_index=i, state=st.get(str(i), "expired"),
                reward=float(r) if r is not None else None,
                info=json.loads(info) if info else None,
                trained_version=int(v) if v is not None else None,
                token_versions=[list(t) for t in json.loads(raw)["token_versions"]] if raw else None))
        return out

    async def sweep(self, now: float | None = None, exclude: set[str] | None = None) -> tuple[int, int]:
        """Expire pending experiences past their deadline, release timed-out groups, and drop
        the oldest undelivered ready entries past ``max_ready`` (state ``backlog-dropped``,
        counted), in script calls of at most `SWEEP_BATCH` of each (a backlog of a million
        expiries never holds Redis in one long script). ``exclude``: stream ids the caller (a
        trainer) holds, never dropped even when the consumer group's pending entries list lost
        them; a sweep by any other caller cannot know those, and `ack` counts an entry it shed
        after delivery as trained (or as the trainer says).

        Returns:
            (experiences expired, groups released by timeout) in this call; both counted.
        """
        now = now if now is not None else time.time()
        expired = released = 0
        while True:
            e, r, shed = await self._sweep(args=[self.p, now, self.reward_timeout_s, SWEEP_BATCH,
                                                 self.max_ready or 0, *sorted(exclude or ())])
            expired, released = expired + int(e), released + int(r)
            if int(e) < SWEEP_BATCH and int(r) < SWEEP_BATCH and int(shed) < SWEEP_BATCH:
                return expired, released

    async def tenant_bytes(self, *tenants: str) -> dict[str, TenantBytes]:
        """The bytes each of ``tenants`` keeps in the store now (none named: every tenant that
        keeps any), taking what expired off their ledgers (`serve_rft.buffer.ledger`).

        Raises:
            redis.exceptions.RedisError: the store is unreachable.
        """
        rows = await self._tenant_bytes(args=[self.p, *tenants])
        return {t: TenantBytes(int(b), float(nxt) if float(nxt) >= 0 else None) for t, b, nxt in rows}

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
                           groups_timed_out=s.get("groups_timed_out", 0),
                           dead_lettered=s.get("dead_lettered", 0),
                           backlog_dropped=s.get("backlog_dropped", 0),
                           constrained=s.get("constrained", 0), greedy=s.get("greedy", 0),
                           redis_restarts=s.get("redis_restarts", 0))

"""The bytes each tenant keeps in the store (`serve_rft.buffer.ledger`) against a real
redis-server: what a completion and its rewards charge, to its own tenant only; what expires comes
off; a reward keeps its experiences charged as long as it keeps them; a reward info shared by
every turn of a conversation is charged once."""

from __future__ import annotations

import asyncio
import json
import uuid

from serve_rft.buffer.ledger import CHOICE_OVERHEAD, RECORD_OVERHEAD
from serve_rft.buffer.store import ExperienceStore
from serve_rft.explorer.engine.engine_tap import RequestContext
from serve_rft.explorer.engine.experience_log import ExperienceLog, Sampled
from serve_rft.explorer.http.auth import ApiKeys
from serve_rft.types import SamplingInfo
from tests.support.rewards_flow import NullMetrics, post

KEYS = ApiKeys([], ["adm"], [], {"alice": (["a-inf"], ["a-rew"]), "bob": (["b-inf"], ["b-rew"])})
ALICE = KEYS.check("/v1/rewards", "Bearer a-rew")
SAMPLING = SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=2)


async def _log(store, tenant: str, cid: str, n: int = 1, **ctx) -> None:
    xlog = ExperienceLog(store, "r0", NullMetrics(), store_wait_s=2.0)
    choices = [Sampled(i, token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="length") for i in range(n)]
    assert await xlog.log(RequestContext(tenant=tenant, **ctx), cid, [1, 2, 3], choices, SAMPLING, 0) == n


def _store(redis_server, **kw) -> ExperienceStore:
    return ExperienceStore(redis_server.url, prefix=f"l{uuid.uuid4().hex[:8]}", tenant_ledger=True, **kw)


async def _written(store, cid: str, n: int) -> tuple[int, int]:
    """The bytes of completion ``cid``'s values as Redis holds them: (record's shared fields,
    every choice's experience JSON)."""
    shared = await store.redis.hget(store._k("cmp", cid), "pr")
    exps = [await store.redis.get(store._k("exp", cid, str(i))) for i in range(n)]
    return len(shared.encode()), sum(len(e.encode()) for e in exps)


def test_a_completion_is_charged_to_its_tenant_alone_by_the_bytes_it_writes(redis_server):
    async def go():
        store = _store(redis_server)
        await _log(store, "alice", "chatcmpl-a", n=3)
        shared, exps = await _written(store, "chatcmpl-a", 3)
        got = await store.tenant_bytes("alice", "bob")
        gid_len = len(await store.redis.hget(store._k("cmp", "chatcmpl-a"), "group"))
        assert got["alice"].bytes == shared + gid_len + RECORD_OVERHEAD + exps + 3 * CHOICE_OVERHEAD
        assert got["bob"].bytes == 0 and got["bob"].next_free_s is None
        assert 3590 < got["alice"].next_free_s <= 3600  # the pending experiences go first
        assert set(await store.tenant_bytes()) == {"alice"}  # every tenant that keeps any
        await store.close()
    asyncio.run(go())


def test_what_expires_comes_off_and_a_tenant_that_keeps_nothing_leaves_the_ledger(redis_server):
    async def go():
        store = _store(redis_server, reward_timeout_s=1.0, trained_ttl_s=2.0)
        await _log(store, "alice", "chatcmpl-a", n=2)
        full = (await store.tenant_bytes("alice"))["alice"].bytes
        shared, exps = await _written(store, "chatcmpl-a", 2)
        await asyncio.sleep(1.3)  # the experiences' TTL (reward_timeout_s) passed; the record stays
        assert (await store.tenant_bytes("alice"))["alice"].bytes == full - exps - 2 * CHOICE_OVERHEAD
        await asyncio.sleep(1.0)  # the record's (max of both TTLs) passed too
        assert (await store.tenant_bytes("alice"))["alice"].bytes == 0
        assert await store.redis.hgetall(store._k("tbytes")) == {}
        assert await store.redis.exists(store._k("tled", "alice"), store._k("tsz", "alice")) == 0
        await store.close()
    asyncio.run(go())


def test_a_reward_charges_its_fields_and_keeps_the_experiences_charged_while_they_are_kept(redis_server):
    async def go():
        store = _store(redis_server, reward_timeout_s=1.0, trained_ttl_s=3.0)
        await _log(store, "alice", "chatcmpl-a", n=1)
        before = (await store.tenant_bytes("alice"))["alice"].bytes
        assert await store.post_reward("chatcmpl-a", 0, 1.0, tenant="alice")
        after = (await store.tenant_bytes("alice"))["alice"]
        assert after.bytes > before
        await asyncio.sleep(1.3)  # past reward_timeout_s: a rewarded experience is still kept
        assert await store.redis.exists(store._k("exp", "chatcmpl-a", "0")) == 1
        assert (await store.tenant_bytes("alice"))["alice"].bytes == after.bytes
        await store.close()
    asyncio.run(go())


def test_a_conversation_rewards_info_is_charged_once_however_many_turns_and_choices(redis_server):
    """The issue's 65 MiB case, scaled down: one 16 KiB info over 8 turns x 4 choices charges
    the ledger ~16 KiB (once), not 32 x 16 KiB."""
    async def go():
        store = _store(redis_server, max_conversation_turns=8)
        for t in range(8):
            await _log(store, "alice", f"chatcmpl-{t}", n=4, conversation_id="c")
        logged = (await store.tenant_bytes("alice"))["alice"].bytes
        info = {"note": "x" * 16_000}
        results = await post(store, {"conversation_id": "c", "reward": 1.0, "info": info}, ALICE)
        assert len(results) == 32
        grew = (await store.tenant_bytes("alice"))["alice"].bytes - logged
        assert len(json.dumps(info)) <= grew < len(json.dumps(info)) + 32 * 200, grew
        await store.close()
    asyncio.run(go())


def test_without_a_stored_bytes_limit_the_store_keeps_no_ledger(redis_server):
    """The ledger costs Redis memory per completion: a store without it (the default, where no
    tenant's stored bytes are limited) writes none of its keys when logging and rewarding."""
    async def go():
        store = ExperienceStore(redis_server.url, prefix=f"n{uuid.uuid4().hex[:8]}")
        await _log(store, "alice", "chatcmpl-a", n=2)
        assert await store.post_reward("chatcmpl-a", 0, 1.0, info={"x": 1}, tenant="alice")
        keys = [k async for k in store.redis.scan_iter(match=f"{store.p}:t*")]
        assert keys == [] and (await store.tenant_bytes("alice"))["alice"].bytes == 0
        await store.close()
    asyncio.run(go())

"""Reward requests against a real redis-server: every item of a batch is independent."""

import asyncio
import uuid

from serve_rft.buffer.store import ExperienceStore
from serve_rft.explorer.http import rewards_api
from serve_rft.explorer.http.protocol import parse_reward_body
from tests.support.experiences import experience


async def _post(store, body):
    return await rewards_api.post_rewards(store, parse_reward_body(body))


def test_a_refused_item_never_blocks_the_rest_and_a_retry_records_what_is_left(redis_server):
    async def go():
        store = ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}", reward_timeout_s=1.0)
        await store.log_experiences([experience("chatcmpl-old", 0)], conversation_id="conv")
        await store.sweep(now=10**10)  # the first turn expired before its reward came
        await store.log_experiences([experience("chatcmpl-new", 0)], conversation_id="conv")
        body = {"conversation_id": "conv", "reward": 1.0}
        results = await _post(store, body)
        assert [(r["completion_id"], r["status"]) for r in results] == [
            ("chatcmpl-old", "refused"), ("chatcmpl-new", "recorded")]
        assert results[0]["status_code"] == 410 and results[0]["error"]["code"] == "expired"
        assert rewards_api.batch_status(results) == 200
        assert [r["status"] for r in await _post(store, body)] == ["refused", "duplicate"]

        batch = {"rewards": [{"completion_id": "chatcmpl-nope", "reward": 1.0},
                             {"completion_id": "chatcmpl-new", "reward": 0.0},  # conflicts with 1.0
                             {"completion_id": "chatcmpl-old", "reward": 1.0}]}
        results = await _post(store, batch)
        assert [r.get("status_code") for r in results] == [404, 409, 410]
        assert rewards_api.batch_status(results) == 404  # every item refused: the first refusal's
        full = [{"status": "recorded"}, {"status": "refused", "status_code": 409},
                {"status": "refused", "status_code": 507}]
        assert rewards_api.batch_status(full) == 507  # retryable: the whole request is retried
        body = rewards_api.batch_body(results)  # the refusal that decided the status, every result beside
        assert body["error"]["code"] == "not_found" and body["data"] == results
        assert "error" not in rewards_api.batch_body([{"status": "recorded"}, results[1]])
        await store.close()
    asyncio.run(go())


def test_group_members_are_checked_one_by_one(redis_server):
    async def go():
        store = ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
        await store.log_experiences([experience("chatcmpl-a", 0, group="u:g1")], group_size=2)
        await store.log_experiences([experience("chatcmpl-b", 0, group="u:g2")], group_size=2)
        results = await _post(store, {"group_id": "g1", "rewards": [
            {"completion_id": "chatcmpl-b", "reward": 1.0}, {"completion_id": "chatcmpl-a", "reward": 1.0}]})
        assert [r["status"] for r in results] == ["refused", "recorded"]
        assert results[0]["error"]["code"] == "not_in_group"
        await store.close()
    asyncio.run(go())


def test_a_refused_non_finite_reward_has_a_json_result(redis_server):
    """NaN cannot be written as JSON: the refusal carries reward null (it once made a 500)."""
    import json

    async def go():
        store = ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
        await store.log_experiences([experience("chatcmpl-n", 0)])
        results = await _post(store, {"completion_id": "chatcmpl-n", "reward": float("nan")})
        assert results[0]["status_code"] == 422 and results[0]["reward"] is None
        json.dumps(results, allow_nan=False)
        await store.close()
    asyncio.run(go())


def _used_memory(url) -> int:
    import redis

    r = redis.Redis.from_url(url)
    try:
        return r.info("memory")["used_memory"]
    finally:
        r.close()


def test_a_conversation_rewards_info_is_stored_once_however_many_choices_it_reaches(redis_server):
    """A conversation of 256 turns of 16 choices rewarded with a 16 KiB ``info`` (one ~16 KB
    request reaching 4,096 choices, which once stored 4,096 copies, 65 MiB): what the info adds to
    Redis, against the same request without it, stays under 1 MiB; every choice still reads it
    back, and the info outlives its records."""
    turns, n = 256, 16
    info = {"judge": "x" * (16 * 1024 - 20)}

    async def growth(with_info: bool):
        store = ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
        for t in range(turns):
            await store.log_experiences([experience(f"chatcmpl-{t}", i) for i in range(n)], conversation_id="c")
        before = _used_memory(redis_server.url)
        body = {"conversation_id": "c", "reward": 1.0, **({"info": info} if with_info else {})}
        results = await _post(store, body)
        grew = _used_memory(redis_server.url) - before
        assert [r["status"] for r in results] == ["recorded"] * turns * n
        return store, grew

    async def go():
        plain, without = await growth(False)
        await plain.close()
        store, grew = await growth(True)
        assert grew - without < 2**20, (grew, without)
        for cid in ("chatcmpl-0", f"chatcmpl-{turns - 1}"):
            assert [c.info for c in await store.choices(cid)] == [info] * n
        (key,) = await store.redis.keys(f"{store.p}:info:*")
        assert await store.redis.ttl(key) >= await store.redis.ttl(f"{store.p}:cmp:chatcmpl-0")
        await store.close()
    asyncio.run(go())


def test_a_record_kept_longer_after_training_keeps_its_info(redis_server):
    """Training a choice keeps its record ``trained_ttl_s`` from then: the info it names is kept
    as long (it would otherwise expire first and read back as none)."""
    async def go():
        store = ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}", trained_ttl_s=7200.0,
                                reward_timeout_s=60.0)
        await store.log_experiences([experience("chatcmpl-a", 0)])
        assert await store.post_reward("chatcmpl-a", 0, 1.0, info={"judge": "y"})
        (key,) = await store.redis.keys(f"{store.p}:info:*")
        for k in (key, f"{store.p}:cmp:chatcmpl-a"):
            await store.redis.expire(k, 5)  # as if the reward were old
        await store.ready.ensure_group()
        batch = await store.ready.read_ready("t", 10, block_ms=10)
        assert await store.ready.ack(batch, version=1) == (1, 0)
        assert await store.redis.ttl(key) > 7000
        assert [c.info for c in await store.choices("chatcmpl-a")] == [{"judge": "y"}]
        await store.close()
    asyncio.run(go())

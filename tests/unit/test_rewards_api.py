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

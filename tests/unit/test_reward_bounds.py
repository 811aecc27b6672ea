"""Rewards from an untrusted client, against a real redis-server: JSON numbers only (no strings,
no booleans), within ``buffer.reward_range``, checked in every form before anything is written."""

import asyncio
import uuid

import pytest
from pydantic import ValidationError

from serve_rft.buffer.store import ExperienceStore
from serve_rft.config.buffer import BufferConfig
from serve_rft.explorer.http import rewards_api
from serve_rft.explorer.http.protocol import ApiError, parse_reward_body
from tests.support.experiences import experience

LAX = ["1.5", True, False, "nan", None, [1.0], {"v": 1}]


@pytest.mark.parametrize("bad", LAX)
@pytest.mark.parametrize("form", ["single", "list", "group", "conversation", "batch"])
def test_a_reward_must_be_a_json_number(form, bad):
    body = {"single": {"completion_id": "c", "reward": bad},
            "list": {"completion_id": "c", "rewards": [0.5, bad]},
            "group": {"group_id": "g", "rewards": [{"completion_id": "c", "reward": bad}]},
            "conversation": {"conversation_id": "v", "reward": bad},
            "batch": {"rewards": [{"completion_id": "c", "reward": 1.0}, {"completion_id": "d", "reward": bad}]},
            }[form]
    with pytest.raises(ValidationError):
        parse_reward_body(body)


def test_integers_are_rewards_and_strict_fields_refuse_strings():
    assert parse_reward_body({"completion_id": "c", "reward": 1}).reward == 1.0
    assert parse_reward_body({"completion_id": "c", "rewards": [0, 1]}).rewards == [0.0, 1.0]
    assert parse_reward_body({"conversation_id": "v", "reward": -3, "discount": 1}).reward == -3.0
    with pytest.raises(ValidationError):
        parse_reward_body({"completion_id": "c", "choice_index": "1", "reward": 1})
    with pytest.raises(ValidationError):
        parse_reward_body({"conversation_id": "v", "reward": 1, "discount": "0.5"})


@pytest.mark.parametrize("rng", [(1.0, 1.0), (2.0, 1.0), (float("-inf"), 1.0), (0.0, float("nan"))])
def test_reward_range_must_be_finite_and_ordered(rng):
    with pytest.raises(ValidationError, match="reward_range"):
        BufferConfig(reward_range=rng)


def test_the_default_range_takes_every_reward_a_well_behaved_client_posts():
    low, high = BufferConfig().reward_range
    assert (low, high) == (-1000.0, 1000.0)
    assert BufferConfig(reward_range=[-1, 1]).reward_range == (-1.0, 1.0)


def _store(url: str) -> ExperienceStore:
    return ExperienceStore.from_config(BufferConfig(redis_url=url, key_prefix=f"t{uuid.uuid4().hex[:8]}"))


async def _post(store, body):
    return await rewards_api.post_rewards(store, parse_reward_body(body))


async def _states(store, cid):
    return [(c.state, c.reward) for c in await store.choices(cid)]


@pytest.mark.parametrize("reward", [1e39, 1e20, -1000.5, 1001])
def test_a_reward_out_of_range_is_refused_with_422_and_nothing_is_written(redis_server, reward):
    async def go():
        store = _store(redis_server.url)
        await store.log_experiences([experience("chatcmpl-1", 0)])
        results = await _post(store, {"completion_id": "chatcmpl-1", "reward": reward})
        assert results[0]["status"] == "refused" and results[0]["status_code"] == 422
        err = results[0]["error"]
        assert (err["code"], err["param"]) == ("reward_out_of_range", "reward") and "reward_range" in err["message"]
        assert rewards_api.batch_status(results) == 422
        assert rewards_api.batch_body(results)["error"] == err
        assert await _states(store, "chatcmpl-1") == [("pending", None)]
        assert (await store.counts()).rewarded == 0
        # the bounds themselves are rewards
        assert (await _post(store, {"completion_id": "chatcmpl-1", "reward": 1000}))[0]["status"] == "recorded"
        await store.close()
    asyncio.run(go())


def test_a_batch_and_a_group_check_each_item_with_its_own_result(redis_server):
    async def go():
        store = _store(redis_server.url)
        for cid in ("chatcmpl-a", "chatcmpl-b", "chatcmpl-c"):
            await store.log_experiences([experience(cid, 0)])
        results = await _post(store, {"rewards": [{"completion_id": "chatcmpl-a", "reward": 1.0},
                                                  {"completion_id": "chatcmpl-b", "reward": 1e39},
                                                  {"completion_id": "chatcmpl-c", "reward": -2}]})
        assert [(r["status"], r.get("status_code")) for r in results] == [
            ("recorded", None), ("refused", 422), ("recorded", None)]
        assert rewards_api.batch_status(results) == 200
        assert await _states(store, "chatcmpl-b") == [("pending", None)]

        await store.log_experiences([experience("chatcmpl-g1", 0, group="u:g")], group_size=2)
        await store.log_experiences([experience("chatcmpl-g2", 0, group="u:g")], group_size=2)
        results = await _post(store, {"group_id": "g", "rewards": [
            {"completion_id": "chatcmpl-g1", "reward": 1e200}, {"completion_id": "chatcmpl-g2", "reward": 0.0}]})
        assert [r["status"] for r in results] == ["refused", "recorded"]
        assert results[0]["error"]["code"] == "reward_out_of_range"
        await store.close()
    asyncio.run(go())


def test_a_rewards_list_or_a_conversation_with_a_reward_out_of_range_is_refused_whole(redis_server):
    async def go():
        store = _store(redis_server.url)
        await store.log_experiences([experience("chatcmpl-n", 0), experience("chatcmpl-n", 1)])
        with pytest.raises(ApiError) as e:
            await _post(store, {"completion_id": "chatcmpl-n", "rewards": [0.5, 1e39]})
        assert (e.value.status, e.value.code, e.value.param) == (422, "reward_out_of_range", "reward")
        assert await _states(store, "chatcmpl-n") == [("pending", None), ("pending", None)]

        await store.log_experiences([experience("chatcmpl-t1", 0)], conversation_id="conv")
        await store.log_experiences([experience("chatcmpl-t2", 0)], conversation_id="conv")
        for reward in (1e39, -1e20):
            with pytest.raises(ApiError) as e:
                await _post(store, {"conversation_id": "conv", "reward": reward, "discount": 0.5})
            assert (e.value.status, e.value.code) == (422, "reward_out_of_range")
        assert await _states(store, "chatcmpl-t1") == [("pending", None)]
        assert await _states(store, "chatcmpl-t2") == [("pending", None)]
        results = await _post(store, {"conversation_id": "conv", "reward": 1000, "discount": 0.5})
        assert [r["reward"] for r in results] == [500.0, 1000.0]
        await store.close()
    asyncio.run(go())


def test_a_reward_whose_square_overflows_is_refused_whole_even_with_a_wide_range(redis_server):
    """A configured range wider than a double's square root: the store's own check still refuses
    1e200 (its square overflows) with 422 before anything is written, not a 504."""
    async def go():
        store = ExperienceStore.from_config(BufferConfig(redis_url=redis_server.url, reward_range=(-1e300, 1e300),
                                                         key_prefix=f"t{uuid.uuid4().hex[:8]}"))
        await store.log_experiences([experience("chatcmpl-w", 0)])
        results = await _post(store, {"completion_id": "chatcmpl-w", "reward": 1e200})
        assert results[0]["status_code"] == 422 and results[0]["error"]["code"] == "invalid_reward"
        assert await _states(store, "chatcmpl-w") == [("pending", None)]
        assert (await _post(store, {"completion_id": "chatcmpl-w", "reward": 0.5}))[0]["status"] == "recorded"
        await store.close()
    asyncio.run(go())

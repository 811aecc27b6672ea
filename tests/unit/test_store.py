"""The experience store against a real redis-server (started by the session fixture)."""

import asyncio
import uuid

import pytest

from serve_rft.buffer.store import ExperienceStore, RewardError
from serve_rft.types import Experience, SamplingInfo


def _exp(cid, i, versions=((0, 0, 3),)):
    return Experience(completion_id=cid, choice_index=i, group_id=cid, replica_id="r0",
                      prompt_token_ids=[1, 2], response_token_ids=[5, 6, 7],
                      behaviour_logprobs=[-1.0, -2.0, -0.5], token_versions=list(versions),
                      sampling=SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=3),
                      finish_reason="length")


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def store_factory(redis_server):
    def make(**kw):
        return ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}", **kw)
    return make


def test_log_reward_read_ack_roundtrip(store_factory):
    async def go():
        s = store_factory()
        cid = "chatcmpl-a"
        await s.log_experiences([_exp(cid, 0), _exp(cid, 1)], num_choices=2)
        got = await s.get_experience(cid, 1)
        assert got.behaviour_logprobs == [-1.0, -2.0, -0.5]
        c = await s.counts()
        assert (c.pending, c.ready, c.trained, c.logged) == (2, 0, 0, 2)
        assert await s.post_reward(cid, 0, 1.0) is True
        assert await s.post_reward(cid, 0, 1.0) is False  # idempotent
        c = await s.counts()
        assert (c.pending, c.ready) == (1, 1)
        await s.ensure_group()
        await s.ensure_group()  # idempotent
        batch = await s.read_ready("t", 10, block_ms=10)
        assert len(batch) == 1 and batch[0].reward == 1.0
        assert batch[0].experience.completion_id == cid and batch[0].experience.choice_index == 0
        await s.ack([b.stream_id for b in batch])
        c = await s.counts()
        assert (c.ready, c.trained) == (0, 1)
        await s.close()
    run(go())


def test_reward_errors(store_factory):
    async def go():
        s = store_factory()
        await s.log_experiences([_exp("c", 0)], num_choices=1)
        for bad in (float("nan"), float("inf"), -float("inf")):
            with pytest.raises(RewardError) as e:
                await s.post_reward("c", 0, bad)
            assert e.value.status == 422
        with pytest.raises(RewardError) as e:
            await s.post_reward("unknown", 0, 1.0)
        assert e.value.status == 404
        with pytest.raises(RewardError) as e:
            await s.post_reward("c", 1, 1.0)
        assert e.value.status == 404
        await s.post_reward("c", 0, 0.5)
        with pytest.raises(RewardError) as e:
            await s.post_reward("c", 0, 0.7)
        assert e.value.status == 409
        await s.close()
    run(go())


def test_unrewarded_experiences_expire_and_are_counted(store_factory):
    async def go():
        s = store_factory(reward_timeout_s=1.0)
        await s.log_experiences([_exp("c", 0)], num_choices=1)
        await asyncio.sleep(1.3)
        c = await s.counts()
        assert (c.pending, c.expired) == (0, 1)
        with pytest.raises(RewardError) as e:
            await s.post_reward("c", 0, 1.0)
        assert e.value.status == 410
        await s.close()
    run(go())


def test_unacked_entries_are_redelivered(store_factory):
    async def go():
        s = store_factory()
        await s.log_experiences([_exp("c", 0)], num_choices=1)
        await s.post_reward("c", 0, 1.0)
        await s.ensure_group()
        first = await s.read_ready("t", 10, block_ms=10)
        assert len(first) == 1
        assert await s.read_ready("t", 10, block_ms=10) == []
        again = await s.read_ready("t", 10, block_ms=0, redeliver=True)
        assert [b.stream_id for b in again] == [b.stream_id for b in first]
        await s.close()
    run(go())

"""Acknowledgements and the ready bound when Redis lost the trainer group's pending entries list
(an AOF restored to an earlier point, a failover to a lagging replica): nothing is acknowledged
that the caller did not hold, and nothing the trainer trained is miscounted (against a real
redis-server, started by the session fixture)."""

import asyncio
import uuid

import pytest

from serve_rft.buffer.store import ExperienceStore
from tests.support.experiences import experience


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def store_factory(redis_server):
    def make(**kw):
        return ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}", **kw)
    return make


async def _released(s, cid, n):
    """Log a completion of ``n`` choices and reward all of them (its group is released)."""
    await s.log_experiences([experience(cid, i) for i in range(n)])
    for i in range(n):
        await s.post_reward(cid, i, float(i))


async def _lose_pending_list(s):
    ready = s._k("ready")
    await s.redis.xgroup_destroy(ready, "trainer")
    await s.redis.xgroup_create(ready, "trainer", id="0")


def test_an_ack_after_the_pending_list_was_lost_leaves_an_entry_of_another_member(store_factory):
    """The id an acknowledgement names holds another member's entry (ids reused after a failover
    to a replica whose clock is behind): that entry stays, its choice is not marked, nothing is
    counted; the entry of the named member is acknowledged as before."""
    async def go():
        s = store_factory()
        await s.ensure_group()
        await _released(s, "chatcmpl-a", 1)
        got = await s.read_ready("t", 10, block_ms=10)
        await _lose_pending_list(s)
        sid = got[0].stream_id
        assert await s.ack_entries([(sid, "chatcmpl-other:0", 3)]) == (0, 0)
        assert await s.redis.xlen(s._k("ready")) == 1
        assert await s.redis.hget(s._k("st", "chatcmpl-a"), "0") == "ready"
        assert (await s.counts()).trained == 0
        assert await s.ack_entries([(sid, "chatcmpl-a:0", 3)]) == (1, 0)
        assert await s.redis.xlen(s._k("ready")) == 0
        assert await s.redis.hget(s._k("st", "chatcmpl-a"), "0") == "trained"
        await s.close()
    run(go())

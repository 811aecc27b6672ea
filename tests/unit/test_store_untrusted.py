"""The store against hostile input and lost state, on a real redis-server: a reward is recorded
whole or not at all, a held entry is never handed out twice, a late sweep leaks no key, and a
reward the store answered survives a kill -9 of redis-server."""

import asyncio
from asyncio import run
import os
import signal
import time
import uuid

import pytest
import redis

from serve_rft.buffer.records import RewardNotFinite, RewardOutOfRange
from serve_rft.buffer.redis_server import start_redis
from serve_rft.buffer.store import ExperienceStore
from serve_rft.config.buffer import BufferConfig
from tests.support.experiences import experience


def _store(url, **kw):
    return ExperienceStore(url, prefix=f"t{uuid.uuid4().hex[:8]}", **kw)


async def _snapshot(s: ExperienceStore) -> dict:
    """Every key of the store's prefix with its type and content (what a refusal must not change)."""
    out = {}
    async for key in s.redis.scan_iter(match=f"{s.p}:*"):
        kind = await s.redis.type(key)
        if kind == "hash":
            out[key] = await s.redis.hgetall(key)
        elif kind == "zset":
            out[key] = await s.redis.zrange(key, 0, -1, withscores=True)
        elif kind == "set":
            out[key] = sorted(await s.redis.smembers(key))
        elif kind == "list":
            out[key] = await s.redis.lrange(key, 0, -1)
        elif kind == "stream":
            out[key] = await s.redis.xrange(key)
        else:
            out[key] = await s.redis.get(key)
    return out


def _reward_args(s: ExperienceStore, cid: str, i: int, reward: str) -> list:
    return [s.p, cid, str(i), reward, "", time.time(), s.group_timeout_s,
            max(1, int(s.reward_timeout_s + s.trained_ttl_s))]


def test_the_reward_script_writes_nothing_for_a_reward_whose_square_overflows(redis_server):
    """1e200 sent straight to the REWARD script (no API, no Python check): r*r is not finite.
    The script refuses it before its first write; the choice stays pending and a correct
    reward is then recorded normally."""
    async def go():
        s = _store(redis_server.url)
        await s.log_experiences([experience("chatcmpl-big", 0)])
        before = await _snapshot(s)
        status, _ = await s._reward(args=_reward_args(s, "chatcmpl-big", 0, "1e200"))
        assert int(status) == 422
        assert await _snapshot(s) == before
        assert [c.state for c in await s.choices("chatcmpl-big")] == ["pending"]
        assert await s.post_reward("chatcmpl-big", 0, 0.5) is True  # not "duplicate"
        assert (await s.counts()).ready == 1
        await s.close()
    run(go())


def test_the_reward_script_writes_nothing_when_a_per_version_sum_would_overflow(redis_server):
    async def go():
        s = _store(redis_server.url)
        await s.log_experiences([experience("chatcmpl-q", 0)])
        keys = [k async for k in s.redis.scan_iter(match=f"{s.p}:cmp:*")]
        created, ver = await s.redis.hmget(keys[0], "created", "ver")
        vk = f"{s.p}:vr:{ver}:{int(float(created) // 3600)}"
        await s.redis.hset(vk, f"{int(float(created) // 5)}:q", "1.7e308")  # a sum near the double's max
        before = await _snapshot(s)
        status, _ = await s._reward(args=_reward_args(s, "chatcmpl-q", 0, repr(1e154)))
        assert int(status) == 422
        assert await _snapshot(s) == before
        with pytest.raises(RewardNotFinite):
            await s.post_reward("chatcmpl-q", 0, 1e154)
        assert await _snapshot(s) == before
        await s.close()
    run(go())


@pytest.mark.parametrize("reward", [1e200, -1e155, float("inf"), float("nan"), 10**400, True, "1.5"])
def test_post_reward_refuses_what_cannot_be_recorded_before_any_write(redis_server, reward):
    async def go():
        s = _store(redis_server.url)  # no reward_range: only finiteness is checked
        await s.log_experiences([experience("chatcmpl-x", 0)])
        before = await _snapshot(s)
        with pytest.raises(RewardNotFinite):
            await s.post_reward("chatcmpl-x", 0, reward)
        assert await _snapshot(s) == before
        await s.close()
    run(go())


def test_post_reward_refuses_a_reward_outside_the_range_before_any_write(redis_server):
    async def go():
        s = _store(redis_server.url, reward_range=(-1.0, 1.0))
        await s.log_experiences([experience("chatcmpl-r", 0), experience("chatcmpl-r", 1)])
        before = await _snapshot(s)
        for bad in (1e39, 1.0000001, -2, 1e20):
            with pytest.raises(RewardOutOfRange, match="reward_range"):
                await s.post_reward("chatcmpl-r", 0, bad)
        assert await _snapshot(s) == before
        assert await s.post_reward("chatcmpl-r", 0, 1) is True  # the bounds are inclusive; ints are fine
        assert await s.post_reward("chatcmpl-r", 1, -1.0) is True
        await s.close()
    run(go())


def test_a_lost_read_never_hands_out_an_entry_the_trainer_holds(redis_server):
    """The consumer group's pending entries list is lost (as after an AOF restored to a point
    before the read, or a failover to a lagging replica): the entries the trainer holds are
    still not delivered again, and the trainer's acknowledgement still retires them."""
    async def go():
        s = _store(redis_server.url)
        await s.ready.ensure_group()
        for k in range(3):
            await s.log_experiences([experience(f"chatcmpl-{k}", 0)])
            await s.post_reward(f"chatcmpl-{k}", 0, float(k))
        first = await s.ready.read_ready("t", 2, block_ms=10)
        held = {e.stream_id for e in first}
        assert len(held) == 2
        ready = s._k("ready")
        await s.redis.xgroup_destroy(ready, "trainer")  # the group as it was before the read
        await s.redis.xgroup_create(ready, "trainer", id="0")
        again = await s.ready.read_ready("t", 10, block_ms=10, exclude=held)
        assert [e.stream_id for e in again] not in ([], None)
        assert not {e.stream_id for e in again} & held
        assert len(again) == 1
        assert await s.ready.read_ready("t", 10, block_ms=10, exclude=held | {again[0].stream_id}) == []
        assert await s.ready.ack(first, version=1) == (2, 0)  # not in the pending list, acknowledged all the same
        assert await s.ready.ack(first, version=1) == (0, 0)  # and only once
        assert await s.ready.ack(again, version=1) == (1, 0)
        c = await s.counts()
        assert (c.ready, c.trained) == (0, 3)
        await s.close()
    run(go())


def test_a_lost_read_never_lets_drop_stale_take_an_entry_the_trainer_holds(redis_server):
    async def go():
        s = _store(redis_server.url)
        await s.ready.ensure_group()
        for k in range(2):
            await s.log_experiences([experience(f"chatcmpl-s{k}", 0, versions=((1, 0, 3),))])
            await s.post_reward(f"chatcmpl-s{k}", 0, 0.0)
        held = {e.stream_id for e in await s.ready.read_ready("t", 1, block_ms=10)}
        ready = s._k("ready")
        await s.redis.xgroup_destroy(ready, "trainer")
        await s.redis.xgroup_create(ready, "trainer", id="0")
        assert await s.ready.drop_stale(threshold=5, version=7, exclude=held) == 1  # only the one not held
        assert [e[0] for e in await s.redis.xrange(ready)] == sorted(held)
        await s.close()
    run(go())


def test_a_late_sweep_leaves_no_key_without_a_ttl(redis_server):
    """The service was down past every TTL: the sweep that runs when it comes back finds the
    state and group hashes expired and does not re-create them (without a TTL, for good)."""
    async def go():
        s = _store(redis_server.url, reward_timeout_s=1.0, trained_ttl_s=1.0, group_timeout_s=1.0)
        await s.log_experiences([experience("chatcmpl-a", 0, group="u:g"), experience("chatcmpl-a", 1, group="u:g")],
                                group_size=3)
        await s.post_reward("chatcmpl-a", 0, 1.0)  # held: its group waits for the others
        await s.log_experiences([experience("chatcmpl-b", 0)])  # pending, never rewarded
        await asyncio.sleep(2.5)  # past every TTL (ceil(1 + 1) s for the rewarded member)
        await s.sweep(now=time.time() + 10_000)
        permanent = {s._k(k) for k in ("pending", "stat", "gdl", "ready")}
        leaked = {}
        async for key in s.redis.scan_iter(match=f"{s.p}:*"):
            if key not in permanent and await s.redis.ttl(key) < 0:
                leaked[key] = await s.redis.type(key)
        assert leaked == {}
        assert await s.redis.zcard(s._k("pending")) == 0 and await s.redis.zcard(s._k("gdl")) == 0
        await s.close()
    run(go())


def test_a_reward_the_store_answered_survives_kill_9_of_redis_with_the_default_durability(tmp_path):
    """The default ``buffer.durability`` writes and fsyncs the AOF before Redis answers
    (appendfsync always): kill -9 right after the answer, restart from the AOF, the reward is
    there. (With everysec Redis may answer before it has written the AOF at all: it postpones
    the write up to 2 s while a background fsync runs.)"""
    durability = BufferConfig().durability
    assert durability == "always"
    server = start_redis(tmp_path / "r", appendfsync=durability)
    try:
        assert redis.Redis(port=server.port).config_get("appendfsync") == {"appendfsync": "always"}

        async def post():
            s = ExperienceStore(server.url, prefix="k", reconnect_s=1.0)
            await s.log_experiences([experience("chatcmpl-d", 0)])
            assert await s.post_reward("chatcmpl-d", 0, 0.75) is True
            await s.close()
        run(post())
        os.kill(server.pid, signal.SIGKILL)
        server.proc.wait()
    finally:
        server.stop()
    server = start_redis(tmp_path / "r", port=server.port, appendfsync=durability)
    try:
        async def read():
            s = ExperienceStore(server.url, prefix="k", reconnect_s=1.0)
            states = await s.choices("chatcmpl-d")
            await s.close()
            return states
        states = run(read())
        assert [(c.state, c.reward) for c in states] == [("ready", 0.75)]
    finally:
        server.stop()


def test_an_ack_with_a_malformed_id_or_member_retires_the_rest_and_counts_them(redis_server):
    """Nothing in a list of acknowledgements can fail the ACK script midway (the entries before
    it would be acknowledged and deleted but never counted)."""
    async def go():
        s = _store(redis_server.url)
        await s.ready.ensure_group()
        for k in range(2):
            await s.log_experiences([experience(f"chatcmpl-m{k}", 0)])
            await s.post_reward(f"chatcmpl-m{k}", 0, 1.0)
        got = sorted(await s.ready.read_ready("t", 2, block_ms=10), key=lambda e: e.stream_id)
        assert await s.ready.ack_entries([(got[0].stream_id, got[0].member, 3), ("not-an-id", "x:0", 3),
                                    (got[1].stream_id, "no-separator", 3)]) == (2, 0)
        c = await s.counts()
        assert (c.ready, c.trained) == (0, 2)
        assert [x.state for x in await s.choices("chatcmpl-m0")] == ["trained"]
        await s.close()
    run(go())

"""The experience store against a real redis-server (started by the session fixture)."""

import asyncio
from asyncio import run

import pytest

from serve_rft.buffer.records import (RewardConflict, RewardExpired, RewardNotFinite, StoreFull,
                                      UnknownChoice, shared_names)
from serve_rft.buffer.store import ExperienceStore
from tests.support.experiences import experience, large_experience


def test_log_reward_read_ack_roundtrip(store_factory):
    async def go():
        s = store_factory()
        cid = "chatcmpl-a"
        await s.log_experiences([experience(cid, 0), experience(cid, 1)])
        got = await s.get_experience(cid, 1)
        assert got.behaviour_logprobs == [-1.0, -2.0, -0.5]
        c = await s.counts()
        assert (c.pending, c.ready, c.trained, c.logged) == (2, 0, 0, 2)
        assert await s.post_reward(cid, 0, 1.0, info={"judge": "x"}) is True
        assert await s.post_reward(cid, 0, 1.0) is False  # idempotent
        c = await s.counts()
        assert (c.pending, c.held, c.ready) == (1, 1, 0)  # held until its group (n=2) is complete
        assert await s.post_reward(cid, 1, 0.0) is True
        c = await s.counts()
        assert (c.pending, c.held, c.ready) == (0, 0, 2)
        await s.ready.ensure_group()
        await s.ready.ensure_group()  # idempotent
        batch = await s.ready.read_ready("t", 10, block_ms=10)
        assert sorted((b.experience.choice_index, b.reward) for b in batch) == [(0, 1.0), (1, 0.0)]
        assert await s.ready.ack(batch, version=3) == (2, 0)
        assert await s.ready.ack(batch, version=3) == (0, 0)  # a retried ack counts nothing twice
        c = await s.counts()
        assert (c.ready, c.trained) == (0, 2)
        states = await s.choices(cid)
        assert [(x.state, x.reward, x.trained_version) for x in states] == [("trained", 1.0, 3), ("trained", 0.0, 3)]
        assert states[0].info == {"judge": "x"} and states[1].info is None
        await s.close()
    run(go())


def test_reward_errors(store_factory):
    async def go():
        s = store_factory()
        await s.log_experiences([experience("c", 0)])
        for bad in (float("nan"), float("inf"), -float("inf")):
            with pytest.raises(RewardNotFinite):
                await s.post_reward("c", 0, bad)
        with pytest.raises(UnknownChoice):
            await s.post_reward("unknown", 0, 1.0)
        with pytest.raises(UnknownChoice):
            await s.post_reward("c", 1, 1.0)
        await s.post_reward("c", 0, 0.5)
        with pytest.raises(RewardConflict):
            await s.post_reward("c", 0, 0.7)
        await s.close()
    run(go())


def test_unrewarded_experiences_expire_and_are_counted(store_factory):
    async def go():
        s = store_factory(reward_timeout_s=1.0)
        await s.log_experiences([experience("c", 0)])
        assert [x.state for x in await s.choices("c")] == ["pending"]
        await asyncio.sleep(1.3)
        c = await s.counts()
        assert (c.pending, c.expired) == (0, 1)
        assert [x.state for x in await s.choices("c")] == ["expired"]
        with pytest.raises(RewardExpired):
            await s.post_reward("c", 0, 1.0)
        await s.close()
    run(go())


def test_unacked_entries_are_redelivered(store_factory):
    async def go():
        s = store_factory()
        await s.log_experiences([experience("c", 0)])
        await s.post_reward("c", 0, 1.0)
        await s.ready.ensure_group()
        first = await s.ready.read_ready("t", 10, block_ms=10)
        assert len(first) == 1
        assert await s.ready.read_ready("t", 10, block_ms=10) == []
        again = await s.ready.delivered("t")
        assert [b.stream_id for b in again] == [b.stream_id for b in first]
        await s.close()
    run(go())


def test_client_group_without_size_is_released_after_group_timeout_with_two_rewards(store_factory):
    async def go():
        s = store_factory(group_timeout_s=0.5)
        for cid in ("a", "b", "c"):  # three requests, one client group "u:task"
            await s.log_experiences([experience(cid, 0, group="u:task")])
        await s.post_reward("a", 0, 1.0)
        await s.post_reward("b", 0, 0.0)
        c = await s.counts()
        assert (c.held, c.ready) == (2, 0)  # c may still come
        await asyncio.sleep(0.7)
        c = await s.counts()
        assert (c.held, c.ready, c.groups_timed_out) == (0, 2, 1)
        await s.post_reward("c", 0, 0.5)  # a late member of a released group: ready at once
        assert (await s.counts()).ready == 3
        await s.close()
    run(go())


def test_a_lone_reward_waits_until_a_second_one_comes_after_the_group_timeout(store_factory):
    async def go():
        s = store_factory(group_timeout_s=0.3)
        for cid in ("a", "b", "c"):
            await s.log_experiences([experience(cid, 0, group="u:t")])
        await s.post_reward("a", 0, 1.0)
        await asyncio.sleep(0.5)
        assert (await s.counts()).ready == 0  # one reward is not a group
        await s.post_reward("b", 0, 0.0)  # past the group timeout: released at once
        assert (await s.counts()).ready == 2
        await s.close()
    run(go())


def test_client_group_with_size_is_released_when_complete_or_when_the_rest_expired(store_factory):
    async def go():
        s = store_factory(group_timeout_s=60, reward_timeout_s=1.0)
        await s.log_experiences([experience("a", 0, group="u:g"), experience("a", 1, group="u:g")], group_size=3)
        await s.log_experiences([experience("b", 0, group="u:g")], group_size=3)
        await s.post_reward("a", 0, 1.0)
        await s.post_reward("a", 1, 0.0)
        assert (await s.counts()).ready == 0  # 2 of 3
        await asyncio.sleep(1.2)  # b:0 expires: every living member is rewarded
        c = await s.counts()
        assert (c.expired, c.ready) == (1, 2)
        await s.close()
    run(go())


def test_stale_dropped_entries_are_acked_and_counted(store_factory):
    async def go():
        s = store_factory()
        await s.log_experiences([experience("c", 0)])
        await s.post_reward("c", 0, 1.0)
        await s.ready.ensure_group()
        batch = await s.ready.read_ready("t", 10, block_ms=10)
        assert await s.ready.ack(batch, version=9, state="stale-dropped") == (0, 1)
        c = await s.counts()
        assert (c.ready, c.trained, c.stale_dropped) == (0, 0, 1)
        assert [(x.state, x.trained_version) for x in await s.choices("c")] == [("stale-dropped", 9)]
        assert await s.ready.delivered("t") == []
        await s.close()
    run(go())


def test_a_conversation_lists_its_turns(store_factory):
    async def go():
        s = store_factory()
        await s.log_experiences([experience("t0", 0)], conversation_id="conv")
        await s.log_experiences([experience("t1", 0)], conversation_id="conv")
        assert await s.conversation_turns("conv") == ["t0", "t1"]
        assert await s.choices("nope") is None
        await s.close()
    run(go())


def test_every_delivered_entry_is_redelivered_however_many(store_factory):
    """A restarted trainer reads its whole pending entries list, not just one batch."""
    async def go():
        s = store_factory()
        await s.ready.ensure_group()
        cids = [f"c{k}" for k in range(300)]
        for cid in cids:
            await s.log_experiences([experience(cid, 0)])
            await s.post_reward(cid, 0, 1.0)
        first = await s.ready.read_ready("t", 300, block_ms=10, newest_first=False)
        assert len(first) == 300
        await s.ready.ack(first[:10], version=1)
        assert len(await s.ready.delivered("t")) == 290
        again = await s.ready.delivered("t")
        assert [e.stream_id for e in again] == [e.stream_id for e in first[10:]]
        # per-entry versions, and a repeated ack counts nothing
        assert await s.ready.ack_entries([(e.stream_id, e.member, 2 + k % 2) for k, e in enumerate(again)]) == (290, 0)
        assert await s.ready.ack_entries([(e.stream_id, e.member, 9) for e in again]) == (0, 0)
        assert [c.trained_version for c in await s.choices("c10")] == [2]
        assert [c.trained_version for c in await s.choices("c11")] == [3]
        assert await s.ready.delivered("t") == [] and (await s.counts()).trained == 300
    run(go())


def test_the_store_survives_a_redis_restart(tmp_path):
    """AOF persistence: after redis-server is stopped and started again on the same data
    directory, pending and ready experiences, rewards and their info are all there, and a client
    created before the restart keeps working (it retries across the lost connection)."""
    from serve_rft.buffer.redis_server import start_redis

    servers = [start_redis(tmp_path / "redis")]

    def restart():
        servers[0].stop()  # SIGTERM: redis writes the AOF and exits
        servers[0] = start_redis(tmp_path / "redis", port=servers[0].port)

    async def go():
        s = ExperienceStore(servers[0].url, prefix="r")
        await s.ready.ensure_group()
        await s.log_experiences([experience("p", 0)])                 # stays pending
        await s.log_experiences([experience("q", 0)])
        await s.post_reward("q", 0, 0.5, info={"judge": "rule"})
        assert len(await s.ready.read_ready("t", 10, block_ms=10)) == 1  # q delivered, not acked
        await s.log_experiences([experience("d", 0)])
        await s.post_reward("d", 0, 1.0)                         # d ready, undelivered
        counts = await s.counts()
        await asyncio.to_thread(restart)
        assert await s.counts() == counts
        assert [c.state for c in await s.choices("p")] == ["pending"]
        q = (await s.choices("q"))[0]
        assert (q.state, q.reward, q.info) == ("ready", 0.5, {"judge": "rule"})
        held = await s.ready.delivered("t")
        assert [e.member for e in held] == ["q:0"]
        # the first new-entry read may meet the dead connection: it then returns what was
        # delivered and is not held (nothing here); the next read gets the new entry
        got = []
        for _ in range(3):
            got = got or await s.ready.read_ready("t", 10, block_ms=10, exclude={e.stream_id for e in held})
        assert [e.member for e in got] == ["d:0"]
        assert await s.post_reward("p", 0, 0.25) is True  # the pending one still takes its reward
        await s.close()

    try:
        run(go())
    finally:
        servers[0].stop()


def test_a_completion_is_logged_once_even_if_the_call_is_repeated(store_factory):
    """A LOG call re-sent after a lost reply (redis-py's retry) changes nothing."""
    async def go():
        s = store_factory()
        await s.log_experiences([experience("x", 0), experience("x", 1)], conversation_id="conv")
        await s.log_experiences([experience("x", 0), experience("x", 1)], conversation_id="conv")
        c = await s.counts()
        assert (c.logged, c.pending) == (2, 2)
        assert await s.conversation_turns("conv") == ["x"]
    run(go())


def test_rewards_are_filed_by_policy_version_and_generation_time(redis_server):
    """Canary verdicts compare versions by the rewards of what each generated in a window,
    whenever the rewards arrive; a duplicate reward is counted once."""
    import asyncio
    import time

    from serve_rft.buffer.store import ExperienceStore
    from serve_rft.types import Experience, SamplingInfo

    def exp(cid, version):
        return Experience(completion_id=cid, choice_index=0, group_id=cid, replica_id="r",
                          prompt_token_ids=[1], response_token_ids=[2, 3], behaviour_logprobs=[-1.0, -1.0],
                          token_versions=[(version, 0, 2)], sampling=SamplingInfo(temperature=1.0, top_p=1.0,
                                                                                   max_tokens=2),
                          finish_reason="length")

    async def go():
        s = ExperienceStore(redis_server.url, "vr-test")
        t0 = time.time()
        for i, (v, r) in enumerate([(3, 1.0), (3, 0.5), (4, 0.0)]):
            await s.log_experiences([exp(f"c{i}", v)])
            await s.post_reward(f"c{i}", 0, r)
        await s.post_reward("c0", 0, 1.0)  # duplicate: not counted twice
        got = await s.version_rewards([3, 4, 5], t0 - 10, t0 + 10)
        early = await s.version_rewards([3], t0 - 3600, t0 - 60)
        await s.close()
        return got, early

    got, early = asyncio.run(go())
    assert got[3][0] == 2 and abs(got[3][1] - 1.5) < 1e-9 and abs(got[3][2] - 1.25) < 1e-9
    assert got[4] == (1, 0.0, 0.0) and got[5] == (0, 0.0, 0.0)
    assert early[3][0] == 0


def test_a_rewarded_member_outlives_its_groups_longest_hold(store_factory):
    """trained_ttl_s <= reward_timeout_s once lost rewards: the member expired while its group
    was held (released up to reward_timeout_s after the first reward). Now it is kept
    reward_timeout_s + trained_ttl_s from its reward, and a trained one trained_ttl_s from its ack."""
    async def go():
        s = store_factory(reward_timeout_s=100.0, trained_ttl_s=10.0)
        await s.log_experiences([experience("chatcmpl-h", 0), experience("chatcmpl-h", 1)])
        await s.post_reward("chatcmpl-h", 0, 1.0)
        assert await s.redis.ttl(s._k("exp", "chatcmpl-h", "0")) > 100
        await s.ready.ensure_group()
        await s.post_reward("chatcmpl-h", 1, 0.0)
        batch = await s.ready.read_ready("t", 10, block_ms=10)
        await s.redis.delete(s._k("cmp", "chatcmpl-h"))  # as if the record (the states) had expired
        await s.ready.ack(batch, version=1)
        assert 0 < await s.redis.ttl(s._k("cmp", "chatcmpl-h")) <= 10  # never left without a TTL
        await s.close()
    run(go())


def test_a_sweep_works_in_bounded_script_calls_and_misses_nothing(store_factory, monkeypatch):
    import serve_rft.buffer.store as store_mod

    monkeypatch.setattr(store_mod, "SWEEP_BATCH", 7)
    calls = []

    async def go():
        s = store_factory(reward_timeout_s=1.0)
        for k in range(20):
            await s.log_experiences([experience(f"chatcmpl-s{k}", 0)])
        real = s._sweep

        async def counted(args):
            calls.append(args[3])
            return await real(args=args)
        s._sweep = counted
        assert await s.sweep(now=10**10) == (20, 0)
        assert (await s.counts()).expired == 20
        await s.close()
    run(go())
    assert calls[:3] == [7, 7, 7]  # 7 + 7 + 6 expiries, each call bounded


def test_a_full_store_refuses_new_writes_cleanly_and_still_drains(tmp_path):
    """maxmemory + noeviction: past it a completion is refused whole (StoreFull) and so is a
    reward (nothing half-written, nothing evicted), while the sweep's expiries and the
    trainer's acknowledgements still run, which is how a full store drains."""
    from serve_rft.buffer.redis_server import start_redis

    server = start_redis(tmp_path / "r", maxmemory_bytes=3 * 2**20)

    async def go():
        s = ExperienceStore(server.url, prefix="full", reward_timeout_s=1.0)
        await s.ready.ensure_group()
        await s.log_experiences([experience("chatcmpl-keep", 0), experience("chatcmpl-keep", 1)])
        await s.post_reward("chatcmpl-keep", 0, 1.0)
        await s.post_reward("chatcmpl-keep", 1, 0.0)
        ready = await s.ready.read_ready("t", 10, block_ms=10)
        await s.log_experiences([experience("chatcmpl-late", 0)])
        assert (await s.redis.config_get("maxmemory-policy"))["maxmemory-policy"] == "noeviction"
        await s.redis.config_set("maxmemory", 1)  # full, whatever the allocator does next
        with pytest.raises(StoreFull):
            await s.log_experiences([experience("chatcmpl-refused", 0)])
        assert await s.num_choices("chatcmpl-refused") is None  # nothing of it was written
        with pytest.raises(StoreFull):
            await s.post_reward("chatcmpl-late", 0, 1.0)
        assert await s.ready.ack(ready, version=1) == (2, 0)  # acknowledgements run past maxmemory
        expired, _ = await s.sweep(now=10**10)
        assert expired >= 1
        await s.close()
    try:
        run(go())
    finally:
        server.stop()


def test_the_prompt_is_stored_once_per_completion_and_joined_back_on_every_read(store_factory):
    async def go():
        s = store_factory()
        exps = [experience("chatcmpl-p", i).model_copy(update={"prompt_token_ids": list(range(500))}) for i in range(4)]
        await s.log_experiences(exps)
        raw = await s.redis.get(s._k("exp", "chatcmpl-p", "2"))
        assert "prompt_token_ids" not in raw and len(raw) < 600  # 500 ids would be ~2 KB more
        assert (await s.get_experience("chatcmpl-p", 2)).prompt_token_ids == list(range(500))
        await s.ready.ensure_group()
        for i in range(4):
            await s.post_reward("chatcmpl-p", i, float(i))
        got = await s.ready.read_ready("t", 10, block_ms=10)
        assert len(got) == 4 and all(b.experience.prompt_token_ids == list(range(500)) for b in got)
        assert await s.redis.ttl(s._k("cmp", "chatcmpl-p")) >= await s.redis.ttl(s._k("exp", "chatcmpl-p", "0"))
        await s.close()
    run(go())


def test_the_ready_stream_is_bounded_by_dropping_the_oldest_undelivered_entries(store_factory):
    async def go():
        s = store_factory(max_ready=4)
        for k in range(6):  # serve-only: nothing consumes
            await s.log_experiences([experience(f"chatcmpl-r{k}", 0)])
            await s.post_reward(f"chatcmpl-r{k}", 0, 1.0)
        c = await s.counts()  # counts() sweeps
        assert (c.ready, c.backlog_dropped) == (4, 2)
        assert [x.state for x in await s.choices("chatcmpl-r0")] == ["backlog-dropped"]
        assert [x.state for x in await s.choices("chatcmpl-r2")] == ["ready"]
        await s.ready.ensure_group()
        held = await s.ready.read_ready("t", 3, block_ms=10)  # a trainer holds three
        for k in range(6, 9):
            await s.log_experiences([experience(f"chatcmpl-r{k}", 0)])
            await s.post_reward(f"chatcmpl-r{k}", 0, 1.0)
        c = await s.counts()
        assert c.ready == 4 and c.backlog_dropped == 5
        assert sorted(b.member for b in await s.ready.delivered("t")) == sorted(b.member for b in held)  # never touched
        await s.close()
    run(go())


def test_the_trainer_reads_the_freshest_first_or_the_oldest_and_never_an_entry_it_holds(store_factory):
    async def go():
        s = store_factory()
        await s.ready.ensure_group()
        for k in range(8):
            await s.log_experiences([experience(f"chatcmpl-f{k}", 0)])
            await s.post_reward(f"chatcmpl-f{k}", 0, 1.0)
        newest = await s.ready.read_ready("t", 3, block_ms=10)
        assert [b.experience.completion_id for b in newest] == ["chatcmpl-f7", "chatcmpl-f6", "chatcmpl-f5"]
        oldest = await s.ready.read_ready("t", 2, block_ms=10, newest_first=False)
        assert [b.experience.completion_id for b in oldest] == ["chatcmpl-f0", "chatcmpl-f1"]
        again = await s.ready.read_ready("t", 10, block_ms=10)  # what is held is never delivered twice
        assert [b.experience.completion_id for b in again] == ["chatcmpl-f4", "chatcmpl-f3", "chatcmpl-f2"]
        assert await s.ready.read_ready("t", 10, block_ms=10) == []
        held = sorted(b.stream_id for b in newest + oldest + again)
        assert sorted(b.stream_id for b in await s.ready.delivered("t")) == held  # all pending, none lost
        assert await s.ready.ack(newest + oldest + again, version=1) == (8, 0)
        assert await s.ready.delivered("t") == [] and (await s.counts()).ready == 0
        await s.close()
    run(go())


def test_a_read_with_nothing_free_waits_for_a_new_entry(store_factory):
    async def go():
        s = store_factory()
        await s.ready.ensure_group()
        await s.log_experiences([experience("chatcmpl-w0", 0)])
        await s.post_reward("chatcmpl-w0", 0, 1.0)
        held = await s.ready.read_ready("t", 10, block_ms=10)
        assert len(held) == 1

        async def later():
            await asyncio.sleep(0.3)
            await s.log_experiences([experience("chatcmpl-w1", 0)])
            await s.post_reward("chatcmpl-w1", 0, 1.0)
        task = asyncio.create_task(later())
        t0 = asyncio.get_running_loop().time()
        got = await s.ready.read_ready("t", 10, block_ms=5000)
        waited = asyncio.get_running_loop().time() - t0
        await task
        assert [b.experience.completion_id for b in got] == ["chatcmpl-w1"] and 0.2 < waited < 4.0
        t0 = asyncio.get_running_loop().time()
        assert await s.ready.read_ready("t", 10, block_ms=200) == []  # times out, nothing free
        assert asyncio.get_running_loop().time() - t0 >= 0.15
        await s.close()
    run(go())


def test_waiting_experiences_past_the_staleness_threshold_are_dropped_before_they_are_read(store_factory):
    async def go():
        s = store_factory()
        await s.ready.ensure_group()
        for k in range(6):  # choice k's oldest token came from policy version k
            await s.log_experiences([experience(f"chatcmpl-s{k}", 0, versions=((k, 0, 2), (k + 1, 2, 3)))])
            await s.post_reward(f"chatcmpl-s{k}", 0, 1.0)
        held = await s.ready.read_ready("t", 1, block_ms=10, newest_first=False)  # a trainer holds s0
        assert held[0].experience.completion_id == "chatcmpl-s0"
        assert await s.ready.drop_stale(threshold=3, version=9) == 2  # s1, s2: s0 is held, s3.. are fresh
        assert [x.state for x in await s.choices("chatcmpl-s1")] == ["stale-dropped"]
        assert (await s.choices("chatcmpl-s2"))[0].trained_version == 9
        c = await s.counts()
        assert (c.stale_dropped, c.ready) == (2, 4)  # s0 (held) + s3..s5
        assert await s.ready.drop_stale(threshold=3, version=9) == 0
        await s.close()
    run(go())


def test_the_fields_a_completion_shares_are_stored_once_and_every_read_sees_them(store_factory):
    async def go():
        s = store_factory()
        exps = [large_experience("chatcmpl-s", i) for i in range(4)]
        await s.log_experiences(exps)
        for i in range(4):
            raw = await s.redis.get(s._k("exp", "chatcmpl-s", str(i)))
            assert len(raw) < 600 and '"user"' not in raw and "structured_outputs" not in raw
            assert await s.get_experience("chatcmpl-s", i) == exps[i]
        shared = await s.redis.hget(s._k("cmp", "chatcmpl-s"), "pr")
        assert shared.count("u" * 512) == 1 and shared.count('"p00000"') == 1
        assert await s.redis.ttl(s._k("cmp", "chatcmpl-s")) >= await s.redis.ttl(s._k("exp", "chatcmpl-s", "0"))
        assert [c.token_versions for c in await s.choices("chatcmpl-s")] == [[[0, 0, 1]]] * 4
        await s.ready.ensure_group()
        for i in range(4):
            await s.post_reward("chatcmpl-s", i, float(i))
        # the ready entries keep the shared fields (P:rp:{cid}, without a TTL): the trainer reads
        # the same experiences once every key of the completion is gone (its TTLs ran out while
        # the trainer was away)
        for key in [s._k("cmp", "chatcmpl-s")] + [s._k("exp", "chatcmpl-s", str(i)) for i in range(4)]:
            await s.redis.delete(key)
        got = sorted(await s.ready.read_ready("t", 10, block_ms=10), key=lambda b: b.experience.choice_index)
        assert [b.experience for b in got] == exps and [b.reward for b in got] == [0.0, 1.0, 2.0, 3.0]
        await s.close()
    run(go())


def test_a_field_the_choices_do_not_share_stays_with_each_choice(store_factory):
    async def go():
        s = store_factory()
        exps = [experience("chatcmpl-d", i).model_copy(update={"user": f"u{i}", "metadata": {"k": "v"}}) for i in range(3)]
        await s.log_experiences(exps)
        assert '"user":"u1"' in await s.redis.get(s._k("exp", "chatcmpl-d", "1"))
        assert '"metadata"' not in await s.redis.get(s._k("exp", "chatcmpl-d", "1"))
        assert [await s.get_experience("chatcmpl-d", i) for i in range(3)] == exps
        await s.close()
    run(go())


def test_a_record_whose_shared_key_holds_only_the_prompt_ids_still_reads(store_factory):
    async def go():
        s = store_factory()
        e = experience("chatcmpl-o", 0)
        await s.redis.set(s._k("exp", "chatcmpl-o", "0"), e.model_dump_json(exclude={"prompt_token_ids"}), ex=60)
        await s.redis.set(s._k("pr", "chatcmpl-o"), "[1,2]", ex=60)
        assert await s.get_experience("chatcmpl-o", 0) == e
        await s.close()
    run(go())


def test_a_completion_logged_with_its_states_and_shared_fields_in_keys_of_their_own_is_rewarded_and_trained_once(
        store_factory):
    """A store written before a completion's record held its choices' states and shared fields
    (``P:st:{cid}``, ``P:pr:{cid}`` beside ``P:cmp:{cid}``) keeps working after an upgrade: its
    rewards are recorded there exactly once, its group released with the shared fields, and the
    trainer reads it whole and marks it trained there."""
    async def go():
        s = store_factory()
        e = experience("chatcmpl-old", 0)
        cid, ttl = "chatcmpl-old", 600
        await s.redis.hset(s._k("cmp", cid), mapping={"n": 1, "group": cid, "conv": "", "created": 1.0,
                                                       "ver": 0, "tenant": "default"})
        await s.redis.hset(s._k("grp", cid), mapping={"size": 1, "logged": 1})
        await s.redis.set(s._k("exp", cid, "0"), e.model_dump_json(exclude=shared_names([e])), ex=ttl)
        await s.redis.set(s._k("pr", cid), e.model_dump_json(include=shared_names([e])), ex=ttl)
        await s.redis.hset(s._k("st", cid), "0", "pending")
        for k in ("cmp", "grp", "st"):
            await s.redis.expire(s._k(k, cid), ttl)
        await s.redis.zadd(s._k("pending"), {f"{cid}:0": 1e12})
        assert await s.get_experience(cid, 0) == e
        await s.ready.ensure_group()
        assert await s.post_reward(cid, 0, 1.0) is True
        assert await s.post_reward(cid, 0, 1.0) is False  # the same reward again: recorded once
        with pytest.raises(RewardConflict):
            await s.post_reward(cid, 0, 0.0)
        assert await s.redis.hget(s._k("cmp", cid), "r0") is None  # written where its states are
        got = await s.ready.read_ready("t", 10, block_ms=10)
        assert [b.experience for b in got] == [e] and [b.reward for b in got] == [1.0]
        await s.ready.ack(got, version=1)
        assert await s.redis.hget(s._k("st", cid), "0") == "trained"
        assert [c.state for c in await s.choices(cid)] == ["trained"]
        assert (await s.counts()).trained == 1
        await s.close()
    run(go())


async def _used_memory(s) -> int:
    return int((await s.redis.info("memory"))["used_memory"])


def test_logging_n16_with_the_largest_fields_grows_redis_by_less_than_twice_their_bytes(store_factory):
    """The storage-amplification bound: one completion with ``n=16`` choices of one token each and
    the largest ``user``, ``metadata`` and grammar adds less than 2x those fields' bytes to Redis's
    ``used_memory`` (stored once, not 16 times: 16 copies would be ~20x)."""
    async def go():
        s = store_factory()
        await s.log_experiences([large_experience("chatcmpl-warm", i) for i in range(16)])  # loads the script
        exps = [large_experience("chatcmpl-amp", i) for i in range(16)]
        field_bytes = len(exps[0].model_dump_json(include={"user", "metadata", "sampling"}).encode())
        assert field_bytes > 70_000
        # used_memory counts every client's buffers too: the least growth of a few tries is the
        # store's (a freshly allocated buffer of another client only adds to one try)
        growth = []
        for k in range(3):
            before = await _used_memory(s)
            await s.log_experiences([e.model_copy(update={"completion_id": f"chatcmpl-amp{k}",
                                                          "group_id": f"chatcmpl-amp{k}"}) for e in exps])
            growth.append(await _used_memory(s) - before)
        assert min(growth) < 2 * field_bytes, (growth, field_bytes)
        await s.close()
    run(go())

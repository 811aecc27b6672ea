"""Acknowledgements and the ready bound when Redis lost the trainer group's pending entries list
(an AOF restored to an earlier point, a failover to a lagging replica): nothing is acknowledged
that the caller did not hold, and nothing the trainer trained is miscounted (against a real
redis-server, started by the session fixture)."""

from asyncio import run

from serve_rft.buffer.records import DeadLetter
from tests.support.experiences import experience, large_experience


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
        await s.ready.ensure_group()
        await _released(s, "chatcmpl-a", 1)
        got = await s.ready.read_ready("t", 10, block_ms=10)
        await _lose_pending_list(s)
        sid = got[0].stream_id
        assert await s.ready.ack_entries([(sid, "chatcmpl-other:0", 3)]) == (0, 0)
        assert await s.redis.xlen(s._k("ready")) == 1
        assert await s.redis.hget(s._k("cmp", "chatcmpl-a"), "0") == "ready"
        assert (await s.counts()).trained == 0
        assert await s.ready.ack_entries([(sid, "chatcmpl-a:0", 3)]) == (1, 0)
        assert await s.redis.xlen(s._k("ready")) == 0
        assert await s.redis.hget(s._k("cmp", "chatcmpl-a"), "0") == "trained"
        await s.close()
    run(go())


def test_entries_a_trainer_holds_after_a_lost_pending_list_are_counted_once_trained(store_factory):
    """The pending entries list is lost while the trainer holds three trained, unacknowledged
    entries and the ready stream is past ``max_ready``: the trainer's own sweep (in its read)
    sheds only what it does not hold; one by a replica (``counts``), which cannot know, sheds the
    oldest held one, and the trainer's acknowledgement then counts all three trained, once."""
    async def go():
        s = store_factory(max_ready=3)
        await s.ready.ensure_group()
        held = []
        for k in range(3):
            await _released(s, f"chatcmpl-h{k}", 1)
            held += await s.ready.read_ready("t", 1, block_ms=10)
        assert len(held) == 3
        await _lose_pending_list(s)
        await _released(s, "chatcmpl-h3", 1)
        assert await s.ready.read_ready("t", 1, block_ms=10, exclude={b.stream_id for b in held}) == []
        states = [x.state for k in range(4) for x in await s.choices(f"chatcmpl-h{k}")]
        assert states == ["ready", "ready", "ready", "backlog-dropped"]
        await _released(s, "chatcmpl-h4", 1)
        assert (await s.counts()).backlog_dropped == 2  # a replica's sweep: chatcmpl-h0 goes
        assert [x.state for x in await s.choices("chatcmpl-h0")] == ["backlog-dropped"]
        assert await s.ready.ack(held, version=1) == (3, 0)
        assert await s.ready.ack(held, version=1) == (0, 0)
        c = await s.counts()
        assert (c.trained, c.backlog_dropped, c.ready) == (3, 1, 1)
        assert [x.state for k in range(3) for x in await s.choices(f"chatcmpl-h{k}")] == ["trained"] * 3
        await s.close()
    run(go())


def test_a_whole_dead_letter_holds_the_shared_fields_once(store_factory):
    """A letter of a parsed entry (`DeadLetter.of`: its ``exp`` is the whole experience) stores
    the completion's largest shared fields once, not a second time in ``prompt``: dead letters
    are written past maxmemory (allow-oom), up to ``DEAD_LETTER_MAXLEN`` of them."""
    async def go():
        s = store_factory()
        await s.ready.ensure_group()
        exps = [large_experience("chatcmpl-w", i) for i in range(2)]
        await s.log_experiences(exps)
        for i in range(2):
            await s.post_reward("chatcmpl-w", i, 1.0)
        got = await s.ready.read_ready("t", 10, block_ms=10)
        assert await s.ready.dead_letter([DeadLetter.of(b, "test") for b in got]) == 2
        field_bytes = len(exps[0].model_dump_json(include={"user", "metadata", "sampling"}).encode())
        assert field_bytes > 70_000
        for d in await s.ready.dead_letters():
            assert len(d["exp"]) + len(d["prompt"]) < 1.5 * field_bytes
            assert type(exps[0]).model_validate_json(d["exp"]) == exps[int(d["member"].rsplit(":", 1)[1])]
        assert await s.redis.xlen(s._k("ready")) == 0 and not await s.redis.exists(s._k("rp", "chatcmpl-w"))
        await s.close()
    run(go())

"""The ready stream holds a completion's shared fields once (``P:rp:{cid}``), not once per
released choice; every path that removes a ready entry releases its reference exactly once
(against a real redis-server, started by the session fixture)."""

from asyncio import run
import json

import pytest

from serve_rft.buffer.records import DeadLetter
from tests.support.experiences import experience, large_experience


async def _refs(s, cid) -> int | None:
    """The payload's reference count, None when the key is gone."""
    if not await s.redis.exists(s._k("rp", cid)):
        return None
    return int(await s.redis.hget(s._k("rp", cid), "refs"))


async def _released(s, cid, n, big=False):
    """Log a completion of ``n`` choices and reward all of them (its group is released)."""
    exps = [(large_experience if big else experience)(cid, i) for i in range(n)]
    await s.log_experiences(exps)
    for i in range(n):
        await s.post_reward(cid, i, float(i))
    return exps


async def _used_memory(s) -> int:
    return int((await s.redis.info("memory"))["used_memory"])


def test_releasing_n16_with_the_largest_fields_grows_redis_by_less_than_twice_their_bytes(store_factory):
    """Rewarding (and so releasing) all 16 choices of one completion with the largest ``user``,
    ``metadata`` and grammar adds one copy of those fields to Redis (the payload), not 16."""
    async def go():
        s = store_factory()
        await s.ready.ensure_group()
        await _released(s, "chatcmpl-warm", 16, big=True)  # loads the scripts
        field_bytes = len(large_experience("c", 0).model_dump_json(include={"user", "metadata", "sampling"}).encode())
        assert field_bytes > 70_000
        growth = []
        for k in range(3):  # the least of a few tries: another client's buffer only adds to one
            cid = f"chatcmpl-amp{k}"
            await s.log_experiences([large_experience(cid, i) for i in range(16)])
            before = await _used_memory(s)
            for i in range(16):
                await s.post_reward(cid, i, float(i))
            growth.append(await _used_memory(s) - before)
            assert await _refs(s, cid) == 16
        assert min(growth) < 2 * field_bytes, (growth, field_bytes)
        await s.close()
    run(go())


def test_the_trainer_reads_whole_experiences_after_the_completion_keys_are_gone(store_factory):
    async def go():
        s = store_factory()
        await s.ready.ensure_group()
        exps = await _released(s, "chatcmpl-g", 4, big=True)
        ready = [f for _, f in await s.redis.xrange(s._k("ready"))]
        assert all(f["prompt_ref"] == "chatcmpl-g" and "prompt" not in f and len(f["exp"]) < 600 for f in ready)
        for key in [s._k("cmp", "chatcmpl-g")] + [s._k("exp", "chatcmpl-g", str(i)) for i in range(4)]:
            await s.redis.delete(key)
        got = sorted(await s.ready.read_ready("t", 10, block_ms=10), key=lambda b: b.experience.choice_index)
        assert [b.experience for b in got] == exps and [b.reward for b in got] == [0.0, 1.0, 2.0, 3.0]
        # a restarted trainer re-reads what it holds (XREADGROUP, not the READ script): also whole
        again = sorted(await s.ready.delivered("t"), key=lambda b: b.experience.choice_index)
        assert [b.experience for b in again] == exps
        assert await s.ready.ack(got, version=1) == (4, 0)
        assert await _refs(s, "chatcmpl-g") is None
        await s.close()
    run(go())


@pytest.mark.parametrize("path", ["ack", "dead_letter", "drop_stale", "shed"])
def test_every_removal_path_releases_each_reference_once_and_the_last_deletes_the_payload(store_factory, path):
    async def go():
        s = store_factory(max_ready=1 if path == "shed" else None)
        await s.ready.ensure_group()
        await _released(s, "chatcmpl-r", 4)
        assert await _refs(s, "chatcmpl-r") == 4
        if path == "shed":  # past a bound of 1 the group's release goes whole
            await s.sweep()
            assert await s.redis.xlen(s._k("ready")) == 0
        elif path == "drop_stale":  # token_versions (0, 0, 3): below threshold 1
            assert await s.ready.drop_stale(threshold=1, version=2) == 4
            assert await s.ready.drop_stale(threshold=1, version=2) == 0
        else:
            got = await s.ready.read_ready("t", 10, block_ms=10)
            assert len(got) == 4
            if path == "ack":
                assert await s.ready.ack(got[:1], version=1) == (1, 0)
                assert await _refs(s, "chatcmpl-r") == 3
                assert await s.ready.ack(got[:1], version=1) == (0, 0)  # a retried ack: no second release
                assert await _refs(s, "chatcmpl-r") == 3
                assert await s.ready.ack(got, version=1) == (3, 0)
                assert await s.ready.ack(got, version=1) == (0, 0)
            else:
                letters = [DeadLetter.of(b, "test") for b in got]
                assert await s.ready.dead_letter(letters) == 4
                assert await s.ready.dead_letter(letters) == 0
        assert await s.redis.xlen(s._k("ready")) == 0
        assert await _refs(s, "chatcmpl-r") is None
        await s.close()
    run(go())


def test_acked_dead_lettered_and_shed_entries_of_one_completion_each_release_once(store_factory):
    """(The ready bound sheds a group's release whole: the 6 entries no trainer holds go together.)"""
    async def go():
        s = store_factory()
        await s.ready.ensure_group()
        await _released(s, "chatcmpl-m", 8)
        got = await s.ready.read_ready("t", 2, block_ms=10, newest_first=True)
        s.max_ready = 5
        assert len(got) == 2 and (await s.counts()).backlog_dropped == 6  # counts() sweeps
        assert await _refs(s, "chatcmpl-m") == 2
        assert await s.ready.ack(got[:1], version=1) == (1, 0)
        assert await _refs(s, "chatcmpl-m") == 1
        assert await s.ready.dead_letter([DeadLetter.of(got[1], "test")]) == 1
        assert await s.redis.xlen(s._k("ready")) == 0
        assert await _refs(s, "chatcmpl-m") is None
        await s.close()
    run(go())


def test_an_ack_after_the_pending_list_was_lost_releases_once(store_factory):
    async def go():
        s = store_factory()
        await s.ready.ensure_group()
        await _released(s, "chatcmpl-l", 2)
        got = await s.ready.read_ready("t", 10, block_ms=10)
        ready = s._k("ready")
        await s.redis.xgroup_destroy(ready, "trainer")  # as after an AOF restored to before the read
        await s.redis.xgroup_create(ready, "trainer", id="0")
        assert await s.ready.ack(got[:1], version=1) == (1, 0)
        assert await s.ready.ack(got[:1], version=1) == (0, 0)
        assert await _refs(s, "chatcmpl-l") == 1
        assert await s.ready.ack(got, version=1) == (1, 0)
        assert await _refs(s, "chatcmpl-l") is None
        await s.close()
    run(go())


def test_a_dead_letter_carries_the_shared_fields_after_the_payload_is_gone(store_factory):
    async def go():
        s = store_factory()
        await s.ready.ensure_group()
        exps = await _released(s, "chatcmpl-d", 2, big=True)
        shared = await s.redis.hget(s._k("cmp", "chatcmpl-d"), "pr")
        got = await s.ready.read_ready("t", 10, block_ms=10)
        # an entry whose record does not parse (raw exp without the shared fields), and one whole
        ids = sorted(b.stream_id for b in got)
        raw = {eid: f for eid, f in await s.redis.xrange(s._k("ready"))}
        letters = [DeadLetter(ids[0], raw[ids[0]]["member"], "unparseable: test", raw[ids[0]]["exp"], "0.0"),
                   DeadLetter.of(next(b for b in got if b.stream_id == ids[1]), "test")]
        assert await s.ready.dead_letter(letters) == 2
        await s.redis.delete(s._k("cmp", "chatcmpl-d"))
        assert await _refs(s, "chatcmpl-d") is None
        dead = {d["id"]: d for d in await s.ready.dead_letters()}
        assert dead[ids[0]]["prompt"] == shared and dead[ids[1]]["prompt"] == ""  # the whole one needs no copy
        member = int(dead[ids[0]]["member"].rsplit(":", 1)[1])
        whole = {**json.loads(dead[ids[0]]["prompt"]), **json.loads(dead[ids[0]]["exp"])}
        assert type(exps[0]).model_validate(whole) == exps[member]
        member = int(dead[ids[1]]["member"].rsplit(":", 1)[1])
        assert type(exps[0]).model_validate_json(dead[ids[1]]["exp"]) == exps[member]
        await s.close()
    run(go())


def test_an_entry_whose_payload_is_missing_is_dead_lettered_not_crashed_on(store_factory):
    async def go():
        s = store_factory()
        await s.ready.ensure_group()
        await _released(s, "chatcmpl-x", 1)
        await s.redis.delete(s._k("rp", "chatcmpl-x"))  # by hand: no script path does this
        assert await s.ready.read_ready("t", 10, block_ms=10) == []
        dead = await s.ready.dead_letters()
        assert len(dead) == 1 and "shared fields" in dead[0]["reason"]
        assert await s.redis.xlen(s._k("ready")) == 0 and not await s.redis.exists(s._k("rp", "chatcmpl-x"))
        await s.close()
    run(go())


def test_an_entry_that_carries_its_own_copy_still_reads_and_leaves_no_payload_key(store_factory):
    """An entry written before the payload keys (a full ``prompt`` copy) reads whole, and its
    acknowledgement touches no payload."""
    async def go():
        s = store_factory()
        await s.ready.ensure_group()
        e = large_experience("chatcmpl-o", 0)
        shared = json.dumps({"prompt_token_ids": e.prompt_token_ids,
                             **e.model_dump(mode="json", include={"sampling", "user", "metadata"})})
        exp = e.model_dump_json(exclude={"prompt_token_ids", "sampling", "user", "metadata"})
        await s.redis.xadd(s._k("ready"), {"exp": exp, "reward": "0.5", "member": "chatcmpl-o:0",
                                           "prompt": shared, "v": 0})
        got = await s.ready.read_ready("t", 10, block_ms=10)
        assert [b.experience for b in got] == [e] and got[0].reward == 0.5
        assert await s.ready.ack(got, version=1) == (1, 0)
        assert await s.redis.xlen(s._k("ready")) == 0
        assert [k async for k in s.redis.scan_iter(match=f"{s.p}:rp:*")] == []
        await s.close()
    run(go())

"""The trainer's intake: poison entries dead-lettered, lost acknowledgements never retrained,
crash-looping entries bounded (store parts against a real redis-server)."""

import asyncio
import json
import uuid

import pytest
from hypothesis import given, strategies as st

from serve_rft.buffer.records import DeadLetter
from serve_rft.buffer.store import ExperienceStore
from serve_rft.trainer.intake.admission import TrainedLedger, batch_complete, stale_threshold, sync_cycles, untrainable
from serve_rft.types import RewardedExperience
from tests.support.experiences import experience


def _rx(**changes):
    e = experience("chatcmpl-x", 0).model_copy(update=changes)
    return RewardedExperience(experience=e, reward=changes.pop("reward", 1.0), stream_id="1-0")


def test_a_batch_trains_full_at_once_min_after_the_wait_and_any_size_after_the_max_wait():
    def done(size, waited_s, oldest_s, max_wait=30.0):
        return batch_complete(size, waited_s, oldest_s, batch_size=32, min_batch_size=4, batch_wait_s=2.0,
                              max_batch_wait_s=max_wait)

    assert done(32, 0.0, 0.0)  # full: at once
    assert not done(31, 1.9, 1.9) and done(4, 2.0, 2.0) and not done(3, 2.0, 2.0)
    # traffic stopped with 2 left (one group of n=2): trained once the oldest waited 30 s, not never
    assert not done(2, 2.0, 29.9) and done(2, 2.0, 30.0)
    assert not done(2, 1.0, 31.0)  # only at the end of a collection round
    assert not done(0, 100.0, 0.0) and not done(2, 2.0, 1e9, max_wait=None)


def test_untrainable_names_the_reason():
    assert untrainable(_rx(), vocab_size=100) is None
    assert "non-finite behaviour logprob" in untrainable(_rx(behaviour_logprobs=[-1.0, float("nan"), 0.0]), 100)
    assert "2 behaviour logprobs for 3" in untrainable(_rx(behaviour_logprobs=[-1.0, -1.0]), 100)
    assert "vocabulary" in untrainable(_rx(response_token_ids=[5, 6, 100]), 100)
    bad_reward = RewardedExperience(experience=experience("c", 0), reward=float("inf"), stream_id="1-0")
    assert "non-finite reward" in untrainable(bad_reward, 100)


def test_the_ledger_splits_what_saved_states_cover():
    ledger = TrainedLedger(cap=2)
    ledger.add([("1-0", "a:0", 3), ("2-0", "b:0", 3), ("3-0", "c:0", 4)])
    assert len(ledger) == 2  # a:0 forgotten (oldest)
    batch = [RewardedExperience(experience=experience(cid, 0), reward=0.0, stream_id=f"{9 + k}-0")
             for k, cid in enumerate(["a", "c"])]
    fresh, again = ledger.split(batch)
    assert [b.member for b in fresh] == ["a:0"] and again == [("10-0", "c:0", 4)]


def test_unparseable_entries_are_dead_lettered_on_read_and_attempts_are_counted(redis_server):
    async def go():
        s = ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
        await s.ready.ensure_group()
        ready = s._k("ready")
        await s.redis.xadd(ready, {"exp": "{not json", "reward": "1.0", "member": "chatcmpl-p:0"})
        good = experience("chatcmpl-g", 0).model_dump_json()
        await s.redis.xadd(ready, {"exp": good, "reward": "0.5", "member": "chatcmpl-g:0"})
        got = await s.ready.read_ready("t", 10, block_ms=10)
        assert [b.member for b in got] == ["chatcmpl-g:0"]
        assert (await s.counts()).dead_lettered == 1
        dead = await s.ready.dead_letters()
        assert dead[0]["member"] == "chatcmpl-p:0" and dead[0]["reason"].startswith("unparseable")
        assert await s.ready.begin_attempt([got[0].stream_id]) == [1]
        assert await s.ready.begin_attempt([got[0].stream_id]) == [2]
        letter = DeadLetter(got[0].stream_id, got[0].member, "test", good, "0.5")
        assert await s.ready.dead_letter([letter]) == 1
        assert await s.ready.dead_letter([letter]) == 0  # acknowledged already: counted once
        assert (await s.counts()).dead_lettered == 2
        assert await s.redis.hlen(s._k("attempts")) == 0
        assert await s.ready.delivered("t") == []
        assert json.loads(dead[0]["reward"]) == 1.0
        await s.close()
    asyncio.run(go())


def test_staleness_counts_sync_cycles_not_trainer_steps():
    """sync_interval=4: versions 0, 4, 8, 12. A sample of v8 is one cycle behind v12 (XTuner's
    max_staleness=1 keeps it), not 4 steps."""
    published = [0, 4, 8, 12]
    assert [sync_cycles(published, v) for v in (12, 8, 5, 4, 0)] == [0, 1, 2, 2, 3]


def test_a_reset_counts_staleness_from_the_version_taken_back():
    """After a rollback to v0 with 18 versions published since (sync_interval 4, max_staleness
    16), the answers the replicas now sample from v0 are 0 cycles behind the weights the trainer
    holds, not 18: counted against the whole history every one was dropped as stale and the
    trainer never published again (tests/integration/test_stack_canary.py saw no new candidate
    in 300 s after the operator's rollback). Shown to fail without `ExperienceFeed.reset_to`'s
    rewind: 18 cycles."""
    from serve_rft.config import TrainerConfig
    from serve_rft.trainer.intake.feed import ExperienceFeed

    feed = ExperienceFeed(TrainerConfig(max_staleness=16), store=None)
    for v in range(4, 73, 4):
        feed.published(v)
    assert feed.staleness(0) == 18 and stale_threshold(feed.published_versions, 16) == 8
    feed.reset_to(0)
    assert feed.staleness(0) == 0 and stale_threshold(feed.published_versions, 16) is None
    feed.published(76)  # the first version trained from v0's weights
    assert feed.staleness(0) == 1 and feed.staleness(76) == 0 and feed.staleness(40) == 1
    feed.reset_to(76)
    assert feed.published_versions == [0, 76]


@given(st.lists(st.integers(0, 60), unique=True, max_size=20).map(sorted), st.integers(0, 60),
       st.one_of(st.none(), st.integers(0, 8)))
def test_the_stale_threshold_agrees_with_counting_sync_cycles(published, version, max_staleness):
    threshold = stale_threshold(published, max_staleness)
    past = max_staleness is not None and sync_cycles(published, version) > max_staleness
    assert past == (threshold is not None and version < threshold)


@pytest.mark.parametrize("train_greedy", [False, True])
def test_the_feed_leaves_greedy_answers_out_of_the_loss_counted_unless_asked(redis_server, train_greedy):
    """Answers sampled at temperature 0 (greedy) or below ``min_train_temperature`` are served,
    logged and rewarded as any, and acknowledged as ``greedy``, counted by the feed and the store,
    never trained; ``trainer.train_greedy`` trains them. (Before, all three were trained.)"""
    from serve_rft.config import TrainerConfig
    from serve_rft.trainer.intake.feed import ExperienceFeed

    async def go():
        store = ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
        exps = {"chatcmpl-t1": 1.0, "chatcmpl-t0": 0.0, "chatcmpl-t005": 0.05, "chatcmpl-t01": 0.1}
        for cid, temperature in exps.items():
            e = experience(cid, 0)
            e.sampling.temperature = temperature
            await store.log_experiences([e])
        await store.ready.ensure_group()
        for cid in exps:
            await store.post_reward(cid, 0, 1.0)
        feed = ExperienceFeed(TrainerConfig(train_greedy=train_greedy), store.ready)
        batch = await store.ready.read_ready("t", 10, block_ms=10)
        kept = sorted(b.experience.completion_id for b in await feed.admit(batch, vocab_size=1024, version=2))
        if train_greedy:
            assert kept == sorted(exps) and feed.greedy == 0
        else:
            assert kept == ["chatcmpl-t01", "chatcmpl-t1"] and feed.greedy == 2
            assert (await store.counts()).greedy == 2
            assert [(c.state, c.trained_version) for c in await store.choices("chatcmpl-t0")] == [("greedy", 2)]
        await store.close()
    asyncio.run(go())


def test_the_feed_leaves_grammar_sampled_experiences_out_of_the_loss_counted(redis_server):
    """An experience sampled under a structured-output grammar (a forced tool call, a JSON
    schema) has behaviour logprobs of the masked distribution: acknowledged as ``constrained``,
    counted by the feed and the store, never trained."""
    from serve_rft.config import TrainerConfig
    from serve_rft.trainer.intake.feed import ExperienceFeed

    async def go():
        store = ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
        free, forced = experience("chatcmpl-free", 0), experience("chatcmpl-forced", 0)
        forced.sampling.structured_outputs = {"structural_tag": "{...}"}
        await store.log_experiences([free])
        await store.log_experiences([forced])
        await store.ready.ensure_group()
        for cid in ("chatcmpl-free", "chatcmpl-forced"):
            await store.post_reward(cid, 0, 1.0)
        feed = ExperienceFeed(TrainerConfig(), store.ready)
        batch = await store.ready.read_ready("t", 10, block_ms=10)
        kept = await feed.admit(batch, vocab_size=1024, version=4)
        assert [b.experience.completion_id for b in kept] == ["chatcmpl-free"] and feed.constrained == 1
        assert (await store.counts()).constrained == 1
        assert [(c.state, c.trained_version) for c in await store.choices("chatcmpl-forced")] == [("constrained", 4)]
        await store.close()
    asyncio.run(go())


def test_restarts_after_successful_steps_dead_letter_nothing(redis_server):
    """Entries trained by a step that succeeded stay delivered and unacknowledged until a saved
    state covers them; trainer processes that die meanwhile (in a publish, a kill) must not count
    as crashes in their step. Four processes in a row (max_entry_attempts is 3) each step the
    same redelivered entries successfully and die: nothing is dead-lettered. An entry whose step
    never finishes is dead-lettered after the bound, as before."""
    from serve_rft.config import TrainerConfig
    from serve_rft.trainer.intake.feed import ExperienceFeed

    async def go():
        store = ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
        for cid in ("chatcmpl-a", "chatcmpl-b"):
            await store.log_experiences([experience(cid, 0)])
        await store.ready.ensure_group()
        for cid in ("chatcmpl-a", "chatcmpl-b"):
            await store.post_reward(cid, 0, 1.0)
        cfg = TrainerConfig(max_entry_attempts=3)
        await store.ready.read_ready("trainer", 10, block_ms=10)  # the first process takes both
        for _ in range(4):  # each process: read its backlog, step, step succeeds, process dies
            feed = ExperienceFeed(cfg, store.ready)
            batch = await feed.count_attempts(await store.ready.delivered("trainer"))
            assert len(batch) == 2
            await feed.stepped(batch)
        assert feed.dead_lettered == 0 and (await store.counts()).dead_lettered == 0
        for _ in range(3):  # a step that kills its process every time
            feed = ExperienceFeed(cfg, store.ready)
            assert len(await feed.count_attempts(await store.ready.delivered("trainer"))) == 2
        feed = ExperienceFeed(cfg, store.ready)
        assert await feed.count_attempts(await store.ready.delivered("trainer")) == []
        assert feed.dead_lettered == 2
        await store.close()
    asyncio.run(go())


def test_the_feed_drops_a_stale_release_whole_by_its_oldest_token():
    """A release's entries carry its oldest token's version: one long answer that spanned versions
    takes its fresher group members with it, as the store's DROP_STALE does (no group is cut)."""
    from serve_rft.config import TrainerConfig
    from serve_rft.trainer.intake.feed import ExperienceFeed

    class Store:
        acked: list = []

        async def ack(self, entries, version, state="trained"):
            Store.acked += [(e.experience.completion_id, e.experience.choice_index, state) for e in entries]
            return 0, len(entries)

    feed = ExperienceFeed(TrainerConfig(max_staleness=1), Store())
    for v in (1, 2, 3, 4):
        feed.published(v)
    def entry(cid, i, release_version):
        return RewardedExperience(experience=experience(cid, i, versions=((4, 0, 3),)), reward=1.0,
                                  stream_id=f"1-{i}", release_version=release_version)
    batch = [entry("c", i, 1) for i in range(3)] + [entry("d", 0, 4)]
    kept = asyncio.run(feed.drop_stale(batch, version=4))
    assert [b.experience.completion_id for b in kept] == ["d"]
    assert sorted(Store.acked) == [("c", 0, "stale-dropped"), ("c", 1, "stale-dropped"), ("c", 2, "stale-dropped")]

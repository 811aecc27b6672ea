"""Whole GRPO groups against a real redis-server: the store fixes a group's reward statistics when
it first releases the group and every member's ready entry carries them (late members too), so a
member's advantage does not depend on how the trainer batches; staleness and the ready-stream
bound drop a group's release whole. Before, READ delivered any ``count`` entries and the trainer
normalised over whatever members landed in a batch (the unit tests of test_algorithm.py give the
numbers), and the bound cut groups."""

import asyncio

import pytest

from serve_rft.config import TrainerConfig
from serve_rft.trainer.algorithms import get_algorithm
from serve_rft.trainer.algorithms.advantages import RunningBaseline
from tests.support.experiences import experience


def run(coro):
    return asyncio.run(coro)


def _group(cid: str, n: int, versions=None):
    """``n`` choices of completion ``cid`` (one group); choice ``i`` at versions ``versions[i]``."""
    return [experience(cid, i, versions=((versions[i] if versions else 0, 0, 3),)) for i in range(n)]


@pytest.mark.parametrize("first", [3, 1])
def test_a_group_read_across_two_batches_gets_the_whole_groups_advantages(store_factory, first):
    async def go():
        s = store_factory()
        await s.ready.ensure_group()
        await s.log_experiences(_group("chatcmpl-g", 4))
        for i, r in enumerate([1.0, 0.0, 0.0, 0.0]):
            await s.post_reward("chatcmpl-g", i, r)
        grpo, b = get_algorithm(TrainerConfig()), RunningBaseline()
        one = await s.ready.read_ready("t", first, block_ms=10, newest_first=False)
        two = await s.ready.read_ready("t", 4 - first, block_ms=10, newest_first=False,
                                       exclude={x.stream_id for x in one})
        assert len(one) + len(two) == 4
        got = {x.experience.choice_index: float(a) for part in (one, two)
               for x, a in zip(part, grpo.advantages(part, b).values)}
        assert [got[i] for i in range(4)] == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)
        assert {(x.group.size, x.group.mean) for x in one + two} == {(4, 0.25)}
        await s.close()
    run(go())


def test_a_late_member_carries_the_statistics_of_the_groups_first_release(store_factory):
    async def go():
        s = store_factory(group_timeout_s=0.0)
        await s.ready.ensure_group()
        await s.log_experiences(_group("chatcmpl-l", 3))
        await s.post_reward("chatcmpl-l", 0, 1.0)
        await s.post_reward("chatcmpl-l", 1, 0.0)  # released at once (timeout 0) with two members
        first = await s.ready.read_ready("t", 10, block_ms=10)
        assert len(first) == 2
        await s.post_reward("chatcmpl-l", 2, 0.0)  # late: released alone
        late = await s.ready.read_ready("t", 10, block_ms=10, exclude={x.stream_id for x in first})
        assert [x.experience.choice_index for x in late] == [2]
        assert late[0].group == first[0].group and late[0].group.size == 2 and late[0].group.mean == 0.5
        a = get_algorithm(TrainerConfig()).advantages(late, RunningBaseline())
        assert float(a.values[0]) == pytest.approx(-0.5 / (0.5 ** 0.5 + 1e-6), rel=1e-5)  # not a singleton's
        await s.close()
    run(go())


def test_the_ready_bound_and_the_staleness_bound_drop_a_group_whole(store_factory):
    async def go():
        s = store_factory(max_ready=3)
        # a group of 4 whose members were sampled at versions 5, 5, 2, 5, then a singleton
        await s.log_experiences(_group("chatcmpl-a", 4, versions=[5, 5, 2, 5]))
        for i in range(4):
            await s.post_reward("chatcmpl-a", i, float(i))
        await s.log_experiences(_group("chatcmpl-b", 1, versions=[5]))
        await s.post_reward("chatcmpl-b", 0, 1.0)
        c = await s.counts()  # 5 ready past a bound of 3: the 2 oldest were due, their group goes whole
        assert (c.ready, c.backlog_dropped) == (1, 4)
        assert {x.state for x in await s.choices("chatcmpl-a")} == {"backlog-dropped"}

        t = store_factory()
        await t.ready.ensure_group()
        await t.log_experiences(_group("chatcmpl-a", 4, versions=[5, 5, 2, 5]))
        for i in range(4):
            await t.post_reward("chatcmpl-a", i, float(i))
        # every entry of the release carries the group's oldest version: a bound at 3 drops all four
        assert await t.ready.drop_stale(threshold=3, version=6) == 4
        assert {x.state for x in await t.choices("chatcmpl-a")} == {"stale-dropped"}
        await s.close()
        await t.close()
    run(go())

"""Ids owned by the key that sent them, against a real redis-server: another key of the same
tenant cannot join a conversation or a group, size it or take a share of its reward; the
creating key's flow and the tenant's reward and admin keys' rewards still work (the explorer's
log, the store and the rewards API as the routes call them)."""


import pytest

from serve_rft.explorer.engine.engine_tap import RequestContext
from serve_rft.explorer.engine.experience_log import ExperienceLog, Sampled
from serve_rft.explorer.http import rewards_api
from serve_rft.explorer.http.auth import ApiKeys
from serve_rft.explorer.http.openai_request import check_against_store
from serve_rft.explorer.http.protocol import ApiError
from serve_rft.types import SamplingInfo
from tests.support.rewards_flow import NullMetrics, post, rewards

# the flat keys: every one in the tenant `default`, as the users were
KEYS = ApiKeys(["alice-key", "bob-key"], ["admin-key"], ["grader-key"])
ALICE, BOB = (KEYS.check("/v1/chat/completions", f"Bearer {k}") for k in ("alice-key", "bob-key"))
GRADER, ADMIN = (KEYS.check("/v1/rewards", f"Bearer {k}") for k in ("grader-key", "admin-key"))
SAMPLING = SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=2)


def _ctx(who, **ext) -> RequestContext:
    """The request context a route builds for a caller (`openai_routes`: tenant and owner)."""
    return RequestContext(tenant=who.tenant, owner=who.owner, **ext)


async def _request(store, who, cid: str, n: int = 1, **ext) -> None:
    """A chat request of ``who`` as a replica runs it: checked against the store, then logged."""
    await check_against_store(store, _ctx(who, **ext), 2.0)
    xlog = ExperienceLog(store, "r0", NullMetrics(), store_wait_s=2.0)
    choices = [Sampled(i, token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="length") for i in range(n)]
    assert await xlog.log(_ctx(who, **ext), cid, [1, 2, 3], choices, SAMPLING, 0) == n


def test_keys_of_one_tenant_are_owners_of_their_ids():
    assert ALICE.tenant == BOB.tenant == GRADER.tenant == "default"
    assert len({ALICE.owner, BOB.owner, GRADER.owner, ADMIN.owner}) == 4
    assert "alice-key" not in ALICE.owner


def test_another_key_cannot_join_a_conversation_nor_share_its_reward(run):
    """The issue's case: bob logs a turn under alice's conversation id. It joins a conversation
    of his own; the grader names alice's by one of its turns and her turns get 0.5 and 1.0, his
    none (on a store with tenant-only ids bob's turn took 0.5 of her reward)."""
    async def go(store):
        await _request(store, ALICE, "chatcmpl-a1", conversation_id="c")
        await _request(store, ALICE, "chatcmpl-a2", conversation_id="c")
        await _request(store, BOB, "chatcmpl-b1", conversation_id="c")
        assert await store.conversation_turns("c", "default", ALICE.owner) == ["chatcmpl-a1", "chatcmpl-a2"]
        assert await store.conversation_turns("c", "default", BOB.owner) == ["chatcmpl-b1"]
        assert await store.conversation_turns("c", "default") == []  # no tenant-wide list

        # two keys have a "c": the grader must say which, nothing is recorded until it does
        with pytest.raises(ApiError) as e:
            await post(store, {"conversation_id": "c", "reward": 1.0}, GRADER)
        assert (e.value.status, e.value.code, e.value.param) == (409, "ambiguous_conversation", "completion_id")
        assert await rewards(store, "chatcmpl-a1") == [None]
        await _request(store, ALICE, "chatcmpl-x", conversation_id="other")
        with pytest.raises(ApiError) as e:  # a turn of no conversation "c"
            await post(store, {"conversation_id": "c", "completion_id": "chatcmpl-x", "reward": 1.0}, GRADER)
        assert (e.value.status, e.value.code) == (404, "not_found")

        results = await post(store, {"conversation_id": "c", "completion_id": "chatcmpl-a2", "reward": 1.0,
                                      "discount": 0.5}, GRADER)
        assert [(r["completion_id"], r["reward"], r["status"]) for r in results] == \
            [("chatcmpl-a1", 0.5, "recorded"), ("chatcmpl-a2", 1.0, "recorded")]
        assert await rewards(store, "chatcmpl-b1") == [None]
        results = await post(store, {"conversation_id": "c", "completion_id": "chatcmpl-b1", "reward": 0.2}, ADMIN)
        assert [(r["completion_id"], r["status"]) for r in results] == [("chatcmpl-b1", "recorded")]
    run(go)


def test_a_conversation_only_one_key_has_is_rewarded_by_its_id_as_before(run):
    """A grader that names a conversation by its id alone (today's request) still rewards it when
    one key of its tenant has a conversation of that id; an admin key's own conversation is the
    one it rewards."""
    async def go(store):
        await _request(store, ALICE, "chatcmpl-a1", conversation_id="solo")
        await _request(store, ALICE, "chatcmpl-a2", conversation_id="solo")
        results = await post(store, {"conversation_id": "solo", "reward": 1.0}, GRADER)
        assert [r["status"] for r in results] == ["recorded", "recorded"]
        with pytest.raises(ApiError) as e:
            await post(store, {"conversation_id": "none", "reward": 1.0}, GRADER)
        assert (e.value.status, e.value.code) == (404, "not_found")

        await _request(store, ADMIN, "chatcmpl-adm", conversation_id="solo")
        results = await post(store, {"conversation_id": "solo", "reward": 0.5}, ADMIN)
        assert [r["completion_id"] for r in results] == ["chatcmpl-adm"]
        # a turn named: that conversation, the admin's own of the id notwithstanding
        results = await post(store, {"conversation_id": "solo", "completion_id": "chatcmpl-a1", "reward": 1.0},
                              ADMIN)
        assert [r["status"] for r in results] == ["duplicate", "duplicate"]
    run(go)


def test_another_key_cannot_fill_a_conversation(run):
    """Bob's three turns under alice's id fill his conversation, not hers."""
    async def go(store):
        await _request(store, ALICE, "chatcmpl-a1", conversation_id="c")
        for t in range(3):  # max_conversation_turns=3
            await _request(store, BOB, f"chatcmpl-b{t}", conversation_id="c")
        with pytest.raises(ApiError) as e:
            await _request(store, BOB, "chatcmpl-b3", conversation_id="c")
        assert (e.value.status, e.value.code) == (409, "conversation_full")
        await _request(store, ALICE, "chatcmpl-a2", conversation_id="c")
        assert await store.conversation_turns("c", "default", ALICE.owner) == ["chatcmpl-a1", "chatcmpl-a2"]
    run(go)


def test_another_key_cannot_join_or_resize_a_group(run):
    """The issue's case: bob's ``group_size=4096`` under alice's group id no longer blocks her
    (her requests got 409); his answer stays out of her group, which is released as her two
    answers alone, and the grader rewards it by its client id."""
    async def go(store):
        await store.ready.ensure_group()
        await _request(store, ALICE, "chatcmpl-a1", group_id="g", group_size=2)
        await _request(store, BOB, "chatcmpl-b1", group_id="g", group_size=4096)
        await _request(store, ALICE, "chatcmpl-a2", group_id="g", group_size=2)
        with pytest.raises(ApiError) as e:  # her own group keeps its size
            await check_against_store(store, _ctx(ALICE, group_id="g", group_size=3), 2.0)
        assert (e.value.status, e.value.code) == (409, "group_size_conflict")

        groups = {cid: (await store.get_experience(cid, 0)).group_id
                  for cid in ("chatcmpl-a1", "chatcmpl-a2", "chatcmpl-b1")}
        assert groups["chatcmpl-a1"] == groups["chatcmpl-a2"] != groups["chatcmpl-b1"]

        results = await post(store, {"group_id": "g", "rewards": [{"completion_id": "chatcmpl-a1", "reward": 1.0},
                                                                   {"completion_id": "chatcmpl-a2", "reward": 0.0}]},
                              GRADER)
        assert [r["status"] for r in results] == ["recorded", "recorded"]
        entries = await store.ready.read_ready("t0", 10, block_ms=10)
        assert sorted(e.experience.completion_id for e in entries) == ["chatcmpl-a1", "chatcmpl-a2"]
        shown = await rewards_api.describe_completion(store, "chatcmpl-a1", GRADER)
        assert (shown["group_id"], shown["tenant"]) == ("g", "default")
        shown = await rewards_api.describe_completion(store, "chatcmpl-b1", ADMIN)
        assert shown["group_id"] == "g"
    run(go)

"""Tenants against a real redis-server: no key reaches another tenant's completions, groups or
conversations (the explorer's log, the store and the rewards API as the routes call them)."""


import pytest

from serve_rft.explorer.engine.engine_tap import RequestContext, cache_salt
from serve_rft.explorer.engine.experience_log import ExperienceLog, Sampled
from serve_rft.explorer.http import rewards_api
from serve_rft.explorer.http.auth import ApiKeys
from serve_rft.explorer.http.openai_request import check_against_store
from serve_rft.explorer.http.protocol import ApiError
from serve_rft.types import SamplingInfo
from tests.support.rewards_flow import NullMetrics, post, rewards

KEYS = ApiKeys(["inf"], ["adm"], ["rew"], {"alice": (["a-inf"], ["a-rew"]), "mallory": (["m-inf"], ["m-rew"])})
DEFAULT, ALICE, MALLORY, ADMIN = (KEYS.check("/v1/rewards", f"Bearer {k}") for k in ("rew", "a-rew", "m-rew", "adm"))
SAMPLING = SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=2)


def _choices(n: int) -> list[Sampled]:
    return [Sampled(i, token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="length") for i in range(n)]


async def _log(store, tenant: str, cid: str, n: int = 1, **ctx) -> None:
    """Log a completion as a replica does for a request of ``tenant`` with these extensions."""
    xlog = ExperienceLog(store, "r0", NullMetrics(), store_wait_s=2.0)
    assert await xlog.log(RequestContext(tenant=tenant, **ctx), cid, [1, 2, 3], _choices(n), SAMPLING, 0) == n


def test_another_tenants_conversation_with_the_same_id_takes_none_of_its_reward(run):
    """The review's case: mallory logs a turn into alice's conversation id. Alice's reward of 1
    with discount 0.5 still gives her first turn 0.5 and her last 1.0; mallory's turn gets
    nothing (on a store without tenants it took 1.0 and alice's first turn fell to 0.25)."""
    async def go(store):
        await _log(store, "alice", "chatcmpl-a1", conversation_id="c")
        await _log(store, "alice", "chatcmpl-a2", conversation_id="c")
        await _log(store, "mallory", "chatcmpl-m1", conversation_id="c")
        results = await post(store, {"conversation_id": "c", "reward": 1.0, "discount": 0.5}, ALICE)
        assert [(r["completion_id"], r["reward"]) for r in results] == [("chatcmpl-a1", 0.5), ("chatcmpl-a2", 1.0)]
        assert await rewards(store, "chatcmpl-m1") == [None]
        # mallory's own conversation "c" is hers alone; the default tenant has none of that name
        results = await post(store, {"conversation_id": "c", "reward": 0.2}, MALLORY)
        assert [r["completion_id"] for r in results] == ["chatcmpl-m1"]
        with pytest.raises(ApiError) as e:
            await post(store, {"conversation_id": "c", "reward": 1.0}, DEFAULT)
        assert e.value.status == 404
    run(go)


def test_another_tenant_cannot_fix_the_size_of_a_group_with_the_same_id(run):
    """Mallory logs first into group "g" with size 1; alice's group "g" of size 2 is still hers:
    released together when both her answers are rewarded, as one group for the trainer."""
    async def go(store):
        await store.ready.ensure_group()
        await _log(store, "mallory", "chatcmpl-m", group_id="g", group_size=1)
        await _log(store, "alice", "chatcmpl-a1", group_id="g", group_size=2)
        await _log(store, "alice", "chatcmpl-a2", group_id="g", group_size=2)
        assert (await store.get_experience("chatcmpl-a1", 0)).group_id != (await store.get_experience(
            "chatcmpl-m", 0)).group_id  # the trainer never puts them in one group
        await post(store, {"completion_id": "chatcmpl-a1", "reward": 1.0}, ALICE)
        assert (await store.counts()).ready == 0  # held for its second member, not a singleton
        await post(store, {"completion_id": "chatcmpl-a2", "reward": 0.0}, ALICE)
        entries = await store.ready.read_ready("t0", 10, block_ms=10)
        assert sorted(e.experience.completion_id for e in entries) == ["chatcmpl-a1", "chatcmpl-a2"]
        assert {e.experience.group_id for e in entries} == {"t:alice/g"}
        shown = await rewards_api.describe_completion(store, "chatcmpl-a1", ALICE)
        assert (shown["group_id"], shown["tenant"]) == ("g", "alice")
    run(go)


def test_the_default_tenant_keeps_todays_plain_ids(run):
    """Flat keys and a service without keys: groups stored as ``u:{id}``, conversations under
    ``conv:{id}``, exactly as before tenants; and no default id can name a tenant's group."""
    async def go(store):
        await _log(store, "default", "chatcmpl-d", group_id="alice/g", conversation_id="c")
        assert (await store.get_experience("chatcmpl-d", 0)).group_id == "u:alice/g"
        assert await store.redis.lrange(store._k("conv", "c"), 0, -1) == ["chatcmpl-d"]
        await _log(store, "alice", "chatcmpl-a", group_id="g", group_size=2)
        await store.check_request("default", "u:alice/g", 5, None)  # not alice's group "g" (size 2)
    run(go)


@pytest.mark.parametrize("form", ["item", "batch", "choices", "group"])
def test_another_tenants_completion_is_not_found_in_every_reward_form_and_nothing_is_written(run, form):
    async def go(store):
        await _log(store, "alice", "chatcmpl-a", group_id="g")
        body = {"item": {"completion_id": "chatcmpl-a", "reward": 1.0},
                "batch": {"rewards": [{"completion_id": "chatcmpl-a", "reward": 1.0}]},
                "choices": {"completion_id": "chatcmpl-a", "rewards": [1.0]},
                "group": {"group_id": "g", "rewards": [{"completion_id": "chatcmpl-a", "reward": 1.0}]}}[form]
        for who in (MALLORY, DEFAULT):
            try:
                results = await post(store, body, who)
            except ApiError as e:  # a `rewards` list is refused whole
                assert (e.status, e.body()["error"]["code"]) == (404, "not_found")
            else:
                assert [(r["status_code"], r["error"]["code"]) for r in results] == [(404, "not_found")]
            assert await rewards(store, "chatcmpl-a") == [None]
        # the answer is the one a completion that never existed gets
        await _log(store, "mallory", "chatcmpl-m")
        assert (await post(store, {"completion_id": "chatcmpl-nope", "reward": 1.0}, ALICE))[0]["error"] == \
            {**(await post(store, {"completion_id": "chatcmpl-m", "reward": 1.0}, ALICE))[0]["error"],
             "message": "no choice 0 in completion 'chatcmpl-nope'"}
        assert [r["status"] for r in await post(store, body, ALICE)] == ["recorded"]
    run(go)


def test_experience_reads_reach_the_own_tenant_and_admin_reaches_all(run):
    async def go(store):
        await _log(store, "alice", "chatcmpl-a")
        await _log(store, "default", "chatcmpl-d")
        assert (await rewards_api.describe_completion(store, "chatcmpl-a", ALICE))["tenant"] == "alice"
        for who, cid in ((MALLORY, "chatcmpl-a"), (DEFAULT, "chatcmpl-a"), (ALICE, "chatcmpl-d")):
            with pytest.raises(ApiError) as e:
                await rewards_api.describe_completion(store, cid, who)
            assert e.value.status == 404 and e.value.message == f"no completion {cid!r}"
        assert (await rewards_api.describe_completion(store, "chatcmpl-a", ADMIN))["tenant"] == "alice"
        assert (await rewards_api.describe_completion(store, "chatcmpl-d", ADMIN))["tenant"] == "default"
        results = await post(store, {"completion_id": "chatcmpl-a", "reward": 1.0}, ADMIN)
        assert results[0]["status"] == "recorded"
    run(go)


def test_a_conflicting_group_size_and_a_full_conversation_are_refused_before_generation(run):
    async def go(store):
        await _log(store, "alice", "chatcmpl-a1", group_id="g", group_size=2)
        for size in (None, 2):  # the same size, or none: accepted
            await check_against_store(store, RequestContext(tenant="alice", group_id="g", group_size=size), 2.0)
        with pytest.raises(ApiError) as e:
            await check_against_store(store, RequestContext(tenant="alice", group_id="g", group_size=3), 2.0)
        assert (e.value.status, e.value.param, e.value.code) == (409, "group_size", "group_size_conflict")
        # another tenant's group of that name is its own
        await check_against_store(store, RequestContext(tenant="mallory", group_id="g", group_size=3), 2.0)

        for t in range(3):  # max_conversation_turns=3
            await check_against_store(store, RequestContext(tenant="alice", conversation_id="c"), 2.0)
            await _log(store, "alice", f"chatcmpl-c{t}", conversation_id="c")
        with pytest.raises(ApiError) as e:
            await check_against_store(store, RequestContext(tenant="alice", conversation_id="c"), 2.0)
        assert (e.value.status, e.value.param, e.value.code) == (409, "conversation_id", "conversation_full")
        await check_against_store(store, RequestContext(tenant="alice", conversation_id="c", store=False), 2.0)
        await check_against_store(store, RequestContext(tenant="mallory", conversation_id="c"), 2.0)
        # a turn that raced past the check is logged, but the list stays bounded
        await _log(store, "alice", "chatcmpl-c3", conversation_id="c")
        assert await store.conversation_turns("c", "alice") == ["chatcmpl-c0", "chatcmpl-c1", "chatcmpl-c2"]
        assert await store.num_choices("chatcmpl-c3") == 1
    run(go)


def test_the_prefix_cache_salt_holds_version_and_tenant():
    """Blocks are shared only within one (policy version, tenant); the default tenant keeps the
    version-only salt (what the engine's own probe uses)."""
    assert cache_salt(3) == cache_salt(3, "default") == "policy-v3"
    salts = {cache_salt(v, t) for v in (1, 12) for t in ("default", "alice", "2-tenant-x", "bob")}
    assert len(salts) == 8
    assert cache_salt(1, "2-tenant-x") != cache_salt(12, "x")  # digits end the version


def test_the_engine_tap_salts_each_request_with_its_tenant():
    """What reaches the engine: the request's tenant (from the route's context) in the salt of its
    prompt; a call outside a request (the probe, warm-up) gets the default tenant's."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from serve_rft.explorer.engine.engine_tap import CURRENT, EngineTap

    prompts = []
    llm = SimpleNamespace(generate=lambda prompt, *args, **kwargs: prompts.append(prompt))
    tap = EngineTap(SimpleNamespace(policy_version=4, adapter_sync=False, llm=llm), None)
    for tenant in ("alice", "default", None):
        token = CURRENT.set(RequestContext(tenant=tenant) if tenant else None)
        try:
            tap.generate({"prompt_token_ids": [1, 2]}, SamplingParams(temperature=1.0), "chatcmpl-x")
        finally:
            CURRENT.reset(token)
    assert [p["cache_salt"] for p in prompts] == ["policy-v4-tenant-alice", "policy-v4", "policy-v4"]

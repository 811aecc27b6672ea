"""What a request costs, charged to its key and its tenant (`serve_rft.buffer.usage`,
`serve_rft.explorer.http.costs`): slots in flight and a token budget against a real redis-server
(all or nothing, refusal by whose limit, settlement gives back what was not used, a dead replica's
lease runs out, a live one is renewed), this replica's share while Redis is away, the 429 / 413
answers as OpenAI error JSON, and the engine tap's count of what a request used.

Budgets refill by the Redis server's clock; rates are small enough (1 token/s against costs of tens)
that the milliseconds between two calls never change an answer."""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace

import pytest

from serve_rft.buffer.quota import QuotaBuckets
from serve_rft.buffer.usage import CostLeases, CostLimits, LocalCosts, upfront_tokens
from serve_rft.config.service import QuotasConfig
from serve_rft.explorer.http.costs import CostCheck
from serve_rft.explorer.http.protocol import ApiError
from tests.support.rewards_flow import QuotaMetrics as Metrics

NONE = CostLimits()


@pytest.fixture
def leases(redis_server):
    """``make(lease_s)``: `CostLeases` on the session's redis-server under a fresh key prefix."""
    made = []

    def make(lease_s: float = 60.0):
        buckets = QuotaBuckets(redis_server.url, f"c{uuid.uuid4().hex[:8]}", timeout_s=2.0)
        made.append(buckets)
        return CostLeases(buckets, buckets.p, lease_s)
    yield make


def _run(coro_fn):
    return asyncio.run(coro_fn())


def lid() -> str:
    return uuid.uuid4().hex


def test_upfront_cost_is_the_prompt_bytes_plus_n_answers_of_max_tokens():
    assert upfront_tokens(100, 4, 50, 1024) == 100 + 4 * 50
    assert upfront_tokens(5000, 1, None, 1024) == 1024 + 1024  # no max_tokens: the context length
    assert upfront_tokens(10, 2, 4096, 1024) == 10 + 2 * 1024  # one answer never exceeds the context


def test_a_key_at_its_slots_is_refused_another_key_of_the_tenant_is_not_and_a_settle_frees_one(leases):
    async def go():
        c = leases()
        key = CostLimits(max_in_flight=2)
        first, second = lid(), lid()
        assert (await c.admit(first, "a", "t", key, NONE, 1)).allowed
        assert (await c.admit(second, "a", "t", key, NONE, 1)).allowed
        refused = await c.admit(lid(), "a", "t", key, NONE, 1)
        assert (refused.allowed, refused.limit, refused.who) == (False, "in_flight", "key")
        assert (await c.admit(lid(), "b", "t", key, NONE, 1)).allowed  # another key: its own slots
        await c.settle(first, "a", "t", key, NONE, 0)
        assert (await c.admit(lid(), "a", "t", key, NONE, 1)).allowed
        await c.buckets.close()
    _run(go)


def test_a_tenant_at_its_slots_refuses_every_key_of_it_and_no_other_tenant(leases):
    async def go():
        c = leases()
        tenant = CostLimits(max_in_flight=2)
        assert (await c.admit(lid(), "a", "t", NONE, tenant, 1)).allowed
        assert (await c.admit(lid(), "b", "t", NONE, tenant, 1)).allowed
        refused = await c.admit(lid(), "c", "t", NONE, tenant, 1)
        assert (refused.allowed, refused.limit, refused.who) == (False, "in_flight", "tenant")
        assert (await c.admit(lid(), "d", "other", NONE, tenant, 1)).allowed
        await c.buckets.close()
    _run(go)


def test_the_budget_is_taken_up_front_and_what_was_not_used_comes_back(leases):
    async def go():
        c = leases()
        key = CostLimits(tokens_per_s=1.0, tokens_burst=100)
        first = lid()
        assert (await c.admit(first, "a", "t", key, NONE, 80)).allowed
        short = await c.admit(lid(), "a", "t", key, NONE, 30)
        assert (short.allowed, short.limit, short.who, short.too_large) == (False, "tokens", "key", False)
        assert 9.0 <= short.wait_s <= 10.0, short.wait_s  # 30 - 20 tokens at 1/s, less what refilled
        await c.settle(first, "a", "t", key, NONE, 80 - 20)  # it used 20 of its 80
        assert (await c.admit(lid(), "a", "t", key, NONE, 30)).allowed  # ~80 left
        assert (await c.admit(lid(), "a", "t", key, NONE, 30)).allowed
        assert not (await c.admit(lid(), "a", "t", key, NONE, 30)).allowed  # ~20 left
        never = await c.admit(lid(), "b", "t", key, NONE, 101)
        assert (never.allowed, never.too_large) == (False, True)
        await c.buckets.close()
    _run(go)


def test_a_use_beyond_the_estimate_puts_the_budget_into_debt(leases):
    async def go():
        c = leases()
        key = CostLimits(tokens_per_s=1.0, tokens_burst=100)
        first = lid()
        assert (await c.admit(first, "a", "t", key, NONE, 50)).allowed
        await c.settle(first, "a", "t", key, NONE, -70)  # used 120 of its 50
        refused = await c.admit(lid(), "a", "t", key, NONE, 1)
        assert not refused.allowed and 20.0 <= refused.wait_s <= 21.0, refused  # -20 + 1
        await c.buckets.close()
    _run(go)


def test_admission_is_all_or_nothing(leases):
    """The tenant's budget is short: the key's slot is not taken either."""
    async def go():
        c = leases()
        key = CostLimits(max_in_flight=1)
        tenant = CostLimits(tokens_per_s=1.0, tokens_burst=10)
        refused = await c.admit(lid(), "a", "t", key, tenant, 20)
        assert (refused.allowed, refused.who, refused.too_large) == (False, "tenant", True)
        assert await c.buckets.redis.zcard(f"{c.p}:lease:key:a") == 0
        assert (await c.admit(lid(), "a", "t", key, tenant, 5)).allowed  # the slot was free
        await c.buckets.close()
    _run(go)


def test_a_lease_nobody_renews_runs_out_and_a_renewed_one_does_not(leases):
    """A replica killed mid-request never settles: its slot comes free at the lease's deadline."""
    async def go():
        c = leases(lease_s=0.5)
        key = CostLimits(max_in_flight=1)
        dead, live = lid(), lid()
        assert (await c.admit(dead, "a", "t", key, NONE, 1)).allowed
        assert not (await c.admit(lid(), "a", "t", key, NONE, 1)).allowed
        await asyncio.sleep(0.7)
        assert (await c.admit(live, "b", "t", key, NONE, 1)).allowed
        assert (await c.admit(lid(), "a", "t", key, NONE, 1)).allowed  # a's dead lease ran out
        for _ in range(3):
            await asyncio.sleep(0.3)
            await c.renew([(live, "b", "t")])
        assert not (await c.admit(lid(), "b", "t", key, NONE, 1)).allowed  # renewed: still held
        await c.buckets.close()
    _run(go)


def test_the_replicas_share_while_redis_is_away():
    now = [0.0]
    local = LocalCosts(replicas=2, clock=lambda: now[0])
    key = CostLimits(max_in_flight=4, tokens_per_s=2.0, tokens_burst=100)
    assert local.admit("a", "t", key, NONE, 10).allowed
    assert local.admit("a", "t", key, NONE, 10).allowed
    refused = local.admit("a", "t", key, NONE, 10)
    assert (refused.allowed, refused.limit) == (False, "in_flight")  # a share of 4 / 2 slots
    local.settle("a", "t", key, NONE, 10)  # used nothing
    local.settle("a", "t", key, NONE, 0)  # used all 10
    assert local.in_flight == {}
    assert local.admit("a", "t", key, NONE, 40).allowed  # 50 - 10 = 40 of the share's 50
    short = local.admit("a", "t", key, NONE, 10)
    assert (short.allowed, short.limit) == (False, "tokens") and short.wait_s == pytest.approx(10.0)
    now[0] += 10.0
    assert local.admit("a", "t", key, NONE, 10).allowed


def _check(redis_url, metrics, **quotas):
    cfg = QuotasConfig.model_validate({"lease_s": 5.0, **quotas})
    buckets = QuotaBuckets(redis_url, f"h{uuid.uuid4().hex[:8]}", timeout_s=1.0)
    return CostCheck(cfg, buckets, buckets.p, max_model_len=64, metrics=metrics)


def test_the_check_answers_429_and_413_as_openai_errors_and_settles_once(redis_server):
    async def go():
        m = Metrics()
        check = _check(redis_server.url, m, per_key={"max_in_flight": 1},
                       per_tenant={"tokens_per_s": 1.0, "tokens_burst": 200})
        lease = await check.admit("a", "t", body_bytes=20, n=2, max_tokens=10)
        assert lease is not None and lease.charged == 40
        with pytest.raises(ApiError) as busy:
            await check.admit("a", "t", 20, 2, 10)
        assert busy.value.status == 429 and busy.value.retry_after == 1
        assert busy.value.body()["error"]["code"] == "in_flight_limit_exceeded"
        with pytest.raises(ApiError) as big:
            await check.admit("b", "t", 20, 4, 64)  # 20 + 4 x 64 > 200
        assert big.value.status == 413 and big.value.body()["error"]["code"] == "tokens_over_quota"
        await check.settle(lease, used_tokens=40)
        await check.settle(lease, used_tokens=0)  # a second settle gives nothing back
        assert await check.admit("b", "t", 20, 2, 64) is not None  # 148 of the 200 - 40 left
        with pytest.raises(ApiError) as short:
            await check.admit("c", "t", 20, 2, 64)  # 148 more: the tenant's budget is short
        e = short.value
        assert (e.status, e.body()["error"]["type"], e.body()["error"]["code"]) == (429, "tokens", "rate_limit_exceeded")
        assert e.retry_after >= 100  # (148 - 12) tokens at 1/s
        assert ("inference", "key_in_flight") in m.calls and ("inference", "tenant_tokens") in m.calls
        await check.close()
        await check.leases.buckets.close()
    asyncio.run(go())


def test_without_limits_or_without_a_key_nothing_is_charged(redis_server):
    async def go():
        m = Metrics()
        check = _check(redis_server.url, m)
        assert check.leases is None and await check.admit("a", "t", 10, 1, 10) is None
        check = _check(redis_server.url, m, per_key={"max_in_flight": 1})
        assert await check.admit("", "default", 10, 1, 10) is None  # no keys configured: no caller
        await check.leases.buckets.close()
    asyncio.run(go())


def test_redis_away_holds_callers_to_the_replicas_share(redis_server):
    async def go():
        m = Metrics()
        cfg = QuotasConfig.model_validate({"per_key": {"max_in_flight": 2}})
        buckets = QuotaBuckets("redis://127.0.0.1:1/0", "x", timeout_s=0.2)  # nothing listens
        check = CostCheck(cfg, buckets, "x", max_model_len=64, metrics=m, replicas=2)
        lease = await check.admit("a", "t", 10, 1, 10)
        assert lease.local and m.calls[-1] == ("inference", None)
        with pytest.raises(ApiError) as e:
            await check.admit("a", "t", 10, 1, 10)  # the share of 2 slots over 2 replicas is 1
        assert e.value.body()["error"]["code"] == "in_flight_limit_exceeded"
        await check.settle(lease, 5)
        assert (await check.admit("a", "t", 10, 1, 10)).local
        await buckets.close()
    asyncio.run(go())


def test_a_request_in_flight_keeps_its_slot_past_the_lease_by_renewal(redis_server):
    async def go():
        m = Metrics()
        cfg = QuotasConfig.model_validate({"per_key": {"max_in_flight": 1}, "lease_s": 5.0})
        buckets = QuotaBuckets(redis_server.url, f"r{uuid.uuid4().hex[:8]}", timeout_s=1.0)
        check = CostCheck(cfg, buckets, buckets.p, max_model_len=64, metrics=m)
        check.leases.lease_s = 0.6  # renewed every 0.2 s (the config's floor is 5 s)
        lease = await check.admit("a", "t", 10, 1, 10)
        await asyncio.sleep(1.5)
        with pytest.raises(ApiError):
            await check.admit("a", "t", 10, 1, 10)
        await check.settle(lease, 0)
        assert await check.admit("a", "t", 10, 1, 10) is not None
        await check.close()
        await buckets.close()
    asyncio.run(go())


def test_the_engine_tap_counts_the_prompt_and_every_answers_tokens():
    """Delta outputs (a stream) of two answers: the request used its prompt's 3 tokens and 5 more."""
    from serve_rft.explorer.engine.engine_tap import CURRENT, EngineTap, RequestContext

    def out(index, ids, finish=None):
        return SimpleNamespace(index=index, token_ids=ids, logprobs=[{t: SimpleNamespace(logprob=-1.0)} for t in ids],
                               finish_reason=finish, weight_versions=None)

    outputs = [SimpleNamespace(prompt_token_ids=[1, 2, 3], finished=False, outputs=[out(0, [7, 8]), out(1, [9])]),
               SimpleNamespace(prompt_token_ids=[1, 2, 3], finished=False, outputs=[out(0, [10]), out(1, [11])])]

    async def stream():
        for o in outputs:
            yield o

    async def go():
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        ctx = RequestContext()
        llm = SimpleNamespace(generate=lambda *a, **k: stream())
        tap = EngineTap(SimpleNamespace(policy_version=0, adapter_sync=False, llm=llm), None)
        token = CURRENT.set(ctx)
        try:
            params = SamplingParams(n=2, temperature=1.0, output_kind=RequestOutputKind.DELTA)
            got = [o async for o in tap.generate({"prompt_token_ids": [1, 2, 3]}, params, "chatcmpl-x")]
        finally:
            CURRENT.reset(token)
        assert len(got) == 2 and (ctx.prompt_tokens, ctx.generated_tokens) == (3, 5)
    asyncio.run(go())


def test_config_counts_cost_limits_as_limits():
    q = QuotasConfig.model_validate({"per_tenant": {"max_stored_bytes": 10}})
    assert q.limited and not QuotasConfig().limited
    assert QuotasConfig.model_validate({"per_key": {"tokens_per_s": 2.5}}).per_key.tokens_capacity == 150


def test_a_tenant_at_its_stored_bytes_is_refused_until_they_expire_and_another_tenant_is_not(redis_server):
    """alice logs past her limit: her next request gets 429 storage_quota_exceeded with the wait
    until her first bytes expire; bob logs on; once alice's experiences expire she is served."""
    from serve_rft.buffer.store import ExperienceStore
    from tests.unit.test_ledger import _log

    async def go():
        m = Metrics()
        store = ExperienceStore(redis_server.url, prefix=f"s{uuid.uuid4().hex[:8]}", reward_timeout_s=1.0,
                                trained_ttl_s=1.0, tenant_ledger=True)
        cfg = QuotasConfig.model_validate({"per_tenant": {"max_stored_bytes": 600}})
        buckets = QuotaBuckets(redis_server.url, store.p)
        check = CostCheck(cfg, buckets, store.p, max_model_len=64, metrics=m, store=store)
        await check.check_storage("alice", "inference")  # nothing kept yet
        await _log(store, "alice", "chatcmpl-a", n=4)  # ~800 bytes with the overheads
        with pytest.raises(ApiError) as e:
            await check.check_storage("alice", "inference")
        err = e.value
        assert (err.status, err.body()["error"]["code"], err.body()["error"]["type"]) == \
            (429, "storage_quota_exceeded", "storage")
        assert err.retry_after == 1 and m.calls[-1] == ("inference", "tenant_storage")
        await check.check_storage("bob", "inference")
        await _log(store, "bob", "chatcmpl-b", n=1)
        await asyncio.sleep(1.2)  # alice's experiences expired (reward_timeout_s)
        await check.check_storage("alice", "rewards")
        await store.close()
        await buckets.close()
    asyncio.run(go())


def test_a_tenants_own_limits_replace_the_defaults_for_its_keys_alone(redis_server):
    from serve_rft.config.service import ServiceConfig

    async def go():
        service = ServiceConfig.model_validate({"tenants": {"carol": {
            "api_keys": ["c1"], "key_quota": {"max_in_flight": 1}, "quota": {"max_stored_bytes": 10}}}})
        buckets = QuotaBuckets(redis_server.url, f"o{uuid.uuid4().hex[:8]}", timeout_s=1.0)
        check = CostCheck(service.quotas, buckets, buckets.p, max_model_len=64, metrics=Metrics(),
                          tenants=service.tenants)
        assert await check.admit("c1", "carol", 10, 1, 10) is not None
        with pytest.raises(ApiError):
            await check.admit("c1", "carol", 10, 1, 10)
        assert await check.admit("d1", "default", 10, 1, 10) is None  # the defaults charge nothing
        assert check.limits("carol").max_stored_bytes == 10 and check.limits("default").max_stored_bytes == 0
        await buckets.close()
    asyncio.run(go())


def test_the_replicas_share_never_lets_more_than_its_share_in_flight_or_loses_a_slot():
    """Hypothesis, on a simulated clock: any sequence of admissions, settlements (of what was
    admitted, with any use) and waits keeps every caller's requests in flight within its share
    (at least one), never below zero, and once every admitted request is settled every slot is
    free; a token level never exceeds the share's budget."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    steps = st.lists(st.one_of(
        st.tuples(st.just("admit"), st.sampled_from(["a", "b"]), st.integers(1, 80)),
        st.tuples(st.just("settle"), st.integers(0, 50), st.integers(0, 200)),
        st.tuples(st.just("wait"), st.floats(0, 30), st.just(0))), max_size=60)

    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @given(steps, st.integers(1, 4))
    def check(program, replicas):
        now = [0.0]
        local = LocalCosts(replicas, clock=lambda: now[0])
        key = CostLimits(max_in_flight=3, tokens_per_s=1.0, tokens_burst=100)
        tenant = CostLimits(max_in_flight=4, tokens_per_s=2.0, tokens_burst=150)
        held = []
        for op, x, y in program:
            if op == "admit":
                if local.admit(x, "t", key, tenant, y).allowed:
                    held.append((x, y))
            elif op == "settle" and held:
                who, charged = held.pop(x % len(held))
                local.settle(who, "t", key, tenant, charged - y)
            elif op == "wait":
                now[0] += x
            for who, lim in (("key:a", key), ("key:b", key), ("tenant:t", tenant)):
                assert 0 <= local.in_flight.get(who, 0) <= max(1, lim.max_in_flight // replicas)
                if who in local._levels:
                    assert local._levels[who][0] <= lim.tokens_burst / replicas + 1e-9
        for who, charged in held:
            local.settle(who, "t", key, tenant, charged)
        assert local.in_flight == {}

    check()

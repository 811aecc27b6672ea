"""TRAINER_DRIVEN style with the `keep` drain mode: requests in flight across a sync continue
on the new weights, and their experiences record the policy version of every token."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.support.load import get_status
from tests.support.stack import stack_fixture
from tests.support.stack_checks import ADMIN, check_training_rolls_new_versions, read_experience

pytestmark = pytest.mark.integration


stack = stack_fixture("run-keep", ["synchronizer.sync_style=trainer_driven", "synchronizer.drain_mode=keep",
                                   "trainer.max_staleness=1", "explorer.tool_strict_level=parameter",
                                   "service.admin_keys=[x]", "service.api_keys=[inference-key]",
                                   "service.reward_keys=[reward-key,quota-hog-key]",
                                   "service.tenants={alice: {api_keys: [alice-key], reward_keys: [alice-grader]}}",
                                   # the rewards byte quota: 1 MiB at once, 256 KiB/s per key; the other
                                   # tests' reward bodies (under 1 KB each, 6 users at most: tens of KB/s) never reach it
                                   "service.quotas.rewards.bytes_per_s=262144",
                                   "service.quotas.rewards.bytes_burst=1048576"])


def test_keep_mode_requests_span_versions_and_none_fail(stack):
    long_ids: list[str] = []
    failures: list[str] = []

    async def long_user(client, stop):
        while not stop.is_set():
            try:
                comp = await client.chat.completions.create(
                    model="serve-rft", messages=[{"role": "user", "content": "a long one"}],
                    max_tokens=400, temperature=1.0)
                long_ids.append(comp.id)
            except openai.APIError as e:
                failures.append(repr(e))

    async def go():
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=300)
        stop = asyncio.Event()
        tasks = [asyncio.create_task(long_user(client, stop)) for _ in range(4)]
        await asyncio.to_thread(check_training_rolls_new_versions, stack)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(long_ids) < 8:
            await asyncio.sleep(1)
        stop.set()
        await asyncio.gather(*tasks)
        await client.close()

    asyncio.run(go())
    assert not failures, failures[:5]
    spans = [asyncio.run(read_experience(stack, cid, 0)).token_versions for cid in long_ids]
    multi = [s for s in spans if len({v for v, _, _ in s}) > 1]
    assert multi, f"no request spanned a sync: {spans[:5]}"
    for s in multi:  # contiguous spans covering every token, versions increasing
        assert s[0][1] == 0 and all(a[2] == b[1] for a, b in zip(s, s[1:]))
        assert [v for v, _, _ in s] == sorted(v for v, _, _ in s)
    st = get_status(stack.url, ADMIN)
    assert st["sync_style"] == "trainer_driven"


def test_max_staleness_drops_old_experiences_and_status_shows_staleness(stack):
    """With max_staleness=1 nothing older than one version behind is trained; what was dropped
    is counted; `/v1/status` shows the staleness distribution of what was trained."""
    st = get_status(stack.url, ADMIN)
    trained = {int(k): v for k, v in st["trainer"]["staleness_trained"].items()}
    assert trained and sum(trained.values()) > 0, st["trainer"]
    assert max(trained) <= 1, trained
    assert st["experiences"]["stale_dropped"] == st["trainer"]["stale_dropped"]


def test_api_keys_inference_key_serves_reward_and_admin_keys_reward(stack):
    """This stack runs with keys: no key or a wrong one -> 401; the inference key may chat but not
    post rewards or read status (403); the reward key may post rewards and read experiences and
    nothing else; the admin key may do everything, the API document included; /health stays open."""
    u = stack.url
    body = {"messages": [{"role": "user", "content": "k"}], "max_tokens": 2}
    r = httpx.post(f"{u}/v1/chat/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(f"{u}/v1/chat/completions", json=body,
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    inference = {"Authorization": "Bearer inference-key"}
    client = openai.OpenAI(base_url=f"{u}/v1", api_key="inference-key", max_retries=0)
    comp = client.chat.completions.create(model="serve-rft", **body)
    reward = {"completion_id": comp.id, "reward": 1.0}
    r = httpx.post(f"{u}/v1/rewards", json=reward, headers=inference)
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope", r.text
    assert "Missing scope: rewards" in r.json()["error"]["message"]
    assert httpx.get(f"{u}/v1/status", headers=inference).status_code == 403
    rewarder = {"Authorization": "Bearer reward-key"}
    assert httpx.post(f"{u}/v1/chat/completions", json=body, headers=rewarder).status_code == 403
    assert httpx.get(f"{u}/v1/status", headers=rewarder).status_code == 403
    assert httpx.post(f"{u}/v1/sync/rollback", json={}, headers=rewarder).status_code == 403
    assert httpx.post(f"{u}/v1/rewards", json=reward, headers=rewarder).status_code == 200
    assert httpx.get(f"{u}/v1/experiences/{comp.id}", headers=rewarder).status_code == 200
    assert httpx.get(f"{u}/v1/experiences/{comp.id}", headers=inference).status_code == 403
    assert httpx.post(f"{u}/v1/rewards", json=reward, headers=ADMIN).status_code == 200
    assert httpx.post(f"{u}/v1/sync/rollback", json={}).status_code == 401  # before its body is read
    assert httpx.get(f"{u}/openapi.json").status_code == 401
    assert httpx.get(f"{u}/openapi.json", headers=rewarder).status_code == 403
    assert httpx.get(f"{u}/openapi.json", headers=ADMIN, timeout=60).status_code == 200
    assert httpx.get(f"{u}/health").status_code == 200


def test_a_tenant_reaches_only_its_own_completions_and_conversations(stack):
    """Tenant alice and the default tenant (the flat keys) use the same conversation_id: each
    grader's conversation reward covers its own turns only; another tenant's completion is 404 to
    a grader (reward or read, nothing recorded), the admin key reads both."""
    u = stack.url
    clients = {t: openai.OpenAI(base_url=f"{u}/v1", api_key=k, max_retries=0, timeout=120)
               for t, k in (("default", "inference-key"), ("alice", "alice-key"))}
    graders = {"default": {"Authorization": "Bearer reward-key"}, "alice": {"Authorization": "Bearer alice-grader"}}
    conv = f"shared-{time.time_ns()}"
    ids = {t: c.chat.completions.create(model="serve-rft", messages=[{"role": "user", "content": "t"}], max_tokens=2,
                                        extra_body={"conversation_id": conv}).id for t, c in clients.items()}
    for me, other in (("alice", "default"), ("default", "alice")):
        r = httpx.get(f"{u}/v1/experiences/{ids[other]}", headers=graders[me])
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        r = httpx.post(f"{u}/v1/rewards", json={"completion_id": ids[other], "reward": 1.0}, headers=graders[me])
        assert r.status_code == 404, r.text
        assert httpx.get(f"{u}/v1/experiences/{ids[me]}", headers=graders[me]).json()["tenant"] == me
    r = httpx.post(f"{u}/v1/rewards", json={"conversation_id": conv, "reward": 0.5}, headers=graders["alice"])
    assert r.status_code == 200 and [d["completion_id"] for d in r.json()["data"]] == [ids["alice"]], r.text
    for t, cid in ids.items():
        shown = httpx.get(f"{u}/v1/experiences/{cid}", headers=ADMIN).json()
        assert shown["tenant"] == t and shown["choices"][0]["reward"] == (0.5 if t == "alice" else None)


def test_tool_strict_level_parameter_pins_arguments_of_tools_not_marked_strict(stack):
    """explorer.tool_strict_level reaches vLLM's renderer: at `parameter` a forced call of a tool
    without OpenAI's `strict` flag still follows its parameters' schema (at the default `auto`
    vLLM pins only the call envelope, and the random model wrote `"arguments": null`)."""
    import json

    from serve_rft.demo.agent import CALL_TOKENS, CITIES, TOOLS

    loose = [{**TOOLS[0], "function": {k: v for k, v in TOOLS[0]["function"].items() if k != "strict"}}]
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="inference-key", max_retries=0, timeout=300)
    for _ in range(3):  # a call may run out of tokens in whitespace (CALL_TOKENS); try again
        comp = client.chat.completions.create(
            model="serve-rft", messages=[{"role": "user", "content": "weather in Rome?"}], tools=loose,
            tool_choice={"type": "function", "function": {"name": "weather"}}, max_tokens=CALL_TOKENS,
            temperature=1.0)
        if comp.choices[0].finish_reason != "length":
            break
    assert comp.choices[0].finish_reason == "stop", comp
    assert json.loads(comp.choices[0].message.tool_calls[0].function.arguments)["city"] in CITIES


def test_a_key_over_its_byte_quota_gets_429_with_retry_after_while_another_key_is_served(stack):
    """Per-key quotas (service.quotas): a reward key that sends 800 KB bodies empties its byte
    bucket (1 MiB, 256 KiB/s) on the second; that one gets 429 rate_limit_exceeded with a
    Retry-After of whole seconds before its body is parsed (the chunked-body path: charged as
    read), the admin key is served meanwhile (its own bucket), and after Retry-After the first
    key is served again."""
    u = stack.url
    hog = {"Authorization": "Bearer quota-hog-key"}
    padded = b'{"rewards": [], "pad": "' + b"a" * 800_000 + b'"}'
    # sent chunked (an iterator: no Content-Length), so the replica reads each body whole before
    # charging it and a refusal never leaves an unread body on the connection
    first = httpx.post(f"{u}/v1/rewards", content=iter([padded]), headers=hog, timeout=60)
    assert first.status_code in (400, 422), first.text  # charged, then refused by the route
    r = httpx.post(f"{u}/v1/rewards", content=iter([padded]), headers=hog, timeout=60)
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "rate_limit_exceeded" and err["type"] == "bytes", err
    wait = int(r.headers["retry-after"])
    assert 1 <= wait <= 4, wait  # ~550 KB short at 256 KiB/s
    client = openai.OpenAI(base_url=f"{u}/v1", api_key="inference-key", max_retries=0, timeout=300)
    comp = client.chat.completions.create(model="serve-rft", messages=[{"role": "user", "content": "q"}],
                                          max_tokens=2, n=2)
    r = httpx.post(f"{u}/v1/rewards", json={"completion_id": comp.id, "choice_index": 0, "reward": 1.0},
                   headers=ADMIN)
    assert r.status_code == 200, r.text
    time.sleep(wait)
    r = httpx.post(f"{u}/v1/rewards", json={"completion_id": comp.id, "choice_index": 1, "reward": 0.0},
                   headers=hog)
    assert r.status_code == 200, r.text

"""The whole loop on real parts: serve -> log -> reward -> train -> rolling sync."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.support.fuzz import fuzz_seed as seeded
from tests.support.load import get_status
from tests.support.stack_checks import (ADMIN, check_served_logprobs, check_training_rolls_new_versions,
                                         open_store, read_experience, until_every_replica_is_routed_to)

pytestmark = pytest.mark.integration


def _logprob_gap(stack, exp) -> float:
    """max |behaviour logprob - the trainer's recomputation| over ``exp``'s response tokens, with
    the weights of the one version that produced them (version 0: the initial model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from serve_rft.trainer.policy.token_logprobs import response_logprobs
    from serve_rft.weights.folders import version_dir

    (version,) = {v for v, _, _ in exp.token_versions}
    path = version_dir(stack.run_dir / "checkpoints", version) if version else stack.model_path
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    t = exp.sampling.temperature or 1.0
    with torch.no_grad():
        lp, _ = response_logprobs(model, [exp.prompt_token_ids], [exp.response_token_ids], [t],
                                  top_ps=[exp.sampling.top_p])
    return float((lp[0, : len(exp.response_token_ids)] - torch.tensor(exp.behaviour_logprobs)).abs().max())


def test_a_tool_using_agent_runs_through_the_openai_sdk_and_its_conversation_is_trained(stack):
    """serve_rft.demo.agent through the unchanged openai SDK, sync and async, streamed and not (one
    episode each): turn 1 a forced call of the weather tool (message.tool_calls), run client-side,
    sent back as an assistant tool_calls turn and a tool message; turn 2 a text answer; turn 3 a
    user follow-up and its answer; one reward for the conversation. Each turn's experience holds
    exactly the ids the engine consumed and sampled (return_token_ids); the tool's output and the
    user's follow-up lie in the prompts (the trainer's loss covers only response ids); turn 1,
    sampled under the tool's grammar, is left out of the loss and counted (constrained); turns 2
    and 3 are trained, and their behaviour logprobs are the trainer's recomputation."""
    import uuid

    from transformers import AutoTokenizer

    from serve_rft.demo.agent import CITIES, FOLLOW_UP, post_reward, run_episode, run_episode_async

    u = stack.url
    before = get_status(u, ADMIN)["trainer"]["constrained"]
    sync = openai.OpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0)
    episodes = [run_episode(sync, f"agent-{uuid.uuid4().hex}", "Paris"),
                run_episode(sync, f"agent-{uuid.uuid4().hex}", "Rome", stream=True)]

    async def on_async_client():
        client = openai.AsyncOpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0)
        try:
            return await asyncio.gather(run_episode_async(client, f"agent-{uuid.uuid4().hex}", "Oslo", stream=True),
                                        run_episode_async(client, f"agent-{uuid.uuid4().hex}", "Lima", stream=False))
        finally:
            await client.close()

    episodes += asyncio.run(on_async_client())
    for e in episodes:
        assert e.tool_call["name"] == "weather" and e.tool_call["id"] and len(e.turns) == 3, e
        assert json.loads(e.tool_call["arguments"])["city"] in CITIES  # the grammar of the tool's parameters
        assert e.turns[0].finish_reason == "stop"  # a named tool_choice finishes "stop", as OpenAI's
        assert post_reward(u, e, api_key="x")["data"][0]["status"] == "recorded"

    tok = AutoTokenizer.from_pretrained(str(stack.model_path))
    for e in episodes:  # token-exact, streamed or not, sync or async: what the client saw is what is stored
        exps = [asyncio.run(read_experience(stack, t.completion_id, 0)) for t in e.turns]
        for i, (turn, exp) in enumerate(zip(e.turns, exps)):
            assert turn.token_ids and exp.prompt_token_ids == turn.prompt_token_ids, (e.conversation_id, i)
            assert exp.response_token_ids == turn.token_ids, (e.conversation_id, i)
            assert bool(exp.sampling.structured_outputs) == (i == 0)  # turn 1 under the tool's grammar
        # each later prompt extends the earlier one; the tool's output (turn 2) and the user's
        # follow-up (turn 3) are prompt tokens
        for a, b in ((0, 1), (1, 2)):
            assert e.turns[b].prompt_token_ids[:len(e.turns[a].prompt_token_ids)] == e.turns[a].prompt_token_ids
        assert e.tool_output in tok.decode(e.turns[1].prompt_token_ids)
        assert FOLLOW_UP in tok.decode(e.turns[2].prompt_token_ids[len(e.turns[1].prompt_token_ids):])
    for e in episodes:
        for t in e.turns[1:]:
            final = asyncio.run(read_experience(stack, t.completion_id, 0))
            if len({v for v, _, _ in final.token_versions}) == 1:  # a turn spanning a sync has no one checkpoint
                assert _logprob_gap(stack, final) < 1e-3, (e.conversation_id, t.completion_id)

    async def linked(cid):
        store = open_store(stack)
        try:
            return await store.conversation_turns(cid)
        finally:
            await store.close()

    for e in episodes:  # the conversation, in order
        assert asyncio.run(linked(e.conversation_id)) == [t.completion_id for t in e.turns]

    def states(e):
        return [httpx.get(f"{u}/v1/experiences/{t.completion_id}").json()["choices"][0]["state"] for t in e.turns]

    deadline = time.monotonic() + 240
    while any(st in ("pending", "rewarded", "ready") for e in episodes for st in states(e)):
        if time.monotonic() > deadline:
            pytest.fail(f"agent turns not trained: {[states(e) for e in episodes]}")
        time.sleep(1.0)
    assert [states(e) for e in episodes] == [["constrained", "trained", "trained"]] * 4
    assert get_status(u, ADMIN)["trainer"]["constrained"] >= before + 4

    from typer.testing import CliRunner

    from serve_rft.cli import cli
    run = CliRunner().invoke(cli, ["agent", "--url", u, "--episodes", "1", "--api-key", "x", "--stream"])
    assert run.exit_code == 0, run.output
    line = json.loads(run.output.strip().splitlines()[-1])
    assert line["tool_call"]["name"] == "weather" and len(line["turns"]) == 3


def test_health_models_status(stack):
    assert httpx.get(f"{stack.url}/health").status_code == 200
    models = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == ["serve-rft"]
    st = get_status(stack.url)
    assert len(st["replicas"]) == 2
    assert {r["state"] for r in st["replicas"]} <= {"RUNNING", "REQUIRE_SYNC"}
    assert set(st["experiences"]) >= {"pending", "ready", "trained"}


def test_non_streaming_response_matches_logged_experience(stack):
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    raw = client.chat.completions.with_raw_response.create(
        model="serve-rft", messages=messages, max_tokens=12, n=2, logprobs=True, top_logprobs=2,
        temperature=0.9, seed=7)
    comp = raw.parse()
    replica = raw.headers["x-serve-rft-replica"]
    version = int(raw.headers["x-serve-rft-policy-version"])
    assert comp.system_fingerprint == f"policy-v{version}"
    assert len(comp.choices) == 2
    tok = AutoTokenizer.from_pretrained(str(stack.model_path))
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    for choice in comp.choices:
        exp = asyncio.run(read_experience(stack, comp.id, choice.index))
        assert exp is not None, "experience must be logged before the response returns"
        assert exp.replica_id == replica and exp.group_id == comp.id
        assert exp.prompt_token_ids == list(prompt_ids)
        assert len(exp.response_token_ids) == len(choice.logprobs.content)
        assert exp.behaviour_logprobs == pytest.approx([c.logprob for c in choice.logprobs.content])
        assert all(len(c.top_logprobs) == 2 for c in choice.logprobs.content)
        # vLLM leaves out an answer's incomplete last UTF-8 character
        assert tok.decode(exp.response_token_ids, skip_special_tokens=True).rstrip("\ufffd") == choice.message.content
        assert exp.min_version == version
        assert exp.sampling.temperature == 0.9 and exp.sampling.seed == 7
        assert exp.finish_reason == choice.finish_reason
    assert comp.usage.completion_tokens == sum(len(c.logprobs.content) for c in comp.choices)


def test_streaming_with_async_client_is_logged(stack):
    async def go():
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="x")
        stream = await client.chat.completions.create(
            model="serve-rft", messages=[{"role": "user", "content": "stream please"}], max_tokens=10,
            n=2, stream=True, stream_options={"include_usage": True}, logprobs=True)
        texts, cid, usage, finishes = ["", ""], None, None, {}
        async for chunk in stream:
            cid = chunk.id
            usage = chunk.usage or usage
            for ch in chunk.choices:
                texts[ch.index] += ch.delta.content or ""
                if ch.finish_reason:
                    finishes[ch.index] = ch.finish_reason
        await client.close()
        return cid, texts, usage, finishes

    cid, texts, usage, finishes = asyncio.run(go())
    assert cid.startswith("chatcmpl-") and set(finishes) == {0, 1}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(stack.model_path))
    n_tokens = 0
    for i in (0, 1):
        exp = asyncio.run(read_experience(stack, cid, i))
        # vLLM leaves out an answer's incomplete last UTF-8 character (streamed or not)
        assert tok.decode(exp.response_token_ids, skip_special_tokens=True).rstrip("\ufffd") == texts[i]
        assert len(exp.behaviour_logprobs) == len(exp.response_token_ids)
        n_tokens += len(exp.response_token_ids)
    assert usage.completion_tokens == n_tokens

    # the sync client streams too
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x")
    chunks = list(client.chat.completions.create(
        model="serve-rft", messages=[{"role": "user", "content": "x"}], max_tokens=4, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_the_openai_surface_is_vllms_and_every_answer_is_logged_token_exact(stack):
    """Served by vLLM's own serving classes: streamed and non-streamed greedy text are equal (a
    tail that ends mid-character included); a forced tool call comes back as message.tool_calls
    with finish_reason tool_calls and its experience carries the grammar (left out of the loss);
    /v1/completions takes token ids or text, streamed or not, and returns the ids it sampled
    (return_token_ids), which are exactly the experience's, and its answers are rewarded and
    trained; /v1/models/{id}; untrainable fields are refused."""
    u = stack.url
    client = openai.OpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0)
    for content in ("a" * 300, "hello", "x y z"):
        kw = dict(model="serve-rft", messages=[{"role": "user", "content": content}], max_tokens=24, temperature=0)
        whole = client.chat.completions.create(**kw).choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                           if c.choices)
        assert streamed == whole, (content[:10], streamed, whole)

    tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
    comp = client.chat.completions.create(model="serve-rft", messages=[{"role": "user", "content": "1+2?"}],
                                          tools=tools, tool_choice="required", max_tokens=48, temperature=0)
    choice = comp.choices[0]
    if choice.finish_reason != "length":  # a random model may run out of tokens inside the JSON
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "add"
        json.loads(choice.message.tool_calls[0].function.arguments)
    exp = asyncio.run(read_experience(stack, comp.id, 0))
    assert exp.sampling.structured_outputs, exp.sampling  # sampled under the tool-call grammar

    prompt = [5, 6, 7, 8]
    r = httpx.post(f"{u}/v1/completions", json={"model": "serve-rft", "prompt": prompt, "max_tokens": 6,
                                                "return_token_ids": True, "temperature": 0.7}).json()
    exp = asyncio.run(read_experience(stack, r["id"], 0))
    assert exp.prompt_token_ids == prompt == r["choices"][0]["prompt_token_ids"]
    assert exp.response_token_ids == r["choices"][0]["token_ids"] and len(exp.behaviour_logprobs) == 6
    # a streamed text completion on the openai SDK: logged token-exact too; both are trained like chat
    chunks = list(client.completions.create(model="serve-rft", prompt="hello there", max_tokens=6, temperature=0.7,
                                            stream=True, extra_body={"return_token_ids": True, "ignore_eos": True}))
    streamed_ids = [t for c in chunks for ch in c.choices for t in (getattr(ch, "token_ids", None) or [])]
    streamed_prompt = [t for c in chunks for ch in c.choices for t in (getattr(ch, "prompt_token_ids", None) or [])]
    sexp = asyncio.run(read_experience(stack, chunks[0].id, 0))
    assert sexp.response_token_ids == streamed_ids and len(streamed_ids) == 6, (streamed_ids, sexp)
    assert sexp.prompt_token_ids == streamed_prompt and streamed_prompt
    for cid in (r["id"], chunks[0].id):
        got = httpx.post(f"{u}/v1/rewards", json={"completion_id": cid, "reward": 0.5}).json()
        assert got["data"][0]["status"] == "recorded", got

    def state(cid):
        return httpx.get(f"{u}/v1/experiences/{cid}").json()["choices"][0]["state"]

    deadline = time.monotonic() + 180
    while {state(r["id"]), state(chunks[0].id)} != {"trained"}:
        assert time.monotonic() < deadline, (state(r["id"]), state(chunks[0].id))
        time.sleep(1.0)

    assert httpx.get(f"{u}/v1/models/serve-rft").json()["id"] == "serve-rft"
    assert httpx.get(f"{u}/v1/models/gpt-4o").status_code == 404
    r = httpx.post(f"{u}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "top_k": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    assert "top_k is not supported by this service" in r.json()["error"]["message"]
    # a field vLLM does not know: 400 as OpenAI answers it (vLLM would ignore it)
    r = httpx.post(f"{u}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                     "service_tier": "auto"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter", r.text
    # OpenAI's user and metadata are kept with the experiences (through the SDK's own parameters)
    comp = client.chat.completions.create(model="serve-rft", messages=[{"role": "user", "content": "m"}],
                                          max_tokens=2, user="u-7", metadata={"tenant": "t1"})
    exp = asyncio.run(read_experience(stack, comp.id, 0))
    assert (exp.user, exp.metadata) == ("u-7", {"tenant": "t1"})


def test_the_responses_api_is_served_logged_token_exact_and_rewarded_by_its_id(stack):
    """/v1/responses through the openai SDK (``client.responses.create``, what the OpenAI Agents
    SDK calls), plain and streamed: vLLM's response object, the policy version header, one
    experience per answer under the ``resp_...`` id (its tokens the answer's text), rewarded by
    that id; what needs response state the engine would keep is a 400 with the reason. (A route
    answering 404 fails it at the first call; the id the tap logs under is checked by the
    experience read and the reward, and its mapping from vLLM's ``resp_..._0`` by
    ``test_openai_request.py``, which fails without it.)"""
    u = stack.url
    client = openai.OpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0)
    raw = client.responses.with_raw_response.create(model="serve-rft", input="hello", max_output_tokens=8,
                                                    temperature=0.7, extra_body={"conversation_id": "resp-conv"})
    resp = raw.parse()
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.output_text, resp
    assert int(raw.headers["x-serve-rft-policy-version"]) >= 0
    exp = asyncio.run(read_experience(stack, resp.id, 0))
    assert 0 < len(exp.response_token_ids) <= 8 and len(exp.behaviour_logprobs) == len(exp.response_token_ids)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(stack.model_path))
    assert tokenizer.decode(exp.response_token_ids, skip_special_tokens=True).rstrip("\ufffd") == resp.output_text  # a cut character: vLLM holds it back
    events = list(client.responses.create(model="serve-rft", input=[{"role": "user", "content": "x y"}],
                                          instructions="Answer briefly.", max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
    streamed = events[-1].response
    sexp = asyncio.run(read_experience(stack, streamed.id, 0))
    assert tokenizer.decode(sexp.response_token_ids, skip_special_tokens=True).rstrip("\ufffd") == streamed.output_text
    for rid in (resp.id, streamed.id):
        got = httpx.post(f"{u}/v1/rewards", json={"completion_id": rid, "reward": 0.5}).json()
        assert got["data"][0]["status"] == "recorded", got
    for field, value in (("previous_response_id", resp.id), ("background", True)):
        r = httpx.post(f"{u}/v1/responses", json={"model": "serve-rft", "input": "hi", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    # a schemathesis case: an earlier assistant turn with no content (vLLM's reader raised IndexError)
    turn = {"type": "message", "id": "", "role": "assistant", "status": "completed", "content": []}
    r = httpx.post(f"{u}/v1/responses", json={"model": "serve-rft", "input": [turn]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.content", r.text


def test_bad_input_gets_openai_errors(stack):
    u = stack.url
    r = httpx.post(f"{u}/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{u}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 1000})
    assert r.status_code == 400 and "n" in r.json()["error"]["message"]
    r = httpx.post(f"{u}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    r = httpx.post(f"{u}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 5})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]  # vLLM's answer
    client = openai.OpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="serve-rft", messages=[{"role": "user", "content": "x"}],
                                       temperature=5)
    comp = client.chat.completions.create(model="serve-rft", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3)
    post = lambda body: httpx.post(f"{u}/v1/rewards", json=body)  # noqa: E731
    assert post({"completion_id": "chatcmpl-nope", "reward": 1}).status_code == 404
    assert post({"completion_id": comp.id, "choice_index": 3, "reward": 1}).status_code == 404
    assert post({"completion_id": comp.id, "reward": "high"}).status_code == 422
    r = httpx.post(f"{u}/v1/rewards", content=json.dumps({"completion_id": comp.id, "reward": float("nan")}))
    assert r.status_code == 422 and r.json()["error"]["param"] == "reward"
    assert post({"completion_id": comp.id, "reward": 0.25}).status_code == 200
    assert post({"completion_id": comp.id, "reward": 0.25}).json()["data"][0]["status"] == "duplicate"
    r = post({"completion_id": comp.id, "reward": 0.5})
    assert r.status_code == 409 and r.json()["error"]["code"] == "conflict"
    # hostile bodies: each a clear 4xx, never a 5xx and never accepted
    msg = [{"role": "user", "content": "x"}]
    chat = lambda **kw: httpx.post(f"{u}/v1/chat/completions", timeout=60, **kw)  # noqa: E731
    assert chat(content=b"[" * 100_000).status_code == 400
    assert chat(content=b'{"messages": [], "seed": ' + b"9" * 5000 + b"}").status_code == 400
    r = chat(json={"messages": msg, "max_tokens": 1, "seed": 2**64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    r = chat(json={"messages": msg, "max_tokens": 1, "stream": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    assert chat(json={"messages": [{"role": "tool"}], "stop": ""}).status_code == 400  # a schemathesis case
    r = chat(json={"messages": msg, "max_tokens": 1, "model": "gpt-4o"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"  # vLLM's NotFoundError
    assert chat(content=b" " * (8 * 1024 * 1024 + 1)).status_code == 413
    r = httpx.post(f"{u}/v1/rewards", content=b'{"completion_id": "%s", "reward": 1.0, "info": {"x": NaN}}'
                   % comp.id.encode())
    assert r.status_code == 422 and r.json()["error"]["param"] == "info"
    # OpenAI's store=false: answered, never logged (so never trained on)
    r = chat(json={"messages": msg, "max_tokens": 2, "store": False})
    assert r.status_code == 200
    assert httpx.get(f"{u}/v1/experiences/{r.json()['id']}").status_code == 404
    # the service still serves after all of that
    assert httpx.get(f"{u}/health").status_code == 200


def test_training_rolls_new_versions_across_replicas_without_failures(stack):
    """Load + rewards until two trainer versions reached every replica; no request fails and
    at least one replica is in rotation at every recorded state change, once each replica has
    been routed to (`until_every_replica_is_routed_to`). (That a replica out of rotation refuses
    requests and HAProxy re-sends them is shown deterministically by
    test_a_drained_replica_refuses_and_haproxy_resends_every_request.)"""
    check_training_rolls_new_versions(stack)


def test_a_drained_replica_refuses_and_haproxy_resends_every_request(stack):
    """The drain path, held open on purpose: an operator drains one replica (the same refusal a
    sync's drain uses); while it is drained every request still succeeds, all are answered by the
    other replica, and the drained one refused some (HAProxy's leastconn prefers the idle, drained
    replica and re-sends each refusal). A request too large for HAProxy to re-send is served by
    the drained replica, not refused. Draining the last replica in rotation is refused (409)."""
    u = stack.url
    until_every_replica_is_routed_to(stack)  # a warming replica is not in rotation: no 409 for it
    deadline = time.monotonic() + 120
    while True:  # both replicas serving (the trainer may still be publishing: one may be syncing)
        st = get_status(u, ADMIN)
        running = sorted(r["id"] for r in st["replicas"] if r["state"] == "RUNNING")
        if len(running) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    a, b = running[:2]
    before = {r["id"]: r["refused"] for r in st["replicas"]}
    deadline = time.monotonic() + 120
    while True:  # 409 while b syncs (the trainer may still publish): b must be serving first
        r = httpx.post(f"{u}/v1/sync/replicas/{a}/drain", json={"drained": True}, headers=ADMIN)
        if r.status_code != 409 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    try:
        assert httpx.post(f"{u}/v1/sync/replicas/{b}/drain", json={"drained": True},
                          headers=ADMIN).status_code == 409  # b is the last one serving

        def refused_by_a() -> int:
            st = get_status(u, ADMIN)
            return {x["id"]: x["refused"] for x in st["replicas"]}[a] - before[a]

        async def burst(k: int = 8):  # concurrent: leastconn spreads them over both replicas
            client = openai.AsyncOpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0, timeout=60)
            await asyncio.gather(*[client.chat.completions.create(
                model="serve-rft", messages=[{"role": "user", "content": f"w{i}"}], max_tokens=2)
                for i in range(k)])
            await client.close()

        deadline = time.monotonic() + 90
        while refused_by_a() == 0 and time.monotonic() < deadline:
            # a learns of the drain from its next poll answer (on a loaded machine: seconds);
            # until then it may still serve. Its first refusal (re-sent by HAProxy, the client
            # sees b's answer) reaches the synchronizer with the poll after.
            asyncio.run(burst())
            time.sleep(0.5)
        assert refused_by_a() > 0, ("the drained replica never refused a request",
                                    get_status(u, ADMIN)["replicas"])

        async def go():
            client = openai.AsyncOpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0, timeout=60)
            raws = await asyncio.gather(*[client.chat.completions.with_raw_response.create(
                model="serve-rft", messages=[{"role": "user", "content": f"d{i}"}], max_tokens=4)
                for i in range(24)])
            await client.close()
            return [x.headers["x-serve-rft-replica"] for x in raws]

        served_by = asyncio.run(go())  # a refuses now: every request is b's, none fails
        assert set(served_by) == {b}, served_by

        async def large():  # bodies HAProxy cannot re-send (over half its 16 KiB buffer): a serves
            body = json.dumps({"messages": [{"role": "user", "content": "big"}], "max_tokens": 2})
            async with httpx.AsyncClient(timeout=60) as c:  # them instead of refusing, none fails
                return await asyncio.gather(*[c.post(
                    f"{u}/v1/chat/completions", content=body + " " * (20_000 + i),
                    headers={"content-type": "application/json"}) for i in range(12)])

        answers = asyncio.run(large())
        assert all(r.status_code == 200 for r in answers), [(r.status_code, r.text[:300]) for r in answers]
        assert a in {r.headers["x-serve-rft-replica"] for r in answers}
        events = httpx.get(f"{u}/v1/sync/events", headers=ADMIN).json()["events"]
        assert any(e["kind"] == "drained" and e["component"] == a for e in events)
    finally:
        httpx.post(f"{u}/v1/sync/replicas/{a}/drain", json={"drained": False}, headers=ADMIN)

    async def both():
        client = openai.AsyncOpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0, timeout=60)
        raws = await asyncio.gather(*[client.chat.completions.with_raw_response.create(
            model="serve-rft", messages=[{"role": "user", "content": f"u{i}"}], max_tokens=4) for i in range(24)])
        await client.close()
        return {x.headers["x-serve-rft-replica"] for x in raws}

    # back in rotation: a's next poll lifts the drain, unless the synchronizer granted a the
    # versions published while it was out (then it loads them first, b serving meanwhile)
    deadline, seen = time.monotonic() + 120, set()
    while seen != {a, b} and time.monotonic() < deadline:
        seen |= asyncio.run(both())
        time.sleep(1.0)
    assert seen == {a, b}, (seen, get_status(u, ADMIN)["replicas"])


def test_behaviour_logprobs_match_the_trainer_on_the_served_version(stack):
    """After rolling syncs, the logged behaviour logprobs of a response equal the trainer's
    recomputation with that policy version's checkpoint (what makes the PPO ratio mean something)."""
    check_served_logprobs(stack, "checkpoints")


def test_reward_forms_groups_conversations_and_experience_states(stack):
    """Client groups across requests, per-choice / group / conversation reward forms, `info`,
    and `GET /v1/experiences/{id}` following a choice from pending to trained."""
    u = stack.url
    client = openai.OpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0)
    msg = [{"role": "user", "content": "group"}]
    a = client.chat.completions.create(model="serve-rft", messages=msg, max_tokens=4, n=2,
                                       extra_body={"group_id": "task-1", "group_size": 3})
    b = client.chat.completions.create(model="serve-rft", messages=msg, max_tokens=4,
                                       extra_body={"group_id": "task-1", "group_size": 3})
    got = httpx.get(f"{u}/v1/experiences/{a.id}").json()
    assert got["group_id"] == "task-1"
    assert [c["state"] for c in got["choices"]] == ["pending", "pending"]
    assert got["choices"][0]["token_versions"]
    # every choice of a, in one call, with info: held until b is rewarded too (group of 3)
    r = httpx.post(f"{u}/v1/rewards", json={"completion_id": a.id, "rewards": [1.0, 0.0], "info": {"by": "test"}})
    assert r.status_code == 200 and [d["status"] for d in r.json()["data"]] == ["recorded", "recorded"]
    got = httpx.get(f"{u}/v1/experiences/{a.id}").json()
    assert [c["state"] for c in got["choices"]] == ["rewarded", "rewarded"]
    assert got["choices"][0]["info"] == {"by": "test"} and got["choices"][1]["reward"] == 0.0
    r = httpx.post(f"{u}/v1/rewards", json={"completion_id": a.id, "rewards": [1.0]})
    assert r.status_code == 422  # a has 2 choices
    other = client.chat.completions.create(model="serve-rft", messages=msg, max_tokens=2)
    r = httpx.post(f"{u}/v1/rewards", json={"group_id": "task-1", "rewards": [
        {"completion_id": other.id, "reward": 1.0}]})
    assert r.status_code == 422 and r.json()["error"]["code"] == "not_in_group"
    r = httpx.post(f"{u}/v1/rewards", json={"group_id": "task-1", "rewards": [
        {"completion_id": b.id, "reward": 0.5}]})
    assert r.status_code == 200
    # 3 ready experiences, below trainer.min_batch_size (8), and no more traffic: trained once the
    # oldest has waited trainer.max_batch_wait_s (10 s on this stack), not left waiting for ever
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # released together, then trained by the running trainer
        states = [c["state"] for c in httpx.get(f"{u}/v1/experiences/{a.id}").json()["choices"]]
        assert "rewarded" not in states, states
        if states == ["trained", "trained"]:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"group never trained: {states}")
    assert httpx.get(f"{u}/v1/experiences/{a.id}").json()["choices"][0]["trained_version"] >= 1
    # a conversation of two assistant turns, one reward with a per-turn discount
    t0 = client.chat.completions.create(model="serve-rft", messages=msg, max_tokens=3,
                                        extra_body={"conversation_id": "conv-1"})
    msg2 = msg + [{"role": "assistant", "content": t0.choices[0].message.content or ""},
                  {"role": "user", "content": "and?"}]
    t1 = client.chat.completions.create(model="serve-rft", messages=msg2, max_tokens=3,
                                        extra_body={"conversation_id": "conv-1"})
    r = httpx.post(f"{u}/v1/rewards", json={"conversation_id": "conv-1", "reward": 1.0, "discount": 0.5})
    assert r.status_code == 200
    assert [(d["completion_id"], d["reward"]) for d in r.json()["data"]] == [(t0.id, 0.5), (t1.id, 1.0)]
    exp1 = asyncio.run(read_experience(stack, t1.id, 0))
    exp0 = asyncio.run(read_experience(stack, t0.id, 0))
    assert len(exp1.prompt_token_ids) > len(exp0.prompt_token_ids)  # turn 2's prompt holds turn 1
    assert httpx.post(f"{u}/v1/rewards", json={"conversation_id": "nope", "reward": 1}).status_code == 404
    assert httpx.get(f"{u}/v1/experiences/chatcmpl-nope").status_code == 404


def test_fuzzed_requests_get_4xx_never_5xx_and_the_service_survives(stack):
    """Hypothesis-generated bodies (wrong types, missing fields, out-of-bounds n / max_tokens,
    NaN and inf, unknown ids, junk bytes) against chat, rewards and the operator routes
    (``/v1/sync/*``, with the admin key): every answer is 2xx or a 4xx with the OpenAI error
    JSON, never a 5xx, and the service keeps serving. JSON bodies are sent with their
    ``content-type: application/json``.

    Randomized: the seed is ``SERVE_RFT_FUZZ_SEED`` if set, else drawn, and printed (pytest shows
    it with a failure; set it to replay that run). The operator bodies never name a version an
    operator could pin or roll back to (non-negative ints below 10**6 are left out: a pin or a
    rollback would change the shared stack's rollout for the tests after this one); pauses and
    unpins they may send are undone at the end."""
    from hypothesis import HealthCheck, given, seed, settings
    from hypothesis import strategies as st

    u = stack.url
    fuzz_seed = seeded("hypothesis fuzz")
    junk = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.text(max_size=20),
                     st.floats(allow_nan=True, allow_infinity=True), st.lists(st.integers(), max_size=3),
                     st.dictionaries(st.text(max_size=5), st.integers(), max_size=3))
    message = st.one_of(junk, st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "robot"]), junk),
         "content": st.one_of(st.text(max_size=40), junk)}))
    chat = st.fixed_dictionaries({}, optional={
        "messages": st.one_of(junk, st.lists(message, max_size=3)),
        "n": st.one_of(st.integers(-2, 40), junk), "max_tokens": st.one_of(st.integers(-2, 6), junk),
        "temperature": st.one_of(st.floats(-1, 3), junk), "top_p": st.one_of(st.floats(-1, 2), junk),
        "stream": st.one_of(st.booleans(), junk), "logprobs": st.one_of(st.booleans(), junk),
        "top_logprobs": st.one_of(st.integers(-1, 30), junk), "stop": junk, "group_id": junk,
        "group_size": junk, "conversation_id": junk})
    reward = st.fixed_dictionaries({}, optional={
        "completion_id": st.one_of(st.text(max_size=300), junk), "choice_index": st.one_of(st.integers(-3, 5000), junk),
        "reward": st.one_of(st.floats(allow_nan=True, allow_infinity=True), junk), "info": junk,
        "rewards": st.one_of(junk, st.lists(st.floats(allow_nan=True), max_size=3)),
        "group_id": junk, "conversation_id": junk, "discount": junk})
    valid_chat = st.fixed_dictionaries(
        {"messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=30)}),
                              min_size=1, max_size=2),
         "max_tokens": st.integers(1, 4)},
        optional={"n": st.integers(1, 3), "stream": st.booleans(), "logprobs": st.booleans(),
                  "top_logprobs": st.integers(0, 5), "temperature": st.floats(0, 2),
                  "group_id": st.text(min_size=1, max_size=8)})
    # no version an operator could act on (see the docstring); booleans and floats are no version
    # (the operator bodies are strict: sync_api._Body)
    not_a_version = junk.filter(lambda v: not (type(v) is int and 0 <= v < 10**6))
    operator = st.fixed_dictionaries({}, optional={
        "version": not_a_version, "paused": junk, "drained": junk, "extra": junk})
    replica_id = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=12)
    bodies = st.one_of(st.tuples(st.just("/v1/chat/completions"), chat),
                       st.tuples(st.just("/v1/chat/completions"), valid_chat),
                       st.tuples(st.just("/v1/rewards"), reward),
                       st.tuples(st.sampled_from(["/v1/sync/pin", "/v1/sync/rollback", "/v1/sync/promotion"]),
                                 operator),
                       st.tuples(replica_id.map(lambda r: f"/v1/sync/replicas/fuzz-{r}/drain"), operator),
                       st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/rewards", "/v1/sync/pin",
                                                  "/v1/sync/rollback", "/v1/sync/promotion"]),
                                 st.binary(max_size=64)))
    seen: list[tuple[str, int]] = []

    @seed(fuzz_seed)
    @settings(max_examples=80, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(bodies)
    def check(case):
        path, body = case
        headers = dict(ADMIN)
        if isinstance(body, bytes):
            content = body
        else:
            content = json.dumps(body, allow_nan=True)
            headers["content-type"] = "application/json"
        r = httpx.post(f"{u}{path}", timeout=120, headers=headers, content=content)
        seen.append((path, r.status_code))
        assert r.status_code < 500, (fuzz_seed, path, body, r.status_code, r.text[:300])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["message"] and "type" in err, (fuzz_seed, r.text)

    try:
        check()
    finally:  # what the operator bodies may have changed: a pause, an unpin (no pin: none is valid)
        httpx.post(f"{u}/v1/sync/promotion", json={"paused": False}, headers=ADMIN, timeout=60)
    codes = [c for _, c in seen]
    assert any(c >= 400 for c in codes) and any(c == 200 for c in codes), (fuzz_seed, seen)
    # the operator routes were reached past the key check (their own answers, not 401 / 403)
    assert any(p.startswith("/v1/sync/") and c not in (401, 403) for p, c in seen), (fuzz_seed, seen)
    ro = httpx.get(f"{u}/v1/sync/rollout", headers=ADMIN, timeout=60).json()
    assert ro["pinned"] is None and not ro["promotion_paused"], ro
    assert httpx.get(f"{u}/health").status_code == 200
    client = openai.OpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0)
    assert client.chat.completions.create(model="serve-rft", messages=[{"role": "user", "content": "ok"}],
                                          max_tokens=2).choices


def test_schemathesis_over_the_openapi_document_finds_no_5xx(stack):
    """schemathesis reads the served /openapi.json (request bodies included) and sends valid and
    invalid cases to chat, responses, rewards, experiences, status, models and health: no answer
    is a 5xx. Randomized like the fuzz above (`tests.support.fuzz`: ``SERVE_RFT_FUZZ_SEED``, printed).
    The operator routes (/v1/sync/...) are left out: they would pin or drain the shared stack
    (the fuzz above sends them bodies that name no version)."""
    import schemathesis
    from hypothesis import HealthCheck, given, seed, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    u = stack.url
    fuzz_seed = seeded("schemathesis")
    doc = httpx.get(f"{u}/openapi.json", timeout=60).json()
    assert "requestBody" in doc["paths"]["/v1/chat/completions"]["post"]
    schema = schemathesis.openapi.from_dict(doc)
    checked: dict[str, list[int]] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path.startswith("/v1/sync"):
            continue
        # 10 cases of each kind for /v1/responses (its body's schema is OpenAI's, large; a case may
        # generate up to the context length), 25 elsewhere
        examples = 10 if op.path == "/v1/responses" else 25
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @seed(fuzz_seed)
            @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(op.as_strategy(generation_mode=mode))
            def call(case):
                r = case.call(base_url=u, headers=ADMIN, timeout=120)
                checked.setdefault(op.label, []).append(r.status_code)
                assert r.status_code < 500, (fuzz_seed, op.label, mode, case.body, r.status_code, r.text[:300])
            try:
                call()
            except Unsatisfiable:  # nothing to make invalid (no parameters, no body): no negative case
                assert mode is GenerationMode.NEGATIVE, op.label
    assert {"POST /v1/chat/completions", "POST /v1/responses", "POST /v1/rewards", "GET /v1/status"} <= set(checked), \
        checked
    assert len(checked["POST /v1/chat/completions"]) >= 25 and len(checked["POST /v1/rewards"]) >= 25, checked
    assert httpx.get(f"{u}/health").status_code == 200


def test_locust_smoke_run_has_no_errors_and_metrics_are_exported(stack, tmp_path):
    """CI's smoke load test: the locustfile's users (chat, streaming, delayed rewards) for 20 s
    against the stack with --max-fail-ratio 0; then Ray's Prometheus endpoint carries the
    replica, store and trainer metrics."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "locust"
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(root / "loadtests" / "locustfile.py"), "--headless",
         "-u", "5", "-r", "5", "-t", "20s", "--host", stack.url, "--only-summary",
         "--json-file", str(out), "--csv", str(out), "--max-fail-ratio", "0", "--max-p99-s", "60"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "SERVE_RFT_API_KEY": "x"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stats = {s["name"]: s for s in json.loads(Path(f"{out}.json").read_text())}
    assert {"chat", "chat_stream", "rewards"} <= set(stats), stats.keys()
    assert all(s["num_failures"] == 0 and s["num_requests"] > 0 for s in stats.values()), stats
    assert Path(f"{out}_stats.csv").is_file()

    want = ['ray_serve_rft_requests_total{', 'route="chat"', 'route="chat_stream"', 'route="rewards"',
            'ray_serve_rft_request_seconds_bucket', 'ray_serve_rft_time_to_first_token_seconds_count',
            'kind="completion"', 'ray_serve_rft_store_experiences{', 'ray_serve_rft_experiences_done_total{',
            'state="trained"', 'ray_serve_rft_rewards_total', 'ray_serve_rft_experiences_rewarded_total',
            'ray_serve_rft_experiences_logged_total', 'ray_serve_rft_trainer_step_seconds_count',
            'ray_serve_rft_trainer_loss', 'ray_serve_rft_sync_seconds_count',
            'ray_serve_rft_trained_staleness_versions_count',
            # vLLM's own engine metrics, one ReplicaId per replica (explorer.log_stats)
            'ray_vllm_num_requests_running{', 'ReplicaId="', 'ray_vllm_time_to_first_token_seconds_bucket']
    assert stack.metrics_url
    deadline = time.monotonic() + 90
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(stack.metrics_url, timeout=10).text
        if all(w in text for w in want):
            break
        time.sleep(2)
    missing = [w for w in want if w not in text]
    assert not missing, (missing, [ln for ln in text.splitlines() if "serve_rft" in ln][:40])


def test_haproxy_is_the_ingress_and_is_configured_to_re_send_refusals(stack):
    """The default ingress: Ray Serve's HAProxy owns the service port and its rendered config
    retries a 503 on another replica and buffers the whole request first
    (serve_rft/service/ingress.py). That refusals are in fact re-sent is shown by
    test_a_drained_replica_refuses_and_haproxy_resends_every_request. Its files are in the run
    dir's 0700 HAProxy folder, the admin socket 0600, stats and exporter bound to the service
    host, a request timeout set (serve_rft/service/haproxy_home.py; EACCES for another user and
    the timeout's 408: tests/unit/test_haproxy_home.py)."""
    from serve_rft.service.ingress import RETRY_ON
    import glob
    import os
    import re
    import stat
    from pathlib import Path

    port = stack.url.rsplit(":", 1)[1]
    deadline = time.monotonic() + 30  # Serve writes a replica into HAProxy's config after it runs
    while True:
        newest_first = sorted(glob.glob(f"{stack.run_dir}/haproxy/*/haproxy.cfg"), key=lambda p: -Path(p).stat().st_mtime)
        ours = [c for c in map(lambda p: Path(p).read_text(), newest_first) if f"bind 127.0.0.1:{port}\n" in c]
        if (ours and ours[0].count("server SERVE_REPLICA") == 2) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ours, f"no HAProxy config binds port {port}"
    assert f"retry-on {RETRY_ON}\n" in ours[0]
    assert "option redispatch 1" in ours[0]
    assert ours[0].count("server SERVE_REPLICA") == 2  # both replicas behind it
    assert stat.S_IMODE(os.stat(stack.run_dir / "haproxy").st_mode) == 0o700
    (sock,) = re.findall(r"stats socket (\S+) mode 600 level admin", ours[0])
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    binds = re.findall(r"^\s*bind (\S+)$", ours[0], re.M)
    assert binds and all(b.startswith("127.0.0.1:") for b in binds), binds  # none on every interface
    assert "timeout http-request 10s" in ours[0]


def test_replica_log_records_reach_their_files_not_memory(stack):
    """Ray Serve's replica logger buffers each record in a MemoryHandler that hands it to the log
    file. Should vLLM's logging setup close every handler of the replica process when the engine
    starts, the buffer has no target and keeps every later record (one access-log line per
    request) in memory for good, and the file stops at "Started initializing replica"
    (benchmarks/soak.py then shows the replicas' RSS growing linearly). The records reach the file."""
    import glob
    from pathlib import Path

    ids = [r["id"] for r in get_status(stack.url)["replicas"]]

    def logged() -> int:
        n = 0
        for rid in ids:
            files = sorted(glob.glob(f"/tmp/ray/session_*/logs/serve/replica_serve_rft_explorer_{rid}.log"),
                           key=lambda f: Path(f).stat().st_mtime)
            assert files, f"no Serve log file for replica {rid}"
            n += Path(files[-1]).read_text(errors="replace").count("POST /v1/chat/completions 200")
        return n

    before = logged()  # the earlier tests' requests: only this test's six are counted
    for _ in range(6):
        r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=120, json={
            "model": "serve-rft", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text

    deadline = time.time() + 30
    while logged() - before < 6 and time.time() < deadline:
        time.sleep(0.5)
    assert logged() - before >= 6, (before, logged())


def test_the_stacks_ray_workers_record_no_task_events(stack):
    """A Ray that `serve-rft up` starts keeps no task events in its GCS (they grew it ~3.6 KiB per
    actor call, heartbeats included, up to Ray's cap: benchmarks/gcs_task_events.py). Each worker
    reads the setting from its environment when it starts; the replicas' and the trainer's have it."""
    import psutil
    from serve_rft.service.launcher import TASK_EVENTS_ENV

    status = get_status(stack.url)
    pids = [r["pid"] for r in status["replicas"] if r.get("pid")] + [status["trainer"]["pid"]]
    assert len(pids) == 3, status
    for pid in pids:
        env = psutil.Process(pid).environ()
        assert env.get("RAY_task_events_report_interval_ms") == TASK_EVENTS_ENV["RAY_task_events_report_interval_ms"] == "0"


def test_the_replicas_run_their_routes_on_their_http_servers_loop(stack):
    """`explorer.user_code_loop_thread` false (the default): each replica's process starts with
    Ray Serve's switch off, so its routes run on the loop of its HTTP server and no stream chunk
    is handed between two event loops (docs/performance.md, Side by side with plain vLLM)."""
    import psutil

    pids = [r["pid"] for r in get_status(stack.url)["replicas"] if r.get("pid")]
    assert len(pids) == 2
    for pid in pids:
        assert psutil.Process(pid).environ().get("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD") == "0"


def test_responses_have_vllms_shape(stack, embedded_model, tmp_path):
    """Conformance: chat, stream chunks, models and errors have the JSON shape of vLLM's own
    OpenAI server's answers to the same requests (tests/support/conformance.py)."""
    from benchmarks.plain_vllm import start_vllm, stop
    from serve_rft.buffer.redis_server import free_port
    from tests.support.conformance import check

    proc, vllm_url = start_vllm(str(embedded_model), free_port(), tmp_path / "vllm.log")
    try:
        check(stack.url, vllm_url, stack.run_dir / "conformance.json")
    finally:
        stop(proc)

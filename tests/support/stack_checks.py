"""Checks that several stack test modules run against their own stack, and the store reads
they share: each ``check_...(stack)`` takes a running `tests.support.stack.Stack` and asserts; the
default stack's tests (tests/integration/test_stack.py) call them too."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from serve_rft.buffer.store import ExperienceStore
from tests.support.load import get_status

ADMIN = {"Authorization": "Bearer x"}  # the admin key of stacks that turn API keys on (openai api_key="x")


def open_store(stack) -> ExperienceStore:
    """A client of ``stack``'s experience store (the caller closes it)."""
    return ExperienceStore(stack.redis_url, stack.prefix)


async def read_experience(stack, cid: str, i: int):
    """The logged experience of choice ``i`` of completion ``cid`` (None when there is none)."""
    s = open_store(stack)
    try:
        return await s.get_experience(cid, i)
    finally:
        await s.close()


def until_every_replica_is_routed_to(stack, within_s: float = 120.0) -> None:
    """Send concurrent bursts until no live replica is *warming* (a replica counts as serving
    only once the ingress routed a request to it; until then a lone ready replica may sync:
    serve_rft/synchronizer/state.py). HAProxy may send every request of a quiet start to one
    replica, so this is the precondition of "one in rotation at every state change"."""
    u = stack.url

    async def burst(k: int = 8):
        client = openai.AsyncOpenAI(base_url=f"{u}/v1", api_key="x", max_retries=0, timeout=60)
        try:
            await asyncio.gather(*[client.chat.completions.create(
                model="serve-rft", messages=[{"role": "user", "content": f"warm {i}"}], max_tokens=2)
                for i in range(k)])
        finally:
            await client.close()

    deadline = time.monotonic() + within_s
    while True:
        replicas = get_status(u, ADMIN)["replicas"]
        if replicas and not any(r["warming"] for r in replicas if r["alive"]):
            return
        assert time.monotonic() < deadline, f"a replica was never routed to: {replicas}"
        asyncio.run(burst())


def check_training_rolls_new_versions(stack) -> None:
    """Load + rewards until two trainer versions reached every replica; no request fails and
    at least one replica is in rotation at every recorded state change, once each replica has
    been routed to (`until_every_replica_is_routed_to`). (That a replica out of rotation refuses
    requests and HAProxy re-sends them is shown deterministically by
    test_a_drained_replica_refuses_and_haproxy_resends_every_request in
    tests/integration/test_stack.py.)"""
    until_every_replica_is_routed_to(stack)
    t_start = time.time()
    outcomes: list[tuple[bool, str, int]] = []

    async def user(client, http, stop):
        while not stop.is_set():
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model="serve-rft", messages=[{"role": "user", "content": "go"}], max_tokens=8, n=4)
                comp = raw.parse()
                outcomes.append((True, raw.headers["x-serve-rft-replica"],
                                 int(raw.headers["x-serve-rft-policy-version"])))
                rewards = [{"completion_id": comp.id, "choice_index": c.index,
                            "reward": sum(ch in "aeiou" for ch in c.message.content or "")}
                           for c in comp.choices]
                r = await http.post("/v1/rewards", json={"rewards": rewards})
                assert r.status_code == 200, r.text
            except openai.APIError as e:
                outcomes.append((False, repr(e), -1))

    async def go():
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0, timeout=120)
        stop = asyncio.Event()
        async with httpx.AsyncClient(base_url=stack.url, timeout=60, headers=ADMIN) as http:
            users = [asyncio.create_task(user(client, http, stop)) for _ in range(6)]
            deadline = time.monotonic() + 300
            target = None
            while time.monotonic() < deadline:
                await asyncio.sleep(1)
                st = (await http.get("/v1/status")).json()
                if target is None and st["policy_version"] >= 1:
                    target = st["policy_version"] + 1  # two versions: the first and a later one
                if target and all(r["policy_version"] >= target for r in st["replicas"]):
                    break
            stop.set()
            await asyncio.gather(*users)
            st = (await http.get("/v1/status")).json()
            events = (await http.get("/v1/sync/events", params={"since": t_start})).json()["events"]
        await client.close()
        return target, st, events

    target, st, events = asyncio.run(go())
    failed = [o for o in outcomes if not o[0]]
    assert not failed, failed[:5]
    assert target is not None, "the trainer never published a version"
    assert all(r["policy_version"] >= target for r in st["replicas"]), st
    assert st["experiences"]["trained"] > 0
    syncs = [e for e in events if e["state"] == "REQUIRE_SYNC"]
    # every replica synced; a replica granted a sync loads the latest version, so one that was
    # behind may skip a version (a MEMORY run saw 3 syncs for two versions x two replicas)
    assert len({e["component"] for e in syncs}) >= 2, events  # both replicas
    none_serving = [e for e in events if e["component"] != "trainer" and e["serving"] < 1]
    assert not none_serving, (none_serving, st["replicas"])
    served = {o[1] for o in outcomes}
    assert len(served) == 2, "both replicas served traffic"
    assert max(o[2] for o in outcomes) >= 1, "responses came from trained policy versions"
    assert st["version_lag_s"], "version lag is measured"


def check_served_logprobs(stack, folder: str):
    """A response served by one trained version has the logprobs of that version's weights,
    read from ``run_dir/folder/v{version}`` (published checkpoints or trainer states)."""
    import torch
    from transformers import AutoModelForCausalLM

    from serve_rft.trainer.policy.token_logprobs import response_logprobs
    from serve_rft.weights.folders import version_dir

    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x")
    for _ in range(10):  # pick a response whose tokens all come from one trained version
        raw = client.chat.completions.with_raw_response.create(
            model="serve-rft", messages=[{"role": "user", "content": "check"}], max_tokens=16,
            temperature=0.8)
        comp = raw.parse()
        exp = asyncio.run(read_experience(stack, comp.id, 0))
        versions = {v for v, _, _ in exp.token_versions}
        if len(versions) == 1 and exp.min_version >= 1:
            break
    else:
        pytest.fail(f"no single-version trained response: {exp.token_versions}")
    ckpt = version_dir(stack.run_dir / folder, exp.min_version)
    if not ckpt.exists():
        pytest.fail(f"checkpoint of a served version was pruned: {ckpt}")
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    with torch.no_grad():
        lp, mask = response_logprobs(model, [exp.prompt_token_ids], [exp.response_token_ids], [0.8])
    diff = (lp[0, : len(exp.response_token_ids)] - torch.tensor(exp.behaviour_logprobs)).abs().max()
    assert float(diff) < 1e-3, f"max |logprob diff| {float(diff)}"

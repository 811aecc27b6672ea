"""TRAINER_DRIVEN style with the `keep` drain mode: requests in flight across a sync continue
on the new weights, and their experiences record the policy version of every token."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.integration import test_stack as loop
from tests.integration.conftest import start_stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(redis_server, embedded_model, tmp_path_factory):
    yield from start_stack(redis_server.url, embedded_model, tmp_path_factory.mktemp("run-keep"),
                           ["synchronizer.sync_style=trainer_driven", "synchronizer.drain_mode=keep"])


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
        await asyncio.to_thread(loop.test_training_rolls_new_versions_across_replicas_without_failures, stack)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(long_ids) < 8:
            await asyncio.sleep(1)
        stop.set()
        await asyncio.gather(*tasks)
        await client.close()

    asyncio.run(go())
    assert not failures, failures[:5]
    spans = [asyncio.run(loop._experience(stack, cid, 0)).token_versions for cid in long_ids]
    multi = [s for s in spans if len({v for v, _, _ in s}) > 1]
    assert multi, f"no request spanned a sync: {spans[:5]}"
    for s in multi:  # contiguous spans covering every token, versions increasing
        assert s[0][1] == 0 and all(a[2] == b[1] for a, b in zip(s, s[1:]))
        assert [v for v, _, _ in s] == sorted(v for v, _, _ in s)
    st = httpx.get(f"{stack.url}/v1/status").json()
    assert st["sync_style"] == "trainer_driven"

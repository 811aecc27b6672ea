"""A replica's experience log against a real redis-server: what it logs, what it serves unlogged."""

import asyncio
import uuid

from serve_rft.buffer.store import ExperienceStore
from serve_rft.explorer.engine.engine_tap import RequestContext
from serve_rft.explorer.engine.experience_log import ExperienceLog, Sampled
from serve_rft.types import SamplingInfo


class Metrics:
    """Records what `ExplorerMetrics.served` would count."""

    def __init__(self):
        self.served_calls = []

    def served(self, prompt_tokens, completion_tokens, logged, unlogged=0, reason=None):
        self.served_calls.append((logged, unlogged, reason))


def _choices(n: int) -> list[Sampled]:
    return [Sampled(i, token_ids=[5, 6], logprobs=[-0.1, -0.2], finish_reason="length") for i in range(n)]


def test_logs_every_choice_and_honours_store_false(redis_server):
    async def go():
        store = ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
        metrics = Metrics()
        xlog = ExperienceLog(store, "r0", metrics, store_wait_s=2.0)
        sampling = SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=2)
        assert await xlog.log(RequestContext(), "chatcmpl-a", [1, 2, 3], _choices(2), sampling, 3) == 2
        assert xlog.logged == 2 and await store.num_choices("chatcmpl-a") == 2
        exp = await store.get_experience("chatcmpl-a", 1)
        assert exp.prompt_token_ids == [1, 2, 3] and exp.response_token_ids == [5, 6] and exp.min_version == 3

        assert await xlog.log(RequestContext(store=False), "chatcmpl-b", [1], _choices(1), sampling, 3) == 0
        assert xlog.logged == 2 and await store.num_choices("chatcmpl-b") is None  # served, never kept
        assert metrics.served_calls == [(2, 0, None), (0, 1, None)]
        await store.close()
    asyncio.run(go())


def test_a_store_that_does_not_answer_costs_the_log_not_the_answer():
    async def go():
        store = ExperienceStore("redis://127.0.0.1:1", prefix="away", reconnect_s=0.1)  # nothing listens
        metrics = Metrics()
        xlog = ExperienceLog(store, "r0", metrics, store_wait_s=0.5)
        assert await xlog.log(RequestContext(), "chatcmpl-c", [1], _choices(1),
                              SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=2), 0) == 0  # served
        assert xlog.logged == 0 and metrics.served_calls == [(0, 1, "store_unavailable")]
    asyncio.run(go())


def test_a_completion_the_full_log_queue_refuses_is_served_and_counted_store_unavailable(redis_server):
    """Past the bytes a store's batcher may hold (Redis slow or away), a completion is refused at
    once: served, counted unlogged ``store_unavailable``; the one already queued is logged."""
    async def go():
        store = ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
        store.completions.batcher.max_held_bytes = 1  # the first completion queued fills it
        metrics = Metrics()
        xlog = ExperienceLog(store, "r0", metrics, store_wait_s=2.0)
        sampling = SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=2)
        got = await asyncio.gather(xlog.log(RequestContext(), "chatcmpl-q1", [1], _choices(1), sampling, 0),
                                   xlog.log(RequestContext(), "chatcmpl-q2", [1], _choices(1), sampling, 0))
        assert got == [1, 0] and xlog.logged == 1
        assert sorted(metrics.served_calls, key=str) == [(0, 1, "store_unavailable"), (1, 0, None)]
        assert await store.num_choices("chatcmpl-q1") == 1 and await store.num_choices("chatcmpl-q2") is None
        assert store.completions.batcher.held_bytes == 0
        await store.close()
    asyncio.run(go())


def test_sampled_reads_the_sampled_tokens_logprobs_from_either_of_vllms_containers():
    """vLLM returns per-position logprobs as dicts, or flat (``flat_logprobs``, what the tap asks
    for when only it reads them) with the sampled token first at each position."""
    import pytest
    from types import SimpleNamespace

    from vllm.logprobs import FlatLogprobs, Logprob

    def out(logprobs, ids=(7, 9)):
        return SimpleNamespace(token_ids=list(ids), logprobs=logprobs, finish_reason=None, weight_versions=None)

    dicts = [{7: Logprob(-0.5, 1), 3: Logprob(-0.1, 1)}, {9: Logprob(-1.5, 4)}]
    flat = FlatLogprobs()
    flat.append_fast([7, 3], [-0.5, -0.1], iter([1, 1]), [None, None])  # sampled first, then the top-1
    flat.append_fast([9], [-1.5], iter([4]), [None])
    for logprobs in (dicts, flat, flat[0:2]):
        s = Sampled(0)
        s.add(out(logprobs))
        assert s.token_ids == [7, 9] and s.logprobs == [-0.5, -1.5]
    s.add(out(flat[1:2], ids=[9]))  # a delta appends
    assert s.token_ids == [7, 9, 9] and s.logprobs == [-0.5, -1.5, -1.5]
    for bad in (out(dicts, ids=[7, 8]), out(flat, ids=[7, 8]), out(flat, ids=[7]), out(None), out(flat[0:1])):
        with pytest.raises(ValueError):
            Sampled(0).add(bad)


def test_the_engine_tap_asks_for_the_behaviour_logprobs_flat_only_where_no_client_reads_them():
    """The sampled token's logprob is asked of vLLM for every logged request; flat (and left
    undecoded by the replica's engine) only where the client asked for no logprobs of any kind."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from serve_rft.explorer.engine.engine_tap import CURRENT, EngineTap

    seen = []
    llm = SimpleNamespace(generate=lambda prompt, params, *args, **kwargs: seen.append(params))
    tap = EngineTap(SimpleNamespace(policy_version=0, adapter_sync=False, llm=llm), None)
    cases = {"none": {}, "logprobs": {"logprobs": 2}, "token ids": {"logprob_token_ids": [5, 6]},
             "prompt logprobs": {"prompt_logprobs": 1}}
    token = CURRENT.set(RequestContext())
    try:
        for kwargs in cases.values():
            tap.generate({"prompt_token_ids": [1, 2]}, SamplingParams(temperature=1.0, **kwargs), "chatcmpl-x")
    finally:
        CURRENT.reset(token)
    got = {name: (p.logprobs, p.flat_logprobs) for name, p in zip(cases, seen)}
    assert got == {"none": (0, True), "logprobs": (2, False), "token ids": (None, False),
                   "prompt logprobs": (0, False)}
    tap.generate({"prompt_token_ids": [1, 2]}, SamplingParams(temperature=1.0), "probe")  # no request context
    assert (seen[-1].logprobs, seen[-1].flat_logprobs) == (None, False)

"""Tensor-parallel replicas (``explorer.tensor_parallel_size``) on vLLM's CPU backend: an engine
of two workers answers exactly as an engine of one, and every CPU sync method reaches both
workers, checked by the logprobs of what it serves and by the probe a version's handle carries
(`serve_rft.weights.verify`).

The rolling sync of such replicas under load, through the whole stack, is
``tests/integration/test_stack_memory.py`` (its stack runs two workers per replica)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.support.weights import perturbed

pytestmark = pytest.mark.integration

PROMPTS = [[1, 87, 306, 201, 343, 78, 316, 308, 275, 691, 2, 201, 1, 347, 829, 935, 201],
           [1, 201, 347, 829], [5, 6, 7, 8, 9, 10, 11, 12]]


async def _greedy(engine, tag: str) -> list[list[int]]:
    """Each prompt's greedy answer (16 tokens at most)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    answers = []
    for i, prompt in enumerate(PROMPTS):
        sp = SamplingParams(temperature=0.0, max_tokens=16, output_kind=RequestOutputKind.FINAL_ONLY)
        async for ro in engine.generate(prompt, sp, f"{tag}-{i}"):
            pass
        answers.append(list(ro.outputs[0].token_ids))
    return answers


async def _served_vs(engine, model, tag: str) -> float:
    """Largest |difference| between the logprobs of a seeded sample vLLM served and ``model``'s
    (transformers) logprobs of the same tokens."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from serve_rft.trainer.policy.token_logprobs import response_logprobs

    sp = SamplingParams(temperature=1.0, max_tokens=24, logprobs=0, seed=3, output_kind=RequestOutputKind.FINAL_ONLY)
    async for ro in engine.generate(PROMPTS[0], sp, tag):
        pass
    out = ro.outputs[0]
    ids = list(out.token_ids)
    served = torch.tensor([out.logprobs[i][t].logprob for i, t in enumerate(ids)])
    with torch.no_grad():
        lp, _ = response_logprobs(model, [PROMPTS[0]], [ids], [1.0])
    return float((served - lp[0, : len(ids)]).abs().max())


def _load_on_rank_0_only(worker, path: str) -> str:
    """Run in each vLLM worker (``collective_rpc``): rank 0 loads the checkpoint at ``path``,
    the other ranks keep what they hold, as if the version reached one worker only."""
    return worker.load_policy_weights(path, direct=False) if worker.rank == 0 else "kept"


def test_two_workers_answer_as_one_and_every_sync_method_reaches_both(embedded_model, tmp_path, monkeypatch):
    """Greedy answers at the initial weights and after a CHECKPOINT load equal a one-worker
    engine's; after CHECKPOINT and MEMORY loads the served logprobs are the new weights' (both
    workers' slices changed: a stale slice would move them); a version loaded into one worker
    only is refused by the probe check, and loading it into both passes it.

    The test sends a function to the workers (vLLM's ``collective_rpc`` with a callable, which
    vLLM pickles only with ``VLLM_ALLOW_INSECURE_SERIALIZATION``)."""
    import ray

    from serve_rft.config import ExplorerConfig
    from serve_rft.explorer.engine.vllm_engine import ExplorerEngine
    from serve_rft.trainer.policy.token_logprobs import trainer_probe
    from serve_rft.weights import CheckpointMethod, MemoryMethod
    from serve_rft.weights.verify import ProbeMismatch, check_probe

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    ck_model, mem_model = perturbed(embedded_model, 1), perturbed(embedded_model, 2)
    ck = CheckpointMethod(tmp_path / "ck")
    ck.prepare()
    ck_handle = ck.send(ck_model, 1)
    mem = MemoryMethod(bucket_bytes=1 << 18)  # several buckets for the tiny model
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        mem_handle = mem.send(mem_model, 2)

        async def run(tp: int) -> dict:
            engine = await ExplorerEngine.create(str(embedded_model), ExplorerConfig(tensor_parallel_size=tp))
            got: dict = {"workers": len(engine.engine_pids), "world_size": engine.world_size}
            try:
                got["greedy_v0"] = await _greedy(engine, "v0")
                await engine.pause("wait")
                await ck.receive(engine, ck_handle, 1)
                await engine.resume()
                got["greedy_v1"] = await _greedy(engine, "v1")
                got["checkpoint"] = await _served_vs(engine, ck_model, "v1")
                got["load_path"] = engine.load_path
                if tp == 1:
                    return got
                await engine.pause("wait")
                await mem.receive(engine, mem_handle, 2)
                await engine.resume()
                got["memory"] = await _served_vs(engine, mem_model, "v2")
                # version 1 into rank 0 only: neither version 1's probe nor version 2's holds
                probe1, probe2 = trainer_probe(ck_model, 1), trainer_probe(mem_model, 2)
                await engine.pause("wait")
                got["partial_rpc"] = await engine.llm.collective_rpc(
                    _load_on_rank_0_only, args=(str(tmp_path / "ck" / "v000001"),))
                await engine.resume()
                for probe in (probe1, probe2):
                    with pytest.raises(ProbeMismatch):
                        check_probe(probe, await engine.probe_logprobs(probe["token_ids"]), 1e-3)
                await engine.pause("wait")
                await ck.receive(engine, ck_handle, 1)
                await engine.resume()
                got["probe_after_full_load"] = check_probe(probe1, await engine.probe_logprobs(probe1["token_ids"]), 1e-3)
                return got
            finally:
                engine.shutdown()

        one = asyncio.run(run(1))
        two = asyncio.run(run(2))
    finally:
        ray.shutdown()
    assert (one["workers"], one["world_size"], two["workers"], two["world_size"]) == (1, 1, 2, 2), (one, two)
    assert two["greedy_v0"] == one["greedy_v0"] and two["greedy_v1"] == one["greedy_v1"], (one, two)
    assert one["greedy_v0"] != one["greedy_v1"]  # the load changed the answers
    assert one["checkpoint"] < 1e-4 and two["checkpoint"] < 1e-4 and two["memory"] < 1e-4, (one, two)
    assert two["load_path"] == "layerwise (tensor-parallel)", two  # vLLM's loader shards each tensor
    assert sorted(two["partial_rpc"]) == ["kept", "layerwise (turned off)"], two
    assert two["probe_after_full_load"] < 1e-4, two

"""Both CPU sync methods, on a real vLLM engine: after a load, vLLM's logprobs equal the new
weights' (transformers) logprobs — the whole model changed, tied LM head included."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytestmark = pytest.mark.integration

PROMPT = [1, 87, 306, 201, 343, 78, 316, 308, 275, 691, 2, 201, 1, 347, 829, 935, 201]


def _perturbed(model_dir, seed):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _hf_logprobs(model, ids):
    from serve_rft.trainer.algorithm import response_logprobs

    with torch.no_grad():
        lp, _ = response_logprobs(model, [PROMPT], [ids], [1.0])
    return lp[0, : len(ids)]


async def _sample(engine, rid):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(temperature=1.0, max_tokens=24, logprobs=0, seed=3,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    async for ro in engine.generate(PROMPT, sp, rid):
        pass
    out = ro.outputs[0]
    return list(out.token_ids), torch.tensor([out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)]), out.weight_versions


def test_checkpoint_and_memory_loads_give_exactly_the_new_policy(embedded_model, tmp_path):
    import ray
    from transformers import AutoModelForCausalLM

    from serve_rft.config import ExplorerConfig
    from serve_rft.explorer.engine import ExplorerEngine
    from serve_rft.synchronizer.methods import CheckpointMethod, LoadFailed, MemoryMethod, load_or_restore

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        async def go():
            engine = await ExplorerEngine.create(str(embedded_model), ExplorerConfig())
            try:
                results = {}
                ids0, lp0, _ = await _sample(engine, "v0")
                base = AutoModelForCausalLM.from_pretrained(str(embedded_model), dtype=torch.float32)
                results["v0"] = float((lp0 - _hf_logprobs(base, ids0)).abs().max())
                ck_model = _perturbed(embedded_model, 1)
                ck = CheckpointMethod(tmp_path / "ck")
                ck.prepare()
                handle = ck.send(ck_model, 1)
                await engine.pause("wait")
                info = await ck.receive(engine, handle, 1)
                await engine.resume()
                ids1, lp1, spans1 = await _sample(engine, "v1")
                results["checkpoint"] = float((lp1 - _hf_logprobs(ck_model, ids1)).abs().max())
                assert info["bytes"] > 0 and spans1[0].version == "1"

                mem_model = _perturbed(embedded_model, 2)
                mem = MemoryMethod(bucket_bytes=1 << 18)  # several buckets for the tiny model
                handle = mem.send(mem_model, 2)
                assert len(handle["buckets"]) > 2
                await engine.pause("wait")
                await mem.receive(engine, handle, 2)
                await engine.resume()
                ids2, lp2, spans2 = await _sample(engine, "v2")
                results["memory"] = float((lp2 - _hf_logprobs(mem_model, ids2)).abs().max())
                assert spans2[0].version == "2"

                # a corrupt (but committed) version: the load fails, version 2 is restored
                bad = tmp_path / "ck" / "v000003"
                bad.mkdir()
                (bad / "config.json").write_text((tmp_path / "ck" / "v000001" / "config.json").read_text())
                (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
                (bad / "COMMITTED").write_text("3")
                await engine.pause("wait")
                with pytest.raises(LoadFailed):
                    await load_or_restore(engine, {"method": "checkpoint", "path": str(bad)}, 3, handle, 2)
                await engine.resume()
                ids3, lp3, spans3 = await _sample(engine, "v2-restored")
                results["restored"] = float((lp3 - _hf_logprobs(mem_model, ids3)).abs().max())
                assert spans3[0].version == "2" and engine.policy_version == 2
                return results
            finally:
                engine.shutdown()

        results = asyncio.run(go())
    finally:
        ray.shutdown()
    assert results["v0"] < 1e-4, results
    assert results["checkpoint"] < 1e-4, results
    assert results["memory"] < 1e-4, results
    assert results["restored"] < 1e-4, results

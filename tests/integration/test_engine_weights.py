"""Both CPU sync methods, on a real vLLM engine: after a load, vLLM's logprobs equal the new
weights' (transformers) logprobs — the whole model changed, tied LM head included."""

from __future__ import annotations

import asyncio
import io
import logging
import logging.handlers

import pytest
import torch
from safetensors.torch import save_file

from serve_rft.service.ray_start import init_local_ray
from tests.support.weights import perturbed

pytestmark = pytest.mark.integration

PROMPT = [1, 87, 306, 201, 343, 78, 316, 308, 275, 691, 2, 201, 1, 347, 829, 935, 201]


def _hf_logprobs(model, ids):
    from serve_rft.trainer.policy.token_logprobs import response_logprobs

    with torch.no_grad():
        lp, _ = response_logprobs(model, [PROMPT], [ids], [1.0])
    return lp[0, : len(ids)]


async def _final(engine, rid, **params):
    """The final output of one seeded sample of ``PROMPT`` with the sampled tokens' logprobs."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(temperature=1.0, max_tokens=24, logprobs=0, seed=3,
                        output_kind=RequestOutputKind.FINAL_ONLY, **params)
    async for ro in engine.generate(PROMPT, sp, rid):
        pass
    return ro.outputs[0]


async def _sample(engine, rid):
    out = await _final(engine, rid)
    return list(out.token_ids), torch.tensor([out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids)]), out.weight_versions


def test_checkpoint_and_memory_loads_give_exactly_the_new_policy(embedded_model, tmp_path):
    import ray
    from transformers import AutoModelForCausalLM

    from serve_rft.config import Config, ExplorerConfig
    from serve_rft.explorer.engine.vllm_engine import ExplorerEngine
    from serve_rft.explorer.engine.engine_tap import EngineTap
    from serve_rft.explorer.engine.openai_serving import build_serving
    from serve_rft.weights import CheckpointMethod, LoadFailed, MemoryMethod, load_or_restore
    from serve_rft.weights.memory import checkpoint_tensors, iter_buckets

    init_local_ray(ray.init, num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        async def go():
            # a buffered handler like Ray Serve's replica log handler: the engine's start must not
            # close it (vLLM's logging dictConfig once did; it then kept every record in memory)
            buffered = logging.handlers.MemoryHandler(1, target=logging.StreamHandler(io.StringIO()))
            logging.getLogger("serve_rft.test.buffered").addHandler(buffered)
            # explorer.engine_args reach vLLM unchanged; enforce_eager defaults to true on CPU
            # (sampling defaults as an Instruct model's generation_config.json sets them)
            engine = await ExplorerEngine.create(str(embedded_model), ExplorerConfig(
                engine_args={"max_num_batched_tokens": 2048, "override_generation_config": {
                    "temperature": 0.5, "top_k": 20, "repetition_penalty": 1.05}}))
            assert buffered.target is not None, "starting the engine closed the process's log handlers"
            assert engine.llm.vllm_config.scheduler_config.max_num_batched_tokens == 2048
            assert engine.llm.vllm_config.model_config.enforce_eager is True
            # the serving layer applies only the defaults the trainer reproduces
            serving = build_serving(Config(), EngineTap(engine, None), str(embedded_model))
            assert serving.chat.default_sampling_params == serving.completion.default_sampling_params == {
                "temperature": 0.5}
            try:
                results = {}
                ids0, lp0, _ = await _sample(engine, "v0")
                # logprobs only the engine tap reads (it marks them flat_logprobs): the same
                # values, flat, their tokens not decoded; a client's are decoded
                shown = await _final(engine, "v0-shown")
                tap_only = await _final(engine, "v0-tap-only", flat_logprobs=True)
                assert list(shown.token_ids) == list(tap_only.token_ids) == ids0
                assert [shown.logprobs[i][t].logprob for i, t in enumerate(ids0)] == [
                    tap_only.logprobs.logprobs[s] for s in tap_only.logprobs.start_indices]
                assert all(shown.logprobs[i][t].decoded_token is not None for i, t in enumerate(ids0))
                assert tap_only.logprobs.decoded_tokens and all(d is None for d in tap_only.logprobs.decoded_tokens)
                base = AutoModelForCausalLM.from_pretrained(str(embedded_model), dtype=torch.float32)
                results["v0"] = float((lp0 - _hf_logprobs(base, ids0)).abs().max())
                ck_model = perturbed(embedded_model, 1)
                ck = CheckpointMethod(tmp_path / "ck")
                ck.prepare()
                handle = ck.send(ck_model, 1)
                await engine.pause("wait")
                info = await ck.receive(engine, handle, 1)
                await engine.resume()
                ids1, lp1, spans1 = await _sample(engine, "v1")
                results["checkpoint"] = float((lp1 - _hf_logprobs(ck_model, ids1)).abs().max())
                assert info["bytes"] > 0 and spans1[0].version == "1"
                assert engine.load_path == "direct"  # straight into vLLM-CPU's packed layers

                mem_model = perturbed(embedded_model, 2)
                mem = MemoryMethod(bucket_bytes=1 << 18)  # several buckets for the tiny model
                handle = mem.send(mem_model, 2)
                assert len(handle["buckets"]) > 2
                # the parts of each fused layer (q/k/v, gate/up) travel in one bucket
                assert not _fused_layers_split(list(iter_buckets(checkpoint_tensors(mem_model), 1 << 18)))
                await engine.pause("wait")
                await mem.receive(engine, handle, 2)
                await engine.resume()
                ids2, lp2, spans2 = await _sample(engine, "v2")
                results["memory"] = float((lp2 - _hf_logprobs(mem_model, ids2)).abs().max())
                assert engine.load_path == "direct"
                assert engine.gathered_layers == []  # every fused layer packed from one view of a file
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

                # a committed version missing one shard of a fused layer: refused, 2 restored
                partial = tmp_path / "ck" / "v000004"
                partial.mkdir()
                (partial / "config.json").write_text((tmp_path / "ck" / "v000001" / "config.json").read_text())
                tensors = {n: p.detach().clone() for n, p in perturbed(embedded_model, 4).named_parameters()}
                del tensors["model.layers.0.self_attn.k_proj.weight"]
                save_file(tensors, str(partial / "model.safetensors"))
                (partial / "COMMITTED").write_text("4")
                await engine.pause("wait")
                with pytest.raises(LoadFailed) as refused:
                    await load_or_restore(engine, {"method": "checkpoint", "path": str(partial)}, 4, handle, 2)
                assert "k_proj" in str(refused.value) or "qkv_proj" in str(refused.value), refused.value
                await engine.resume()
                ids4, lp4, _ = await _sample(engine, "v2-restored-again")
                results["restored_after_partial"] = float((lp4 - _hf_logprobs(mem_model, ids4)).abs().max())

                # vLLM's own layer-wise reload (explorer.direct_weight_load=false) gives the same
                lw_model = perturbed(embedded_model, 5)
                engine.direct_weight_load = False
                lw = mem.send(lw_model, 5)
                await engine.pause("wait")
                await mem.receive(engine, lw, 5)
                await engine.resume()
                ids5, lp5, spans5 = await _sample(engine, "v5")
                results["layerwise"] = float((lp5 - _hf_logprobs(lw_model, ids5)).abs().max())
                assert spans5[0].version == "5" and engine.load_path == "layerwise (turned off)"

                # a sender that splits fused layers across buckets: their parts are gathered
                engine.direct_weight_load = True
                split_model = perturbed(embedded_model, 6)
                split, buckets = _split_handle(split_model, 1 << 18)
                assert _fused_layers_split(buckets), "no fused layer spans two buckets"
                await engine.pause("wait")
                await mem.receive(engine, split, 6)
                await engine.resume()
                ids6, lp6, _ = await _sample(engine, "v6")
                results["split"] = float((lp6 - _hf_logprobs(split_model, ids6)).abs().max())
                assert engine.load_path == "direct" and engine.gathered_layers  # those split were gathered
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
    assert results["restored_after_partial"] < 1e-4, results
    assert results["layerwise"] < 1e-4, results
    assert results["split"] < 1e-4, results


def _split_handle(model, bucket_bytes: int):
    """A MEMORY handle whose buckets are cut at any tensor (fused layers split), and its buckets."""
    import ray

    from serve_rft.weights.memory import checkpoint_tensors, pack_bucket
    from serve_rft.weights.verify import digest

    buckets, size = [[]], 0
    for name, t in checkpoint_tensors(model):
        n = t.numel() * t.element_size()
        if buckets[-1] and size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += n
    blobs = [pack_bucket(b) for b in buckets]
    return {"method": "memory", "buckets": [ray.put(b) for b in blobs], "checksums": [digest(b) for b in blobs],
            "bytes": sum(t.numel() * t.element_size() for b in buckets for _, t in b)}, buckets


def _fused_layers_split(buckets) -> bool:
    """Whether ``buckets`` (lists of ``(name, tensor)``) put the parts of some fused vLLM layer in
    different buckets."""
    where = {}
    for i, bucket in enumerate(buckets):
        for name, _ in bucket:
            for part, fused in (("q_proj", "qkv"), ("k_proj", "qkv"), ("v_proj", "qkv"),
                                ("gate_proj", "gate_up"), ("up_proj", "gate_up")):
                if f".{part}.weight" in name:
                    where.setdefault(name.replace(part, fused), set()).add(i)
    return any(len(buckets) > 1 for buckets in where.values())


def _trained_adapter(embedded_model, seed, rank=8):
    """A peft model whose LoRA B matrices are random (so the adapter changes the policy)."""
    from serve_rft.trainer.policy.lora import random_adapter

    return random_adapter(embedded_model, rank, seed)


def test_adapter_only_sync_serves_each_version_as_its_adapter(embedded_model, tmp_path):
    """An engine started with LoRA: an adapter published by CHECKPOINT or MEMORY answers with
    exactly base + adapter; a request started on version 1 keeps version 1's adapter while
    version 2 is registered (no pause); an adapter vLLM refuses leaves the engine unchanged."""
    import ray

    from serve_rft.config import ExplorerConfig
    from serve_rft.explorer.engine.vllm_engine import ExplorerEngine
    from serve_rft.weights import CheckpointMethod, LoadFailed, MemoryMethod, load_or_restore
    from serve_rft.trainer.policy import lora

    from transformers import AutoModelForCausalLM

    def merged(peft_model):
        out = AutoModelForCausalLM.from_pretrained(str(embedded_model), dtype=torch.float32)
        lora.merge_into(peft_model, out)
        return out

    a1, a2 = _trained_adapter(embedded_model, 1), _trained_adapter(embedded_model, 2)
    init_local_ray(ray.init, num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        async def go():
            from vllm import SamplingParams
            from vllm.sampling_params import RequestOutputKind

            engine = await ExplorerEngine.create(str(embedded_model), ExplorerConfig(), lora_rank=8)
            try:
                res = {}
                ids0, lp0, _ = await _sample(engine, "base")
                base = AutoModelForCausalLM.from_pretrained(str(embedded_model), dtype=torch.float32)
                res["base"] = float((lp0 - _hf_logprobs(base, ids0)).abs().max())
                ck = CheckpointMethod(tmp_path / "ck")
                h1 = ck.send(a1, 1)
                info = await ck.receive(engine, h1, 1)
                assert engine.policy_version == 1 and 0 < info["bytes"] < 500_000
                ids1, lp1, _ = await _sample(engine, "v1")
                res["checkpoint"] = float((lp1 - _hf_logprobs(merged(a1), ids1)).abs().max())

                # a long request on version 1; version 2 arrives (memory) while it runs.
                # (ignore_eos, not min_tokens: min_tokens masks EOS, which shifts vLLM's
                # processed logprobs by -log(1 - p_eos))
                sp = SamplingParams(temperature=1.0, max_tokens=200, ignore_eos=True, logprobs=0, seed=5,
                                    output_kind=RequestOutputKind.FINAL_ONLY)

                async def long_request():
                    async for ro in engine.generate(PROMPT, sp, "long", version=1):
                        pass
                    return ro.outputs[0], asyncio.get_running_loop().time()

                task = asyncio.create_task(long_request())
                await asyncio.sleep(0.3)
                mem = MemoryMethod()
                await mem.receive(engine, mem.send(a2, 2), 2)
                swapped_at = asyncio.get_running_loop().time()
                out, finished_at = await task
                assert finished_at > swapped_at, "the request must span the adapter swap"
                ids_long = list(out.token_ids)
                lp_long = torch.tensor([out.logprobs[i][t].logprob for i, t in enumerate(ids_long)])
                res["in_flight_kept_v1"] = float((lp_long - _hf_logprobs(merged(a1), ids_long)).abs().max())
                assert len(ids_long) == 200
                assert float((lp_long - _hf_logprobs(merged(a2), ids_long)).abs().max()) > 0.05
                ids2, lp2, _ = await _sample(engine, "v2")
                res["memory"] = float((lp2 - _hf_logprobs(merged(a2), ids2)).abs().max())

                # rank 16 > the engine's max_lora_rank 8: refused, version 2 keeps serving
                h3 = ck.send(_trained_adapter(embedded_model, 3, rank=16), 3)
                with pytest.raises(LoadFailed):
                    await load_or_restore(engine, h3, 3, {"method": "memory"}, 2)
                assert engine.policy_version == 2 and 3 not in engine.adapters
                ids4, lp4, _ = await _sample(engine, "v2-again")
                res["after_refusal"] = float((lp4 - _hf_logprobs(merged(a2), ids4)).abs().max())
                return res
            finally:
                engine.shutdown()

        results = asyncio.run(go())
    finally:
        ray.shutdown()
    print(results)
    assert all(v < 1e-4 for v in results.values()), results

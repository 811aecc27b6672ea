"""LoRA training (seed 004): with merge_and_sync the published full model equals base + adapter;
without, only the adapter is published (as a folder or a memory object) and it rebuilds the same
policy; only the adapter trains, and a saved state resumes exactly."""

import pytest
import torch

from serve_rft.config import load_config
from serve_rft.service.ray_start import init_local_ray
from serve_rft.trainer.policy.policy import PolicyTrainer
from serve_rft.trainer.publishing.state import save_state
from tests.support.batches import small_batch

LORA = ["trainer.lora={rank: 4, alpha: 8}", "trainer.lr=0.01"]


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def test_the_published_model_is_base_plus_adapter_and_only_the_adapter_trains(embedded_model, tmp_path):
    """...streamed: the merged weights are computed a bucket at a time (no second full copy of
    the model is kept); the folder they write loads as a plain transformers model."""
    from transformers import AutoModelForCausalLM

    from serve_rft.trainer.policy.gathered import GatheredModel

    p = PolicyTrainer(load_config(None, LORA), str(embedded_model))
    base_before = {n: t.detach().clone() for n, t in p.model.named_parameters() if ".lora_" not in n}
    for k in range(3):
        p.step(small_batch(k))
    for n, t in p.model.named_parameters():
        if ".lora_" not in n:
            assert torch.equal(t, base_before[n]), n  # the base is frozen
    published = p.publish_model()
    assert isinstance(published, GatheredModel)
    published.save_pretrained(tmp_path / "merged")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not hasattr(p, "export")  # no second full copy
    ids = [1, 5, 9, 33, 70, 2]
    assert torch.allclose(_logits(exported, ids), _logits(p.model, ids), atol=1e-5)
    plain = PolicyTrainer(load_config(None, []), str(embedded_model))
    assert not torch.allclose(_logits(exported, ids), _logits(plain.model, ids), atol=1e-3)  # it moved
    assert exported.__class__.__name__ == "Qwen2ForCausalLM"  # the folder is a plain transformers model


def test_a_lora_state_resumes_exactly_and_loads_as_a_merged_hf_model(embedded_model, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = load_config(None, LORA)
    a = PolicyTrainer(cfg, str(embedded_model))
    a.step(small_batch(0))
    path = save_state(tmp_path, a.publish_model(), a.optimizer, 3, 3, a.baseline.value, [], embedded_model,
                      scheduler=a.scheduler, adapter_model=a.model)
    b = PolicyTrainer(cfg, str(embedded_model), resume=path)
    ids = [1, 5, 9, 33, 70, 2]
    assert torch.allclose(_logits(b.model, ids), _logits(a.model, ids), atol=1e-6)
    merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert torch.allclose(_logits(merged, ids), _logits(a.model, ids), atol=1e-5)
    a.step(small_batch(1))
    b.step(small_batch(1))
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.allclose(x, y, atol=1e-6), n


def test_lora_kl_uses_the_base_as_reference(embedded_model):
    p = PolicyTrainer(load_config(None, LORA + ["trainer.kl_coef=0.1"]), str(embedded_model))
    first = p.step(small_batch(0))
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # adapter B starts at 0: policy == base
    p.step(small_batch(1))
    assert p.step(small_batch(2))["kl_ref"] > 0


ADAPTER_ONLY = ["trainer.lora={rank: 4, alpha: 8, merge_and_sync: false}", "trainer.lr=0.01"]


def _rebuilt(embedded_model, folder):
    """base + the adapter folder, as peft (and vLLM) would load it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(embedded_model), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(folder))


def test_adapter_only_sync_publishes_the_adapter_alone(embedded_model, tmp_path):
    """CHECKPOINT writes only adapter files (no full weights); MEMORY carries the same tensors
    and config; either folder + the base gives the trained policy, and the trainer state still
    holds full merged weights."""
    import asyncio

    from transformers import AutoModelForCausalLM

    import ray

    from serve_rft.weights import CheckpointMethod, MemoryMethod

    cfg = load_config(None, ADAPTER_ONLY)
    assert cfg.adapter_sync and cfg.trainer.lora.vllm_max_lora_rank() == 8
    p = PolicyTrainer(cfg, str(embedded_model))
    for k in range(2):
        p.step(small_batch(k))
    ids = [1, 5, 9, 33, 70, 2]
    want = _logits(p.model, ids)
    handle = CheckpointMethod(tmp_path / "ckpt").send(p.publish_model(), 3)
    folder = tmp_path / "ckpt" / "v000003"
    assert handle == {"method": "checkpoint", "path": str(folder), "adapter": True,
                      "checksums": {"adapter_model.safetensors": handle["checksums"]["adapter_model.safetensors"]}}
    assert (folder / "adapter_config.json").is_file() and not (folder / "model.safetensors").exists()
    assert torch.allclose(_logits(_rebuilt(embedded_model, folder), ids), want, atol=1e-5)

    class Engine:  # what MemoryMethod.receive asks of an ExplorerEngine for an adapter
        adapter_dir = tmp_path / "shm"
        adapters: dict = {}

        async def load_adapter(self, path, version):
            self.adapters[version] = path
            return 0.0

    init_local_ray(ray.init, num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        mh = MemoryMethod().send(p.publish_model(), 3)
        assert mh["adapter"] and 0 < mh["bytes"] < 200_000
        engine = Engine()
        asyncio.run(MemoryMethod().receive(engine, mh, 3))
    finally:
        ray.shutdown()
    assert torch.allclose(_logits(_rebuilt(embedded_model, engine.adapters[3]), ids), want, atol=1e-5)
    full = p.full_model()  # what a trainer state holds: the merged weights, streamed
    assert not hasattr(full, "peft_config")
    full.save_pretrained(tmp_path / "full")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "full", dtype=torch.float32)
    assert torch.allclose(_logits(merged, ids), want, atol=1e-5)


def test_adapter_only_sync_config_errors():
    with pytest.raises(Exception, match="checkpoint or memory"):
        load_config(None, ["trainer.lora={merge_and_sync: false}", "synchronizer.sync_method=nccl",
                           "trainer.device=cuda", "explorer.num_gpus_per_replica=1"])
    with pytest.raises(Exception, match="up to rank 512"):
        load_config(None, ["trainer.lora={merge_and_sync: false, rank: 600}"])


def test_a_bf16_lora_base_trains_the_fp32_adapter_and_publishes_fp32_merged_weights(embedded_model, tmp_path):
    """trainer.precision=bf16: the frozen base is held in bf16 (half of fp32's memory), the
    adapter and its AdamW state in fp32; the published merged weights are fp32 base + delta and
    compute the policy the adapted model computes (within bf16 rounding)."""
    from transformers import AutoModelForCausalLM

    p = PolicyTrainer(load_config(None, LORA + ["trainer.precision=bf16"]), str(embedded_model))
    dtypes = {n: t.dtype for n, t in p.model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    for k in range(2):
        stats = p.step(small_batch(k))
    assert stats["grad_norm"] > 0
    p.publish_model().save_pretrained(tmp_path / "merged")
    from safetensors import safe_open

    for f in (tmp_path / "merged").glob("*.safetensors"):  # as stored, not as loaded
        with safe_open(str(f), "pt") as fh:
            assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.float32}, f
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    base = {n.removeprefix("base_model.model.").replace(".base_layer.", "."): t
            for n, t in p.model.named_parameters() if ".lora_" not in n}
    moved = 0
    for n, t in merged.named_parameters():
        moved += not torch.equal(t, base[n].float())
    assert moved > 0  # the adapter's delta is in the merged weights
    ids = [1, 5, 9, 33, 70, 2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _logits(p.model, ids).float().log_softmax(-1)
    got = _logits(merged, ids).log_softmax(-1)
    assert (got - want).abs().max() < 0.1  # bf16 activations against fp32 ones


def test_merged_lora_refuses_nccl():
    with pytest.raises(Exception, match="checkpoint or memory"):
        load_config(None, ["trainer.lora={rank: 4}", "synchronizer.sync_method=nccl", "trainer.device=cuda",
                           "explorer.num_gpus_per_replica=1"])

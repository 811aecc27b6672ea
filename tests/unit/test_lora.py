"""LoRA training with merge_and_sync (seed 004): the published full model equals base + adapter,
only the adapter trains, and a saved state resumes exactly."""

import pytest
import torch

from serve_rft.config import load_config
from serve_rft.trainer.actor import PolicyTrainer
from serve_rft.trainer.state import save_state
from tests.unit.test_losses import _batch

LORA = ["trainer.lora={rank: 4, alpha: 8}", "trainer.lr=0.01"]


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def test_the_published_model_is_base_plus_adapter_and_only_the_adapter_trains(embedded_model):
    p = PolicyTrainer(load_config(None, LORA), str(embedded_model))
    base_before = {n: t.detach().clone() for n, t in p.model.named_parameters() if ".lora_" not in n}
    for k in range(3):
        p.step(_batch(k))
    for n, t in p.model.named_parameters():
        if ".lora_" not in n:
            assert torch.equal(t, base_before[n]), n  # the base is frozen
    exported = p.publish_model()
    ids = [1, 5, 9, 33, 70, 2]
    assert torch.allclose(_logits(exported, ids), _logits(p.model, ids), atol=1e-5)
    plain = PolicyTrainer(load_config(None, []), str(embedded_model))
    assert not torch.allclose(_logits(exported, ids), _logits(plain.model, ids), atol=1e-3)  # it moved
    assert exported.__class__.__name__ == "Qwen2ForCausalLM"  # a plain model: any sync method takes it


def test_a_lora_state_resumes_exactly_and_loads_as_a_merged_hf_model(embedded_model, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = load_config(None, LORA)
    a = PolicyTrainer(cfg, str(embedded_model))
    a.step(_batch(0))
    path = save_state(tmp_path, a.publish_model(), a.optimizer, 3, 3, a.baseline.value, [], embedded_model,
                      scheduler=a.scheduler, adapter_model=a.model)
    b = PolicyTrainer(cfg, str(embedded_model), resume=path)
    ids = [1, 5, 9, 33, 70, 2]
    assert torch.allclose(_logits(b.model, ids), _logits(a.model, ids), atol=1e-6)
    merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert torch.allclose(_logits(merged, ids), _logits(a.model, ids), atol=1e-5)
    a.step(_batch(1))
    b.step(_batch(1))
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.allclose(x, y, atol=1e-6), n


def test_lora_kl_uses_the_base_as_reference(embedded_model):
    p = PolicyTrainer(load_config(None, LORA + ["trainer.kl_coef=0.1"]), str(embedded_model))
    first = p.step(_batch(0))
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # adapter B starts at 0: policy == base
    p.step(_batch(1))
    assert p.step(_batch(2))["kl_ref"] > 0


def test_adapter_only_sync_is_refused_until_built():
    with pytest.raises(Exception, match="merge_and_sync"):
        load_config(None, ["trainer.lora={merge_and_sync: false}"])

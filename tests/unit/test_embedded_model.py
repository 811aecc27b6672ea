import json

import torch


def test_embedded_model_is_a_real_qwen2_directory(embedded_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((embedded_model / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    assert (embedded_model / "model.safetensors").exists()
    tok = AutoTokenizer.from_pretrained(str(embedded_model))
    assert len(tok) == cfg["vocab_size"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    model = AutoModelForCausalLM.from_pretrained(str(embedded_model), dtype=torch.float32)
    ids = tok("hello world", return_tensors="pt").input_ids
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], cfg["vocab_size"])


def test_ensure_is_idempotent(embedded_model):
    from serve_rft.model.embedded import ensure_embedded_model

    before = (embedded_model / "model.safetensors").stat().st_mtime_ns
    assert ensure_embedded_model(embedded_model.parent) == embedded_model
    assert (embedded_model / "model.safetensors").stat().st_mtime_ns == before


def test_resolve_rejects_a_non_model_directory(tmp_path):
    import pytest

    from serve_rft.model.embedded import resolve_model_path

    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path), tmp_path)

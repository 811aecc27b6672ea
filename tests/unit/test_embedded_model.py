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


def test_the_chat_template_renders_tools_calls_and_results_as_qwen25_does(embedded_model):
    """Tools in the system turn, an assistant's ``tool_calls`` as <tool_call> JSON blocks,
    ``tool`` messages as <tool_response> blocks of one user turn (Qwen2.5-Instruct's layout)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(embedded_model))
    tools = [{"type": "function", "function": {"name": "add", "description": "Add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    messages = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "tool", "tool_call_id": "c2", "content": "2"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert '\n<tools>\n{"type": "function", "function": {"name": "add"' in text
    assert ("<|im_start|>assistant\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>\n"
            "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2}}\n</tool_call><|im_end|>\n") in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    plain = tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
                                    tokenize=False, add_generation_prompt=True)
    assert plain == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def _hub_cache(embedded_model, root, repo_id="acme/tiny-chat"):
    """A Hugging Face hub cache (its on-disk layout: models--{owner}--{name}/refs/main naming a
    snapshot folder) holding the embedded model as ``repo_id``: what `hf download` leaves."""
    import shutil

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    shutil.copytree(embedded_model, repo / "snapshots" / revision)
    return repo / "snapshots" / revision


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(embedded_model, tmp_path, monkeypatch):
    import pytest

    from serve_rft.model.embedded import _hub_snapshot

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = _hub_cache(embedded_model, tmp_path)
    assert _hub_snapshot("acme/tiny-chat", tmp_path) == snapshot
    with pytest.raises(FileNotFoundError) as e:
        _hub_snapshot("acme/not-cached", tmp_path)
    assert "HF_HUB_OFFLINE" in str(e.value) and "\n" not in str(e.value)


def test_serve_rft_takes_a_hub_id_as_vllm_serve_does_and_refuses_a_bad_model_in_one_line(embedded_model, tmp_path):
    """``serve-rft config validate --model owner/name`` with the model in the hub cache: valid
    (exit 0); an id that is not cached (offline) or a directory without a model: one line, exit 2,
    before anything starts."""
    import os
    import subprocess
    import sys

    _hub_cache(embedded_model, tmp_path / "hub")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}

    def validate(model):
        return subprocess.run([sys.executable, "-m", "serve_rft.cli", "config", "validate", "--model", model],
                              env=env, capture_output=True, text=True, timeout=120)

    ok = validate("acme/tiny-chat")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for bad in ("acme/not-cached", str(tmp_path)):
        out = validate(bad)
        assert out.returncode == 2, out.stdout + out.stderr
        lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
        assert len(lines) == 1 and "model.path" in lines[0], lines

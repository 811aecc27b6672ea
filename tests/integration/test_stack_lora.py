"""The loop with adapter-only LoRA sync (``trainer.lora.merge_and_sync=false``; Twinkle's
CheckpointEngine documentation, "merge_and_sync"): the trainer publishes only its adapter
(CHECKPOINT folders), replicas started with vLLM's LoRA support register each version's adapter
without pausing, and serve exactly base + adapter."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.load import get_status
from tests.support.stack import stack_fixture
from tests.support.stack_checks import check_served_logprobs, check_training_rolls_new_versions

pytestmark = pytest.mark.integration


stack = stack_fixture("run-lora", ["trainer.lora={rank: 8, alpha: 32, merge_and_sync: false}",
                                   "trainer.keep_states=1000", "trainer.keep_checkpoints=1000"])


def test_adapter_versions_roll_without_pause_or_failures(stack):
    check_training_rolls_new_versions(stack)
    from serve_rft.weights.folders import committed_versions, version_dir

    st = get_status(stack.url)
    for r in st["replicas"]:
        last = r["last_sync"]
        assert last and last["drain_s"] < 0.05 and last["pause_s"] < 0.05, r  # no drain, no pause
        assert 0 < last["bytes"] < 1_000_000, r  # an adapter, not the model
    versions = committed_versions(stack.run_dir / "checkpoints")
    assert versions
    for v in versions:
        folder = version_dir(stack.run_dir / "checkpoints", v)
        assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
        assert not (folder / "model.safetensors").exists()


def test_each_response_is_one_adapter_version_with_its_exact_logprobs(stack):
    """Every logged experience has one policy version for all its tokens (a request keeps its
    adapter), and the served logprobs equal base + that version's adapter (the trainer state
    holds the merged weights)."""
    from serve_rft.buffer.store import ExperienceStore

    check_served_logprobs(stack, "trainer_state")

    async def spans():
        s = ExperienceStore(stack.redis_url, stack.prefix)
        try:
            out = []
            for _ in range(5):
                async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
                    r = await c.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "span"}], "max_tokens": 24, "n": 2})
                body = r.json()
                for ch in body["choices"]:
                    exp = await s.get_experience(body["id"], ch["index"])
                    out.append((int(r.headers["x-serve-rft-policy-version"]), exp.token_versions))
            return out
        finally:
            await s.close()

    for version, token_versions in asyncio.run(spans()):
        assert len({v for v, _, _ in token_versions}) == 1 and token_versions[0][0] == version

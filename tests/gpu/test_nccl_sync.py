"""NCCL weight sync on the real stack: runs only where CUDA, at least 3 GPUs (trainer + two
replicas; NCCL puts each rank on its own device) and a CUDA build of vLLM are present. The
project's CI machines have none, so these are skipped there; the README says NCCL is unverified
on them. The handshake logic itself is unit-tested on CPU (tests/unit/test_nccl_handshake.py).
"""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.support.stack import stack_fixture
from tests.support.stack_checks import check_training_rolls_new_versions


def _nccl_runnable() -> bool:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 3:
        return False
    try:
        from serve_rft.weights.nccl import check_available

        check_available()
    except Exception:
        return False
    return True


pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not _nccl_runnable(), reason="needs 3 CUDA GPUs and vLLM with NCCL")]


stack = stack_fixture("run-nccl", ["synchronizer.sync_method=nccl", "trainer.device=cuda",
                                   "explorer.num_gpus_per_replica=1", "explorer.kv_cache_gib=1",
                                   "synchronizer.sync_style=trainer_driven"])


def test_nccl_rolls_versions_with_the_two_way_handshake(stack):
    check_training_rolls_new_versions(stack)
    st = httpx.get(f"{stack.url}/v1/status").json()
    assert all(r["last_sync"] and r["last_sync"]["bytes"] > 0 for r in st["replicas"]), st
    assert not (stack.run_dir / "checkpoints").exists(), "NCCL must not write checkpoints"
    events = httpx.get(f"{stack.url}/v1/sync/events").json()["events"]
    trainer_states = {e["state"] for e in events if e["component"] == "trainer"}
    # both sides toggle for NCCL (Trinity-RFT Synchronizer documentation, "Three Key States")
    assert "REQUIRE_SYNC" in trainer_states


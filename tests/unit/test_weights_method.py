"""`serve_rft.weights.method_class`: the one query callers outside `serve_rft.weights` make of a
configured sync method (preflight, a replica's engine set-up)."""

from __future__ import annotations

import pytest
import torch

from serve_rft.config import SyncMethod
from serve_rft.weights import CheckpointMethod, MemoryMethod, MethodUnavailable, NcclMethod, method_class


def test_every_configurable_method_has_its_class():
    assert method_class(SyncMethod.CHECKPOINT) is CheckpointMethod
    assert method_class(SyncMethod.MEMORY) is MemoryMethod
    assert method_class(SyncMethod.NCCL) is NcclMethod
    assert {m.value for m in SyncMethod} == {method_class(m).name for m in SyncMethod}


def test_only_nccl_needs_a_weight_transfer_backend_in_the_engine():
    assert method_class(SyncMethod.NCCL).engine_transfer == "nccl"
    assert method_class(SyncMethod.CHECKPOINT).engine_transfer is None
    assert method_class(SyncMethod.MEMORY).engine_transfer is None


def test_checkpoint_and_memory_run_anywhere():
    method_class(SyncMethod.CHECKPOINT).check_available()
    method_class(SyncMethod.MEMORY).check_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="NCCL may run on a machine with CUDA")
def test_nccl_is_refused_without_cuda():
    with pytest.raises(MethodUnavailable, match="CUDA"):
        method_class(SyncMethod.NCCL).check_available()

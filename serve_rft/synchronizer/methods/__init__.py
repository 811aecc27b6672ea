"""Weight-sync methods behind one interface (`base.WeightSyncMethod`); `make_method` picks one."""

from __future__ import annotations

from pathlib import Path

from serve_rft.config import Config, SyncMethod
from serve_rft.synchronizer.methods.base import WeightSyncMethod
from serve_rft.synchronizer.methods.checkpoint import CheckpointMethod
from serve_rft.synchronizer.methods.memory import MemoryMethod


__all__ = ["CheckpointMethod", "MemoryMethod", "WeightSyncMethod", "make_method", "receiver_for"]


def make_method(cfg: Config) -> WeightSyncMethod:
    """The configured method (trainer side; replicas use `receiver_for`).

    Raises:
        ValueError: a method this build cannot run.
    """
    m = cfg.synchronizer.sync_method
    if m is SyncMethod.CHECKPOINT:
        return CheckpointMethod(Path(cfg.service.run_dir) / "checkpoints", cfg.trainer.keep_checkpoints)
    if m is SyncMethod.MEMORY:
        return MemoryMethod(cfg.synchronizer.bucket_bytes)
    raise ValueError(f"sync_method {m.value} is not available")


def receiver_for(handle: dict) -> WeightSyncMethod:
    """The method that can ``receive`` this handle (replica side; needs no trainer state)."""
    name = handle["method"]
    if name == CheckpointMethod.name:
        return CheckpointMethod(Path(handle["path"]).parent)
    if name == MemoryMethod.name:
        return MemoryMethod()
    raise ValueError(f"unknown sync method in handle: {name!r}")

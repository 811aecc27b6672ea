"""The weights wing: every weight-sync method, both sides, behind one interface.

`base.WeightSyncMethod` is what the trainer (``prepare``, ``send``, ``serve_window``,
``peer_waiting``, ``trainer_peer``) and a replica (``precheck``, ``receive``) call without knowing
which method runs; `make_method` builds the configured one for the trainer, `receiver_for` the one
a handle names for a replica. CHECKPOINT (`checkpoint`, its version folders in `folders`),
MEMORY (`memory`: buckets through Ray's object store), NCCL (`nccl`: vLLM's weight-transfer
engine); `adapters` moves LoRA adapters, `verify` checks what arrived (checksums, probe logprobs).
"""

from __future__ import annotations

from pathlib import Path

from serve_rft.config import Config, SyncMethod
from serve_rft.weights.base import EngineBroken, EngineUnchanged, MethodUnavailable, WeightSyncMethod
from serve_rft.weights.checkpoint import CheckpointMethod
from serve_rft.weights.memory import MemoryMethod
from serve_rft.weights.nccl import NcclMethod
from serve_rft.weights.nccl_sender import NcclSender


__all__ = ["CheckpointMethod", "EngineBroken", "EngineUnchanged", "LoadFailed", "MemoryMethod",
           "MethodUnavailable", "NcclMethod", "WeightSyncMethod", "load_or_restore", "make_method",
           "method_class", "receiver_for"]

METHODS: dict[SyncMethod, type[WeightSyncMethod]] = {
    SyncMethod.CHECKPOINT: CheckpointMethod, SyncMethod.MEMORY: MemoryMethod, SyncMethod.NCCL: NcclMethod}
"""The class behind each configured ``synchronizer.sync_method``."""


class LoadFailed(Exception):
    """Loading a version failed; the engine was restored to the previous version."""


async def load_or_restore(engine, handle: dict, version: int, previous_handle: dict,
                          previous_version: int) -> dict[str, float]:
    """Load ``version`` into a paused ``engine``; on failure reload the previous version, so the
    engine never serves half old, half new weights.

    Returns:
        The method's load info (seconds, bytes).
    Raises:
        LoadFailed: the load failed and the previous version was restored, or was never left
            (`EngineUnchanged`); the cause chained.
        EngineBroken: the engine cannot be restored in place (the replica must be replaced).
        Exception: the restore failed too (the replica must be replaced).
    """
    try:
        return await receiver_for(handle).receive(engine, handle, version)
    except EngineUnchanged as e:
        raise LoadFailed(f"loading version {version} failed: {e}") from e
    except EngineBroken:
        raise
    except Exception as e:
        await receiver_for(previous_handle).receive(engine, previous_handle, previous_version)
        raise LoadFailed(f"loading version {version} failed: {e!r}") from e


def method_class(method: SyncMethod) -> type[WeightSyncMethod]:
    """The class of a configured sync method, for what callers outside this package ask of it
    without an instance: ``check_available()`` (preflight), ``engine_transfer`` (the vLLM
    weight-transfer backend a replica's engine enables), ``handshake``, ``durable``.

    Raises:
        ValueError: a method this build cannot run.
    """
    try:
        return METHODS[method]
    except KeyError:
        raise ValueError(f"sync_method {method.value} is not available") from None


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
    if m is SyncMethod.NCCL:
        return NcclMethod(sender=NcclSender(reserve_timeout_s=cfg.synchronizer.sync_timeout_s,
                                            bucket_bytes=cfg.synchronizer.bucket_bytes))
    raise ValueError(f"sync_method {m.value} is not available")


def receiver_for(handle: dict) -> WeightSyncMethod:
    """The method that can ``receive`` this handle (replica side; needs no trainer state)."""
    name = handle["method"]
    if name == CheckpointMethod.name:
        return CheckpointMethod(Path(handle["path"]).parent)
    if name == MemoryMethod.name:
        return MemoryMethod()
    if name == NcclMethod.name:
        return NcclMethod()
    raise ValueError(f"unknown sync method in handle: {name!r}")

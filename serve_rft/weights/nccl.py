"""NCCL: weights go GPU to GPU through vLLM's weight-transfer engine, bucketed.

**Unverified on this project's machines** (CPU only): written against vLLM's documented API
(``vllm/distributed/weight_transfer/nccl_engine.py``: `NCCLTrainerWeightTransferEngine` on the
trainer, ``AsyncLLM.init_weight_transfer_engine / start_weight_update / update_weights /
finish_weight_update`` on a replica); `tests/gpu/test_nccl_sync.py` runs it where CUDA and vLLM
are present. The handshake logic below is unit-tested on CPU with fakes.

Process groups, set up by the synchronizer (`Synchronizer.nccl_group`): one group per replica,
rank 0 = the trainer, ranks 1..W = the replica's vLLM workers (W = ``explorer.tensor_parallel_size``;
vLLM gives each worker its rank from the group's offset). The synchronizer asks the trainer for a
rendezvous endpoint (its node address and a free port); the replica joins from its workers while
the trainer joins rank 0, at the same time.
One group per replica, not one for all, because replicas sync at different moments (rolling).

Two-way handshake (the Trinity-RFT Synchronizer documentation, "NCCL Synchronization"): both sides must be in the collective at
once, so a transfer needs the trainer too. After publishing version v the trainer goes
REQUIRE_SYNC and opens a *sync window* (`NcclSender.serve_window`): its weights stay at v while
replicas pull. A replica granted v (REQUIRE_SYNC, drained, paused) *reserves* the trainer
(`NcclSender.reserve`: waits for a window, takes the send lock), then starts vLLM's update and
receives while the trainer broadcasts (`NcclSender.broadcast`, vLLM's packed producer: buckets of
``packed_buffer_size_bytes``, double-buffered). The window closes once no live replica that is
due lags behind v and nobody waits, or after ``sync_timeout_s``; both sides return to RUNNING.
A replica that reserves while no window is open waits for the next one (the trainer also opens
one between steps when someone waits); the version it gets is the trainer's current one, which
may be newer than its order's, and it is labelled with that.

The trainer's side (`NcclSender`: rank 0 of each group, the send lock, the window) is in
`serve_rft.weights.nccl_sender`; this module holds the method and the replica's side.

Failures: before vLLM's update starts, the engine is untouched (`EngineUnchanged`: the replica
keeps serving its version and reports the failure). After it starts, a broken collective leaves
the workers blocked inside NCCL (vLLM's own note in `send_weights`), so nothing can be restored
in place (`EngineBroken`): the replica's sync loop ends and Ray Serve replaces it; the new
replica pulls the latest version before it takes traffic.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Collection

from serve_rft.weights.base import EngineBroken, EngineUnchanged, MethodUnavailable, WeightSyncMethod
from serve_rft.weights.nccl_sender import RANK_OFFSET, NcclSender

class NcclUnavailable(MethodUnavailable):
    """``sync_method=nccl`` cannot run here (no CUDA device, or a vLLM build without NCCL)."""


def check_available() -> None:
    """Fail fast, before anything starts, if this machine cannot run NCCL weight sync.

    Raises:
        NcclUnavailable: torch sees no CUDA device, or vLLM's NCCL weight transfer is missing.
    """
    import torch

    if not torch.cuda.is_available():
        raise NcclUnavailable("synchronizer.sync_method=nccl needs CUDA GPUs and torch sees none on "
                              "this machine; use sync_method=checkpoint or memory")
    try:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine  # noqa: F401
    except ImportError as e:
        raise NcclUnavailable(f"synchronizer.sync_method=nccl needs vLLM's NCCL weight transfer: {e}") from e


class _RayPeers:
    """The replica's view of the synchronizer and trainer actors (by name)."""

    def __init__(self):
        from serve_rft.names import get_synchronizer, get_trainer

        self.sync = get_synchronizer()
        self.trainer = get_trainer()

    async def group(self, replica_id: str, world_size: int) -> dict:
        return await self.sync.nccl_group.remote(replica_id, world_size)

    async def connect(self, replica_id: str, init_info: dict) -> dict:
        return await self.trainer.nccl_connect.remote(replica_id, init_info)

    async def reserve(self, replica_id: str) -> int:
        return await self.trainer.nccl_reserve.remote(replica_id)

    async def broadcast(self, replica_id: str) -> dict:
        return await self.trainer.nccl_broadcast.remote(replica_id)


class NcclMethod(WeightSyncMethod):
    """Trainer side: ``send`` only records the model (the bytes move in the handshake, through
    ``sender``). Replica side: ``receive`` joins the group once, then reserves, receives, labels.

    Args:
        timeout_s: bound on group set-up and on one transfer, seconds.
        peers: the synchronizer/trainer calls (Ray actors by default; fakes in unit tests).
    """

    name = "nccl"
    handshake = True
    engine_transfer = "nccl"

    @classmethod
    def check_available(cls) -> None:
        """The module's `check_available` (raises `NcclUnavailable`)."""
        check_available()

    def __init__(self, timeout_s: float = 300.0, peers=None, sender: NcclSender | None = None):
        self.timeout_s = timeout_s
        self.peers = peers
        self.sender = sender

    def prepare(self) -> None:
        check_available()
        if self.sender is None:
            self.sender = NcclSender()

    def send(self, model, version: int, in_use: Collection[int] | None = ()) -> dict[str, Any]:
        self.sender.model = model
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        return {"method": self.name, "version": version, "bytes": nbytes}

    async def serve_window(self, version: int, lagging: Callable[[], Awaitable[int]], timeout_s: float) -> float:
        return await self.sender.serve_window(version, lagging, timeout_s)

    def peer_waiting(self) -> bool:
        return self.sender is not None and self.sender.waiting

    def trainer_peer(self) -> NcclSender:
        if self.sender is None:
            raise RuntimeError("the NCCL sender is not prepared yet")
        return self.sender

    async def receive(self, engine, handle: dict[str, Any], version: int) -> dict[str, float]:
        """Pull the trainer's current version into ``engine`` (paused by the caller).

        Returns:
            ``seconds``, ``bytes`` and ``version`` (the version actually loaded, >= ``version``).
        Raises:
            EngineUnchanged: set-up or reservation failed; the engine serves what it served.
            EngineBroken: the transfer failed after vLLM's update started.
        """
        peers = self.peers or _RayPeers()
        rid = engine.replica_id
        if engine.nccl_update_info is None:
            try:
                init = await peers.group(rid, RANK_OFFSET + engine.world_size)
                _, info = await asyncio.wait_for(
                    asyncio.gather(engine.init_weight_transfer(init), peers.connect(rid, init)),
                    self.timeout_s)
            except Exception as e:
                raise EngineBroken(f"joining the NCCL group with the trainer failed: {e!r}") from e
            engine.nccl_update_info = info
        try:
            sent_version = await peers.reserve(rid)
        except Exception as e:
            raise EngineUnchanged(f"the trainer opened no sync window: {e!r}") from e
        t0 = time.perf_counter()
        try:
            await engine.start_weight_update()
            _, sent = await asyncio.wait_for(
                asyncio.gather(engine.update_weights(engine.nccl_update_info), peers.broadcast(rid)),
                self.timeout_s)
            await engine.finish_weight_update(sent_version)
        except Exception as e:
            raise EngineBroken(f"NCCL transfer of version {sent_version} failed: {e!r}") from e
        return {"seconds": time.perf_counter() - t0, "bytes": sent["bytes"], "version": sent_version}

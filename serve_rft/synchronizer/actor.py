"""The Synchronizer Ray actor: the one place that knows every component's state.

Talks to: the trainer (``publish``, ``set_trainer``), every explorer replica (``register``,
``poll`` long-poll for a `SyncOrder`, ``synced`` / ``failed``), and the HTTP API (``status``,
``events``). It never pushes into a replica: replicas pull (seed 000, CHECKPOINT/MEMORY: "the
Explorer initiates the sync request ... pulls the weights, then returns to RUNNING").
"""

from __future__ import annotations

import asyncio
import time

import ray

from serve_rft.config import SynchronizerConfig
from serve_rft.synchronizer.state import SyncState
from serve_rft.types import ComponentState, PublishedVersion, SyncOrder

NAMESPACE = "serve_rft"
SYNCHRONIZER_NAME = "serve_rft_synchronizer"


@ray.remote(num_cpus=0, max_concurrency=1000)
class Synchronizer:
    """Named actor ``serve_rft_synchronizer`` in namespace ``serve_rft``."""

    def __init__(self, cfg_json: str, num_replicas: int):
        cfg = SynchronizerConfig.model_validate_json(cfg_json)
        self.cfg = cfg
        self.state = SyncState(max_unavailable=cfg.max_unavailable, drain_mode=cfg.drain_mode,
                               replica_timeout_s=cfg.replica_timeout_s, num_replicas=num_replicas,
                               style=cfg.sync_style, interval=cfg.sync_interval,
                               offset=cfg.sync_offset, sync_timeout_s=cfg.sync_timeout_s)
        self._changed = asyncio.Condition()
        self._rebuilt = False
        from serve_rft.observability.sync_metrics import SyncMetrics

        self.metrics = SyncMetrics(cfg.sync_method.value)

    async def _rebuild(self) -> None:
        """After a restart (Ray restarts this actor with fresh state), recover the latest
        version from the trainer; replicas re-register themselves on their next poll."""
        if self._rebuilt:
            return
        self._rebuilt = True
        from serve_rft.trainer.actor import TRAINER_NAME

        try:
            trainer = ray.get_actor(TRAINER_NAME, namespace=NAMESPACE)
        except ValueError:  # no trainer (serve-only mode, or not created yet)
            return
        published = await trainer.latest_published.remote()
        if published is not None and published.version > self.state.latest_version():
            self.state.publish(published)

    async def _notify(self) -> None:
        self.metrics.refresh(self.state)
        async with self._changed:
            self._changed.notify_all()

    # -- replicas ------------------------------------------------------------------
    async def register(self, replica_id: str, version: int) -> None:
        await self._rebuild()
        self.state.register(replica_id, version)
        await self._notify()

    async def latest(self) -> PublishedVersion | None:
        """The latest published version (a new replica loads it before taking traffic)."""
        await self._rebuild()
        return self.state.latest

    async def poll(self, replica_id: str, version: int, explorer_step: int = 0,
                   timeout_s: float = 1.0) -> SyncOrder | None:
        """Heartbeat + long-poll: returns a `SyncOrder` when this replica may sync now."""
        await self._rebuild()
        deadline = time.monotonic() + timeout_s
        while True:
            self.state.heartbeat(replica_id, version, explorer_step)
            self.state.expire()
            self.metrics.refresh(self.state)
            order: SyncOrder | None = self.state.grant(replica_id)
            if order is not None:
                await self._notify()
                return order
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=left)
                except asyncio.TimeoutError:
                    pass

    async def synced(self, replica_id: str, version: int, timings: dict | None = None) -> None:
        self.state.synced(replica_id, version, timings=timings)
        self.metrics.observe_sync(replica_id, timings)
        await self._notify()

    async def failed(self, replica_id: str, version: int, error: str) -> None:
        self.state.failed(replica_id, version, error)
        self.metrics.failed(replica_id)
        await self._notify()

    # -- trainer -------------------------------------------------------------------
    async def publish(self, version: int, handle: dict) -> None:
        """The trainer published ``version``; ``handle`` is its sync method's handle.
        Idempotent for the latest version (a call retried across a restart)."""
        await self._rebuild()
        if version == self.state.latest_version() and self.state.latest is not None:
            return
        self.state.publish(PublishedVersion(version=version, handle=handle))
        await self._notify()

    def sync_requested(self) -> bool:
        """EXPLORER_DRIVEN: a replica waits for weights newer than the latest version."""
        return self.state.sync_requested()

    def in_use_floor(self) -> int:
        return self.state.in_use_floor()

    def lagging(self, version: int) -> int:
        """NCCL: live replicas due for a sync still below ``version`` (`SyncState.lagging`)."""
        self.state.expire()
        return self.state.lagging(version)

    async def nccl_group(self, replica_id: str, world_size: int) -> dict:
        """NCCL: set up ``replica_id``'s process group with the trainer (seed 000: "the
        Synchronizer helps set up communication groups"): rank 0 = the trainer, ranks
        1..``world_size``-1 = the replica's vLLM workers; the rendezvous is a free port on the
        trainer's node, the wire parameters (bucket size) the trainer's. The replica and the
        trainer then join at the same time.

        Returns:
            vLLM's worker init info (``NCCLWeightTransferInitInfo`` fields).
        """
        from serve_rft.trainer.actor import TRAINER_NAME

        trainer = ray.get_actor(TRAINER_NAME, namespace=NAMESPACE)
        return await trainer.nccl_endpoint.remote(world_size)

    def set_trainer(self, state: str, step: int) -> None:
        self.state.set_trainer(ComponentState(state), step)
        self.metrics.refresh(self.state)

    # -- views ---------------------------------------------------------------------
    def status(self) -> dict:
        if self.state.expire():
            self.metrics.refresh(self.state)
        return self.state.status()

    def events(self, since: float = 0.0) -> list[dict]:
        return [e.model_dump() for e in self.state.events if e.t >= since]


def get_or_create_synchronizer(cfg: SynchronizerConfig, num_replicas: int):
    """The named synchronizer actor, created (detached) if it does not exist yet.

    Ray restarts it if it dies (``max_restarts=-1``) and retries calls that were in flight
    (``max_task_retries``), so replicas and the trainer ride through a restart; the new
    instance rebuilds its state from the trainer and the replicas' polls.
    """
    return Synchronizer.options(name=SYNCHRONIZER_NAME, namespace=NAMESPACE, get_if_exists=True,
                                lifetime="detached", max_restarts=-1, max_task_retries=10,
                                ).remote(cfg.model_dump_json(), num_replicas)


def get_synchronizer(timeout_s: float = 60.0):
    """Look the synchronizer up by name, waiting up to ``timeout_s`` for it to exist.

    Raises:
        ValueError: it did not appear in time.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(SYNCHRONIZER_NAME, namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)

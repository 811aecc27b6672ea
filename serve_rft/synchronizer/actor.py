"""The Synchronizer Ray actor: the one place that knows every component's state.

Talks to: the trainer (``publish``, ``set_trainer``), every explorer replica (``register``,
``poll`` long-poll for a `PollReply`, ``renew`` while it syncs, ``synced`` / ``failed``,
``left``), the HTTP API (``status``, ``events``, ``rollout`` and the operator's ``pin``,
``rollback``, ``pause_promotion``, ``drain``), Ray (which replica actors are alive) and Redis (the
canary's rewards, its own rollout snapshot, both through its `SyncMonitor`; the store's experience
counts, which it reports as metrics). It never pushes into a replica: replicas pull (the
Trinity-RFT Synchronizer documentation, CHECKPOINT/MEMORY: "the Explorer initiates the sync
request ... pulls the weights, then returns to RUNNING"). The rules live in the pure
`serve_rft.synchronizer.state.SyncState`; this actor feeds it the clock and the world.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import ray

from serve_rft.config import BufferConfig, SynchronizerConfig
from serve_rft.names import NAMESPACE, SYNCHRONIZER_NAME, get_trainer
from serve_rft.synchronizer.monitor import SyncMonitor
from serve_rft.synchronizer.state import SyncState
from serve_rft.types import ComponentState, PollReply, PublishedVersion

log = logging.getLogger("serve_rft.synchronizer")

EXPIRE_EVERY_S = 0.5
CLOCK_PERIOD_S = 0.25
"""How often `Synchronizer._clock` notes that this process runs, s."""
STALL_S = 2.0
"""A gap longer than this since this process last ran (`Synchronizer._awake`) is a stall of the
synchronizer itself (SIGSTOP, a blocked event loop, a starved CPU): the replicas' silence during it
is pardoned (`serve_rft.synchronizer.membership.Membership.pardon`)."""


@ray.remote(num_cpus=0, max_concurrency=1000)
class Synchronizer:
    """Named actor ``serve_rft_synchronizer`` in namespace ``serve_rft``.

    Args:
        cfg_json: the `SynchronizerConfig` as JSON.
        buffer_json: the `BufferConfig` as JSON (the canary reads rewards there and the rollout
            is saved there), or None (no Redis: no canary verdicts, no saved rollout).
    """

    def __init__(self, cfg_json: str, buffer_json: str | None = None):
        cfg = SynchronizerConfig.model_validate_json(cfg_json)
        self.cfg = cfg
        self.state = SyncState(cfg)
        self._changed = asyncio.Condition()
        self.store = None
        if buffer_json is not None:
            from serve_rft.buffer.store import ExperienceStore

            self.store = ExperienceStore.from_config(BufferConfig.model_validate_json(buffer_json))
        from serve_rft.observability.store_metrics import StoreMetrics
        from serve_rft.observability.sync_metrics import SyncMetrics

        self.metrics = SyncMetrics(cfg.sync_method.value)
        self.store_metrics = StoreMetrics()
        # its rebuild and background checks; nothing is granted (or pruned) before `SyncMonitor.rebuild`
        self.monitor = SyncMonitor(cfg, self.state, self.store, self.metrics, self._expire, self._notify,
                                   ray.get_runtime_context().was_current_actor_reconstructed)
        self._ran_at = time.time()  # when this process was last seen running (`_awake`)
        self._watch_task = asyncio.get_running_loop().create_task(self.monitor.watch())
        self._clock_task = asyncio.get_running_loop().create_task(self._clock())
        self._counts_task = asyncio.get_running_loop().create_task(self._export_store_counts())

    # -- its own clock -------------------------------------------------------------
    async def _clock(self) -> None:
        """Note every `CLOCK_PERIOD_S` that this process runs (nothing else: it never blocks)."""
        while True:
            await asyncio.sleep(CLOCK_PERIOD_S)
            self._awake(time.time())

    async def _export_store_counts(self) -> None:
        """Every `STORE_COUNTS_PERIOD_S`, the store's counts into `StoreMetrics` (one reporter
        per stack); a Redis outage or a slow read only skips a beat."""
        from redis.exceptions import RedisError

        from serve_rft.observability.store_metrics import STORE_COUNTS_PERIOD_S

        while self.store is not None:
            await asyncio.sleep(STORE_COUNTS_PERIOD_S)
            try:
                self.store_metrics.counts(await asyncio.wait_for(self.store.counts(), STORE_COUNTS_PERIOD_S))
            except (asyncio.TimeoutError, RedisError):
                pass

    def _awake(self, now: float) -> None:
        """This process runs at ``now``: if it did not for longer than `STALL_S` before (it was
        stuck), pardon the replicas' silence meanwhile, before anything expires them."""
        gap = now - self._ran_at
        if gap > STALL_S:
            log.warning("synchronizer: this process did not run for %.1f s; the replicas' silence "
                        "meanwhile does not count against them", gap)
            self.state.members.pardon(gap - CLOCK_PERIOD_S, now)
        self._ran_at = max(self._ran_at, now)

    def _expire(self, now: float, every_s: float = 0.0) -> list[str]:
        """`SyncState.expire` after `_awake`: a silence this process did not listen through
        never expires a replica."""
        self._awake(now)
        return self.state.expire(now, every_s)

    # -- replicas ------------------------------------------------------------------
    async def register(self, replica_id: str, version: int, base_handle: dict | None = None,
                       handle: dict | None = None, drained: bool = False, actor_name: str | None = None,
                       pid: int | None = None, warming: bool = False, node_id: str | None = None) -> None:
        """A replica serves ``version`` (``handle`` loads it; ``base_handle`` its initial weights);
        ``actor_name``: its Ray actor (how its death is noticed); ``pid`` / ``node_id``: its
        process and Ray node."""
        await self.monitor.rebuild()
        if actor_name:
            self.monitor.watch_actor(replica_id, actor_name)
        self.state.register(replica_id, version, time.time(), base_handle=base_handle, handle=handle,
                            drained=drained, pid=pid, warming=warming, node_id=node_id)
        await self._notify()

    async def initial(self) -> PublishedVersion | None:
        """What a replica starting now loads before it takes traffic (pinned, else incumbent)."""
        await self.monitor.rebuild()
        return self.state.initial()

    async def latest(self) -> PublishedVersion | None:
        """The latest published version (the trainer numbers new versions after it)."""
        await self.monitor.rebuild()
        return self.state.latest

    # Heartbeats (every replica, every second) are not traced as Ray task events: the GCS keeps
    # kilobytes per traced call up to RAY_task_events_max_num_task_in_gcs (benchmarks/
    # gcs_task_events.py measures it), megabytes per replica-hour of heartbeats.
    @ray.method(enable_task_events=False)
    async def poll(self, replica_id: str, version: int, explorer_step: int = 0, timeout_s: float = 1.0,
                   traffic: dict[int, tuple[int, int, float]] | None = None, refused: int | None = None,
                   ready: bool = True, drained: bool = False) -> PollReply:
        """Heartbeat + long-poll: returns within ``timeout_s`` with a `SyncOrder` if this
        replica may sync now. ``traffic``: requests that ended since the last poll, per version
        (requests, errors, latency seconds), for a canary's verdict; ``refused``: requests it
        refused so far while out of rotation; ``ready``: a request has reached it through the
        ingress (until then it is warming: not counted in rotation); ``drained``: it holds an
        operator's drain now (put back, it counts in rotation once it says it no longer does)."""
        await self.monitor.rebuild()
        if not self.state.known(replica_id):
            return PollReply(known=False)
        if traffic:
            self.state.record_traffic({int(k): tuple(v) for k, v in traffic.items()})
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.time()
            self._expire(now, EXPIRE_EVERY_S)
            self.state.heartbeat(replica_id, version, explorer_step, now, refused, ready, drained)
            try:
                await self.monitor.check_ray()
            except Exception:  # noqa: BLE001 - GCS busy: the grant below trusts the last answer,
                log.exception("listing replica actors")  # the monitor tries again every second
            order = self.state.grant(replica_id, time.time())
            r = self.state.members.get(replica_id)
            reply = PollReply(order=order, drained=self.state.drain_holds(replica_id),
                              role="canary" if r is not None and self.state.rollout.is_canary(r)
                              else "incumbent")
            if order is not None:
                await self._notify()
                return reply
            left = deadline - time.monotonic()
            if left <= 0:
                return reply
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=left)
                except asyncio.TimeoutError:
                    pass

    @ray.method(enable_task_events=False)
    async def renew(self, replica_id: str, version: int, granted: int, drained: bool = False) -> bool:
        """A syncing replica's lease renewal; returns whether another replica serves."""
        return self.state.renew(replica_id, version, granted, time.time(), drained)

    async def synced(self, replica_id: str, version: int, timings: dict | None = None,
                     handle: dict | None = None) -> None:
        self.state.synced(replica_id, version, time.time(), timings=timings, handle=handle)
        self.metrics.observe_sync(replica_id, timings)
        await self._notify()

    async def failed(self, replica_id: str, version: int, error: str, serving: int | None = None,
                     broken: bool = False) -> None:
        """The replica could not load ``version``; it serves ``serving`` again (or is ``broken``)."""
        self.state.failed(replica_id, version, error, time.time(), serving, broken)
        self.metrics.failed(replica_id)
        await self._notify()

    async def left(self, replica_id: str) -> None:
        """Ray Serve stopped the replica gracefully (scale-down, redeploy)."""
        self.state.left(replica_id, time.time())
        self.monitor.forget_actor(replica_id)
        await self._notify()

    # -- trainer -------------------------------------------------------------------
    async def publish(self, version: int, handle: dict) -> None:
        """The trainer published ``version``; ``handle`` is its sync method's handle.
        Idempotent for the latest version (a call retried across a restart)."""
        await self.monitor.rebuild()
        if version == self.state.latest_version() and self.state.latest is not None:
            return
        self.state.publish(PublishedVersion(version=version, handle=handle), time.time())
        await self._notify()

    def sync_requested(self) -> bool:
        """EXPLORER_DRIVEN: a replica waits for weights newer than the latest version."""
        return self.state.sync_requested()

    def in_use_versions(self) -> list[int] | None:
        """Versions whose checkpoints must stay loadable (`SyncState.in_use_versions`; None:
        not known yet, prune nothing)."""
        return self.state.in_use_versions(time.time())

    def lagging(self, version: int) -> int:
        """NCCL: live replicas due for a sync still below ``version`` (`SyncState.lagging`)."""
        self._expire(time.time())
        return self.state.lagging(version)

    async def nccl_group(self, replica_id: str, world_size: int) -> dict:
        """NCCL: set up ``replica_id``'s process group with the trainer (the Trinity-RFT
        Synchronizer documentation: "the Synchronizer helps set up communication groups"): rank 0
        = the trainer, ranks 1..``world_size``-1 = the replica's vLLM workers; the rendezvous is a
        free port on the trainer's node, the wire parameters (bucket size) the trainer's. The
        replica and the trainer then join at the same time.

        Returns:
            vLLM's worker init info (``NCCLWeightTransferInitInfo`` fields).
        """
        return await get_trainer().nccl_endpoint.remote(world_size)

    def set_trainer(self, state: str, step: int) -> None:
        self.state.set_trainer(ComponentState(state), step, time.time())
        self.metrics.refresh(self.state)

    # -- operator ------------------------------------------------------------------
    async def pin(self, version: int | None) -> dict:
        """Serve ``version`` everywhere (None unpins). Raises ValueError: not loadable."""
        self.state.pin(version, time.time())
        await self.monitor.save_rollout()
        await self._notify()
        return self.state.rollout.status()

    async def rollback(self, version: int) -> dict:
        """Reject every version above ``version``; it becomes the incumbent. Raises ValueError."""
        rejected = self.state.rollback(version, time.time())
        await self.monitor.save_rollout()
        await self._notify()
        if self.cfg.canary.on_reject == "reset":
            await self.monitor.reset_trainer()
        return {**self.state.rollout.status(), "rejected": rejected}

    async def pause_promotion(self, paused: bool) -> dict:
        self.state.set_promotion_paused(paused, time.time())
        await self.monitor.save_rollout()
        await self._notify()
        return self.state.rollout.status()

    async def drain(self, replica_id: str, drained: bool) -> dict:
        """Take a replica out of rotation or back. Raises KeyError (unknown), ValueError (the
        last replica in rotation)."""
        self.state.set_drained(replica_id, drained, time.time())
        await self._notify()
        return {"id": replica_id, "drained": drained}

    async def _notify(self) -> None:
        """Refresh the metrics and wake every long-polling replica (a state change)."""
        self.metrics.refresh(self.state)
        async with self._changed:
            self._changed.notify_all()

    # -- views ---------------------------------------------------------------------
    def status(self) -> dict:
        """The state's status (`serve_rft.synchronizer.state.SyncState.status`) and this
        process's ``synchronizer.pid``."""
        if self._expire(time.time()):
            self.metrics.refresh(self.state)
        return {**self.state.status(time.time()), "synchronizer": {"pid": os.getpid()}}

    def rollout(self) -> dict:
        return self.state.rollout.status()

    def events(self, since: float = 0.0) -> list[dict]:
        return [e.model_dump() for e in self.state.events if e.t >= since]


def get_or_create_synchronizer(cfg: SynchronizerConfig, buffer: BufferConfig | None = None):
    """The named synchronizer actor, created (detached) if it does not exist yet.

    Ray restarts it if it dies (``max_restarts=-1``) and retries calls that were in flight
    (``max_task_retries``), so replicas and the trainer ride through a restart; the new
    instance rebuilds its state from its saved rollout, the trainer and the replicas' polls.
    """
    buffer_json = buffer.model_dump_json() if buffer is not None and buffer.redis_url else None
    return Synchronizer.options(name=SYNCHRONIZER_NAME, namespace=NAMESPACE, get_if_exists=True,
                                lifetime="detached", max_restarts=-1, max_task_retries=10,
                                ).remote(cfg.model_dump_json(), buffer_json)

"""The synchronizer actor's background side: its state rebuilt after a restart, and the monitor.

A component of `serve_rft.synchronizer.actor.Synchronizer` (held as ``monitor``). Every
`MONITOR_PERIOD_S` the monitor reports replicas whose Ray actor is gone, expires silent ones,
refreshes the metrics and wakes long-polls; then, bounded by `STORE_STEP_S` so a Redis outage
never holds up the death checks, it judges an open canary window from the rewards filed by version
and saves the rollout.

It owns the rebuild's progress, the replicas' Ray actor names and the last saved rollout snapshot;
it receives the state, the store, the metrics and the actor's ``expire`` and ``notify`` through
its constructor.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Awaitable, Callable

import ray
from redis.exceptions import RedisError

from serve_rft.config import SynchronizerConfig
from serve_rft.names import find_trainer
from serve_rft.synchronizer.canary import ArmStats
from serve_rft.synchronizer.state import SyncState

log = logging.getLogger("serve_rft.synchronizer")

MONITOR_PERIOD_S = 1.0
"""How often the actor checks Ray for dead replicas, expires silent ones and judges a canary."""
RAY_CHECK_MAX_AGE_S = 0.25
"""A grant trusts Ray's list of live replica actors at most this old."""
STORE_STEP_S = 2.0
"""Bound of the monitor's Redis part per period (canary verdict, rollout save), s."""
MAX_MONITOR_ERRORS = 30
"""Consecutive failed monitor periods (e.g. Redis away) after which the process exits for Ray
to restart it."""


class SyncMonitor:
    """`Synchronizer`'s rebuild and monitor (module docstring). Until `rebuild` succeeds the state
    grants and prunes nothing (its ``hold_grants_until`` is infinite).

    Args:
        cfg: the synchronizer's settings (``canary.on_reject``).
        state: the state machine it rebuilds, feeds deaths and verdicts to, and snapshots.
        store: an `serve_rft.buffer.store.ExperienceStore` (canary rewards, the saved rollout),
            or None (no Redis: no canary verdicts, no saved rollout).
        metrics: a `serve_rft.observability.sync_metrics.SyncMetrics` (canary arms, verdicts).
        expire: ``now -> stopped ids``: the actor's expiry of silent replicas (unix s).
        notify: refreshes the metrics and wakes the long-polls after a change (awaitable).
        reconstructed: Ray restarted this actor (a restarted state waits for syncs in flight).
    """

    def __init__(self, cfg: SynchronizerConfig, state: SyncState, store, metrics,
                 expire: Callable[[float], list[str]], notify: Callable[[], Awaitable[None]],
                 reconstructed: bool = False):
        self.cfg, self.state, self.store, self.metrics = cfg, state, store, metrics
        self._expire, self._notify = expire, notify
        self._reconstructed = reconstructed
        self._rebuilt = False
        self._rebuild_lock = asyncio.Lock()
        self._actor_names: dict[str, str] = {}  # replica id -> its Ray actor name (namespace serve)
        self._ray_checked = float("-inf")
        self._snapshot = ""
        state.hold_grants_until = float("inf")  # nothing is granted (or pruned) before `rebuild`

    def watch_actor(self, replica_id: str, actor_name: str) -> None:
        """Check ``replica_id``'s Ray actor ``actor_name`` (namespace ``serve``) for its death."""
        self._actor_names[replica_id] = actor_name

    def forget_actor(self, replica_id: str) -> None:
        """``replica_id`` left: its actor's end is no death."""
        self._actor_names.pop(replica_id, None)

    async def rebuild(self) -> bool:
        """Once per process, until it succeeds: take back the saved rollout and the latest
        version from the trainer (replicas re-register themselves when their next poll finds them
        unknown). Until then nothing is granted, pruned or saved; a failure (Redis away) is
        logged and tried again by the next call or monitor period.

        Returns:
            Whether the state is rebuilt.
        """
        if self._rebuilt:
            return True
        async with self._rebuild_lock:
            if self._rebuilt:
                return True
            try:
                await self._restore()
            except Exception:  # noqa: BLE001 - retried by the next call; grants stay held meanwhile
                log.exception("synchronizer: rebuilding its state failed; retrying")
                return False
            self._rebuilt = True
            # a restarted synchronizer waits for syncs in flight to renew before granting
            self.state.hold_grants_until = float("-inf")
            if self._reconstructed:
                self.state.restarted(time.time())
            return True

    async def _restore(self) -> None:
        now = time.time()
        if self.store is not None:
            raw = await self.store.load_rollout()
            if raw:
                self.state.rollout.restore(json.loads(raw), now)
                self._snapshot = raw
        trainer = find_trainer()
        if trainer is None:  # no trainer (serve-only mode, or not created yet)
            return
        published = await trainer.latest_published.remote()
        if published is not None and published.version > self.state.latest_version():
            self.state.publish(published, now)

    async def check_ray(self, max_age_s: float = RAY_CHECK_MAX_AGE_S) -> None:
        """Report replicas whose Ray actor is gone (kill -9, node loss) as lost; asks Ray at most
        once per ``max_age_s`` seconds. Raises what Ray's actor listing raises (the GCS busy)."""
        if time.monotonic() - self._ray_checked < max_age_s or not self._actor_names:
            return
        self._ray_checked = time.monotonic()
        alive = {a["name"] for a in await asyncio.to_thread(ray.util.list_named_actors, True)
                 if a["namespace"] == "serve"}
        now = time.time()
        for rid, name in list(self._actor_names.items()):
            if name not in alive:
                log.warning("replica %s: its actor %s is gone", rid, name)
                self.state.lost(rid, now)
                del self._actor_names[rid]

    async def watch(self) -> None:
        """Every `MONITOR_PERIOD_S`: dead and silent replicas and the metrics, then the parts
        that need Redis (the canary verdict, the saved rollout) within `STORE_STEP_S`, so a
        Redis outage never holds up the death checks (a store step that runs out is tried again
        the next period). A failed period is retried the next one; `MAX_MONITOR_ERRORS` in a row
        end the process, and Ray restarts the actor."""
        errors = 0
        while True:
            await asyncio.sleep(MONITOR_PERIOD_S)
            try:
                await self.rebuild()
                await self.check_ray(0.0)
                self._expire(time.time())
                await self._notify()
                try:
                    await asyncio.wait_for(self._store_step(), timeout=STORE_STEP_S)
                except (asyncio.TimeoutError, RedisError) as e:  # Redis away: tried again next period
                    log.warning("synchronizer: canary verdict / rollout save deferred: %r", e)
                errors = 0
            except Exception:  # noqa: BLE001 - retried next period, bounded below
                errors += 1
                log.exception("synchronizer monitor (%d in a row)", errors)
                if errors >= MAX_MONITOR_ERRORS:
                    os._exit(1)

    async def _store_step(self) -> None:
        await self._judge_canary()
        await self.save_rollout()

    async def _judge_canary(self) -> None:
        window = self.state.rollout.canary_window()
        if window is None or self.store is None:
            return
        versions = [self.state.candidate, self.state.incumbent]
        got = await self.store.version_rewards(versions, *window)
        rewards = {v: ArmStats(n, s, q) for v, (n, s, q) in got.items()}
        self.metrics.canary(self.state.rollout, rewards)
        verdict = self.state.decide(time.time(), rewards)
        if verdict is None:
            return
        self.metrics.verdict(verdict.decision)
        log.warning("canary verdict: %s (%s)", verdict.decision, verdict.reason)
        if verdict.decision == "rollback" and self.cfg.canary.on_reject == "reset":
            await self.reset_trainer()

    async def reset_trainer(self) -> None:
        """``canary.on_reject=reset``: the trainer continues from the incumbent's weights."""
        inc = self.state.versions.get(self.state.incumbent)
        trainer = find_trainer()
        if trainer is None:
            return
        await trainer.reset_to.remote(self.state.incumbent, inc.handle if inc else None)

    async def save_rollout(self) -> None:
        """Save the rollout's snapshot to the store if it changed (not before `rebuild` read the
        saved one). Raises RedisError: the store is away (retried by the monitor's next period)."""
        if self.store is None or not self._rebuilt:  # never overwrite a snapshot not yet read
            return
        snap = json.dumps(self.state.rollout.snapshot(), sort_keys=True)
        if snap != self._snapshot:
            await self.store.save_rollout(snap)
            self._snapshot = snap

"""The synchronizer's state machine, pure Python (no Ray), so every rule is unit-testable.

It owns: the latest published policy version, each explorer replica's state (seed 000:
RUNNING / REQUIRE_SYNC / STOPPED) and policy version, and the rolling policy that decides
which replica may sync now. CHECKPOINT transitions follow seed 000: the trainer stays RUNNING
(it only saves), a replica goes RUNNING -> REQUIRE_SYNC, pulls the weights, and returns to
RUNNING at the new version.

Rolling rule: at most ``max_unavailable`` replicas are out of RUNNING for a sync at once, and
a grant is refused if it would leave no live replica RUNNING (a deployment of one replica is
the exception: it must pause to sync at all, and its requests wait, not fail). A deployment
configured with more replicas never syncs its last serving replica, even while another one is
down and being restarted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from serve_rft.config import SyncStyle
from serve_rft.synchronizer.styles import ReplicaSchedule
from serve_rft.types import ComponentState, PublishedVersion, SyncEvent, SyncOrder

TRAINER = "trainer"


@dataclass
class ReplicaInfo:
    """What the synchronizer knows of one explorer replica."""

    replica_id: str
    state: ComponentState = ComponentState.RUNNING
    policy_version: int = 0
    last_seen: float = field(default_factory=time.time)
    sync_started: float | None = None
    failures: int = 0
    last_error: str | None = None
    last_sync_s: float | None = None
    last_sync: dict[str, float] | None = None
    schedule: ReplicaSchedule = field(default_factory=ReplicaSchedule)


class SyncState:
    """Replica states, the latest version, and the rolling-sync grants.

    Args:
        max_unavailable: replicas that may be in REQUIRE_SYNC at the same time (>= 1).
        drain_mode: ``wait`` or ``keep``, passed to replicas in each `SyncOrder`.
        replica_timeout_s: a replica unheard for this long is STOPPED.
        max_events: how many state-change events are kept for audits.
        num_replicas: replicas the deployment is configured with.
        style, interval, offset, sync_timeout_s: the sync style and its schedule
            (`serve_rft.synchronizer.styles`).
    """

    def __init__(self, max_unavailable: int = 1, drain_mode: str = "wait",
                 replica_timeout_s: float = 30.0, max_events: int = 10_000, num_replicas: int = 2,
                 style: SyncStyle = SyncStyle.TRAINER_DRIVEN, interval: int = 1, offset: int = 0,
                 sync_timeout_s: float = 30.0):
        if max_unavailable < 1:
            raise ValueError("max_unavailable must be >= 1")
        self.max_unavailable = max_unavailable
        self.drain_mode = drain_mode
        self.replica_timeout_s = replica_timeout_s
        self.max_events = max_events
        self.num_replicas = num_replicas
        self.style, self.interval, self.offset = style, interval, offset
        self.sync_timeout_s = sync_timeout_s
        self.replicas: dict[str, ReplicaInfo] = {}
        self.latest: PublishedVersion | None = None
        self.trainer_state = ComponentState.STOPPED
        self.trainer_step = 0
        self.events: list[SyncEvent] = []
        self._not_everywhere: dict[int, float] = {}  # version -> published_at, until everywhere
        self.version_lags: dict[int, float] = {}  # version -> seconds to reach every replica

    # -- bookkeeping -----------------------------------------------------------------
    def serving(self) -> int:
        """Replicas RUNNING now."""
        return sum(r.state is ComponentState.RUNNING for r in self.replicas.values())

    def _event(self, component: str, state: ComponentState, version: int, now: float) -> None:
        self.events.append(SyncEvent(t=now, component=component, state=state,
                                     policy_version=version, serving=self.serving()))
        if len(self.events) > self.max_events:
            del self.events[: len(self.events) - self.max_events]

    def _set(self, r: ReplicaInfo, state: ComponentState, now: float) -> None:
        if r.state is not state:
            r.state = state
            self._event(r.replica_id, state, r.policy_version, now)

    def in_use_floor(self) -> int:
        """The oldest policy version a live replica serves (checkpoints >= it must be kept)."""
        live = [r.policy_version for r in self.replicas.values() if r.state is not ComponentState.STOPPED]
        return min(live, default=0)

    def latest_version(self) -> int:
        return self.latest.version if self.latest else 0

    def lagging(self, version: int) -> int:
        """Live replicas that are due for a sync (their style's schedule) and serve a version
        below ``version``: those an NCCL trainer waits for in its sync window."""
        return sum(r.state is not ComponentState.STOPPED and r.policy_version < version and r.schedule.due
                   for r in self.replicas.values())

    # -- replica side ---------------------------------------------------------------
    def register(self, replica_id: str, version: int, now: float | None = None) -> None:
        """A replica came up serving ``version`` (it loads the latest before registering)."""
        now = now or time.time()
        r = self.replicas.get(replica_id)
        if r is None:
            r = self.replicas[replica_id] = ReplicaInfo(replica_id, ComponentState.STOPPED, version, now)
        r.policy_version, r.last_seen, r.sync_started = version, now, None
        self._set(r, ComponentState.RUNNING, now)
        r.schedule.observe(self.style, r.schedule.explorer_step, version, self.interval, self.offset,
                           self.sync_timeout_s, now)

    def heartbeat(self, replica_id: str, version: int, explorer_step: int = 0,
                  now: float | None = None) -> None:
        """A replica's poll: it is alive, serves ``version`` and reached ``explorer_step``."""
        now = now or time.time()
        r = self.replicas.get(replica_id)
        if r is None:
            self.register(replica_id, version, now)
            r = self.replicas[replica_id]
        r.last_seen = now
        if r.state is ComponentState.STOPPED:  # came back
            r.policy_version = version
            self._set(r, ComponentState.RUNNING, now)
        r.schedule.observe(self.style, explorer_step, r.policy_version, self.interval, self.offset,
                           self.sync_timeout_s, now)

    def sync_requested(self) -> bool:
        """EXPLORER_DRIVEN: some live replica asked for weights newer than the latest version."""
        latest = self.latest_version()
        return any(r.state is not ComponentState.STOPPED and r.schedule.open_request()
                   and r.schedule.request_base_version >= latest for r in self.replicas.values())

    def expire(self, now: float | None = None) -> list[str]:
        """Mark replicas unheard for ``replica_timeout_s`` as STOPPED; returns their ids."""
        now = now or time.time()
        gone = []
        for r in self.replicas.values():
            if r.state is not ComponentState.STOPPED and now - r.last_seen > self.replica_timeout_s:
                r.sync_started = None
                self._set(r, ComponentState.STOPPED, now)
                gone.append(r.replica_id)
        return gone

    def grant(self, replica_id: str, now: float | None = None) -> SyncOrder | None:
        """Let ``replica_id`` sync to the latest version if the rolling rule allows it now.

        Returns:
            A `SyncOrder` (the replica is now REQUIRE_SYNC), or None.
        """
        now = now or time.time()
        r = self.replicas.get(replica_id)
        if r is None or self.latest is None or r.state is not ComponentState.RUNNING:
            return None
        if r.policy_version >= self.latest.version or not r.schedule.due:
            return None
        syncing = sum(x.state is ComponentState.REQUIRE_SYNC for x in self.replicas.values())
        if syncing >= self.max_unavailable:
            return None
        if self.num_replicas > 1 and self.serving() - 1 < 1:
            return None
        r.sync_started = now
        self._set(r, ComponentState.REQUIRE_SYNC, now)
        return SyncOrder(version=self.latest.version, handle=self.latest.handle, drain_mode=self.drain_mode,
                         others_serving=self.serving() >= 1)

    def synced(self, replica_id: str, version: int, now: float | None = None,
               timings: dict[str, float] | None = None) -> None:
        """The replica loaded ``version`` and serves again (``timings``: its drain/pause/load
        seconds and bytes, shown in `status`)."""
        now = now or time.time()
        if replica_id not in self.replicas:  # reported to a restarted synchronizer
            self.register(replica_id, version, now)
        r = self.replicas[replica_id]
        r.last_sync = timings
        if r.sync_started is not None:
            r.last_sync_s = now - r.sync_started
        r.policy_version, r.last_seen, r.sync_started, r.last_error = version, now, None, None
        r.schedule.synced()
        self._set(r, ComponentState.RUNNING, now)
        live = [x for x in self.replicas.values() if x.state is not ComponentState.STOPPED]
        if live:  # every published version <= the slowest live replica's is now everywhere
            floor = min(x.policy_version for x in live)
            for v in [v for v in self._not_everywhere if v <= floor]:
                self.version_lags[v] = now - self._not_everywhere.pop(v)
            while len(self.version_lags) > self.max_events:
                self.version_lags.pop(next(iter(self.version_lags)))

    def failed(self, replica_id: str, version: int, error: str, now: float | None = None) -> None:
        """The replica could not load ``version``; it restored its previous weights and serves."""
        now = now or time.time()
        if replica_id not in self.replicas:
            self.register(replica_id, version, now)
        r = self.replicas[replica_id]
        r.failures += 1
        r.last_error = error
        r.sync_started = None
        r.last_seen = now
        self._set(r, ComponentState.RUNNING, now)

    # -- trainer side ---------------------------------------------------------------
    def publish(self, published: PublishedVersion, now: float | None = None) -> None:
        """The trainer committed a new version; replicas will be granted it one by one.

        Raises:
            ValueError: the version is not newer than the latest one.
        """
        now = now or time.time()
        if self.latest is not None and published.version <= self.latest.version:
            raise ValueError(f"version {published.version} is not newer than {self.latest.version}")
        self.latest = published
        self._not_everywhere[published.version] = published.published_at
        self._event(TRAINER, self.trainer_state, published.version, now)

    def set_trainer(self, state: ComponentState, step: int, now: float | None = None) -> None:
        now = now or time.time()
        self.trainer_step = step
        if state is not self.trainer_state:
            self.trainer_state = state
            self._event(TRAINER, state, self.latest_version(), now)

    def version_lag(self) -> dict[int, float]:
        """Seconds from publishing each version to the last live replica serving it (or a newer
        one); the newest ``max_events`` versions."""
        return dict(self.version_lags)

    def status(self) -> dict:
        return {
            "policy_version": self.latest_version(),
            "sync_style": self.style.value,
            "trainer": {"state": self.trainer_state.value, "step": self.trainer_step},
            "replicas": [
                {"id": r.replica_id, "state": r.state.value, "policy_version": r.policy_version,
                 "failures": r.failures, "last_error": r.last_error,
                 "last_sync_s": r.last_sync_s,
                 "last_sync": r.last_sync, "explorer_step": r.schedule.explorer_step,
                 "sync_due": r.schedule.due, "sync_requested": r.schedule.open_request(),
                 "sync_timeouts": r.schedule.timeouts}
                for r in sorted(self.replicas.values(), key=lambda r: r.replica_id)
            ],
            "version_lag_s": {str(k): round(v, 3) for k, v in sorted(self.version_lag().items())},
        }

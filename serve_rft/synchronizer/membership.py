"""Which explorer replicas exist and serve: the synchronizer's membership, from the replicas
themselves (never from a configured count).

A replica is *live* while it polls (every second; unheard for ``replica_timeout_s`` it is STOPPED)
or, while it syncs, while it renews its lease; Ray reporting its actor dead (`Membership.gone`
with ``lost``) or Ray Serve stopping it gracefully (``left``) ends it at once. *In rotation* =
live, RUNNING, not drained by an operator and not *warming*: a replica that started counts only
once a request reached it through the ingress (before, HAProxy may not route to it yet, so a
syncing peer must not refuse requests on its account). A replica an operator put back counts
once its own poll says it stopped refusing (*undraining* until then: it learns of the undrain
from a poll answer, and a peer granted a sync meanwhile would refuse too). A STOPPED replica that is not known dead may come
back (a stalled event loop), so the versions it serves stay loadable (`alive_versions`).

Counts are kept incrementally (every change goes through `Membership.update`), so a poll costs
O(1) whatever the fleet size (benchmarks/rollout_sim.py drives 4,096 replicas).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from serve_rft.synchronizer.styles import ReplicaSchedule
from serve_rft.types import ComponentState

FORGET_AFTER_S = 600.0
"""A replica gone (left, dead, or unheard) this long is dropped from the state."""


@dataclass
class ReplicaInfo:
    """What the synchronizer knows of one explorer replica (times: the caller's clock, s)."""

    replica_id: str
    state: ComponentState = ComponentState.STOPPED
    policy_version: int = 0
    last_seen: float = 0.0
    alive: bool = True  # False once it left or Ray reported it dead
    gone_at: float | None = None
    granted: int | None = None  # the version of its open sync
    sync_started: float | None = None
    lease_until: float | None = None
    drained: bool = False  # an operator took it out of rotation
    undraining: bool = False  # put back by an operator, but it has not yet said it stopped refusing
    warming: bool = False  # registered, but the ingress has not routed a request to it yet
    pid: int | None = None  # the replica's process id (operators, fault tests)
    node_id: str | None = None  # the Ray node it runs on (hex), for operators and placement checks
    refused: int = 0  # requests it refused while out of rotation (re-sent elsewhere by HAProxy)
    introduced: bool = True  # False: known from a lease renewal only; it registers (with handles) next
    drain_known: bool = False  # not introduced, yet its drain is known (its renewal, or an operator since)
    failures: int = 0
    consecutive_failures: int = 0
    backoff_version: int | None = None
    backoff_until: float = 0.0
    last_error: str | None = None
    last_sync_s: float | None = None
    last_sync: dict[str, float] | None = None
    schedule: ReplicaSchedule = field(default_factory=ReplicaSchedule)

    @property
    def live(self) -> bool:
        return self.alive and self.state is not ComponentState.STOPPED

    @property
    def in_rotation(self) -> bool:
        return (self.live and self.state is ComponentState.RUNNING and not self.drained and not self.undraining
                and not self.warming)

    def clear_sync(self) -> None:
        self.granted = self.sync_started = self.lease_until = None

    def status(self, now: float) -> dict:
        """This replica for `SyncState.status` (JSON-able; ``backoff_s`` / ``last_seen_s_ago``:
        seconds from ``now``, the caller's clock)."""
        return {"id": self.replica_id, "state": self.state.value, "policy_version": self.policy_version,
                "alive": self.alive, "drained": self.drained, "undraining": self.undraining,
                "warming": self.warming, "granted": self.granted,
                "refused": self.refused, "pid": self.pid, "node_id": self.node_id,
                "failures": self.failures, "last_error": self.last_error,
                "backoff_s": round(max(0.0, self.backoff_until - now), 3) if self.backoff_version else 0.0,
                "last_sync_s": self.last_sync_s, "last_seen_s_ago": round(now - self.last_seen, 3),
                "last_sync": self.last_sync, "explorer_step": self.schedule.explorer_step,
                "sync_due": self.schedule.due, "sync_requested": self.schedule.open_request(),
                "sync_timeouts": self.schedule.timeouts}


class Membership:
    """Replicas by id with O(1) counts.

    Args:
        replica_timeout_s: a RUNNING replica unheard this long is STOPPED.
        on_change: ``(replica, kind, detail, now)`` after every state change (the event log;
            ``now``: the change's time, s).
    """

    def __init__(self, replica_timeout_s: float,
                 on_change: Callable[[ReplicaInfo, str, str | None, float], None] = lambda r, k, d, t: None):
        self.replica_timeout_s = replica_timeout_s
        self.on_change = on_change
        self.replicas: dict[str, ReplicaInfo] = {}
        self.n_live = self.n_in_rotation = self.n_warming = 0
        self.live_versions: Counter[int] = Counter()  # live replicas per served version
        self.alive_versions: Counter[int] = Counter()  # replicas not known dead, per version
        self._next_expire = float("-inf")

    def __iter__(self):
        return iter(self.replicas.values())

    def get(self, replica_id: str) -> ReplicaInfo | None:
        return self.replicas.get(replica_id)

    def _count(self, r: ReplicaInfo, sign: int) -> None:
        self.n_live += sign * r.live
        self.n_in_rotation += sign * r.in_rotation
        self.n_warming += sign * (r.live and r.warming and r.state is ComponentState.RUNNING)
        if r.live:
            self.live_versions[r.policy_version] += sign
        if r.alive:
            self.alive_versions[r.policy_version] += sign
        for c in (self.live_versions, self.alive_versions):
            if c.get(r.policy_version) == 0:
                del c[r.policy_version]

    def update(self, r: ReplicaInfo, now: float, kind: str = "state", detail: str | None = None,
               **changes) -> None:
        """Change ``r``'s ``state`` / ``policy_version`` / ``alive`` / ``drained`` and keep the
        counts; report a change of state or a non-``state`` ``kind`` to ``on_change``."""
        self._count(r, -1)
        before = r.state
        for k, v in changes.items():
            setattr(r, k, v)
        self._count(r, +1)
        if r.state is not before or kind != "state":
            self.on_change(r, kind, detail, now)

    def add(self, replica_id: str, version: int, now: float) -> ReplicaInfo:
        r = self.replicas[replica_id] = ReplicaInfo(replica_id, ComponentState.STOPPED, version, now)
        self._count(r, +1)
        return r

    def granted_versions(self) -> set[int]:
        """Versions live replicas are loading now (scans only while any replica is out)."""
        if not self.n_out:
            return set()
        return {r.granted for r in self.replicas.values() if r.live and r.granted is not None}

    @property
    def n_out(self) -> int:
        """Live replicas out of rotation (syncing, or drained), not counting warming ones that
        merely wait to be routed to (a warming replica that syncs takes a slot)."""
        return self.n_live - self.n_in_rotation - self.n_warming

    @property
    def n_ready(self) -> int:
        """Live replicas but those warming (RUNNING, not yet routed to)."""
        return self.n_live - self.n_warming

    def serving_besides(self, r: ReplicaInfo) -> int:
        """Replicas in rotation other than ``r``."""
        return self.n_in_rotation - r.in_rotation

    def gone(self, replica_id: str, now: float, kind: str) -> bool:
        """``left`` or ``lost``: the replica is gone for good. True if it was not already."""
        r = self.replicas.get(replica_id)
        if r is None or not r.alive:
            return False
        r.clear_sync()
        r.gone_at = now
        self.update(r, now, kind, state=ComponentState.STOPPED, alive=False)
        return True

    def pardon(self, gap_s: float, now: float) -> None:
        """The synchronizer itself did not run for ``gap_s`` seconds (a frozen process, a blocked
        event loop): it could not hear the replicas meanwhile, so that silence is not theirs.
        Every live replica's last heartbeat and sync lease move ``gap_s`` later (a heartbeat never
        past ``now``), so `expire` judges only the silence after the synchronizer runs again: a
        replica really gone still times out, ``replica_timeout_s`` (or its lease) later. Without
        it every replica timed out at once on resuming, and a lapsed lease of a replica still
        loading let a second replica be granted a sync."""
        for r in self.replicas.values():
            if r.live:
                r.last_seen = min(now, r.last_seen + gap_s)
                if r.lease_until is not None:
                    r.lease_until += gap_s

    def expire(self, now: float, every_s: float = 0.0) -> list[str]:
        """STOPPED for RUNNING replicas unheard for ``replica_timeout_s`` and syncing ones whose
        lease lapsed; forget replicas gone for `FORGET_AFTER_S`. Scans at most once per
        ``every_s`` of clock. Returns the ids newly STOPPED."""
        if now < self._next_expire:
            return []
        self._next_expire = now + every_s
        stopped = []
        for r in list(self.replicas.values()):
            if r.live:
                if r.state is ComponentState.REQUIRE_SYNC:
                    lapsed = r.lease_until is not None and now > r.lease_until
                else:
                    lapsed = now - r.last_seen > self.replica_timeout_s
                if lapsed:
                    r.clear_sync()
                    self.update(r, now, "timeout", state=ComponentState.STOPPED)
                    stopped.append(r.replica_id)
            elif now - (r.gone_at if r.gone_at is not None else r.last_seen) > FORGET_AFTER_S:
                self._count(r, -1)
                del self.replicas[r.replica_id]
        return stopped

"""The synchronizer's state machine, pure Python (no Ray, no clock of its own: every call takes
``now``), so every rule is unit- and property-testable (tests/unit/test_sync_properties.py).

It owns each explorer replica's state (the Trinity-RFT Synchronizer documentation's RUNNING /
REQUIRE_SYNC / STOPPED) and policy version, the published versions (`versions.Versions`), the
rollout (rolling or canary, operator pins and rollbacks) and the rule that decides which replica
may sync now. CHECKPOINT and MEMORY transitions follow that documentation: the trainer stays
RUNNING (it only publishes), a replica goes RUNNING -> REQUIRE_SYNC, pulls the weights, and
returns to RUNNING at the new version.

Membership comes from the replicas themselves, never from a configured count: a replica is
*live* while it polls (every second; unheard for ``replica_timeout_s`` it is STOPPED and no longer
counts as serving), or, while it syncs, while it renews its *lease*; Ray tells the actor of a dead
replica (`lost`) and Ray Serve's graceful stop of one (`left`) ends it at once. Autoscaling
therefore just works: the rule counts whoever is there.

Rolling rule (`grant`): at most ``max_unavailable`` live replicas out of rotation (syncing, or
drained by an operator) at once, and a grant never leaves no live replica serving: with two or
more live replicas another one must be RUNNING, undrained and heard from within
``replica_timeout_s``. A lone live replica may sync (it pauses: its requests wait, none fail).
A drained replica syncs without taking a slot only while its drain holds (another replica in
rotation); otherwise it serves anyway (`drain_holds`) and a sync takes a slot like any other.

Which version a replica gets (`target`): the pinned version if an operator pinned one; in the
canary rollout the candidate for up to ``canary.replicas`` replicas (never the last one on the
incumbent); otherwise the incumbent (the newest promoted version). When (`due`): when its sync
style says so (`styles`), or when the version has waited long enough that the roll would
otherwise miss ``max_version_lag_s`` (`lag_trigger_s`); pins, rollbacks and canaries at once.
A failed load is retried after an exponential backoff; ``max_load_attempts`` failures quarantine
the version.
"""

from __future__ import annotations

import math
import time

from serve_rft.config import SynchronizerConfig
from serve_rft.synchronizer.canary import Verdict
from serve_rft.synchronizer.membership import Membership, ReplicaInfo
from serve_rft.synchronizer.replica_events import ReplicaEvents
from serve_rft.synchronizer.rollout import SYNCHRONIZER, Rollout
from serve_rft.synchronizer.versions import Versions
from serve_rft.types import ComponentState, PublishedVersion, SyncEvent, SyncOrder

TRAINER = "trainer"
MAX_BACKOFF_FACTOR = 64


class SyncState:
    """Replicas, versions, the rollout, and the rolling-sync grants.

    Composed of `Membership` (``members``), `Versions` (``versions``), `Rollout` (``rollout``)
    and `ReplicaEvents` (``replica_events``: the replicas' own events, which this class's
    ``register`` ... ``expire`` delegate to).

    Args:
        cfg: the synchronizer's settings (`serve_rft.config.SynchronizerConfig`).
        max_events: state-change events kept for audits.
    """

    def __init__(self, cfg: SynchronizerConfig | None = None, max_events: int = 10_000):
        self.cfg = cfg = cfg or SynchronizerConfig()
        self.max_events = max_events
        self.members = Membership(cfg.replica_timeout_s, self._replica_event)
        self.versions = Versions(cfg.max_load_attempts, cfg.retain_versions)
        self.rollout = Rollout(cfg, self.versions, self.members, self.event,
                               lambda now: now < self.hold_grants_until)
        self.replica_events = ReplicaEvents(cfg, self.members, self.versions, self.rollout, self._update)
        self.latest: PublishedVersion | None = None
        self.trainer_state = ComponentState.STOPPED
        self.trainer_step = 0
        self.events: list[SyncEvent] = []
        self.sync_seconds_ewma = 1.0  # a sync's duration, for the lag trigger's reserve
        self.hold_grants_until = float("-inf")
        self._now = 0.0  # the clock of the latest replica or rollout change (`in_use_versions`' default)

    def restarted(self, now: float) -> None:
        """This state replaces one that was lost (Ray restarted the synchronizer): grant nothing
        for half a lease, until every replica syncing now has renewed its lease and so holds its
        slot again."""
        self.hold_grants_until = now + self.cfg.lease_s / 2
        self._now = now

    # -- bookkeeping -----------------------------------------------------------------
    @property
    def replicas(self) -> dict[str, ReplicaInfo]:
        return self.members.replicas

    @property
    def incumbent(self) -> int:
        return self.rollout.incumbent

    @property
    def candidate(self) -> int | None:
        return self.rollout.candidate

    @property
    def pinned(self) -> int | None:
        return self.rollout.pinned

    def drain_holds(self, replica_id: str) -> bool:
        """Whether ``replica_id`` must hold an operator's drain now (what its poll answer says): an
        operator's drain holds only while another replica is in rotation (else it serves anyway)."""
        r = self.members.get(replica_id)
        return bool(r and r.drained and self.members.serving_besides(r))

    def serving(self) -> int:
        """Live replicas in rotation now (RUNNING, not drained)."""
        return self.members.n_in_rotation

    def event(self, component: str, state: ComponentState, version: int, now: float,
              kind: str = "state", detail: str | None = None) -> None:
        self.events.append(SyncEvent(t=now, component=component, state=state, policy_version=version,
                                     serving=self.serving(), kind=kind, detail=detail))
        if len(self.events) > self.max_events:
            del self.events[: len(self.events) - self.max_events]

    def _replica_event(self, r: ReplicaInfo, kind: str, detail: str | None, now: float) -> None:
        self.event(r.replica_id, r.state, r.policy_version, now, kind, detail)

    def _update(self, r: ReplicaInfo, now: float, kind: str = "state", detail: str | None = None,
                **changes) -> None:
        self._now = now
        self.members.update(r, now, kind, detail, **changes)

    def latest_version(self) -> int:
        """The latest published version (0: none yet)."""
        return self.latest.version if self.latest else 0

    def in_use_versions(self, now: float | None = None) -> list[int] | None:
        """The versions that may still be loaded, ascending: served by a replica not known dead
        (one that stopped answering may come back and restore it), being loaded, the incumbent,
        the candidate, the pinned version, and every version whose handle is kept. Their
        checkpoints are never pruned. None while a restarted synchronizer waits for its
        replicas to introduce themselves (any version may be in use: prune nothing)."""
        if (self._now if now is None else now) < self.hold_grants_until:
            return None
        keep = set(self.members.alive_versions) | self.members.granted_versions()
        keep |= {v for v in (self.incumbent, self.candidate, self.pinned) if v is not None}
        keep |= {v.version for v in self.versions.by_version.values() if v.handle is not None and v.version}
        return sorted(keep)

    def in_use_floor(self, now: float | None = None) -> int:
        """The oldest of `in_use_versions` (0: none, or not known yet)."""
        return min(self.in_use_versions(now) or [0])

    def lagging(self, version: int) -> int:
        """Live replicas that are due for a sync (their style's schedule) and serve a version
        below ``version``: those an NCCL trainer waits for in its sync window."""
        return sum(r.live and r.policy_version < version and r.schedule.due for r in self.members)

    # -- the replicas' own events (serve_rft.synchronizer.replica_events) ------------------
    def register(self, replica_id: str, version: int, now: float, base_handle: dict | None = None,
                 handle: dict | None = None, drained: bool = False, pid: int | None = None,
                 warming: bool = False, node_id: str | None = None) -> None:
        """`ReplicaEvents.register`: a replica came up (or re-introduced itself) serving ``version``."""
        self._now = now
        self.replica_events.register(replica_id, version, now, base_handle=base_handle, handle=handle,
                                     drained=drained, pid=pid, warming=warming, node_id=node_id)

    def known(self, replica_id: str) -> bool:
        """`ReplicaEvents.known`: False: the replica should `register` before it polls."""
        return self.replica_events.known(replica_id)

    def initial(self) -> PublishedVersion | None:
        """`ReplicaEvents.initial`: what a replica starting now loads (None: its initial weights)."""
        return self.replica_events.initial()

    def heartbeat(self, replica_id: str, version: int, explorer_step: int, now: float,
                  refused: int | None = None, ready: bool = True, drained: bool = False) -> None:
        """`ReplicaEvents.heartbeat`: a replica's poll."""
        self.replica_events.heartbeat(replica_id, version, explorer_step, now, refused, ready, drained)

    def renew(self, replica_id: str, version: int, granted: int, now: float, drained: bool = False) -> bool:
        """`ReplicaEvents.renew`: a syncing replica's lease renewal; whether another replica is in
        rotation."""
        return self.replica_events.renew(replica_id, version, granted, now, drained)

    def set_drained(self, replica_id: str, drained: bool, now: float) -> None:
        """`ReplicaEvents.set_drained`. Raises KeyError (unknown replica), ValueError (draining it
        would leave no live replica in rotation)."""
        self.replica_events.set_drained(replica_id, drained, now)

    def left(self, replica_id: str, now: float) -> None:
        """`ReplicaEvents.left`: Ray Serve stopped the replica gracefully."""
        self._now = now
        self.replica_events.left(replica_id, now)

    def lost(self, replica_id: str, now: float) -> None:
        """`ReplicaEvents.lost`: Ray reports the replica's actor dead."""
        self._now = now
        self.replica_events.lost(replica_id, now)

    def expire(self, now: float, every_s: float = 0.0) -> list[str]:
        """`ReplicaEvents.expire`: the ids of replicas newly STOPPED (unheard, or lease lapsed)."""
        self._now = now
        return self.replica_events.expire(now, every_s)

    # -- which version, when ---------------------------------------------------------
    def target(self, r: ReplicaInfo) -> int:
        """The version ``r`` should serve (`Rollout.target`)."""
        return self.rollout.target(r)

    def settled(self, r: ReplicaInfo) -> bool:
        """``r`` serves what it should, or has no reason to leave its version."""
        return not self.rollout.must_move(r, self.rollout.target(r))

    def lag_trigger_s(self) -> float | None:
        """Seconds a promoted version may wait for a replica's own schedule before that replica
        is due anyway: half of ``max_version_lag_s``, less when rolling the live replicas one
        ``max_unavailable`` slot at a time at the mean sync time would not fit in the rest
        (``bound - ceil(live / max_unavailable) * sync_s``). None: no bound."""
        bound = self.cfg.max_version_lag_s
        if bound is None:
            return None
        reserve = math.ceil(self.members.n_live / self.cfg.max_unavailable) * self.sync_seconds_ewma
        return max(0.0, min(bound / 2, bound - reserve))

    def due(self, r: ReplicaInfo, target: int, now: float) -> bool:
        """Whether ``r`` should sync to ``target`` now (module docstring)."""
        if self.pinned is not None or target == self.candidate or target < r.policy_version:
            return True
        if r.schedule.due:
            return True
        trigger = self.lag_trigger_s()
        first = self.versions.first_promoted_above(r.policy_version)
        return trigger is not None and first is not None and now - first.promoted_at >= trigger

    def grant(self, replica_id: str, now: float) -> SyncOrder | None:
        """Let ``replica_id`` sync now if the rules allow (module docstring).

        Returns:
            A `SyncOrder` (the replica is now REQUIRE_SYNC with a lease), or None.
        """
        r = self.members.get(replica_id)
        if r is None or not r.live or r.state is not ComponentState.RUNNING or now < self.hold_grants_until:
            return None
        self.rollout.choose_candidate(now)
        target = self.target(r)
        if not self.rollout.must_move(r, target):
            return None
        v = self.versions.get(target)
        if v is None or v.handle is None or (v.quarantined and target != self.pinned):
            return None
        if r.backoff_version == target and now < r.backoff_until:
            return None
        if not self.due(r, target, now):
            return None
        if not self.drain_holds(replica_id):  # a held drain is out of rotation already: syncing costs nothing
            # a drained replica whose drain does not hold (no other replica serves) serves anyway,
            # yet counts in n_out: not against itself
            others_out = self.members.n_out - (r.live and not r.in_rotation and not r.warming)
            if others_out >= self.cfg.max_unavailable:
                return None
            if self.members.n_ready >= 2 and self.members.serving_besides(r) == 0:
                return None
        r.granted, r.sync_started, r.lease_until = target, now, now + self.cfg.lease_s
        self._update(r, now, "granted", f"v{r.policy_version} -> v{target}", state=ComponentState.REQUIRE_SYNC)
        return SyncOrder(version=target, handle=v.handle, drain_mode=self.cfg.drain_mode,
                         others_serving=self.members.serving_besides(r) > 0)

    # -- outcomes ------------------------------------------------------------------------
    def synced(self, replica_id: str, version: int, now: float, timings: dict[str, float] | None = None,
               handle: dict | None = None) -> None:
        """The replica loaded (and verified) ``version`` and serves again."""
        r = self.members.get(replica_id)
        if r is None:  # reported to a restarted synchronizer: it registers fully on its next poll
            self.register(replica_id, version, now, handle=handle)
            r = self.members.replicas[replica_id]
            r.introduced = False
        if not r.alive:
            return
        if handle is not None:
            self.versions.add(version, handle, now)
        r.last_sync = timings
        if r.sync_started is not None:
            r.last_sync_s = now - r.sync_started
            self.sync_seconds_ewma = 0.8 * self.sync_seconds_ewma + 0.2 * r.last_sync_s
        r.last_seen, r.last_error = now, None
        r.clear_sync()
        r.consecutive_failures, r.backoff_version = 0, None
        r.schedule.synced()
        self._update(r, now, "synced", state=ComponentState.RUNNING, policy_version=version)
        self.rollout.served(replica_id, version, now)
        self.rollout.close_lags(now)
        self.rollout.retain(self.latest_version(), now)

    def failed(self, replica_id: str, version: int, error: str, now: float, serving: int | None = None,
               broken: bool = False) -> None:
        """The replica could not load (or verify) ``version``; it restored its previous weights
        (``serving``, if given) and serves them, and retries after a backoff; enough failures
        quarantine the version. ``broken``: it could not restore; it is out (STOPPED) until Ray
        Serve replaces it."""
        r = self.members.get(replica_id)
        if r is None:
            return
        r.failures += 1
        r.consecutive_failures = r.consecutive_failures + 1 if r.backoff_version == version else 1
        r.last_error = error
        r.backoff_version = version
        r.backoff_until = now + self.cfg.retry_backoff_s * min(2 ** (r.consecutive_failures - 1),
                                                               MAX_BACKOFF_FACTOR)
        r.clear_sync()
        r.last_seen = now
        if r.alive:
            changes = {"state": ComponentState.STOPPED if broken else ComponentState.RUNNING}
            if serving is not None:
                changes["policy_version"] = serving
            self._update(r, now, "failed", f"v{version}: {error[:200]}", **changes)
        if self.versions.failed(version, error):
            self.event(SYNCHRONIZER, ComponentState.RUNNING, version, now, "quarantined",
                       self.versions.get(version).reason)
            if version == self.candidate:
                self.rollout.end_canary(now, Verdict("rollback", "quarantined: the candidate failed to load"))
            self.rollout.repromote(now)

    # -- trainer side ----------------------------------------------------------------
    def publish(self, published: PublishedVersion, now: float) -> None:
        """The trainer committed a new version.

        Raises:
            ValueError: the version is not newer than the latest one.
        """
        if self.latest is not None and published.version <= self.latest.version:
            raise ValueError(f"version {published.version} is not newer than {self.latest.version}")
        self.latest = published
        self.versions.add(published.version, published.handle, now)
        self.event(TRAINER, self.trainer_state, published.version, now, "published")
        if self.cfg.rollout == "rolling":
            self.rollout.promote(published.version, now)
        self.rollout.retain(published.version, now)

    def set_trainer(self, state: ComponentState, step: int, now: float) -> None:
        """The trainer reports its state and optimizer step (an event when its state changes)."""
        self.trainer_step = step
        if state is not self.trainer_state:
            self.trainer_state = state
            self.event(TRAINER, state, self.latest_version(), now)

    def sync_requested(self) -> bool:
        """EXPLORER_DRIVEN: some live replica asked for weights newer than the latest version."""
        latest = self.latest_version()
        return any(r.live and r.schedule.open_request() and r.schedule.request_base_version >= latest
                   for r in self.members)

    # -- rollout (serve_rft.synchronizer.rollout) --------------------------------------
    def decide(self, now: float, rewards: dict | None = None):
        """`Rollout.decide`: the canary verdict, acted on (or None)."""
        self._now = now
        return self.rollout.decide(now, rewards)

    def record_traffic(self, per_version: dict[int, tuple[int, int, float]]) -> None:
        """`Rollout.record_traffic`: requests a replica saw per version since its last poll."""
        self.rollout.record_traffic(per_version)

    def pin(self, version: int | None, now: float) -> None:
        """`Rollout.pin` (None unpins). Raises ValueError: not loadable."""
        self._now = now
        self.rollout.pin(version, now)

    def rollback(self, version: int, now: float, reason: str = "operator rollback") -> list[int]:
        """`Rollout.rollback`. Raises ValueError: not loadable."""
        self._now = now
        return self.rollout.rollback(version, now, reason)

    def set_promotion_paused(self, paused: bool, now: float) -> None:
        """`Rollout.set_promotion_paused`: hold (or release) canary verdicts."""
        self._now = now
        self.rollout.set_promotion_paused(paused, now)

    # -- views ---------------------------------------------------------------------
    def status(self, now: float | None = None) -> dict:
        """Versions, rollout, trainer and every replica, JSON-able (``now``: unix s; None: the
        wall clock)."""
        now = time.time() if now is None else now
        return {
            "policy_version": self.latest_version(),
            "incumbent_version": self.incumbent,
            "sync_style": self.cfg.sync_style.value,
            "rollout": self.rollout.status(),
            "trainer": {"state": self.trainer_state.value, "step": self.trainer_step},
            "replicas": [r.status(now) for r in sorted(self.members, key=lambda r: r.replica_id)],
            "version_lag_s": {str(k): round(v, 3) for k, v in sorted(self.rollout.version_lags.items())},
        }

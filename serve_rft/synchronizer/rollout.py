"""The rollout: which policy version each replica should serve.

Rolling (``synchronizer.rollout=rolling``): every published version is promoted at once and is
the *incumbent* every replica moves to. Canary (``rollout=canary``): the newest eligible version
above the incumbent becomes the *candidate*; up to ``canary.replicas`` replicas load it (never the
last one on the incumbent) while the others keep the incumbent; once the window is over the
verdict (`serve_rft.synchronizer.canary.judge`) promotes it (it becomes the incumbent and rolls
to the rest) or rolls it back (it is *rejected*; its canaries move back). Versions the trainer
publishes during a window wait; after the verdict the next candidate is the newest one then.
Operators may *pin* a version (served everywhere until unpinned), *roll back* to a named version
(every version above it rejected) and pause verdicts. Pure Python, no clock of its own.
"""

from __future__ import annotations

from typing import Callable

from serve_rft.config import SynchronizerConfig
from serve_rft.synchronizer.canary import ArmStats, Verdict, judge
from serve_rft.synchronizer.membership import Membership, ReplicaInfo
from serve_rft.synchronizer.versions import Versions
from serve_rft.types import ComponentState

SYNCHRONIZER = "synchronizer"
MAX_LAGS = 10_000
"""Versions whose version lag is kept."""


class Rollout:
    """Incumbent, candidate, pins and verdicts over `Versions` and `Membership`.

    Args:
        cfg: the synchronizer's settings.
        versions, members: the state's version registry and membership.
        event: ``(component, state, version, now, kind, detail)``: the audit log.
        held: ``now -> bool``: a restarted synchronizer still waits for replicas (keep every handle).
    """

    def __init__(self, cfg: SynchronizerConfig, versions: Versions, members: Membership,
                 event: Callable, held: Callable[[float], bool]):
        self.cfg, self.versions, self.members, self.event, self.held = cfg, versions, members, event, held
        self.incumbent = 0
        self.candidate: int | None = None
        self.canary_since: float | None = None  # the first canary replica served the candidate
        self.canary_traffic: dict[int, ArmStats] = {}  # version -> requests in the window
        self.pinned: int | None = None
        self.promotion_paused = False
        self.verdicts: list[dict] = []
        self.version_lags: dict[int, float] = {}  # version -> seconds to reach every live replica
        self.lag_open: dict[int, float] = {}  # promoted version -> promoted_at, until everywhere

    def is_canary(self, r: ReplicaInfo) -> bool:
        return self.candidate is not None and self.candidate in (r.policy_version, r.granted)

    def canary_slot_open(self) -> bool:
        canaries = sum(r.live and self.is_canary(r) for r in self.members)
        return canaries < self.cfg.canary.replicas and self.members.n_live - canaries - 1 >= 1

    def target(self, r: ReplicaInfo) -> int:
        """The version ``r`` should serve (it may already): the pinned one, the candidate for a
        canary (or a replica that may become one), else the incumbent."""
        if self.pinned is not None:
            return self.pinned
        if self.candidate is not None and (self.is_canary(r) or self.canary_slot_open()):
            return self.candidate
        return self.incumbent

    def must_move(self, r: ReplicaInfo, target: int) -> bool:
        """Whether ``r`` should leave its version for ``target``: always upward; downward only
        when pinned, away from a rejected version, or (canary) from a version that is neither
        the incumbent nor the candidate."""
        if target > r.policy_version:
            return True
        if target == r.policy_version:
            return False
        own = self.versions.get(r.policy_version)  # a downgrade: only away from a version to leave
        return self.pinned is not None or (own is not None and own.rejected) or (
            self.cfg.rollout == "canary" and r.policy_version != self.candidate)

    def promote(self, version: int, now: float) -> None:
        """``version`` is to be served everywhere: it becomes the incumbent if it is eligible and
        newer (or the incumbent no longer is eligible); its lag clock starts now."""
        self.versions.promote(version, now)
        v, inc = self.versions.get(version), self.versions.get(self.incumbent)
        if v.eligible and (version > self.incumbent or (inc is not None and not inc.eligible and inc.version)):
            self.incumbent = version
            self.lag_open[version] = now

    def repromote(self, now: float) -> None:
        """After a quarantine or rejection of the incumbent: the newest promoted eligible version
        below it (0, the initial weights, when none is known)."""
        inc = self.versions.get(self.incumbent)
        if inc is not None and (inc.quarantined or inc.rejected):
            fallback = 0
            for version in sorted(self.versions.by_version, reverse=True):
                v = self.versions.by_version[version]
                if version < self.incumbent and (v.promoted_at is not None or version == 0) and v.eligible:
                    fallback = version
                    break
            self.incumbent = fallback
            if self.candidate is not None:  # the window compared against the old incumbent
                self.event(SYNCHRONIZER, ComponentState.RUNNING, self.candidate, now, "canary_ended",
                           f"incumbent v{inc.version} quarantined; no verdict")
                self.candidate = self.canary_since = None
                self.canary_traffic = {}
        self.retain(self.versions.newest(), now)

    def choose_candidate(self, now: float) -> None:
        if self.cfg.rollout != "canary" or self.candidate is not None or self.pinned is not None:
            return
        newest = self.versions.newest_eligible(above=self.incumbent)
        if newest is not None:
            self.candidate, self.canary_since = newest, None
            self.event(SYNCHRONIZER, ComponentState.RUNNING, newest, now, "candidate",
                       f"v{newest} vs incumbent v{self.incumbent}")

    def served(self, replica_id: str, version: int, now: float) -> None:
        """A replica now serves ``version``: the first canary on the candidate opens the window."""
        if version == self.candidate and self.canary_since is None:
            self.canary_since = now
            self.canary_traffic = {self.candidate: ArmStats(), self.incumbent: ArmStats()}
            self.event(SYNCHRONIZER, ComponentState.RUNNING, version, now, "canary_started",
                       f"v{version} on {replica_id} vs incumbent v{self.incumbent}")

    def record_traffic(self, per_version: dict[int, tuple[int, int, float]]) -> None:
        """Requests that ended on a replica since its last poll, by version: ``(requests,
        errors, latency seconds)``; kept only for the two arms of an open canary window."""
        for version, (n, errors, latency) in per_version.items():
            arm = self.canary_traffic.get(version)
            if arm is not None and self.canary_open():
                arm.add_traffic(n, errors, latency)

    def canary_open(self) -> bool:
        return self.candidate is not None and self.canary_since is not None

    def canary_window(self) -> tuple[float, float] | None:
        """``[start, end)`` of the open canary window (unix s), or None."""
        if not self.canary_open():
            return None
        return self.canary_since, self.canary_since + self.cfg.canary.window_s

    def decide(self, now: float, rewards: dict[int, ArmStats] | None = None) -> Verdict | None:
        """Judge the open canary once its window is over (`canary.judge`), with ``rewards``
        (version -> reward counts of experiences generated in the window); promote or roll back.

        Returns:
            The verdict acted on, or None (no canary, window open, paused, or waiting).
        """
        window = self.canary_window()
        if window is None or self.promotion_paused or now < window[1]:
            return None
        rewards = rewards or {}
        arms = []
        for version in (self.candidate, self.incumbent):
            arm = self.canary_traffic.get(version, ArmStats())
            got = rewards.get(version, ArmStats())
            arms.append(ArmStats(got.rewards, got.reward_sum, got.reward_sq, arm.requests, arm.errors,
                                 arm.latency_s))
        verdict = judge(arms[0], arms[1], self.cfg.canary, now >= window[1] + self.cfg.canary.reward_wait_s)
        if verdict.decision is None:
            return None
        self.end_canary(now, verdict)
        return verdict

    def end_canary(self, now: float, verdict: Verdict) -> None:
        version = self.candidate
        self.verdicts.append({"t": now, "version": version, "incumbent": self.incumbent,
                              "decision": verdict.decision, "reason": verdict.reason, **verdict.stats})
        del self.verdicts[:-100]
        if verdict.decision == "promote":
            self.promote(version, now)
            self.event(SYNCHRONIZER, ComponentState.RUNNING, version, now, "promoted", verdict.reason)
        else:
            v = self.versions.get(version)
            v.rejected, v.reason = True, verdict.reason
            self.event(SYNCHRONIZER, ComponentState.RUNNING, version, now, "rolled_back", verdict.reason)
        self.candidate = self.canary_since = None
        self.canary_traffic = {}
        self.retain(self.versions.newest(), now)

    def pin(self, version: int | None, now: float) -> None:
        """Serve ``version`` everywhere until unpinned (None unpins); no other version rolls.

        Raises:
            ValueError: the version is not loadable any more (its handle was released).
        """
        if version is not None:
            v = self.versions.get(version)
            if v is None or v.handle is None:
                raise ValueError(f"version {version} is not loadable; loadable: {self.loadable()}")
        self.pinned = version
        detail = None
        if version is not None and self.candidate is not None:  # no verdict on a starved arm: the
            detail = f"canary of v{self.candidate} ended without a verdict"  # candidate may come back
            self.candidate = self.canary_since = None
            self.canary_traffic = {}
        self.event(SYNCHRONIZER, ComponentState.RUNNING, version if version is not None else self.incumbent,
                   now, "pinned" if version is not None else "unpinned", detail)
        self.retain(self.versions.newest(), now)

    def rollback(self, version: int, now: float, reason: str = "operator rollback") -> list[int]:
        """Reject every version above ``version`` and make it the incumbent (replicas move back
        to it; versions the trainer publishes later roll as usual). Ends an open canary.

        Returns:
            The versions rejected.
        Raises:
            ValueError: ``version`` is not loadable.
        """
        v = self.versions.get(version)
        if v is None or v.handle is None:
            raise ValueError(f"version {version} is not loadable; loadable: {self.loadable()}")
        v.rejected = v.quarantined = False
        v.failures = 0
        rejected = []
        for other in self.versions.by_version.values():
            if other.version > version and not other.rejected:
                other.rejected, other.reason = True, reason
                rejected.append(other.version)
        self.candidate = self.canary_since = None
        self.canary_traffic = {}
        self.incumbent = version
        self.versions.promote(version, now)
        self.event(SYNCHRONIZER, ComponentState.RUNNING, version, now, "rollback",
                   f"{reason}; rejected {rejected}")
        self.retain(self.versions.newest(), now)
        return rejected

    def set_promotion_paused(self, paused: bool, now: float) -> None:
        """Hold (or release) canary verdicts: the candidate keeps serving on its canaries."""
        if paused != self.promotion_paused:
            self.promotion_paused = paused
            self.event(SYNCHRONIZER, ComponentState.RUNNING, self.incumbent, now,
                       "promotion_paused" if paused else "promotion_resumed")

    def loadable(self) -> list[int]:
        return sorted(v.version for v in self.versions.by_version.values() if v.handle is not None)

    def retain(self, latest: int, now: float) -> None:
        """Keep the handles of versions served (or restored to) by replicas not known dead, of
        the incumbent, candidate, pinned and latest versions (a granted version is one of those),
        and of the newest ``retain_versions`` eligible ones. Nothing is dropped while a restarted
        synchronizer still waits for replicas to introduce themselves."""
        if self.held(now):
            return
        needed = set(self.members.alive_versions) | self.members.granted_versions()
        needed |= {v for v in (self.incumbent, self.candidate, self.pinned, latest) if v is not None}
        self.versions.retain_only(needed, min(needed, default=0))

    def close_lags(self, now: float) -> None:
        """Record the lag of every promoted version that every live replica now serves or passed."""
        if not self.members.live_versions:
            return
        floor = min(self.members.live_versions)
        for version in [v for v in self.lag_open if v <= floor]:
            self.version_lags[version] = now - self.lag_open.pop(version)
        for version in [v for v in self.lag_open if self.versions.get(v) is None or not self.versions.get(v).eligible]:
            del self.lag_open[version]  # quarantined or rejected: it will never be everywhere
        while len(self.version_lags) > MAX_LAGS:
            self.version_lags.pop(next(iter(self.version_lags)))

    def snapshot(self) -> dict:
        """What a restarted synchronizer needs to keep the rollout (JSON-able; handles excluded:
        replicas and the trainer bring them back)."""
        return {"incumbent": self.incumbent, "candidate": self.candidate, "canary_since": self.canary_since,
                "pinned": self.pinned, "promotion_paused": self.promotion_paused,
                "rejected": sorted(v.version for v in self.versions.by_version.values() if v.rejected),
                "quarantined": sorted(v.version for v in self.versions.by_version.values() if v.quarantined),
                "promoted": {str(v.version): v.promoted_at for v in self.versions.by_version.values()
                             if v.promoted_at is not None}}

    def restore(self, snap: dict, now: float) -> None:
        """Take a `snapshot` back after a restart."""
        self.incumbent, self.candidate = snap["incumbent"], snap["candidate"]
        self.canary_since, self.pinned = snap["canary_since"], snap["pinned"]
        self.promotion_paused = snap["promotion_paused"]
        if self.canary_since is not None:
            self.canary_traffic = {self.candidate: ArmStats(), self.incumbent: ArmStats()}
        for version in (self.incumbent, self.candidate, self.pinned):
            if version is not None:
                self.versions.add(version, None, now)  # handles come back with replicas and the trainer
        for key in ("rejected", "quarantined"):
            for version in snap[key]:
                v = self.versions.add(version, None, now)
                setattr(v, key, True)
                if key == "quarantined":
                    v.failures = max(v.failures, self.versions.max_load_attempts)
                v.reason = v.reason or f"{key} before a synchronizer restart"
        for version, at in snap["promoted"].items():
            self.versions.add(int(version), None, now)
            self.versions.promote(int(version), at)

    def version_lag(self) -> dict[int, float]:
        """Seconds from promoting each version to the last live replica serving it (or a newer
        one); the newest `MAX_LAGS` versions."""
        return dict(self.version_lags)

    def status(self) -> dict:
        window = self.canary_window()
        return {"rollout": self.cfg.rollout, "incumbent": self.incumbent, "candidate": self.candidate,
                "canary_window": list(window) if window else None, "pinned": self.pinned,
                "promotion_paused": self.promotion_paused,
                "canary_traffic": {str(k): v.as_dict() for k, v in self.canary_traffic.items()},
                "verdicts": self.verdicts[-10:], "versions": self.versions.status(),
                "loadable": self.loadable()}


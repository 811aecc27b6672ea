"""The policy versions the synchronizer knows: handles, promotion, failures, quarantine.

Pure Python, no clock of its own (every call takes ``now``). A version is *published* by the
trainer, *promoted* when every replica should serve it (at once in the rolling rollout; after a
canary verdict in the canary rollout), *quarantined* after ``max_load_attempts`` failed loads
(never granted again), *rejected* when a canary verdict or an operator rolled it back (replicas
serving it move back). Handles are kept only for versions that may still be loaded (bounded;
`Versions.retain`): a MEMORY handle holds the version's buckets in Ray's object store.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any


@dataclass
class VersionInfo:
    """One policy version. Times are unix seconds of the caller's clock."""

    version: int
    published_at: float
    handle: dict[str, Any] | None
    promoted_at: float | None = None
    failures: int = 0
    quarantined: bool = False
    rejected: bool = False
    reason: str | None = None

    @property
    def eligible(self) -> bool:
        """May be granted: loadable, not quarantined, not rejected."""
        return self.handle is not None and not self.quarantined and not self.rejected

    def as_dict(self) -> dict:
        return {"version": self.version, "published_at": self.published_at, "promoted_at": self.promoted_at,
                "failures": self.failures, "quarantined": self.quarantined, "rejected": self.rejected,
                "reason": self.reason, "loadable": self.handle is not None}


class Versions:
    """Published versions by number (version 0 = the initial weights, registered by replicas).

    Args:
        max_load_attempts: failed loads that quarantine a version.
        retain: newest eligible versions whose handles are kept for an operator rollback.
        max_kept: versions remembered at most (oldest forgotten first).
    """

    def __init__(self, max_load_attempts: int = 3, retain: int = 3, max_kept: int = 1000):
        self.max_load_attempts = max_load_attempts
        self.retain = retain
        self.max_kept = max_kept
        self.by_version: dict[int, VersionInfo] = {}
        self._promoted: list[int] = []  # ascending promoted versions still needed for lag clocks

    def __contains__(self, version: int) -> bool:
        return version in self.by_version

    def get(self, version: int | None) -> VersionInfo | None:
        return None if version is None else self.by_version.get(version)

    def newest(self) -> int:
        """The newest published version (0 if none)."""
        return max(self.by_version, default=0)

    def add(self, version: int, handle: dict[str, Any] | None, now: float) -> VersionInfo:
        v = self.by_version.get(version)
        if v is None:
            v = self.by_version[version] = VersionInfo(version, now, handle)
        elif v.handle is None and handle is not None:
            v.handle = handle
        return v

    def newest_eligible(self, above: int = -1) -> int | None:
        """The newest eligible version above ``above``, or None."""
        for version in sorted(self.by_version, reverse=True):
            if version <= above:
                return None
            if self.by_version[version].eligible:
                return version
        return None

    def promote(self, version: int, now: float) -> None:
        v = self.by_version[version]
        if v.promoted_at is None:
            v.promoted_at = now
            bisect.insort(self._promoted, version)

    def first_promoted_above(self, version: int) -> VersionInfo | None:
        """The oldest promoted version above ``version`` (its promotion starts a replica's lag clock)."""
        for promoted in self._promoted[bisect.bisect_right(self._promoted, version):]:
            v = self.by_version.get(promoted)
            if v is not None and v.eligible:
                return v
        return None

    def failed(self, version: int, reason: str) -> bool:
        """Count a failed load of ``version``; True if that quarantined it now."""
        v = self.by_version.get(version)
        if v is None or v.quarantined:
            return False
        v.failures += 1
        if v.failures >= self.max_load_attempts:
            v.quarantined, v.reason = True, f"{v.failures} failed loads; last: {reason}"
            return True
        return False

    def retain_only(self, needed: set[int], floor: int) -> None:
        """Drop handles of versions neither ``needed`` nor among the newest ``retain`` eligible
        CHECKPOINT ones (a folder path costs nothing to keep; a MEMORY handle holds a whole model
        in Ray's object store, so only needed ones are kept); forget versions below ``floor``
        beyond ``max_kept`` and promotions below ``floor``."""
        keep = set(needed)
        for version in sorted(self.by_version, reverse=True):
            if len(keep - set(needed)) >= self.retain:
                break
            v = self.by_version[version]
            if v.eligible and v.handle.get("method") == "checkpoint":
                keep.add(version)
        for version, v in self.by_version.items():
            if version not in keep and version != 0:
                v.handle = None
        # lag clocks only need the promotions above the slowest replica (and the newest one)
        i = bisect.bisect_right(self._promoted, floor)
        if i > 1:
            del self._promoted[: i - 1]
        while len(self.by_version) > self.max_kept:
            oldest = min(self.by_version)
            if oldest >= floor or oldest in needed:
                break
            del self.by_version[oldest]

    def status(self, last: int = 10) -> list[dict]:
        return [self.by_version[v].as_dict() for v in sorted(self.by_version)[-last:]]

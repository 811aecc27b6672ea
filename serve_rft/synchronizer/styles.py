"""When syncs happen: the three sync styles of the Trinity-RFT Synchronizer documentation, for a
serving system, and the time bound that keeps them live without traffic.

Clocks:
- a **trainer step** is one optimizer step;
- an **explorer step** of a replica is ``explorer_step_experiences`` experiences logged by that
  replica (a serving system has no episodes: traffic is its clock).

Styles (``interval`` = ``sync_interval``, ``offset`` = ``sync_offset``):
- FIXED: the trainer publishes at trainer steps ``interval, 2*interval, ...``; a replica syncs at
  its explorer steps ``offset, offset + interval, offset + 2*interval, ...`` (the documentation's table:
  interval=10, offset=5 -> the explorer runs 5 steps first, then syncs every 10). At a scheduled
  step the replica becomes *due* and syncs as soon as a version newer than its own exists; it
  keeps serving while it waits.
- TRAINER_DRIVEN: the trainer publishes every ``interval`` trainer steps; replicas pick each
  version up as soon as the rolling rule lets them.
- EXPLORER_DRIVEN: after every ``interval`` of its own explorer steps a replica *requests* new
  weights; the trainer notices the request at its next loop and publishes its current weights;
  the replica syncs. If no newer version comes within ``sync_timeout_s`` the replica keeps
  serving and asks again in the next cycle.

The styles say when a replica *wants* weights; traffic is their clock, so with no traffic a FIXED
or EXPLORER_DRIVEN replica would never be due again and keep yesterday's weights while the trainer
publishes from its backlog. Hence the liveness bound, whatever the style: once the oldest promoted
version a replica lacks has waited `SyncState.lag_trigger_s` (half of
``synchronizer.max_version_lag_s``, less when the live replicas could not all roll in the other
half one ``max_unavailable`` slot at a time at the mean sync time), the replica is due anyway.
So every promoted version reaches every live replica within ``max_version_lag_s`` as long as the
roll itself fits (benchmarks/rollout_sim.py measures where it stops fitting). ``null`` turns the
bound off and leaves the styles alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_rft.config import SyncStyle


def fixed_scheduled_step(explorer_step: int, interval: int, offset: int) -> int | None:
    """The latest FIXED sync point ``s <= explorer_step`` (``s = offset + k * interval``, k >= 0),
    or None before ``offset``."""
    if explorer_step < offset:
        return None
    return offset + ((explorer_step - offset) // interval) * interval


@dataclass
class ReplicaSchedule:
    """One replica's sync schedule: its explorer step, whether it is due, its open request."""

    explorer_step: int = 0
    due: bool = False
    last_scheduled: int = -1
    last_request_step: int = 0
    requested_at: float | None = None
    request_base_version: int = 0
    timeouts: int = 0
    history: list[int] = field(default_factory=list)

    def observe(self, style: SyncStyle, step: int, version: int, interval: int, offset: int,
                timeout_s: float, now: float) -> None:
        """Advance to explorer ``step`` at time ``now`` (serving ``version``)."""
        self.explorer_step = max(self.explorer_step, step)
        if style is SyncStyle.TRAINER_DRIVEN:
            self.due = True
        elif style is SyncStyle.FIXED:
            s = fixed_scheduled_step(self.explorer_step, interval, offset)
            if s is not None and s > self.last_scheduled:
                self.last_scheduled = s
                self.history.append(s)
                self.due = True
        else:  # EXPLORER_DRIVEN
            if self.requested_at is not None and now - self.requested_at > timeout_s:
                self.requested_at = None  # keep serving; ask again next cycle
                self.timeouts += 1
                self.last_request_step = self.explorer_step
            if self.requested_at is None and self.explorer_step - self.last_request_step >= interval:
                self.requested_at = now
                self.request_base_version = version
                self.last_request_step = self.explorer_step
                self.history.append(self.explorer_step)
            self.due = self.requested_at is not None

    def open_request(self) -> bool:
        """EXPLORER_DRIVEN: the replica waits for a version newer than when it asked."""
        return self.requested_at is not None

    def synced(self) -> None:
        self.due = False
        self.requested_at = None

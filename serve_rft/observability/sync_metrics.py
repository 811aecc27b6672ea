"""Synchronizer metrics: replica states and versions, sync durations, failures.

Owned by the `Synchronizer` actor, which calls `SyncMetrics.refresh` after every state change
and `observe_sync` when a replica reports a finished sync.
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

from serve_rft.types import ComponentState

SYNC_SECONDS_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class SyncMetrics:
    """Gauges and histograms for the synchronizer's view of the world."""

    def __init__(self, method: str):
        self.method = method
        self.state = Gauge("serve_rft_replica_state",
                           description="1 if the replica is in this state (RUNNING/REQUIRE_SYNC/STOPPED).",
                           tag_keys=("replica", "state"))
        self.replica_version = Gauge("serve_rft_replica_policy_version",
                                     description="Policy version a replica serves.", tag_keys=("replica",))
        self.latest_version = Gauge("serve_rft_policy_version", description="Latest published policy version.")
        self.serving = Gauge("serve_rft_replicas_serving", description="Replicas RUNNING now.")
        self.trainer_state = Gauge("serve_rft_trainer_state", description="1 if the trainer is in this state.",
                                   tag_keys=("state",))
        self.sync_seconds = Histogram("serve_rft_sync_seconds",
                                      description="Seconds a replica spent syncing, by phase (total, load).",
                                      boundaries=SYNC_SECONDS_BUCKETS, tag_keys=("method", "replica", "phase"))
        self.sync_bytes = Counter("serve_rft_sync_bytes_total", description="Weight bytes loaded by replicas.",
                                  tag_keys=("method", "replica"))
        self.failures = Counter("serve_rft_sync_failures_total", description="Failed weight loads.",
                                tag_keys=("replica",))

    def refresh(self, state) -> None:
        """Set every gauge from a `SyncState`."""
        for r in state.replicas.values():
            for s in ComponentState:
                self.state.set(1.0 if r.state is s else 0.0, tags={"replica": r.replica_id, "state": s.value})
            self.replica_version.set(r.policy_version, tags={"replica": r.replica_id})
        self.latest_version.set(state.latest_version())
        self.serving.set(state.serving())
        for s in ComponentState:
            self.trainer_state.set(1.0 if state.trainer_state is s else 0.0, tags={"state": s.value})

    def observe_sync(self, replica_id: str, timings: dict | None) -> None:
        if not timings:
            return
        for phase in ("total_s", "load_s"):
            if phase in timings:
                self.sync_seconds.observe(timings[phase], tags={"method": self.method, "replica": replica_id,
                                                                 "phase": phase[:-2]})
        if timings.get("bytes"):
            self.sync_bytes.inc(timings["bytes"], tags={"method": self.method, "replica": replica_id})

    def failed(self, replica_id: str) -> None:
        self.failures.inc(tags={"replica": replica_id})

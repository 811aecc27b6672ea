"""Synchronizer metrics: replica states and versions, sync durations, failures, the rollout.

Owned by the `Synchronizer` actor, which calls `SyncMetrics.refresh` after every state change,
`observe_sync` when a replica reports a finished sync, and `canary` / `verdict` while a canary
runs. Per-version series are kept to a bounded set: the two canary arms are labelled
``arm="incumbent"`` / ``arm="candidate"``, their versions are gauges. The store's experience
counts are `serve_rft.observability.store_metrics.StoreMetrics` (the synchronizer reports those too).
"""

from __future__ import annotations

import time

from ray.util.metrics import Counter, Histogram

from serve_rft.observability.held import Gauge
from serve_rft.types import ComponentState

SYNC_SECONDS_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class SyncMetrics:
    """Gauges and histograms for the synchronizer's view of the world."""

    def __init__(self, method: str):
        self.method = method
        self._replicas: set[str] = set()  # the replica ids of the last refresh
        self.state = Gauge("serve_rft_replica_state",
                           description="1 if the replica is in this state (RUNNING/REQUIRE_SYNC/STOPPED).",
                           tag_keys=("replica", "state"))
        self.replica_version = Gauge("serve_rft_replica_policy_version",
                                     description="Policy version a replica serves.", tag_keys=("replica",))
        self.latest_version = Gauge("serve_rft_policy_version", description="Latest published policy version.")
        self.incumbent = Gauge("serve_rft_incumbent_policy_version",
                               description="The promoted version every replica converges to.")
        self.candidate = Gauge("serve_rft_candidate_policy_version",
                               description="The canary's candidate version (0: none).")
        self.version_lag = Gauge("serve_rft_version_lag_seconds",
                                 description="Seconds since the oldest promoted version that a live "
                                 "replica does not serve yet was promoted (0: every live replica serves "
                                 "the incumbent or newer, or an operator's pin holds them).")
        self.version_lag_bound = Gauge("serve_rft_max_version_lag_seconds",
                                       description="synchronizer.max_version_lag_s, s: the bound "
                                       "serve_rft_version_lag_seconds is kept under (absent: no bound).")
        self.serving = Gauge("serve_rft_replicas_serving", description="Live replicas in rotation now.")
        self.live = Gauge("serve_rft_replicas_live", description="Replicas that poll (or renew a sync lease).")
        self.quarantined = Gauge("serve_rft_versions_quarantined",
                                 description="Versions never granted again after failed loads.")
        self.trainer_state = Gauge("serve_rft_trainer_state", description="1 if the trainer is in this state.",
                                   tag_keys=("state",))
        self.sync_seconds = Histogram("serve_rft_sync_seconds",
                                      description="Seconds a replica spent syncing, by phase (total, load).",
                                      boundaries=SYNC_SECONDS_BUCKETS, tag_keys=("method", "replica", "phase"))
        self.sync_bytes = Counter("serve_rft_sync_bytes_total", description="Weight bytes loaded by replicas.",
                                  tag_keys=("method", "replica"))
        self.failures = Counter("serve_rft_sync_failures_total", description="Failed weight loads.",
                                tag_keys=("replica",))
        self.arm_rewards = Gauge("serve_rft_canary_rewards", description="Rewards of experiences generated "
                                 "in the open canary window, per arm (incumbent / candidate).", tag_keys=("arm",))
        self.arm_reward_mean = Gauge("serve_rft_canary_reward_mean", description="Mean reward of the open "
                                     "canary window, per arm (0: no reward yet).", tag_keys=("arm",))
        self.arm_requests = Gauge("serve_rft_canary_requests", description="Requests answered in the open "
                                  "canary window, per arm.", tag_keys=("arm",))
        self.arm_errors = Gauge("serve_rft_canary_errors", description="Requests answered with an error in "
                                "the open canary window, per arm.", tag_keys=("arm",))
        self.verdicts = Counter("serve_rft_canary_verdicts_total", description="Canary verdicts.",
                                tag_keys=("decision",))

    def refresh(self, state, now: float | None = None) -> None:
        """Set every gauge from a `SyncState` at ``now`` (Unix time, s; default: the clock)."""
        now = time.time() if now is None else now
        for r in state.replicas.values():
            for s in ComponentState:
                self.state.set(1.0 if r.state is s else 0.0, tags={"replica": r.replica_id, "state": s.value})
            self.replica_version.set(r.policy_version, tags={"replica": r.replica_id})
        for gone in self._replicas - set(state.replicas):  # held gauges: a replica that left stops
            for s in ComponentState:
                self.state.forget({"replica": gone, "state": s.value})
            self.replica_version.forget({"replica": gone})
        self._replicas = set(state.replicas)
        self.latest_version.set(state.latest_version())
        self.incumbent.set(state.incumbent)
        self.candidate.set(state.candidate or 0)
        pinned = state.rollout.pinned is not None  # an operator holds every replica on one version
        self.version_lag.set(0.0 if pinned else max((now - t for t in state.rollout.lag_open.values()), default=0.0))
        if state.cfg.max_version_lag_s is not None:
            self.version_lag_bound.set(state.cfg.max_version_lag_s)
        self.serving.set(state.serving())
        self.live.set(state.members.n_live)
        self.quarantined.set(sum(v.quarantined for v in state.versions.by_version.values()))
        for s in ComponentState:
            self.trainer_state.set(1.0 if state.trainer_state is s else 0.0, tags={"state": s.value})

    def canary(self, rollout, rewards: dict) -> None:
        """The open window's arms (rewards from the store, traffic from the replicas)."""
        for arm, version in (("candidate", rollout.candidate), ("incumbent", rollout.incumbent)):
            got, traffic = rewards.get(version), rollout.canary_traffic.get(version)
            tags = {"arm": arm}
            self.arm_rewards.set(float(got.rewards if got else 0), tags=tags)
            self.arm_reward_mean.set(float((got.reward_mean or 0.0) if got else 0.0), tags=tags)
            self.arm_requests.set(float(traffic.requests if traffic else 0), tags=tags)
            self.arm_errors.set(float(traffic.errors if traffic else 0), tags=tags)

    def verdict(self, decision: str) -> None:
        """One canary verdict (``decision``: promote / rollback)."""
        self.verdicts.inc(tags={"decision": decision})

    def observe_sync(self, replica_id: str, timings: dict | None) -> None:
        """A finished sync's ``timings`` (``total_s`` / ``load_s`` / ``verify_s`` seconds, ``bytes``)."""
        if not timings:
            return
        for phase in ("total_s", "load_s", "verify_s"):
            if phase in timings:
                self.sync_seconds.observe(timings[phase], tags={"method": self.method, "replica": replica_id,
                                                                 "phase": phase[:-2]})
        if timings.get("bytes"):
            self.sync_bytes.inc(timings["bytes"], tags={"method": self.method, "replica": replica_id})

    def failed(self, replica_id: str) -> None:
        """One failed weight load by ``replica_id``."""
        self.failures.inc(tags={"replica": replica_id})

"""Synchronizer metrics: replica states and versions, sync durations, failures, the rollout.

Owned by the `Synchronizer` actor, which calls `SyncMetrics.refresh` after every state change,
`observe_sync` when a replica reports a finished sync, and `canary` / `verdict` while a canary
runs. Per-version series are kept to a bounded set: the two canary arms are labelled
``arm="incumbent"`` / ``arm="candidate"``, their versions are gauges.
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
        self.incumbent = Gauge("serve_rft_incumbent_policy_version",
                               description="The promoted version every replica converges to.")
        self.candidate = Gauge("serve_rft_candidate_policy_version",
                               description="The canary's candidate version (0: none).")
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
        self.arm = Gauge("serve_rft_canary_arm", description="The open canary window per arm: rewards, "
                         "reward_mean, requests, errors.", tag_keys=("arm", "stat"))
        self.verdicts = Counter("serve_rft_canary_verdicts_total", description="Canary verdicts.",
                                tag_keys=("decision",))

    def refresh(self, state) -> None:
        """Set every gauge from a `SyncState`."""
        for r in state.replicas.values():
            for s in ComponentState:
                self.state.set(1.0 if r.state is s else 0.0, tags={"replica": r.replica_id, "state": s.value})
            self.replica_version.set(r.policy_version, tags={"replica": r.replica_id})
        self.latest_version.set(state.latest_version())
        self.incumbent.set(state.incumbent)
        self.candidate.set(state.candidate or 0)
        self.serving.set(state.serving())
        self.live.set(state.members.n_live)
        self.quarantined.set(sum(v.quarantined for v in state.versions.by_version.values()))
        for s in ComponentState:
            self.trainer_state.set(1.0 if state.trainer_state is s else 0.0, tags={"state": s.value})

    def canary(self, rollout, rewards: dict) -> None:
        """The open window's arms (rewards from the store, traffic from the replicas)."""
        for arm, version in (("candidate", rollout.candidate), ("incumbent", rollout.incumbent)):
            got, traffic = rewards.get(version), rollout.canary_traffic.get(version)
            stats = {"rewards": got.rewards if got else 0,
                     "reward_mean": (got.reward_mean or 0.0) if got else 0.0,
                     "requests": traffic.requests if traffic else 0, "errors": traffic.errors if traffic else 0}
            for stat, value in stats.items():
                self.arm.set(float(value), tags={"arm": arm, "stat": stat})

    def verdict(self, decision: str) -> None:
        self.verdicts.inc(tags={"decision": decision})

    def observe_sync(self, replica_id: str, timings: dict | None) -> None:
        if not timings:
            return
        for phase in ("total_s", "load_s", "verify_s"):
            if phase in timings:
                self.sync_seconds.observe(timings[phase], tags={"method": self.method, "replica": replica_id,
                                                                 "phase": phase[:-2]})
        if timings.get("bytes"):
            self.sync_bytes.inc(timings["bytes"], tags={"method": self.method, "replica": replica_id})

    def failed(self, replica_id: str) -> None:
        self.failures.inc(tags={"replica": replica_id})

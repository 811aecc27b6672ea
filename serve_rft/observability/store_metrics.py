"""Experience store metrics: experiences waiting in the store by state, and the store's own
totals of each transition since it was created, as Prometheus counters.

Owned by the `Synchronizer` actor (one per stack, so each store series has one reporter: a sum
over replicas never counts the store twice), which calls `StoreMetrics.counts` every
`STORE_COUNTS_PERIOD_S` with `serve_rft.buffer.store.ExperienceStore.counts`. The store keeps its
totals in Redis; a counter here follows the store's total from the first read on, so a restarted
synchronizer continues the series instead of starting it again at zero.
"""

from __future__ import annotations

from ray.util.metrics import Counter

from serve_rft.observability.held import Gauge

STORE_COUNTS_PERIOD_S = 5.0
"""How often the synchronizer reads the store's counts, s."""
LEVELS = ("pending", "held", "ready")
"""`StoreCounts` fields that are levels (experiences in that state now)."""
DONE_STATES = ("trained", "expired", "stale_dropped", "dead_lettered", "backlog_dropped", "constrained", "greedy")
"""`StoreCounts` totals of experiences that reached a final state (`state` label of
``serve_rft_experiences_done_total``)."""


class StoreMetrics:
    """The store's levels (gauges) and transition totals (counters), one series per quantity."""

    def __init__(self):
        self.waiting = Gauge("serve_rft_store_experiences",
                             description="Experiences in the store now, by state: pending (awaiting a "
                             "reward), held (rewarded, awaiting the rest of their group), ready (in the "
                             "ready stream, incl. delivered to the trainer and not yet acknowledged).",
                             tag_keys=("state",))
        self.rewarded = Counter("serve_rft_experiences_rewarded_total",
                                description="Experiences that got a reward (pending to held or ready).")
        self.done = Counter("serve_rft_experiences_done_total",
                            description="Experiences that reached a final state, by state: trained, or "
                            "left untrained (expired: never rewarded; stale_dropped: past "
                            "trainer.max_staleness; dead_lettered: untrainable; backlog_dropped: past "
                            "buffer.max_ready; constrained: sampled under a grammar; greedy: sampled "
                            "below trainer.min_train_temperature).", tag_keys=("state",))
        self.groups_timed_out = Counter("serve_rft_groups_timed_out_total",
                                        description="Reward groups released incomplete after their "
                                        "group timeout.")
        self.redis_restarts = Counter("serve_rft_redis_restarts_total",
                                      description="Restarts of the embedded redis-server by its supervisor.")
        self._seen: dict[str, int] = {}  # the highest total already counted, per StoreCounts field

    def _follow(self, counter: Counter, field: str, total: int, tags: dict | None = None) -> None:
        """Count what ``total`` (a store total) grew by since the highest value seen. A total
        that falls (a ready entry put back) is not counted again until it passes that mark."""
        grew = total - self._seen.get(field, 0)
        if grew > 0:
            counter.inc(grew, tags=tags)
            self._seen[field] = total

    def counts(self, counts) -> None:
        """Set the levels and advance the counters from a `StoreCounts` (experiences)."""
        for state in LEVELS:
            self.waiting.set(float(getattr(counts, state)), tags={"state": state})
        self._follow(self.rewarded, "rewarded", counts.rewarded)
        for state in DONE_STATES:
            self._follow(self.done, state, getattr(counts, state), tags={"state": state})
        self._follow(self.groups_timed_out, "groups_timed_out", counts.groups_timed_out)
        self._follow(self.redis_restarts, "redis_restarts", counts.redis_restarts)

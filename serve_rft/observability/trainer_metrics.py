"""Trainer metrics: staleness of what was trained, stale-dropped experiences.

Owned by the `Trainer` actor; exported through Ray's metrics API (Prometheus).
"""

from __future__ import annotations

from ray.util.metrics import Counter, Histogram

STALENESS_BUCKETS = [0.5, 1.5, 2.5, 4.5, 8.5, 16.5, 32.5, 64.5]


class TrainerMetrics:
    """Staleness histogram (policy versions between an experience's oldest token and the
    trainer's latest published version) and counters."""

    def __init__(self):
        self.staleness = Histogram("serve_rft_trained_staleness_versions",
                                   description="Staleness of trained experiences, policy versions.",
                                   boundaries=STALENESS_BUCKETS)
        self.stale_dropped = Counter("serve_rft_stale_dropped_total",
                                     description="Experiences dropped for exceeding max_staleness.")
        self.trained = Counter("serve_rft_trained_experiences_total",
                               description="Experiences trained on.")

    def observe(self, staleness: list[int], dropped: int) -> None:
        for s in staleness:
            self.staleness.observe(s)
        if staleness:
            self.trained.inc(len(staleness))
        if dropped:
            self.stale_dropped.inc(dropped)

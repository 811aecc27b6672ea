"""Trainer metrics: step time and loss / reward / advantage statistics, staleness of what was
trained, stale-dropped experiences, skipped steps (a non-finite update, a gradient-norm spike).

Owned by the `Trainer` actor; exported through Ray's metrics API (Prometheus).
"""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

STALENESS_BUCKETS = [0.5, 1.5, 2.5, 4.5, 8.5, 16.5, 32.5, 64.5]
STEP_SECONDS_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0]
SAMPLE_AGE_BUCKETS = [1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0]
STEP_STATS = ("sample_age_s_mean", "sample_age_s_max", "loss", "reward_mean", "adv_abs_mean", "ratio_mean", "ratio_max", "clip_fraction",
              "approx_kl", "kl_ref", "entropy", "grad_norm", "lr", "max_abs_logprob_diff", "batch_size",
              "tokens", "pg_clipfrac_lower", "is_weight_mean", "is_weight_max", "is_truncated_fraction",
              "is_masked_fraction", "mismatch_k3", "max_abs_mismatch", "drift_k3", "max_abs_drift",
              "clip_fraction_lag0", "clip_fraction_lag1", "clip_fraction_lag2_3", "clip_fraction_lag4p",
              "groups", "zero_variance_groups")
"""`PolicyTrainer.step` statistics exported as ``serve_rft_trainer_stat{stat=...}`` (last step)."""


class TrainerMetrics:
    """Staleness histogram (policy versions between an experience's oldest token and the
    trainer's latest published version) and counters."""

    def __init__(self):
        self.staleness = Histogram("serve_rft_trained_staleness_versions",
                                   description="Staleness of trained experiences, policy versions.",
                                   boundaries=STALENESS_BUCKETS)
        self.sample_age = Histogram("serve_rft_trained_sample_age_seconds",
                                    description="Seconds from an experience's generation to the step "
                                    "that trained it.", boundaries=SAMPLE_AGE_BUCKETS)
        self.stale_dropped = Counter("serve_rft_stale_dropped_total",
                                     description="Experiences dropped for exceeding max_staleness.")
        self.trained = Counter("serve_rft_trained_experiences_total",
                               description="Experiences trained on.")
        self.steps = Counter("serve_rft_trainer_steps_total", description="Optimizer steps taken.")
        self.skipped_steps = Counter("serve_rft_trainer_skipped_steps_total",
                                     description="Steps skipped: a non-finite advantage, loss or gradient "
                                     "norm, or a gradient-norm spike (trainer.grad_norm_spike); their batch is "
                                     "dead-lettered.")
        self.step_seconds = Histogram("serve_rft_trainer_step_seconds",
                                      description="Seconds of one optimizer step (forward, backward, update).",
                                      boundaries=STEP_SECONDS_BUCKETS)
        self.publish_seconds = Histogram("serve_rft_trainer_publish_seconds",
                                         description="Seconds the sync method's send took per publish.",
                                         boundaries=STEP_SECONDS_BUCKETS)
        self.stat = Gauge("serve_rft_trainer_stat", description="The last step's statistics (see STEP_STATS).",
                          tag_keys=("stat",))

    def step(self, stats: dict) -> None:
        """Record one `PolicyTrainer.step` result (plus ``publish_seconds`` if it published)."""
        self.steps.inc()
        if "step_seconds" in stats:
            self.step_seconds.observe(stats["step_seconds"])
        if "publish_seconds" in stats:
            self.publish_seconds.observe(stats["publish_seconds"])
        for name in STEP_STATS:
            if isinstance(stats.get(name), (int, float)):
                self.stat.set(float(stats[name]), tags={"stat": name})

    def skipped(self) -> None:
        """One step skipped: a non-finite update or a gradient-norm spike (`serve_rft.trainer.policy.finite`)."""
        self.skipped_steps.inc()

    def observe(self, staleness: list[int], dropped: int, ages_s: list[float] | None = None) -> None:
        """Trained experiences' staleness (sync cycles) and age (s); ``dropped`` stale ones."""
        for s in staleness:
            self.staleness.observe(s)
        for a in ages_s or []:
            self.sample_age.observe(a)
        if staleness:
            self.trained.inc(len(staleness))
        if dropped:
            self.stale_dropped.inc(dropped)

"""Trainer metrics: step time and the last step's statistics (one gauge each: loss, reward,
KL, learning rate, gradient norm, ...), staleness and age of what was trained, skipped steps (a
non-finite update, a gradient-norm spike).

Owned by the `Trainer` actor; exported through Ray's metrics API (Prometheus). The experiences
trained or dropped are counted by the store (`serve_rft.observability.store_metrics`).
"""

from __future__ import annotations

from ray.util.metrics import Counter, Histogram

from serve_rft.observability.held import Gauge

STALENESS_BUCKETS = [0.5, 1.5, 2.5, 4.5, 8.5, 16.5, 32.5, 64.5]
STEP_SECONDS_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0]
SAMPLE_AGE_BUCKETS = [1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0]

STEP_GAUGES: dict[str, tuple[str, str]] = {
    "loss": ("serve_rft_trainer_loss", "The step's loss (the algorithm's objective, to minimize)."),
    "reward_mean": ("serve_rft_trainer_reward_mean", "Mean reward of the step's experiences."),
    "adv_abs_mean": ("serve_rft_trainer_advantage_abs_mean", "Mean absolute advantage over the step's tokens."),
    "ratio_mean": ("serve_rft_trainer_ratio_mean", "Mean importance ratio pi / mu (trainer policy over "
                   "the policy that sampled) over the step's tokens."),
    "ratio_max": ("serve_rft_trainer_ratio_max", "Largest importance ratio pi / mu over the step's tokens."),
    "clip_fraction": ("serve_rft_trainer_clip_fraction", "Fraction of tokens whose ratio is outside the "
                      "PPO clip range, whatever the advantage's sign."),
    "pg_clipfrac_lower": ("serve_rft_trainer_clip_fraction_lower", "Fraction of tokens where the dual "
                          "clip bound the loss (verl's pg_clipfrac_lower)."),
    "clip_fraction_lag0": ("serve_rft_trainer_clip_fraction_lag0", "Clip fraction of tokens 0 sync cycles "
                           "behind the trainer."),
    "clip_fraction_lag1": ("serve_rft_trainer_clip_fraction_lag1", "Clip fraction of tokens 1 sync cycle "
                           "behind the trainer."),
    "clip_fraction_lag2_3": ("serve_rft_trainer_clip_fraction_lag2_3", "Clip fraction of tokens 2 to 3 "
                             "sync cycles behind the trainer."),
    "clip_fraction_lag4p": ("serve_rft_trainer_clip_fraction_lag4p", "Clip fraction of tokens 4 or more "
                            "sync cycles behind the trainer."),
    "approx_kl": ("serve_rft_trainer_approx_kl", "k3 estimate of KL(mu || pi) between the sampling policy "
                  "and the trainer's, nats per token."),
    "kl_ref": ("serve_rft_trainer_kl_ref", "KL penalty term against the reference policy, nats per token "
               "(present when trainer.kl_coef > 0)."),
    "entropy": ("serve_rft_trainer_entropy", "Mean token entropy of the trainer's policy, nats."),
    "entropy_coef": ("serve_rft_trainer_entropy_coef", "Coefficient of the entropy bonus the step applied "
                     "(trainer.entropy_coef, or the adaptive control's with trainer.entropy_target)."),
    "grad_norm": ("serve_rft_trainer_grad_norm", "Gradient norm before clipping."),
    "lr": ("serve_rft_trainer_learning_rate", "Learning rate of the step (after the schedule)."),
    "max_abs_logprob_diff": ("serve_rft_trainer_max_abs_logprob_diff", "Largest |log pi - log mu| over the "
                             "step's tokens, nats."),
    "is_weight_mean": ("serve_rft_trainer_is_weight_mean", "Mean importance weight pi / mu (off-policy modes)."),
    "is_weight_max": ("serve_rft_trainer_is_weight_max", "Largest importance weight pi / mu (off-policy modes)."),
    "is_truncated_fraction": ("serve_rft_trainer_is_truncated_fraction", "Fraction of tokens whose "
                              "importance weight was truncated at trainer.is_cap (off_policy: tis)."),
    "is_masked_fraction": ("serve_rft_trainer_is_masked_fraction", "Fraction of tokens left out by an "
                           "importance-weight mask (off_policy: mis_*)."),
    "mismatch_k3": ("serve_rft_trainer_mismatch_k3", "Trainer-vs-inference mismatch: k3 of KL(mu || pi) over "
                    "the tokens of the version the trainer holds, nats per token."),
    "max_abs_mismatch": ("serve_rft_trainer_max_abs_mismatch", "Largest |log pi - log mu| over the tokens "
                         "of the version the trainer holds, nats."),
    "drift_k3": ("serve_rft_trainer_drift_k3", "k3 of KL(mu || pi) over older tokens (staleness), nats per token."),
    "max_abs_drift": ("serve_rft_trainer_max_abs_drift", "Largest |log pi - log mu| over older tokens, nats."),
    "batch_size": ("serve_rft_trainer_batch_experiences", "Experiences in the step's batch."),
    "tokens": ("serve_rft_trainer_batch_tokens", "Response tokens in the step's batch."),
    "groups": ("serve_rft_trainer_batch_groups", "Groups of two or more experiences in the step's batch."),
    "zero_variance_groups": ("serve_rft_trainer_batch_zero_variance_groups", "Groups of the step's batch "
                             "with no reward spread."),
    "zero_variance_filtered": ("serve_rft_trainer_batch_zero_variance_filtered", "Experiences of the step's "
                               "batch left out of its loss as members of groups with no reward spread "
                               "(trainer.filter_zero_variance)."),
}
"""`PolicyTrainer.step` statistic -> (gauge name, meaning): one gauge per statistic, the last
step's value."""
STEP_STATS = ("sample_age_s_mean", "sample_age_s_max", *STEP_GAUGES)
"""`PolicyTrainer.step` statistics `Trainer.service_status` shows of the last step (the sample
ages are the ``serve_rft_trained_sample_age_seconds`` histogram in Prometheus)."""


class TrainerMetrics:
    """Staleness and sample-age histograms, step and publish seconds, the last step's
    statistics (`STEP_GAUGES`), steps and skipped steps."""

    def __init__(self):
        self.staleness = Histogram("serve_rft_trained_staleness_versions",
                                   description="Staleness of trained experiences, policy versions.",
                                   boundaries=STALENESS_BUCKETS)
        self.sample_age = Histogram("serve_rft_trained_sample_age_seconds",
                                    description="Seconds from an experience's generation to the step "
                                    "that trained it.", boundaries=SAMPLE_AGE_BUCKETS)
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
        self.stats = {stat: Gauge(name, description=f"{meaning} The last step's value.")
                      for stat, (name, meaning) in STEP_GAUGES.items()}

    def step(self, stats: dict) -> None:
        """Record one `PolicyTrainer.step` result (plus ``publish_seconds``, s, if it published)."""
        self.steps.inc()
        if "step_seconds" in stats:
            self.step_seconds.observe(stats["step_seconds"])
        if "publish_seconds" in stats:
            self.publish_seconds.observe(stats["publish_seconds"])
        for stat, gauge in self.stats.items():
            if isinstance(stats.get(stat), (int, float)):
                gauge.set(float(stats[stat]))

    def skipped(self) -> None:
        """One step skipped: a non-finite update or a gradient-norm spike (`serve_rft.trainer.policy.finite`)."""
        self.skipped_steps.inc()

    def observe(self, staleness: list[int], ages_s: list[float]) -> None:
        """One step's trained experiences: their staleness (sync cycles) and age (s)."""
        for s in staleness:
            self.staleness.observe(s)
        for a in ages_s:
            self.sample_age.observe(a)

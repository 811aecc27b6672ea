"""Canary verdicts: promote a candidate policy version or roll it back, from what it was seen to do.

A canary compares two *arms* over the same window: the candidate version (served by the canary
replicas) and the incumbent version (served by the rest). Per arm it counts

- rewards of the experiences *generated* in the window, whenever those rewards arrive (they come
  late; `serve_rft.buffer.store.ExperienceStore.version_rewards` files each reward under the
  policy version and the generation time of its completion), and
- requests that ended in the window, failed requests and their summed latency (reported by the
  replicas with every poll).

Verdict (`judge`), in order: too few requests or rewards on either side -> wait (or, past the
deadline, the configured ``undecided`` verdict); a failed-request share above the incumbent's by
more than ``max_error_rate_increase`` -> rollback; a mean latency above ``max_latency_ratio``
times the incumbent's -> rollback; a mean reward significantly below the incumbent's,
``(mean_c - mean_i + tolerance) / se < -z`` with ``se = sqrt(var_c / n_c + var_i / n_i)``
(Welch's two-sample statistic, one-sided) -> rollback; otherwise promote. A candidate is judged
worse only on evidence: with noisy rewards a small drop promotes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class ArmStats:
    """What one arm (a policy version) did in the canary window.

    ``rewards`` / ``reward_sum`` / ``reward_sq``: count, sum and sum of squares of the rewards
    of experiences generated in the window; ``requests`` / ``errors`` / ``latency_s``: requests
    that ended in the window, those that failed (5xx or an in-band stream error), and their summed
    latency in seconds.
    """

    rewards: int = 0
    reward_sum: float = 0.0
    reward_sq: float = 0.0
    requests: int = 0
    errors: int = 0
    latency_s: float = 0.0

    @property
    def reward_mean(self) -> float | None:
        return self.reward_sum / self.rewards if self.rewards else None

    @property
    def reward_var(self) -> float:
        """Unbiased sample variance of the rewards (0 with fewer than 2)."""
        if self.rewards < 2:
            return 0.0
        m = self.reward_sum / self.rewards
        return max(0.0, (self.reward_sq - self.rewards * m * m) / (self.rewards - 1))

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    @property
    def latency_mean_s(self) -> float | None:
        ok = self.requests - self.errors
        return self.latency_s / self.requests if self.requests and ok >= 0 else None

    def add_traffic(self, requests: int, errors: int, latency_s: float) -> None:
        self.requests += requests
        self.errors += errors
        self.latency_s += latency_s

    def as_dict(self) -> dict:
        return {"rewards": self.rewards, "reward_mean": self.reward_mean, "requests": self.requests,
                "errors": self.errors, "error_rate": self.error_rate, "latency_mean_s": self.latency_mean_s}


@dataclass
class Verdict:
    """``decision``: ``promote``, ``rollback`` or None (keep waiting); ``reason`` in words."""

    decision: str | None
    reason: str
    stats: dict = field(default_factory=dict)


def judge(candidate: ArmStats, incumbent: ArmStats, cfg, past_deadline: bool) -> Verdict:
    """The verdict on a candidate (formula in the module docstring).

    Args:
        candidate, incumbent: the two arms' window statistics.
        cfg: a `serve_rft.config.CanaryConfig`.
        past_deadline: the window and the late-reward wait are over.
    Returns:
        A `Verdict`; ``decision`` None means wait for more evidence.
    """
    stats = {"candidate": candidate.as_dict(), "incumbent": incumbent.as_dict()}
    if min(candidate.requests, incumbent.requests) >= cfg.min_requests:
        ec, ei = candidate.error_rate or 0.0, incumbent.error_rate or 0.0
        if ec > ei + cfg.max_error_rate_increase:
            return Verdict("rollback", f"error rate {ec:.3f} vs incumbent {ei:.3f}", stats)
        lc, li = candidate.latency_mean_s, incumbent.latency_mean_s
        if lc is not None and li and lc > cfg.max_latency_ratio * li:
            return Verdict("rollback", f"mean latency {lc:.3f} s vs incumbent {li:.3f} s", stats)
    if min(candidate.rewards, incumbent.rewards) < cfg.min_rewards:
        if not past_deadline:
            return Verdict(None, f"waiting for rewards ({candidate.rewards} candidate, {incumbent.rewards} "
                           f"incumbent; {cfg.min_rewards} each needed)", stats)
        return Verdict(cfg.undecided, f"too few rewards by the deadline ({candidate.rewards} candidate, "
                       f"{incumbent.rewards} incumbent): undecided -> {cfg.undecided}", stats)
    mc, mi = candidate.reward_mean, incumbent.reward_mean
    se = math.sqrt(candidate.reward_var / candidate.rewards + incumbent.reward_var / incumbent.rewards)
    gap = mc - mi + cfg.reward_tolerance
    t = gap / se if se > 0 else (math.inf if gap >= 0 else -math.inf)
    stats["t_stat"] = t if math.isfinite(t) else (1e9 if t > 0 else -1e9)
    if t < -cfg.z:
        return Verdict("rollback", f"mean reward {mc:.4f} vs incumbent {mi:.4f} (t = {stats['t_stat']:.2f})", stats)
    return Verdict("promote", f"mean reward {mc:.4f} vs incumbent {mi:.4f} (t = {stats['t_stat']:.2f})", stats)

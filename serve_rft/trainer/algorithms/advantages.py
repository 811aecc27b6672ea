"""Advantages, as pure functions (the trainer's logprobs of sampled tokens are in
`serve_rft.trainer.policy.token_logprobs`, the losses in `serve_rft.trainer.algorithms.losses`).

Shapes: ``B`` experiences in a batch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Literal

import torch

FP32_MAX = float(torch.finfo(torch.float32).max)
"""The largest finite float32 (about 3.4e38)."""


class RunningBaseline:
    """Exponential moving average of rewards: the baseline for singleton experiences.

    ``b <- m * b + (1 - m) * r`` per reward; starts at the first reward seen. A reward that is
    not finite, or beyond float32's range (``|r| > FP32_MAX``: the advantages are float32, so it
    could never train), is not absorbed: one such reward would hold every later singleton's
    advantage at about ``-r`` for hundreds of rewards.
    """

    def __init__(self, momentum: float = 0.9):
        self.momentum = momentum
        self.value: float | None = None

    def update(self, rewards: list[float]) -> None:
        for r in rewards:
            if not (math.isfinite(r) and abs(r) <= FP32_MAX):
                continue
            self.value = r if self.value is None else self.momentum * self.value + (1 - self.momentum) * r


Estimator = Literal["grpo", "group_mean", "baseline"]


def compute_advantages(rewards: list[float], group_ids: list[str], baseline: RunningBaseline,
                       eps: float = 1e-6, estimator: Estimator = "grpo") -> torch.Tensor:
    """Per-experience advantages ``[B]``.

    - ``grpo``: a group with >= 2 rewarded members in the batch gets GRPO's normalisation
      ``A_i = (r_i - mean_g) / (std_g + eps)`` (Shao et al. 2024, DeepSeekMath, eq. 3, outcome
      supervision; unbiased std).
    - ``group_mean``: ``A_i = r_i - mean_g`` (OPMD's baseline, the Trinity-RFT technical report (Pan et al., 2025), appendix A.3).
    - ``baseline``: ``A_i = r_i - b`` for every experience (REINFORCE with a running baseline).

    In ``grpo`` and ``group_mean`` a singleton (online traffic usually has ``n = 1``) gets
    ``r_i - b`` as well. ``b`` is the running baseline taken before this batch; it is then
    updated with all rewards.
    """
    groups: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    adv = [0.0] * len(rewards)
    b = baseline.value if baseline.value is not None else 0.0
    for members in groups.values():
        if len(members) >= 2 and estimator != "baseline":
            rs = [rewards[i] for i in members]
            mean = sum(rs) / len(rs)
            std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1))
            for i in members:
                adv[i] = (rewards[i] - mean) / (std + eps) if estimator == "grpo" else rewards[i] - mean
        else:
            for i in members:
                adv[i] = rewards[i] - b
    baseline.update(rewards)
    return torch.tensor(adv, dtype=torch.float32)

"""GRPO (Shao et al. 2024, DeepSeekMath, §4.1.2): group-normalised advantages and the PPO clipped
surrogate against the behaviour logprobs vLLM logged, under the configured off-policy correction
(`serve_rft.trainer.algorithms.off_policy`)."""

from __future__ import annotations

import torch

from serve_rft.trainer.algorithms.advantages import Advantages, RunningBaseline
from serve_rft.trainer.algorithms.base import Algorithm, LossInputs
from serve_rft.trainer.algorithms.off_policy import policy_gradient_loss
from serve_rft.types import RewardedExperience


class Grpo(Algorithm):
    """``A_i = (r_i - mean_g) / (std_g + eps)`` over the answer's group (singletons: ``r_i - b``,
    the running baseline; the divisor per ``trainer.scale_rewards``), the ratio loss of ``trainer.off_policy``
    (`serve_rft.trainer.algorithms.off_policy.policy_gradient_loss`)."""

    name = "grpo"
    estimator = "grpo"

    def advantages(self, batch: list[RewardedExperience], baseline: RunningBaseline) -> Advantages:
        return self.group_advantages(batch, baseline, self.estimator, self.cfg.scale_rewards)

    def loss(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        return policy_gradient_loss(c.off_policy, x.logprobs, x.behaviour, x.advantages, x.mask,
                                    clip_low=c.clip_low, clip_high=c.clip_high, clip_ratio_c=c.clip_ratio_c,
                                    is_cap=c.is_cap, agg=self.aggregation, n_tokens=x.n_tokens, n_seqs=x.n_seqs,
                                    seq_mask_kl=c.off_policy_seq_mask_kl)

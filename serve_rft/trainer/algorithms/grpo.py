"""GRPO (Shao et al. 2024, DeepSeekMath, §4.1): group-normalised advantages and the PPO clipped
surrogate against the behaviour logprobs vLLM logged."""

from __future__ import annotations

import torch

from serve_rft.trainer.algorithms.advantages import RunningBaseline, compute_advantages
from serve_rft.trainer.algorithms.base import Algorithm, LossInputs
from serve_rft.trainer.algorithms.losses import ppo_clip_loss


class Grpo(Algorithm):
    """``A_i = (r_i - mean_g) / (std_g + eps)`` over the answer's group (singletons: ``r_i - b``,
    the running baseline), PPO-clip loss (`serve_rft.trainer.algorithms.losses.ppo_clip_loss`)."""

    name = "grpo"
    estimator = "grpo"

    def advantages(self, rewards: list[float], group_ids: list[str], baseline: RunningBaseline) -> torch.Tensor:
        return compute_advantages(rewards, group_ids, baseline, estimator=self.estimator)

    def loss(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        return ppo_clip_loss(x.logprobs, x.behaviour, x.advantages, x.mask, c.clip_low, c.clip_high,
                             self.aggregation, x.n_tokens, x.n_seqs)

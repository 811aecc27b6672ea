"""OPMD as in Kimi k1.5, the Trinity-RFT technical report (Pan et al., 2025), appendix A.1: a
squared consistency loss per answer against the behaviour policy that sampled its group."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from pydantic import BaseModel, ConfigDict, Field

from serve_rft.trainer.algorithms.advantages import Advantages, RunningBaseline
from serve_rft.trainer.algorithms.base import Algorithm, LossInputs
from serve_rft.types import RewardedExperience


class OpmdKimiSettings(BaseModel):
    """``trainer.algorithm_args`` of ``opmd_kimi``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tau: float = Field(1.0, gt=0, description="OPMD's tau (> 0: the loss divides rewards by it).")


class OpmdKimi(Algorithm):
    """Loss `opmd_kimi_loss` with the group's ``tau log Z`` (`group_tau_log_z`) over the group's
    members in the batch (it needs every member's reward, not the store's mean and std: a group
    cut by a batch boundary estimates ``Z`` from the members present); the advantages
    (``r_i - mean_g``) are reported, not used by the loss."""

    name = "opmd_kimi"
    filters_zero_variance = False  # the consistency term -tau (log pi - log mu) has a gradient at A = 0
    default_aggregation = "seq_mean_token_sum"
    Settings = OpmdKimiSettings

    def advantages(self, batch: list[RewardedExperience], baseline: RunningBaseline) -> Advantages:
        return self.group_advantages(batch, baseline, "group_mean")

    def batch_values(self, batch: list[RewardedExperience]) -> torch.Tensor:
        return group_tau_log_z([b.reward for b in batch], [b.experience.group_id for b in batch], self.settings.tau)

    def loss(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return opmd_kimi_loss((x.logprobs * x.mask).sum(1), (x.behaviour * x.mask).sum(1), x.rewards, x.extras,
                              self.settings.tau, x.n_seqs)

def opmd_kimi_loss(seq_logprobs: torch.Tensor, seq_ref_logprobs: torch.Tensor, rewards: torch.Tensor,
                   tau_log_z: torch.Tensor, tau: float, n_seqs: float | None = None
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """OPMD as in Kimi k1.5 (the Trinity-RFT technical report (Pan et al., 2025), appendix A.1): a squared consistency loss per answer,

    ``l_i = (r_i - tau * log Z_hat - tau * (log pi_theta(y_i|x) - log pi_ref(y_i|x)))^2``,
    ``tau * log Z_hat = tau * log(1/K * sum_j exp(r_j / tau))`` over the answer's group
    (`group_tau_log_z`), averaged over the batch's answers. ``pi_ref`` is the behaviour policy
    that sampled the group (its logged logprobs); the estimate of ``Z`` needs the group to
    come from that one policy, which in a serving system holds only for groups sampled within
    one policy version.

    Args:
        seq_logprobs: ``[B]`` ``log pi_theta(y_i|x)`` (sum over the answer's tokens, with grad).
        seq_ref_logprobs: ``[B]`` the same under the behaviour policy.
        rewards: ``[B]``. tau_log_z: ``[B]`` the group's ``tau * log Z_hat`` per answer.
        tau: ``tau > 0``.
    """
    n_seqs = float(seq_logprobs.shape[0]) if n_seqs is None else n_seqs
    resid = rewards - tau_log_z - tau * (seq_logprobs - seq_ref_logprobs)
    return (resid ** 2).sum() / max(n_seqs, 1.0), {"opmd_residual_abs": float(resid.detach().abs().mean())}


def group_tau_log_z(rewards: list[float], group_ids: list[str], tau: float) -> torch.Tensor:
    """``[B]``: for each answer, ``tau * log(mean_j exp(r_j / tau))`` over its group in the
    batch (the report's appendix A.1), computed stably with logsumexp."""



    groups: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    out = torch.zeros(len(rewards), dtype=torch.float32)
    for members in groups.values():
        r = torch.tensor([rewards[i] for i in members], dtype=torch.float64) / tau
        value = tau * float(torch.logsumexp(r, 0) - math.log(len(members)))
        out[members] = value
    return out
"""OPMD, the "embarrassingly simple" variant of the Trinity-RFT technical report (Pan et al.,
2025), appendix A.3: the policy gradient with the group-mean baseline, scaled by ``1/(1+tau)``."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field

from serve_rft.trainer.algorithms.advantages import Advantages, RunningBaseline
from serve_rft.trainer.algorithms.base import Algorithm, LossInputs
from serve_rft.types import RewardedExperience
from serve_rft.trainer.algorithms.losses import Aggregation, aggregate


class OpmdSettings(BaseModel):
    """``trainer.algorithm_args`` of ``opmd``."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    tau: float = Field(1.0, ge=0, description="OPMD's tau (>= 0); larger is a smaller step.")


class Opmd(Algorithm):
    """``A_i = r_i - mean_g`` (singletons: ``r_i - b``), loss `opmd_loss`."""

    name = "opmd"
    default_aggregation = "seq_mean_token_sum"
    Settings = OpmdSettings

    def advantages(self, batch: list[RewardedExperience], baseline: RunningBaseline) -> Advantages:
        return self.group_advantages(batch, baseline, "group_mean")

    def loss(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return opmd_loss(x.logprobs, x.advantages, x.mask, self.settings.tau, self.aggregation, x.n_tokens, x.n_seqs)

def opmd_loss(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, tau: float,
              agg: Aggregation = "seq_mean_token_sum", n_tokens: float | None = None,
              n_seqs: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """OPMD, the "embarrassingly simple" variant (the Trinity-RFT technical report (Pan et al., 2025), appendix A.3):

    ``J = -1/(1+tau) * sum_i (r_i - mean_g(r)) * log pi(y_i|x)``

    i.e. the policy gradient with the group-mean baseline, derived as one step of online policy
    mirror descent with ``pi_ref = pi_theta_t``, which is why it tolerates off-policy samples
    without an importance ratio. ``advantages`` must be ``r_i - mean`` of the answer's group
    (`serve_rft.trainer.algorithms.advantages.compute_advantages` with ``"group_mean"``). The paper sums
    over answers; here the sum is divided by the batch's answer count (``seq_mean_token_sum``,
    ``log pi(y|x) = sum_t log pi(y_t|...)``), a constant factor absorbed by the learning rate.

    Args:
        logprobs: ``[B, T]`` (with grad). advantages: ``[B]``. mask: ``[B, T]``.
        tau: ``tau >= 0``; larger is a smaller step.
    """
    mask = mask.to(logprobs.dtype)
    n_tokens = float(mask.sum()) if n_tokens is None else n_tokens
    n_seqs = float(mask.shape[0]) if n_seqs is None else n_seqs
    per_token = -advantages.unsqueeze(1) * logprobs / (1.0 + tau)
    return aggregate(per_token, mask, agg, n_tokens, n_seqs), {}
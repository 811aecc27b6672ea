"""Off-policy correction of the ratio losses (``grpo``, ``reinforce``): how a token sampled by an
older policy version, or by vLLM's numerics rather than the trainer's, enters the update
(``trainer.off_policy``; the Algorithms page compares the modes on a staleness benchmark).

``mu`` is the behaviour policy (the logprobs vLLM logged, of whatever version sampled each token),
``pi`` the trainer's policy. Shapes: ``B`` experiences, ``T`` response tokens (right-padded).

- ``ppo``: the dual-clip PPO surrogate with ``mu`` as the old policy (bypass mode:
  `serve_rft.trainer.algorithms.losses.ppo_clip_loss`, log-ratio clamped, dual clip ``c``).
- ``tis``: truncated importance sampling in the decoupled form of AReaL (Fu et al. 2025, arXiv
  2505.24298, §4.2 "Decoupled PPO objective"): with one optimizer step per batch the proximal
  policy is ``sg(pi)``, so the clipped term is inactive and the loss is
  ``-min(sg(pi / mu), C) * A * log pi`` per token (``C = trainer.is_cap``; Ionides 2008's
  truncation, as TRL's ``vllm_importance_sampling_correction`` caps it).
- ``mis_token`` / ``mis_sequence``: masked importance sampling: tokens whose ratio ``pi / mu`` is
  outside ``[1/C, C]`` (``mis_token``), or whole answers whose geometric-mean ratio
  ``exp(mean_t log(pi / mu))`` is (``mis_sequence``), are left out of the loss (trained with
  weight 0); the rest get the ``ppo`` loss (verl's rollout rejection sampling; TRL's
  ``vllm_importance_sampling_mode`` ``sequence_mask``).

With ``trainer.off_policy_seq_mask_kl = delta`` any mode also masks the answers with a negative
advantage whose mean ``log(mu / pi)`` over their tokens exceeds ``delta`` (off-policy sequence
masking, DeepSeek-V3.2 technical report, arXiv 2512.02556, "Off-Policy Sequence Masking"): a
stale failure the policy has already moved away from is not pushed down further.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from serve_rft.trainer.algorithms.losses import Aggregation, aggregate, clamped_log_ratio, ppo_clip_loss

OffPolicy = Literal["ppo", "tis", "mis_token", "mis_sequence"]
OFF_POLICY_MODES: tuple[str, ...] = ("ppo", "tis", "mis_token", "mis_sequence")


def sequence_mask(log_ratio: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
                  kl_threshold: float) -> torch.Tensor:
    """``[B, 1]`` 0 for answers with ``A < 0`` whose mean ``log(mu / pi)`` over their tokens
    exceeds ``kl_threshold``, else 1. ``log_ratio``: ``[B, T]`` clamped ``log(pi / mu)``, 0 on
    padding."""
    mean_kl = -(log_ratio.sum(1) / mask.sum(1).clamp(min=1.0))
    return (~((advantages < 0) & (mean_kl > kl_threshold))).to(mask.dtype).unsqueeze(1)


def policy_gradient_loss(mode: OffPolicy, logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                         advantages: torch.Tensor, mask: torch.Tensor, *, clip_low: float, clip_high: float,
                         clip_ratio_c: float | None, is_cap: float, agg: Aggregation, n_tokens: float,
                         n_seqs: float, seq_mask_kl: float | None = None
                         ) -> tuple[torch.Tensor, dict[str, float]]:
    """The ratio loss of one micro-batch under off-policy correction ``mode`` (module docstring).

    Args:
        mode: ``ppo``, ``tis``, ``mis_token`` or ``mis_sequence``.
        logprobs: ``[B, T]`` ``log pi`` of the sampled tokens (with grad).
        behaviour_logprobs: ``[B, T]`` ``log mu``, as vLLM logged them.
        advantages: ``[B]``. mask: ``[B, T]`` 1 for response tokens.
        clip_low, clip_high, clip_ratio_c: the PPO bounds (`ppo_clip_loss`).
        is_cap: ``C > 1``: the truncation (``tis``) or the mask's bounds ``[1/C, C]`` (``mis_*``).
        agg, n_tokens, n_seqs: `aggregate`'s mode and the whole batch's normalisers.
        seq_mask_kl: off-policy sequence masking's ``delta``, or None.
    Returns:
        (scalar loss, stats over this call's tokens: `ppo_clip_loss`'s (``ppo``, ``mis_*``),
        ``is_weight_mean`` / ``is_weight_max`` (``pi / mu`` before truncation),
        ``is_truncated_fraction`` (``tis``: ``pi / mu > C``), ``is_masked_fraction`` (tokens
        left out by the mask and the sequence masking)).
    Raises:
        ValueError: an unknown ``mode``; ``is_cap <= 1``.
    """
    if mode not in OFF_POLICY_MODES:
        raise ValueError(f"unknown off-policy mode {mode!r}; choose one of {', '.join(OFF_POLICY_MODES)}")
    if is_cap <= 1.0:
        raise ValueError(f"is_cap must be > 1, got {is_cap}")
    mask = mask.to(logprobs.dtype)
    with torch.no_grad():
        log_ratio = clamped_log_ratio(logprobs.detach(), behaviour_logprobs, mask)
        ratio = torch.exp(log_ratio)
        keep = torch.ones_like(mask)
        log_cap = math.log(is_cap)
        if mode == "mis_token":
            keep = (log_ratio.abs() <= log_cap).to(mask.dtype)
        elif mode == "mis_sequence":
            geo = log_ratio.sum(1) / mask.sum(1).clamp(min=1.0)
            keep = (geo.abs() <= log_cap).to(mask.dtype).unsqueeze(1).expand_as(mask)
        if seq_mask_kl is not None:
            keep = keep * sequence_mask(log_ratio, mask, advantages, seq_mask_kl)
        here = mask.sum().clamp(min=1.0)
        stats = {
            "is_weight_mean": float((ratio * mask).sum() / here),
            "is_weight_max": float((ratio * mask).max()),
            "is_masked_fraction": float(((1.0 - keep) * mask).sum() / here),
        }
    if mode == "tis":
        weight = torch.clamp(ratio, max=is_cap)
        adv = advantages.unsqueeze(1).to(logprobs.dtype)
        # value -w A; gradient -w A grad log pi (the proximal ratio pi / sg(pi) is 1 in value)
        per_token = -weight * adv * torch.exp(logprobs - logprobs.detach())
        loss = aggregate(per_token * keep, mask, agg, n_tokens, n_seqs)
        stats["is_truncated_fraction"] = float(((ratio > is_cap).to(mask.dtype) * mask).sum() / here)
        return loss, stats
    loss, ppo_stats = ppo_clip_loss(logprobs, behaviour_logprobs, advantages, mask, clip_low, clip_high, agg,
                                    n_tokens, n_seqs, clip_ratio_c=clip_ratio_c, keep=keep)
    stats.update(ppo_stats)
    return loss, stats

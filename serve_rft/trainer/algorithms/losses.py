"""Policy losses, pure torch. Shapes: ``B`` experiences, ``T`` response tokens (right-padded).

Every loss takes the current policy's per-token logprobs of the sampled response tokens
``logprobs [B, T]`` (with grad) and a ``mask [B, T]`` (1 = response token to train on) and
returns ``(scalar loss, stats)``. Aggregation over tokens is explicit (`aggregate`) and takes
the normalisers of the *whole* batch, so a batch split into micro-batches gets exactly the
gradient of the unsplit batch (the trainer sums micro-batch losses).
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: Aggregation, n_tokens: float,
              n_seqs: float) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    - ``token_mean``: ``sum(l * mask) / n_tokens`` — every token of the batch weighs the same, so
      long answers are not down-weighted per token (DAPO, Yu et al. 2025, §3.3). The default.
    - ``seq_mean_token_mean``: ``sum_i (sum_t l_it / len_i) / n_seqs`` (GRPO as published, Shao et
      al. 2024 eq. 3): each answer weighs the same whatever its length.
    - ``seq_mean_token_sum``: ``sum_i sum_t l_it / n_seqs``: the sequence-level policy gradient
      (``log pi(y|x)`` is the sum of token logprobs), as in the Trinity-RFT technical report (Pan et al., 2025), appendix A.

    Args:
        per_token: ``[B, T]`` loss per token.
        mask: ``[B, T]`` 1 for tokens that count.
        n_tokens: response tokens in the whole batch (``token_mean``'s normaliser).
        n_seqs: experiences in the whole batch.
    Raises:
        ValueError: an unknown ``mode``.
    """
    masked = per_token * mask
    if mode == "token_mean":
        return masked.sum() / max(n_tokens, 1.0)
    if mode == "seq_mean_token_mean":
        return (masked.sum(1) / mask.sum(1).clamp(min=1.0)).sum() / max(n_seqs, 1.0)
    if mode == "seq_mean_token_sum":
        return masked.sum() / max(n_seqs, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}")


LOG_RATIO_BOUND = 20.0
"""``|log pi - log mu|`` is clamped to this before ``exp`` (verl clamps the log-ratio so in its
rollout correction and ``low_var_kl``): ``exp(20)`` is about 4.9e8, finite in fp32, so a token
whose logprob moved far since it was sampled never turns into ``inf`` (and ``inf * 0 = NaN``)."""


def clamped_log_ratio(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` ``clamp(logp - logp_behaviour, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)``, 0 on padding
    (``mask`` 0). The clamp has no gradient beyond the bound: such a token's ratio is held at
    ``exp(+-20)``."""
    return torch.clamp(logprobs - behaviour_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND) * mask


def ppo_clip_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.28,
                  agg: Aggregation = "token_mean", n_tokens: float | None = None,
                  n_seqs: float | None = None, *, clip_ratio_c: float | None = 3.0,
                  keep: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO surrogate with the logged behaviour logprobs as the old policy (GRPO's loss).

    ``r = exp(clamp(logp - logp_behaviour, -20, 20))`` (`clamped_log_ratio`); per token
    ``l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` (Schulman et al. 2017, eq. 7;
    asymmetric "clip-higher" bounds from DAPO, Yu et al. 2025, §3.1), and for ``A < 0``
    ``l = min(l, -A c)`` with ``c = clip_ratio_c`` (dual-clip PPO, Ye et al. 2020, arXiv
    1912.09729, §3.1; as verl's ``compute_policy_loss_vanilla``): a token whose ratio ran past
    ``c`` (a stale sample the policy has since moved away from) adds at most ``-A c`` to the loss
    and no gradient, instead of a loss and gradient linear in its ratio. Aggregated by `aggregate`.

    Args:
        logprobs: ``[B, T]`` current-policy logprobs of the sampled tokens (with grad).
        behaviour_logprobs: ``[B, T]`` logprobs logged by vLLM when sampling.
        advantages: ``[B]``.
        mask: ``[B, T]`` 1 for response tokens, 0 for padding.
        n_tokens, n_seqs: the whole batch's normalisers (default: this call's).
        clip_ratio_c: the dual clip's ``c`` (> 1), or None for none.
        keep: ``[B, T]`` 1 for tokens the loss counts, 0 for tokens masked out (masked importance
            sampling, `serve_rft.trainer.algorithms.off_policy`), or None (all). Masked tokens
            stay in the normalisers: they are trained with weight 0.
    Returns:
        (scalar loss, stats: ``clip_fraction`` (either bound), ``pg_clipfrac_lower`` (the dual
        clip active: ``A < 0`` and ``r > c``), mean and max ratio, ``approx_kl`` (k3 to the
        behaviour policy) over this call's tokens).
    Raises:
        ValueError: ``clip_ratio_c <= 1``.
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    mask = mask.to(logprobs.dtype)
    n_tokens = float(mask.sum()) if n_tokens is None else n_tokens
    n_seqs = float(mask.shape[0]) if n_seqs is None else n_seqs
    log_ratio = clamped_log_ratio(logprobs, behaviour_logprobs, mask)
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1).to(ratio.dtype).expand_as(ratio)
    per_token = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high))
    lower = torch.zeros_like(mask, dtype=torch.bool)
    if clip_ratio_c is not None:
        dual = torch.minimum(per_token, -adv * clip_ratio_c)
        lower = (adv < 0) & (per_token > -adv * clip_ratio_c)
        per_token = torch.where(adv < 0, dual, per_token)
    if keep is not None:  # weight 0, not out of the normalisers (an answer's length included)
        per_token = per_token * keep.to(per_token.dtype)
    loss = aggregate(per_token, mask, agg, n_tokens, n_seqs)
    with torch.no_grad():
        here = mask.sum().clamp(min=1.0)
        clipped = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
        stats = {
            "clip_fraction": float((clipped.to(mask.dtype) * mask).sum() / here),
            "pg_clipfrac_lower": float((lower.to(mask.dtype) * mask).sum() / here),
            "ratio_mean": float((ratio * mask).sum() / here),
            "ratio_max": float((ratio * mask).max()),
            "approx_kl": float(((ratio - 1 - log_ratio) * mask).sum() / here),
        }
    return loss, stats


KL_LOG_BOUND = 20.0
"""``|ref - logp|`` is clamped to this in `kl_k3` (verl's ``low_var_kl``)."""
KL_K3_BOUND = 10.0
"""`kl_k3`'s per-token value is clamped to ``[-KL_K3_BOUND, KL_K3_BOUND]`` (verl's ``low_var_kl``)."""


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token ``KL(pi_theta || pi_ref)`` estimate on the sampled tokens, Schulman's k3:
    ``exp(d) - d - 1`` with ``d = clamp(ref - logp, -20, 20)``, the result clamped to ``[-10, 10]``
    (>= 0, unbiased before the clamps; GRPO, Shao et al. 2024 eq. 4; the clamps as verl's
    ``low_var_kl``): one token far from the reference adds at most 10 and, past the clamp, no
    gradient, instead of ``exp(d)`` (``d = 15``: 3.3e6). Shapes ``[B, T]``."""
    d = torch.clamp(ref_logprobs - logprobs, -KL_LOG_BOUND, KL_LOG_BOUND)
    return torch.clamp(torch.exp(d) - d - 1.0, -KL_K3_BOUND, KL_K3_BOUND)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` per position of ``logits [..., V]`` -> ``[...]`` (nats)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)  # masked (-inf) tokens contribute 0

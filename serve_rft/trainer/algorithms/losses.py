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


def ppo_clip_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.28,
                  agg: Aggregation = "token_mean", n_tokens: float | None = None,
                  n_seqs: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with the logged behaviour logprobs as the old policy (GRPO's loss).

    ``ratio = exp(logp - logp_behaviour)``; per token
    ``l = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)`` (Schulman et al. 2017,
    eq. 7; asymmetric "clip-higher" bounds from DAPO), aggregated by `aggregate`.

    Args:
        logprobs: ``[B, T]`` current-policy logprobs of the sampled tokens (with grad).
        behaviour_logprobs: ``[B, T]`` logprobs logged by vLLM when sampling.
        advantages: ``[B]``.
        mask: ``[B, T]`` 1 for response tokens, 0 for padding.
        n_tokens, n_seqs: the whole batch's normalisers (default: this call's).
    Returns:
        (scalar loss, stats: clip fraction, mean ratio, approx KL to behaviour (k3)).
    """
    mask = mask.to(logprobs.dtype)
    n_tokens = float(mask.sum()) if n_tokens is None else n_tokens
    n_seqs = float(mask.shape[0]) if n_seqs is None else n_seqs
    log_ratio = (logprobs - behaviour_logprobs) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, mask, agg, n_tokens, n_seqs)
    with torch.no_grad():
        here = mask.sum().clamp(min=1.0)
        clip_frac = (((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).to(mask.dtype) * mask).sum() / here
        stats = {
            "clip_fraction": float(clip_frac),
            "ratio_mean": float((ratio * mask).sum() / here),
            "ratio_max": float((ratio * mask).max()),
            "approx_kl": float(((ratio - 1 - log_ratio) * mask).sum() / here),
        }
    return loss, stats








def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token ``KL(pi_theta || pi_ref)`` estimate on the sampled tokens, Schulman's k3:
    ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased; GRPO, Shao et al. 2024 eq. 4).
    Shapes ``[B, T]``."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy ``-sum_v p_v log p_v`` per position of ``logits [..., V]`` -> ``[...]`` (nats)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)  # masked (-inf) tokens contribute 0

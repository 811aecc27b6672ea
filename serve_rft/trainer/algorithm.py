"""Advantages and policy-gradient losses, as pure torch functions.

Shapes: ``B`` experiences in a batch, ``T`` response tokens (right-padded), ``L`` prompt +
response tokens.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch


class RunningBaseline:
    """Exponential moving average of rewards: the baseline for singleton experiences.

    ``b <- m * b + (1 - m) * r`` per reward; starts at the first reward seen.
    """

    def __init__(self, momentum: float = 0.9):
        self.momentum = momentum
        self.value: float | None = None

    def update(self, rewards: list[float]) -> None:
        for r in rewards:
            self.value = r if self.value is None else self.momentum * self.value + (1 - self.momentum) * r


def compute_advantages(rewards: list[float], group_ids: list[str], baseline: RunningBaseline,
                       eps: float = 1e-6) -> torch.Tensor:
    """Per-experience advantages ``[B]``.

    A group with >= 2 rewarded members in the batch gets GRPO's group normalisation,
    ``A_i = (r_i - mean_g) / (std_g + eps)`` (Shao et al. 2024, DeepSeekMath, eq. 3 outcome
    supervision); a singleton gets ``A_i = r_i - b`` with the running baseline ``b`` taken
    before this batch (REINFORCE with baseline). The baseline is then updated with all rewards.
    """
    groups: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        groups[g].append(i)
    adv = [0.0] * len(rewards)
    b = baseline.value if baseline.value is not None else 0.0
    for members in groups.values():
        if len(members) >= 2:
            rs = [rewards[i] for i in members]
            mean = sum(rs) / len(rs)
            std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (len(rs) - 1))
            for i in members:
                adv[i] = (rewards[i] - mean) / (std + eps)
        else:
            adv[members[0]] = rewards[members[0]] - b
    baseline.update(rewards)
    return torch.tensor(adv, dtype=torch.float32)


def ppo_clip_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.28
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with the logged behaviour logprobs as the old policy.

    ``ratio = exp(logp - logp_behaviour)``; per token
    ``l = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)`` (Schulman et al. 2017,
    eq. 7; asymmetric "clip-higher" bounds from DAPO). Aggregated as the mean over all response
    tokens of the batch (token-mean), so long responses are not down-weighted per token.

    Args:
        logprobs: ``[B, T]`` current-policy logprobs of the sampled tokens (with grad).
        behaviour_logprobs: ``[B, T]`` logprobs logged by vLLM when sampling.
        advantages: ``[B]``.
        mask: ``[B, T]`` 1 for response tokens, 0 for padding.
    Returns:
        (scalar loss, stats: clip fraction, mean ratio, approx KL to behaviour).
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - behaviour_logprobs) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    n_tokens = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / n_tokens
    with torch.no_grad():
        clip_frac = (((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).to(mask.dtype) * mask).sum() / n_tokens
        stats = {
            "clip_fraction": float(clip_frac),
            "ratio_mean": float((ratio * mask).sum() / n_tokens),
            "approx_kl": float(((ratio - 1 - log_ratio) * mask).sum() / n_tokens),
        }
    return loss, stats


def response_logprobs(model, prompts: list[list[int]], responses: list[list[int]],
                      temperatures: list[float], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of the response tokens under ``model``, as vLLM's ``processed_logprobs``.

    Builds ``[B, L]`` right-padded prompt+response ids, runs the model, takes
    ``log_softmax(logits / T)`` (T = the request's temperature; greedy requests use 1) and
    gathers each response token's logprob from the position before it.

    Returns:
        (``[B, T]`` logprobs, ``[B, T]`` float mask of real response tokens).
    """
    device = next(model.parameters()).device
    seqs = [p + r for p, r in zip(prompts, responses)]
    L = max(len(s) for s in seqs)
    T = max(max((len(r) for r in responses), default=0), 1)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros((len(seqs), L), dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    out = torch.zeros((len(seqs), T), dtype=torch.float32, device=device)
    mask = torch.zeros((len(seqs), T), dtype=torch.float32, device=device)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not r:
            continue
        temp = temperatures[i] if temperatures[i] > 1e-5 else 1.0
        # logits at position t predict token t+1: response token j sits at len(p)+j.
        step_logits = logits[i, len(p) - 1 : len(p) - 1 + len(r)] / temp
        lp = torch.log_softmax(step_logits, dim=-1)
        tok = torch.tensor(r, dtype=torch.long, device=device)
        out[i, : len(r)] = lp.gather(1, tok.unsqueeze(1)).squeeze(1)
        mask[i, : len(r)] = 1.0
    return out, mask

"""vLLM's nucleus (top-p) rule: which words a sampler with ``top_p < 1`` keeps, so the trainer's
logprobs of sampled tokens are taken over the same words (`serve_rft.trainer.policy.token_logprobs`).

Shapes: ``T`` rows (tokens), ``V`` vocabulary.
"""

from __future__ import annotations

import torch


def top_p_keep(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Which tokens nucleus sampling keeps, exactly as vLLM's sampler decides it
    (``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p_pytorch``): sort ascending, drop
    the tokens whose cumulative probability is ``<= 1 - top_p``, always keep the most likely.

    Args:
        logits: ``[T, V]`` temperature-scaled logits.
        top_p: one value for every row, or ``[T]`` fp32 per row (vLLM's form: ``1 - p`` is
            then computed in fp32, as vLLM does).
    Returns:
        ``[T, V]`` bool, True = kept.
    """
    sorted_logits, idx = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    threshold = (1 - top_p).unsqueeze(-1) if isinstance(top_p, torch.Tensor) else 1 - top_p
    drop_sorted = cum <= threshold
    drop_sorted[:, -1] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, idx, drop_sorted)
    return ~drop


NUCLEUS_TOPK = 1024
"""Words `nucleus_keep` looks at before it falls back to a full sort of a row."""


def nucleus_keep(logits: torch.Tensor, top_p: float | torch.Tensor, k: int = NUCLEUS_TOPK) -> torch.Tensor:
    """`top_p_keep` without sorting the vocabulary where the nucleus lies within the ``k`` most
    likely words (nearly always at top_p <= 0.99: sampled distributions are peaked).

    vLLM's rule drops a word when the ascending cumulative probability up to it is ``<= 1 - p``.
    For the ``k`` most likely words that cumulative is (the probability of every word outside
    them) + (the ascending cumulative within them): a ``topk`` and a ``[rows, k]`` cumsum. When
    the least likely of the ``k`` is dropped, every word outside them is too (their cumulatives
    are smaller); rows where it is kept are sorted in full (`top_p_keep`). The result equals
    `top_p_keep` up to float rounding of the cumulative sums: a word whose cumulative lies within
    ~1e-6 of ``1 - p`` may fall on the other side (tests/unit/test_losses.py).

    Args:
        logits: ``[T, V]`` temperature-scaled logits.
        top_p: one value, or ``[T]`` fp32 per row.
        k: words looked at per row before the fallback.
    Returns:
        ``[T, V]`` bool, True = kept.
    """
    t, v = logits.shape
    k = min(k, v)
    probs = logits.float().softmax(dim=-1)
    top, idx = probs.topk(k, dim=-1)  # descending
    asc = top.flip(-1)
    tail = (probs.sum(-1) - top.sum(-1)).clamp_min(0.0)
    cum = asc.cumsum(-1) + tail.unsqueeze(-1)
    threshold = (1 - top_p).unsqueeze(-1) if isinstance(top_p, torch.Tensor) else 1 - top_p
    drop_asc = cum <= threshold
    drop_asc[:, -1] = False  # the most likely word is always kept
    keep = torch.zeros((t, v), dtype=torch.bool, device=logits.device)
    keep.scatter_(-1, idx, ~drop_asc.flip(-1))
    wide = ~drop_asc[:, 0]  # the k-th word is kept: the nucleus may reach beyond the k
    if k < v and bool(wide.any()):
        rows = wide.nonzero().squeeze(1)
        tp = top_p.index_select(0, rows) if isinstance(top_p, torch.Tensor) else top_p
        keep[rows] = top_p_keep(logits.index_select(0, rows), tp)
    return keep

"""Advantages and the trainer's logprobs of sampled tokens, as pure torch functions (the
losses are in `serve_rft.trainer.losses`).

Shapes: ``B`` experiences in a batch, ``T`` response tokens (right-padded), ``L`` prompt +
response tokens.
"""

from __future__ import annotations

import math
from collections import defaultdict
from functools import partial
from typing import Literal

import torch

from serve_rft.trainer.token_logprobs import SHARDED_HEAD, decoder_head_logprobs, lm_parts, nucleus_keep, top_p_keep
from serve_rft.weights.verify import probe_ids

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


def _padded_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``[B, L]`` right-padded prompt+response ids, their ``[B, L]`` attention mask (built on
    the host, one copy each to ``device``), and ``T`` (the longest response, at least 1)."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    L = max(len(s) for s in seqs)
    T = max(max((len(r) for r in responses), default=0), 1)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
    return ids.to(device), attn.to(device), T


def response_logprobs(model, prompts: list[list[int]], responses: list[list[int]],
                      temperatures: list[float], pad_id: int = 0, with_entropy: bool = False,
                      top_ps: list[float] | None = None, *, chunk_tokens: int = 1024,
                      impl: Literal["chunked", "full"] = "chunked"):
    """Logprobs of the response tokens under ``model``, as vLLM's ``processed_logprobs``.

    Runs ``[B, L]`` right-padded prompt+response ids through the model, and per response token
    takes ``log_softmax`` of the position before it after vLLM's sampler processing, in vLLM's
    order: logits / T (T = the request's temperature; greedy requests use 1), then the top-p
    mask (`top_p_keep`, computed by `nucleus_keep`) renormalised. The sampled token is always kept: at the weights that
    sampled it, it was in the nucleus, so this changes nothing there, and on later weights it
    keeps its logprob finite (its exact truncated value would be -inf).

    ``impl="chunked"`` (the default) runs the decoder alone and the LM head on the response
    positions only, ``chunk_tokens`` at a time, with a backward that recomputes each chunk
    (`serve_rft.trainer.token_logprobs`); a model without the plain decoder + linear head
    structure (`token_logprobs.lm_parts`) takes ``impl="full"``: ``[B, L, V]`` fp32 logits.
    Both give the same values and gradients (tests/unit/test_algorithm.py).

    Returns:
        (``[B, T]`` logprobs, ``[B, T]`` float mask of real response tokens), and with
        ``with_entropy`` a third ``[B, T]``: the entropy (nats) of each position's tempered
        distribution, without grad.
    Raises:
        ValueError: a non-empty response after an empty prompt (no position predicts its
            first token).
    """
    if any(r and not p for p, r in zip(prompts, responses)):
        raise ValueError("a response needs at least one prompt token before it")
    run = getattr(model, SHARDED_HEAD, None) if impl == "chunked" else None  # FSDP2: gathers the root
    if run is None:
        parts = lm_parts(model) if impl == "chunked" else None
        if parts is None:
            return _response_logprobs_full(model, prompts, responses, temperatures, pad_id, with_entropy, top_ps)
        run = partial(decoder_head_logprobs, *parts)
    device = next(model.parameters()).device
    ids, attn, T = _padded_batch(prompts, responses, pad_id, device)
    rows, pos, cols, toks, temps, tps = [], [], [], [], [], []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        rows += [i] * len(r)
        pos += range(len(p) - 1, len(p) - 1 + len(r))  # position t predicts token t + 1
        cols += range(len(r))
        toks += r
        temps += [temperatures[i] if temperatures[i] > 1e-5 else 1.0] * len(r)
        tps += [top_ps[i] if top_ps is not None else 1.0] * len(r)
    out = torch.zeros((len(prompts), T), dtype=torch.float32, device=device)
    mask, ent = torch.zeros_like(out), torch.zeros_like(out)
    if not toks:  # no response token: one position at weight 0, so the forward and backward still run
        # (a sharded rank must make the collectives its peers make; one process needs a loss with a graph)
        lp, _ = run(ids, attn, torch.zeros((4, 1), dtype=torch.long, device=device),
                    torch.ones((2, 1), dtype=torch.float32, device=device), chunk_tokens, False)
        out = out + 0.0 * lp.sum()
        return (out, mask, ent) if with_entropy else (out, mask)
    index = torch.tensor([rows, pos, cols, toks], dtype=torch.long).to(device)
    scalars = torch.tensor([temps, tps], dtype=torch.float32).to(device)
    lp, e = run(ids, attn, index, scalars, chunk_tokens, with_entropy)
    where = (index[0], index[2])
    out = out.index_put(where, lp)
    mask = mask.index_put_(where, torch.ones_like(lp))
    return (out, mask, ent.index_put_(where, e)) if with_entropy else (out, mask)


def _response_logprobs_full(model, prompts, responses, temperatures, pad_id=0, with_entropy=False,
                            top_ps=None):
    """`response_logprobs` from the full ``[B, L, V]`` fp32 logits of ``model(...)``: any
    causal LM; the reference the chunked path is tested against."""
    from serve_rft.trainer.losses import token_entropy

    device = next(model.parameters()).device
    ids, attn, T = _padded_batch(prompts, responses, pad_id, device)
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    out = torch.zeros((len(prompts), T), dtype=torch.float32, device=device)
    if not any(responses):  # keep the graph (`response_logprobs`, the chunked path's empty case)
        out = out + 0.0 * logits[:, :1, :1].sum()
    mask = torch.zeros((len(prompts), T), dtype=torch.float32, device=device)
    ent = torch.zeros((len(prompts), T), dtype=torch.float32, device=device)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not r:
            continue
        temp = temperatures[i] if temperatures[i] > 1e-5 else 1.0
        # logits at position t predict token t+1: response token j sits at len(p)+j.
        step_logits = logits[i, len(p) - 1 : len(p) - 1 + len(r)] / temp
        tok = torch.tensor(r, dtype=torch.long, device=device)
        top_p = top_ps[i] if top_ps is not None else 1.0
        if top_p < 1.0:
            with torch.no_grad():
                keep = nucleus_keep(step_logits.detach(), top_p)
                keep[torch.arange(len(r), device=device), tok] = True
            step_logits = step_logits.masked_fill(~keep, float("-inf"))
        lp = torch.log_softmax(step_logits, dim=-1)
        out[i, : len(r)] = lp.gather(1, tok.unsqueeze(1)).squeeze(1)
        mask[i, : len(r)] = 1.0
        if with_entropy:
            with torch.no_grad():
                ent[i, : len(r)] = token_entropy(step_logits)
    return (out, mask, ent) if with_entropy else (out, mask)


def trainer_probe(model, version: int) -> dict[str, list]:
    """The probe a handle carries: ``{"token_ids", "logprobs"}`` of ``model`` (a transformers or
    peft model, as published) at temperature 1.

    ``logprobs[t] = log_softmax(logits[t])[token_ids[t + 1]]`` for t < n - 1 (the prompt
    logprobs vLLM returns), computed by `response_logprobs`; the ids are
    `serve_rft.weights.verify.probe_ids`, which the replica's check uses too.
    """
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = probe_ids(min(vocab, getattr(model.config, "vocab_size", vocab)), version)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            lp, _ = response_logprobs(model, [ids[:1]], [ids[1:]], [1.0], pad_id=0)
    finally:
        model.train(was_training)
    return {"token_ids": ids, "logprobs": [float(x) for x in lp[0, : len(ids) - 1].float().cpu()]}

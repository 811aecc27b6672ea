"""The loss of one micro-batch of a policy-gradient step (`serve_rft.trainer.policy.policy.PolicyTrainer.step`
sums its gradients over the micro-batches): the trainer's logprobs of the sampled tokens
(`serve_rft.trainer.policy.token_logprobs.response_logprobs`), the configured algorithm's loss against
the behaviour logprobs (`serve_rft.trainer.algorithms.losses`), the KL penalty to a reference, the
entropy bonus, and the step's statistics.

Shapes: ``B`` experiences in the micro-batch, ``T`` response tokens (right-padded).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable

from serve_rft.config.trainer import TrainerConfig


def micro_batch_loss(cfg: TrainerConfig, algorithm, model, ref_model, pad_id: int,
                     autocast: Callable[[], AbstractContextManager], exps, adv, rewards, extras,
                     n_tokens: float, n_seqs: float, held_version: int | None = None,
                     version_lags: dict[int, int] | None = None, entropy_coef: float | None = None):
    """Loss of one micro-batch, normalised by the whole batch's ``n_tokens`` / ``n_seqs``.

    Args:
        cfg: the trainer settings (KL and entropy coefficients, logprob path).
        algorithm: the configured `serve_rft.trainer.algorithms.Algorithm` (its loss and aggregation).
        model: the policy (a transformers or peft causal LM, possibly FSDP2-sharded).
        ref_model: the frozen KL reference, or None (LoRA: the policy with its adapter disabled).
        pad_id: the token id right-padding uses.
        autocast: a new context manager for each forward (`PolicyTrainer._autocast`).
        exps: the micro-batch's ``B`` `serve_rft.types.Experience`.
        adv: ``[B]`` fp32 advantages; rewards: ``B`` floats; extras: ``[B]`` the algorithm's
            values of the whole batch (`Algorithm.batch_values`), or None.
        n_tokens, n_seqs: response tokens and experiences of the whole batch.
        held_version: the version whose weights the trainer holds, or None (`token_stats`).
        version_lags: ``{version: sync cycles behind}`` (`token_stats`), or None.
        entropy_coef: the entropy bonus's coefficient for this step
            (`serve_rft.trainer.policy.entropy_control.EntropyControl.coef`, which `PolicyTrainer.step`
            passes); None: ``cfg.entropy_coef``, the fixed coefficient (with ``cfg.entropy_target``
            set, only the adaptive one's bound).
    Returns:
        (scalar loss with grad, statistics of this micro-batch, its response token count).
    """
    import torch

    from serve_rft.trainer.algorithms import LossInputs
    from serve_rft.trainer.algorithms.losses import aggregate, kl_k3
    from serve_rft.trainer.sharding.fsdp import reshard
    from serve_rft.trainer.policy.token_logprobs import response_logprobs

    c = cfg
    bonus = c.entropy_coef if entropy_coef is None else entropy_coef
    agg = algorithm.aggregation
    prompts = [e.prompt_token_ids for e in exps]
    responses = [e.response_token_ids for e in exps]
    temps = [e.sampling.temperature for e in exps]
    top_ps = [e.sampling.top_p for e in exps]
    how = dict(chunk_tokens=c.logprob_chunk_tokens, impl=c.logprob_impl)
    with autocast():
        logp, mask, ent = response_logprobs(model, prompts, responses, temps, pad_id, with_entropy=True,
                                            top_ps=top_ps, entropy_grad=bonus > 0, **how)
    behaviour = torch.zeros_like(logp)
    for i, e in enumerate(exps):
        behaviour[i, : len(e.behaviour_logprobs)] = torch.tensor(e.behaviour_logprobs)
    loss, stats = algorithm.loss(LossInputs(logp, behaviour, mask, adv, torch.tensor(rewards, device=logp.device),
                                            extras, n_tokens, n_seqs))
    tokens = float(mask.sum())
    here = max(tokens, 1.0)
    if c.kl_coef > 0:
        with torch.no_grad(), autocast():
            if ref_model is not None:
                ref, _ = response_logprobs(ref_model, prompts, responses, temps, pad_id,
                                           top_ps=top_ps, **how)
                reshard(ref_model)  # sharded: no backward will free the gathered root
            else:
                with model.disable_adapter():
                    ref, _ = response_logprobs(model, prompts, responses, temps, pad_id,
                                               top_ps=top_ps, **how)
        kl = kl_k3(logp, ref)
        loss = loss + c.kl_coef * aggregate(kl, mask, agg, n_tokens, n_seqs)
        stats["kl_ref"] = float((kl.detach() * mask).sum() / here)
    if bonus > 0:  # the bonus: higher entropy, lower loss
        loss = loss - bonus * aggregate(ent, mask, agg, n_tokens, n_seqs)
    stats["entropy"] = float((ent.detach() * mask).sum() / here)
    stats["max_abs_logprob_diff"] = float(((logp.detach() - behaviour).abs() * mask).max())
    stats.update(token_stats(logp.detach(), behaviour, mask, token_versions(exps, logp.shape[1]).to(logp.device),
                             held_version, version_lags, cfg.clip_low, cfg.clip_high))
    return loss, stats, tokens


def token_versions(exps, width: int):
    """``[B, width]`` the policy version that sampled each response token (the experience's
    ``token_versions`` spans), -1 past an answer's end."""
    import torch

    out = torch.full((len(exps), width), -1, dtype=torch.long)
    for i, e in enumerate(exps):
        for version, start, end in e.token_versions:
            out[i, max(0, start): min(end, width)] = version
    return out


def token_stats(logp, behaviour, mask, versions, held_version: int | None, version_lags: dict[int, int] | None,
                clip_low: float, clip_high: float) -> dict[str, float]:
    """Per-token statistics of a micro-batch, split by the version that sampled each token
    (merged by `serve_rft.trainer.policy.micro_batches.finish`).

    Tokens of ``held_version`` (the trainer's own weights) show trainer-vs-inference mismatch;
    the rest drift (staleness): for each, the summed k3 estimate of ``KL(mu || pi)``
    (``r - 1 - log r``, ``r = pi / mu`` with the log-ratio clamped) and the largest
    ``|log pi - log mu|``. Per `LAG_BUCKETS` bucket of the token's lag (``version_lags`` of its
    version: sync cycles behind the trainer, as staleness is counted): its tokens and those whose
    ratio is outside ``[1 - clip_low, 1 + clip_high]``. A token without a version (-1) counts in
    neither.

    Args:
        logp, behaviour, mask: ``[B, T]`` (no grad).
        versions: ``[B, T]`` `token_versions`.
        held_version: None: every token is drift.
        version_lags: ``{version: lag}`` of every version in ``versions``; None: no lag buckets.
    """
    import torch

    from serve_rft.trainer.algorithms.losses import clamped_log_ratio
    from serve_rft.trainer.policy.micro_batches import LAG_BUCKETS

    on = (mask > 0) & (versions >= 0)
    lr = clamped_log_ratio(logp, behaviour, mask.to(logp.dtype))
    k3 = torch.exp(lr) - 1 - lr
    diff = (logp - behaviour).abs()
    current = on & (versions == held_version) if held_version is not None else torch.zeros_like(on)
    out: dict[str, float] = {}
    for part, where in (("mismatch", current), ("drift", on & ~current)):
        n = float(where.sum())
        if n:
            out[f"sum_tokens_{part}"] = n
            out[f"sum_k3_{part}"] = float(k3[where].sum())
            out[f"max_abs_{part}"] = float(diff[where].max())
    if version_lags is not None:
        lag = torch.full_like(versions, -1)
        for version, cycles in version_lags.items():
            lag[versions == version] = cycles
        clipped = (lr < torch.log1p(torch.tensor(-clip_low))) | (lr > torch.log1p(torch.tensor(clip_high)))
        for name, low, high in LAG_BUCKETS:
            where = on & (lag >= low) & ((lag <= high) if high is not None else True)
            n = float(where.sum())
            if n:
                out[f"sum_tokens_{name}"] = n
                out[f"sum_clipped_{name}"] = float(clipped[where].sum())
    return out

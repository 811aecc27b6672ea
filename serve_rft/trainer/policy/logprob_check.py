"""Logprob agreement: the trainer's logprobs of sampled tokens against the behaviour logprobs
vLLM logged for them (this is what makes the PPO ratio mean something).

`sample` draws responses from an `ExplorerEngine` with the replica's own sampling settings
(``processed_logprobs``: after temperature and top-p, as the replica logs them);
`trainer_logprobs` recomputes them with `serve_rft.trainer.policy.token_logprobs.response_logprobs`;
`agreement` compares. Used by tests/integration/test_logprob_agreement.py and
benchmarks/logprob_agreement.py.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch


@dataclass
class Sampled:
    """One sampled response: ``prompt`` and ``response`` token ids, vLLM's logprob per response
    token, and the sampling settings."""

    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    temperature: float
    top_p: float


async def sample(engine, prompts: list[list[int]], temperature: float, top_p: float, n: int,
                 max_tokens: int, seed: int = 0, **fields) -> list[Sampled]:
    """``n`` responses per prompt from ``engine`` with vLLM's logprob of each sampled token;
    ``fields``: more ``SamplingParams`` (``ignore_eos``, ``stop_token_ids``, ``stop``, ...)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    out: list[Sampled] = []
    for k, prompt in enumerate(prompts):
        sp = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0,
                            seed=seed + k, output_kind=RequestOutputKind.FINAL_ONLY, **fields)
        async for ro in engine.generate(prompt, sp, f"lp-{uuid.uuid4().hex}"):
            pass
        for o in ro.outputs:
            ids = list(o.token_ids)
            out.append(Sampled(prompt, ids, [o.logprobs[i][t].logprob for i, t in enumerate(ids)],
                               sp.temperature, sp.top_p))  # as vLLM normalised them (greedy: top_p 1)
    return out


def trainer_logprobs(model, samples: list[Sampled], batch: int = 16, apply_top_p: bool = True
                     ) -> list[torch.Tensor]:
    """The trainer's logprob of every sampled token (``[len(response)]`` per sample);
    ``apply_top_p=False`` ignores the nucleus truncation (to show what it is worth)."""
    from serve_rft.trainer.policy.token_logprobs import response_logprobs

    out: list[torch.Tensor] = []
    with torch.no_grad():
        for i in range(0, len(samples), batch):
            part = samples[i:i + batch]
            lp, _ = response_logprobs(model, [s.prompt for s in part], [s.response for s in part],
                                      [s.temperature for s in part],
                                      top_ps=[s.top_p for s in part] if apply_top_p else None)
            out += [lp[j, : len(s.response)] for j, s in enumerate(part)]
    return out


def agreement(samples: list[Sampled], ours: list[torch.Tensor]) -> dict[str, float]:
    """``max_abs_diff`` and ``mean_abs_diff`` over all sampled tokens, ``tokens``, ``responses``."""
    diffs = torch.cat([(torch.tensor(s.logprobs) - o).abs() for s, o in zip(samples, ours) if s.response])
    return {"max_abs_diff": float(diffs.max()), "mean_abs_diff": float(diffs.mean()),
            "tokens": int(diffs.numel()), "responses": len(samples)}


async def max_abs_diff(engine, model, prompt: list[int], max_tokens: int, seed: int = 1) -> float:
    """One response to ``prompt`` (temperature 1, no top_p): max |vLLM logprob - trainer
    logprob| over its tokens. How the sync benchmarks check that a load gave the new weights."""
    samples = await sample(engine, [prompt], 1.0, 1.0, n=1, max_tokens=max_tokens, seed=seed)
    return agreement(samples, trainer_logprobs(model, samples))["max_abs_diff"]

"""Rewarded experiences for trainer-step tests on the embedded model: a small, uneven batch that
the unit tests of micro-batching (tests/unit/test_micro_batches.py) and the sharded trainer's
test (tests/integration/test_sharded_trainer.py) step on, and a small batch of two groups that
the loss, precision, LoRA and verify unit tests step on."""

from __future__ import annotations

PROMPT_LENS = [2, 14, 3, 1, 9, 5, 30, 2]  # tokens per experience's prompt
RESPONSE_LENS = [12, 1, 0, 3, 7, 15, 6, 2]  # tokens per experience's response (one empty)


def uneven_batch():
    """Eight experiences of 3 to 36 tokens (one with an empty response) in four groups of two,
    ``i`` and ``7 - i``, whose members land in different micro-batches; varied behaviour
    logprobs, temperatures and top_p.

    Returns:
        list of 8 ``RewardedExperience``; token ids in [1, 50] (the embedded model's vocabulary
        holds them).
    """
    from serve_rft.types import Experience, RewardedExperience, SamplingInfo

    out = []
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        g = f"g{min(i, 7 - i)}"
        out.append(RewardedExperience(
            experience=Experience(
                completion_id=g, choice_index=int(i > 3), group_id=g, replica_id="r",
                prompt_token_ids=[(7 * i + 3 * k) % 50 + 1 for k in range(p)],
                response_token_ids=[(11 * i + 5 * k) % 50 + 1 for k in range(r)],
                behaviour_logprobs=[-3.0 - 0.4 * ((i + k) % 5) for k in range(r)],
                token_versions=[(0, 0, r)] if r else [],
                sampling=SamplingInfo(temperature=[1.0, 0.7, 1.3, 0.0][i % 4], top_p=[1.0, 0.9][i % 2],
                                      max_tokens=16),
                finish_reason="length"),
            reward=[0.0, 1.0, 0.25, 2.0, 0.5, -1.0, 1.5, 0.75][i], stream_id=f"0-{i}"))
    return out


def small_batch(k=0, n=6):
    """``n`` experiences in groups of three choices of one completion (``c{k}-{i // 3}``): a
    3-token prompt, 1 to 3 response tokens with behaviour logprobs -4.0, -4.5, -5.0 (nats), all
    at version 0, temperature 1, top_p 1; rewards 0, 1, 2 within a group.

    Args:
        k: tells batches apart (completion ids and stream ids ``{k}-{i}``).
        n: the number of experiences (6 by default: two groups).

    Returns:
        list of ``n`` ``RewardedExperience``; token ids in [1, 30 + n) (the embedded model's
        vocabulary holds them for the default ``n``).
    """
    from serve_rft.types import Experience, RewardedExperience, SamplingInfo

    return [RewardedExperience(
        experience=Experience(completion_id=f"c{k}-{i // 3}", choice_index=i % 3, group_id=f"c{k}-{i // 3}",
                              replica_id="r", prompt_token_ids=[1, 2, 3 + i],
                              response_token_ids=[10 + i, 20 + i, 30 + i][: 1 + i % 3],
                              behaviour_logprobs=[-4.0, -4.5, -5.0][: 1 + i % 3], token_versions=[(0, 0, 1 + i % 3)],
                              sampling=SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=3), finish_reason="length"),
        reward=float(i % 3), stream_id=f"{k}-{i}") for i in range(n)]

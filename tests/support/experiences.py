"""Experiences for the unit tests of the experience store and what reads it (rewards, intake,
the ready stream): one small choice, and one with the largest fields a request may carry."""

from __future__ import annotations

from serve_rft.types import Experience, SamplingInfo


def experience(cid, i, versions=((0, 0, 3),), group=None):
    """One choice of a completion: a 2-token prompt ``[1, 2]``, a 3-token response
    ``[5, 6, 7]`` with behaviour logprobs ``[-1.0, -2.0, -0.5]`` (nats), replica ``r0``,
    temperature 1, top_p 1, max_tokens 3, finish reason ``length``.

    Args:
        cid: the completion id.
        i: the choice index.
        versions: the token versions, ``(policy_version, start, end)`` spans over the response's
            tokens; by default all 3 tokens at version 0.
        group: the group id; the completion id when None.

    Returns:
        an ``Experience``.
    """
    return Experience(completion_id=cid, choice_index=i, group_id=group or cid, replica_id="r0",
                      prompt_token_ids=[1, 2], response_token_ids=[5, 6, 7],
                      behaviour_logprobs=[-1.0, -2.0, -0.5], token_versions=list(versions),
                      sampling=SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=3),
                      finish_reason="length")


def large_experience(cid, i, n_keys=16):
    """A choice of a request with the largest fields `explorer.limits` lets through: a 512-char
    ``user``, ``n_keys`` (16 by default) metadata pairs of 64 + 512 characters, a ~64 KB
    json-schema grammar; a 1-token response ``[5]`` at version 0.

    Returns:
        an ``Experience``, otherwise as `experience` (``cid``, ``i``).
    """
    schema = {"type": "object", "properties": {f"p{k:05d}": {"type": "string", "description": "x" * 40}
                                               for k in range(1200)}}
    return experience(cid, i).model_copy(update={
        "response_token_ids": [5], "behaviour_logprobs": [-1.0], "token_versions": [(0, 0, 1)],
        "user": "u" * 512, "metadata": {f"{k:02d}".ljust(64, "k"): "v" * 512 for k in range(n_keys)},
        "sampling": SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=1, structured_outputs={"json": schema})})

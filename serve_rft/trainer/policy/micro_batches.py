"""How a training step splits its batch into micro-batches (gradient accumulation), pure Python.

A micro-batch of experiences runs through the model as one ``[b, L]`` right-padded tensor,
``L`` = its longest prompt + response (`serve_rft.trainer.policy.token_logprobs.response_logprobs`), so
its activation memory grows with its *padded* size ``b * L`` tokens, not with ``b`` alone.
`partition` bounds both ``b`` (``trainer.micro_batch_size``) and ``b * L``
(``trainer.micro_batch_tokens``). The trainer normalises every micro-batch's loss by the
whole batch's token / answer counts, so any partition gives the whole batch's gradient.
"""

from __future__ import annotations

from collections.abc import Sequence


def padded_tokens(lengths: Sequence[int], part: Sequence[int]) -> int:
    """Tokens of the right-padded ``[len(part), max length]`` tensor micro-batch ``part`` (indices
    into ``lengths``) runs as; 0 for an empty part."""
    return len(part) * max((lengths[i] for i in part), default=0)


def partition(lengths: Sequence[int], max_size: int | None = None,
              max_tokens: int | None = None) -> list[list[int]]:
    """Split a batch into micro-batches.

    Args:
        lengths: ``[B]`` tokens of each experience (prompt + response), ``>= 0``.
        max_size: at most this many experiences per part; ``None`` or 0: no limit.
        max_tokens: at most this many padded tokens per part (`padded_tokens`: part size times
            its longest length); ``None``: no limit.

    Returns:
        The parts: lists of indices into ``lengths``, every index in exactly one part, no part
        empty (``[]`` for an empty batch). Without ``max_tokens``: consecutive runs of the
        batch order (``max_size`` each, the last shorter). With ``max_tokens``: the indices
        sorted longest first (stable: equal lengths keep the batch order), then packed
        greedily, a part closed when the next index would break either limit; parts and the
        indices in them are in that sorted order, so the result is deterministic. An
        experience longer than ``max_tokens`` forms a part of its own (never dropped).

    Raises:
        ValueError: a negative length, ``max_size < 0`` or ``max_tokens < 1``.
    """
    if any(n < 0 for n in lengths):
        raise ValueError("lengths must be >= 0")
    if max_size is not None and max_size < 0:
        raise ValueError(f"max_size must be >= 0, got {max_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    size = max_size or len(lengths) or 1
    if max_tokens is None:
        return [list(range(s, min(s + size, len(lengths)))) for s in range(0, len(lengths), size)]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # sorted() is stable
    parts: list[list[int]] = []
    for i in order:
        part = parts[-1] if parts else None
        # longest first: the part's first index is its longest, so (size + 1) * that is the
        # padded size with i added
        if part is None or len(part) >= size or (len(part) + 1) * lengths[part[0]] > max_tokens:
            parts.append([i])
        else:
            part.append(i)
    return parts


PER_ANSWER_STATS = frozenset({"opmd_residual_abs"})
"""Statistics a micro-step reports as a mean over its answers (the rest: over its tokens)."""


def is_max_stat(key: str) -> bool:
    """A statistic merged by maximum over parts and ranks (``*_max``, ``max_*``), not by weighted sum."""
    return key.endswith("_max") or key.startswith("max_")


def is_sum_stat(key: str) -> bool:
    """A statistic merged by plain sum over parts and ranks (``sum_*``: counts and totals that
    `finish` turns into fractions and means over a subset of the tokens)."""
    return key.startswith("sum_")


LAG_BUCKETS: tuple[tuple[str, int, int | None], ...] = (("lag0", 0, 0), ("lag1", 1, 1), ("lag2_3", 2, 3),
                                                          ("lag4p", 4, None))
"""Version-lag buckets of the per-token statistics: ``(name, lowest lag, highest lag or None)``; a
token's lag is the versions between the one that sampled it and the trainer's."""


def finish(totals: dict[str, float]) -> dict[str, float]:
    """The step's statistics from merged ``totals`` (`accumulate`, then over ranks): each ``sum_*``
    pair becomes a fraction or a mean over its tokens, and the ``sum_*`` keys go.

    - ``mismatch_k3`` / ``drift_k3``: mean k3 of ``KL(mu || pi)`` over the tokens of the version
      the trainer holds (trainer-vs-inference mismatch) / over older tokens (drift), present only
      when such tokens exist; ``max_abs_mismatch`` / ``max_abs_drift`` (from the parts) stay.
    - ``clip_fraction_<bucket>`` and ``token_share_<bucket>`` for each `LAG_BUCKETS` bucket with
      tokens: the share of its tokens whose ratio to behaviour is outside the PPO clip range, and
      its share of the step's tokens.
    """
    out = {k: v for k, v in totals.items() if not is_sum_stat(k)}
    for part in ("mismatch", "drift"):
        n = totals.get(f"sum_tokens_{part}", 0.0)
        if n > 0:
            out[f"{part}_k3"] = totals.get(f"sum_k3_{part}", 0.0) / n
    every = sum(totals.get(f"sum_tokens_{name}", 0.0) for name, _, _ in LAG_BUCKETS)
    for name, _, _ in LAG_BUCKETS:
        n = totals.get(f"sum_tokens_{name}", 0.0)
        if n > 0:
            out[f"clip_fraction_{name}"] = totals.get(f"sum_clipped_{name}", 0.0) / n
            out[f"token_share_{name}"] = n / every
    return out


def accumulate(totals: dict[str, float], stats: dict[str, float], tokens: float, answers: int,
               n_tokens: float, n_seqs: float) -> None:
    """Add one micro-batch's ``stats`` into ``totals`` (in place) so that, after the last part,
    ``totals`` holds the whole batch's values whatever the partition.

    A key ending in ``_max`` or starting with ``max_`` is a maximum (the largest over parts); a
    key starting with ``sum_`` is a plain sum (`finish` derives from it); a key in
    `PER_ANSWER_STATS` is a mean over the part's ``answers`` (weighted by ``answers / n_seqs``);
    any other is a mean over the part's ``tokens`` response tokens (weighted by
    ``tokens / n_tokens``). ``n_tokens`` / ``n_seqs``: the whole batch's response
    tokens and answers.
    """
    for k, v in stats.items():
        if is_max_stat(k):
            totals[k] = max(totals.get(k, v), v)
        elif is_sum_stat(k):
            totals[k] = totals.get(k, 0.0) + v
        elif k in PER_ANSWER_STATS:
            totals[k] = totals.get(k, 0.0) + v * answers / max(n_seqs, 1.0)
        else:
            totals[k] = totals.get(k, 0.0) + v * tokens / max(n_tokens, 1.0)

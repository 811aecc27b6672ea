"""Advantages, as pure functions shared by the algorithms (the trainer's logprobs of sampled tokens
are in `serve_rft.trainer.policy.token_logprobs`, the losses in `serve_rft.trainer.algorithms`).

Shapes: ``B`` experiences in a batch.

A group's statistics come from the store (`serve_rft.types.GroupReward`: fixed when the group was
first released, carried by every member), so a member's advantage never depends on how the
trainer batches; an entry without them (one built by hand) is grouped with the members of its
group in the same batch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

from serve_rft.types import GroupReward

FP32_MAX = float(torch.finfo(torch.float32).max)
"""The largest finite float32 (about 3.4e38)."""

Estimator = Literal["grpo", "group_mean", "baseline"]
Scale = Literal["group", "batch", "none"]


class RunningBaseline:
    """Exponential moving averages of rewards: the baseline for singleton experiences, and the
    spread of rewards around it (what scales a singleton's advantage like a group member's).

    ``b <- m * b + (1 - m) * r`` per reward, starting at the first reward seen;
    ``v <- m * v + (1 - m) * (r - b)^2`` (``b`` before the update), starting at the second. A
    reward that is not finite, or beyond float32's range (``|r| > FP32_MAX``: the advantages
    are float32, so it could never train), is not absorbed: one such reward would hold every
    later singleton's advantage at about ``-r`` for hundreds of rewards.
    """

    def __init__(self, momentum: float = 0.9):
        self.momentum = momentum
        self.value: float | None = None
        self.var: float | None = None

    @property
    def std(self) -> float | None:
        """``sqrt(v)``, or None before two rewards."""
        return math.sqrt(self.var) if self.var is not None else None

    def update(self, rewards: Sequence[float]) -> None:
        m = self.momentum
        for r in rewards:
            if not (math.isfinite(r) and abs(r) <= FP32_MAX):
                continue
            if self.value is None:
                self.value = r
                continue
            d2 = (r - self.value) ** 2
            if math.isfinite(d2):
                self.var = d2 if self.var is None else m * self.var + (1 - m) * d2
            self.value = m * self.value + (1 - m) * r


@dataclass
class Advantages:
    """A batch's advantages and what they were made of.

    Attributes:
        values: ``[B]`` fp32.
        groups: groups of two or more members among the batch's experiences.
        zero_variance_groups: of those, groups whose reward std is below ``zero_std``: their
            members' advantages are exactly 0.
        zero_variance: ``[B]`` whether each experience is a member of such a group (empty when
            made without group statistics).
    """

    values: torch.Tensor
    groups: int = 0
    zero_variance_groups: int = 0
    zero_variance: list[bool] = field(default_factory=list)


def _std(xs: Sequence[float]) -> float:
    """Unbiased standard deviation; 0 for fewer than two values."""
    if len(xs) < 2:
        return 0.0
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def group_advantages(rewards: Sequence[float], group_ids: Sequence[str], baseline: RunningBaseline,
                     groups: Sequence[GroupReward | None] | None = None, estimator: Estimator = "grpo",
                     scale: Scale = "group", eps: float = 1e-6, zero_std: float = 1e-4,
                     singleton_clip: float | None = 3.0) -> Advantages:
    """Per-experience advantages of one batch (module docstring for where a group's statistics
    come from).

    A member of a group of two or more (``grpo``, ``group_mean``) is centred on its group's mean,
    ``r_i - mean_g``; a singleton on the running baseline, ``r_i - b`` (``b`` taken before this
    batch, which then updates it). ``grpo`` then divides by a scale (``scale``, Dr. GRPO's
    ``scale_rewards``, Liu et al. 2025, arXiv 2503.20783, §3.1):

    - ``group``: a member by its group's std (GRPO, Shao et al. 2024, §4.1.2, outcome supervision),
      a singleton by the running std of rewards around the baseline, so both are unit-free (1
      before two rewards were seen);
    - ``batch``: everyone by the std of the batch's rewards;
    - ``none``: no division (Dr. GRPO).

    ``group_mean`` (OPMD, the Trinity-RFT technical report, appendix A.3) never divides;
    ``baseline`` (REINFORCE) gives every experience ``r_i - b``, undivided. A group whose reward
    std is below ``zero_std`` (equal rewards, or differences of float noise) gives its members
    exactly 0 and is counted in ``zero_variance_groups``; a member released after such a group's
    first release whose own reward differs from the group's mean by more than ``zero_std`` has
    nothing to be compared with in its group and is scored as a singleton. A singleton's ``grpo``
    advantage is clipped to ``[-singleton_clip, singleton_clip]``: the running spread can be
    small (a plateau of equal rewards, two rewards seen), and one singleton must not outweigh a
    step's group z-scores (bounded by ``sqrt(n - 1)`` in a group of ``n``).

    Args:
        rewards: ``[B]``. group_ids: ``[B]``.
        baseline: the running baseline (updated with every reward of the batch).
        groups: ``[B]`` each entry's group statistics from the store, or None (grouped within
            the batch by ``group_ids``).
        eps: added to a divisor. zero_std: the zero-variance threshold (reward units).
        singleton_clip: the bound of a singleton's ``grpo`` advantage under ``group`` or ``batch``
            (unit-free), or None.
    Raises:
        ValueError: an unknown ``estimator`` or ``scale``.
    """
    if estimator not in ("grpo", "group_mean", "baseline"):
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"unknown reward scale {scale!r}")
    b = baseline.value if baseline.value is not None else 0.0
    if estimator == "grpo" and scale == "group":
        single_scale = baseline.std if baseline.std is not None and baseline.std > zero_std else 1.0
    elif estimator == "grpo" and scale == "batch":
        single_scale = max(_std(rewards), zero_std)
    else:
        single_scale = 1.0
    stats: list[GroupReward | None] = list(groups) if groups is not None else [None] * len(rewards)
    in_batch: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        if stats[i] is None:
            in_batch[g].append(i)
    for members in in_batch.values():  # entries without the store's statistics: the batch's members
        if len(members) >= 2:
            rs = [rewards[i] for i in members]
            fixed = GroupReward(size=len(rs), mean=sum(rs) / len(rs), std=_std(rs))
            for i in members:
                stats[i] = fixed
    adv = [0.0] * len(rewards)
    without_spread = [False] * len(rewards)
    seen: dict[str, bool] = {}
    def single(r: float) -> float:
        a = (r - b) / single_scale
        if not (math.isfinite(a) and abs(r) <= FP32_MAX):
            return a  # not clipped into a number: the step's guard skips what cannot be trained
        if estimator == "grpo" and scale != "none" and singleton_clip is not None:
            a = max(-singleton_clip, min(singleton_clip, a))
        return a

    for i, r in enumerate(rewards):
        g = stats[i]
        if (estimator == "baseline" or g is None or g.size < 2
                or (g.std < zero_std and abs(r - g.mean) > zero_std)):  # a late member of a group without spread
            adv[i] = single(r)
            continue
        zero = g.std < zero_std
        seen[group_ids[i]] = zero
        if zero:
            adv[i], without_spread[i] = 0.0, True
        elif estimator == "grpo" and scale == "group":
            adv[i] = (r - g.mean) / (g.std + eps)
        elif estimator == "grpo":
            adv[i] = (r - g.mean) / single_scale
        else:
            adv[i] = r - g.mean
    baseline.update(rewards)
    return Advantages(torch.tensor(adv, dtype=torch.float32), groups=len(seen),
                      zero_variance_groups=sum(seen.values()), zero_variance=without_spread)


def compute_advantages(rewards: Sequence[float], group_ids: Sequence[str], baseline: RunningBaseline,
                       eps: float = 1e-6, estimator: Estimator = "grpo", scale: Scale = "group",
                       groups: Sequence[GroupReward | None] | None = None, zero_std: float = 1e-4,
                       singleton_clip: float | None = 3.0) -> torch.Tensor:
    """``[B]`` `group_advantages`' values."""
    return group_advantages(rewards, group_ids, baseline, groups, estimator, scale, eps, zero_std,
                            singleton_clip).values

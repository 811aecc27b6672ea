"""What every algorithm is: an advantage estimator, a loss, and its own settings
(``trainer.algorithm_args``), found by name through `serve_rft.trainer.algorithms.get_algorithm`.

Shapes: ``B`` experiences, ``T`` response tokens (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from serve_rft.config.trainer import TrainerConfig
from serve_rft.types import RewardedExperience
from serve_rft.trainer.algorithms.advantages import Advantages, RunningBaseline
from serve_rft.trainer.algorithms.losses import Aggregation


class NoSettings(BaseModel):
    """An algorithm without settings of its own: ``trainer.algorithm_args`` must be empty."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class LossInputs:
    """One micro-batch's inputs to an algorithm's loss.

    Attributes:
        logprobs: ``[B, T]`` the policy's logprobs of the sampled tokens (with grad).
        behaviour: ``[B, T]`` the logprobs vLLM logged when it sampled them (0 on padding).
        mask: ``[B, T]`` 1 for response tokens to train on, 0 for padding.
        advantages: ``[B]`` from `Algorithm.advantages` over the whole batch.
        rewards: ``[B]``.
        extras: ``[B]`` the algorithm's per-experience values of the whole batch
            (`Algorithm.batch_values`), or None.
        n_tokens, n_seqs: response tokens and experiences of the whole batch (the normalisers).
    """

    logprobs: torch.Tensor
    behaviour: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    extras: torch.Tensor | None
    n_tokens: float
    n_seqs: float


class Algorithm:
    """An RL algorithm of the trainer. A subclass in a module of this package is one algorithm;
    `serve_rft.trainer.algorithms.get_algorithm` finds it by its ``name``.

    Subclasses set ``name``, ``default_aggregation`` and (if it has settings) ``Settings``, a
    pydantic model that validates ``trainer.algorithm_args``; they implement `advantages` and
    `loss`, and `batch_values` if the loss needs values of the whole batch.
    """

    name: ClassVar[str]
    default_aggregation: ClassVar[Aggregation] = "token_mean"
    Settings: ClassVar[type[BaseModel]] = NoSettings
    filters_zero_variance: ClassVar[bool] = True
    """Whether ``trainer.filter_zero_variance`` applies: the algorithm scores answers in groups,
    and a group without reward spread has no policy gradient (advantage 0 and nothing else)."""

    def __init__(self, cfg: TrainerConfig):
        """Raises:
            pydantic.ValidationError: ``trainer.algorithm_args`` is not this algorithm's settings.
            ValueError: ``trainer.filter_zero_variance`` with an algorithm it does not apply to."""
        if cfg.filter_zero_variance and not self.filters_zero_variance:
            raise ValueError(f"trainer.filter_zero_variance does not apply to trainer.algorithm={self.name!r}: "
                             "its answers without reward spread still have a gradient, or it has no groups")
        self.cfg = cfg
        self.settings = self.Settings.model_validate(cfg.algorithm_args)
        self.aggregation: Aggregation = cfg.loss_agg or self.default_aggregation

    def advantages(self, batch: list[RewardedExperience], baseline: RunningBaseline) -> Advantages:
        """The whole batch's advantages (``[B]`` fp32, in batch order); updates ``baseline``."""
        raise NotImplementedError

    def batch_values(self, batch: list[RewardedExperience]) -> torch.Tensor | None:
        """``[B]`` per-experience values the loss needs from the whole batch, or None (default)."""
        return None

    def group_advantages(self, batch: list[RewardedExperience], baseline: RunningBaseline, estimator: str,
                         scale: str = "none") -> Advantages:
        """`serve_rft.trainer.algorithms.advantages.group_advantages` of ``batch`` with the store's
        group statistics and the trainer's ``zero_variance_std``."""
        from serve_rft.trainer.algorithms.advantages import group_advantages

        return group_advantages([b.reward for b in batch], [b.experience.group_id for b in batch], baseline,
                                [b.group for b in batch], estimator, scale, zero_std=self.cfg.zero_variance_std,
                                singleton_clip=self.cfg.singleton_advantage_clip)

    def loss(self, x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        """(scalar loss of the micro-batch normalised by the whole batch, statistics)."""
        raise NotImplementedError

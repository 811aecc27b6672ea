"""REINFORCE with a running baseline (Williams 1992, §4; the baseline an exponential moving
average of rewards), the PPO clipped ratio against the behaviour logprobs bounding each step."""

from __future__ import annotations

from serve_rft.trainer.algorithms.grpo import Grpo


class Reinforce(Grpo):
    """``A_i = r_i - b`` for every experience (groups ignored), PPO-clip loss."""

    name = "reinforce"
    filters_zero_variance = False  # no groups: nothing is ever without spread
    estimator = "baseline"

import math

import pytest
import torch

from serve_rft.trainer.algorithm import RunningBaseline, compute_advantages
from serve_rft.trainer.losses import ppo_clip_loss


def test_group_normalised_advantages():
    b = RunningBaseline()
    adv = compute_advantages([1.0, 0.0, 0.5, 0.5], ["g", "g", "g", "g"], b)
    rs = torch.tensor([1.0, 0.0, 0.5, 0.5])
    expected = (rs - rs.mean()) / (rs.std() + 1e-6)
    assert torch.allclose(adv, expected, atol=1e-5)
    assert abs(float(adv.sum())) < 1e-5


def test_singletons_use_running_baseline_from_before_the_batch():
    b = RunningBaseline(momentum=0.5)
    adv = compute_advantages([1.0], ["a"], b)
    assert float(adv[0]) == 1.0  # no baseline yet: b = 0
    assert b.value == 1.0
    adv = compute_advantages([0.0, 3.0], ["x", "y"], b)
    assert adv.tolist() == [-1.0, 2.0]
    assert b.value == pytest.approx(0.5 * (0.5 * 1.0 + 0.5 * 0.0) + 0.5 * 3.0)


def test_equal_rewards_in_a_group_give_zero_advantage():
    adv = compute_advantages([0.3, 0.3], ["g", "g"], RunningBaseline())
    assert adv.abs().max() < 1e-4


def test_ppo_loss_on_policy_is_minus_mean_advantage_and_grad_follows_advantage():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    behaviour = logp.detach().clone()
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = ppo_clip_loss(logp, behaviour, adv, mask)
    assert float(loss.detach()) == pytest.approx(-(1 + 1 - 1) / 3)
    loss.backward()
    # d loss / d logp = -A * ratio / n_tokens on real tokens, 0 on padding
    assert torch.allclose(logp.grad, torch.tensor([[-1 / 3, -1 / 3], [1 / 3, 0.0]]))
    assert stats["clip_fraction"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)


def test_ppo_clip_stops_gradient_outside_the_trust_region():
    behaviour = torch.tensor([[0.0]])
    logp = torch.tensor([[math.log(2.0)]], requires_grad=True)  # ratio 2 > 1 + clip_high
    loss, stats = ppo_clip_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.28)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.28)
    assert float(logp.grad.abs().sum()) == 0.0
    assert stats["clip_fraction"] == 1.0

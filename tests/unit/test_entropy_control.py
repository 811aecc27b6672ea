"""The entropy bonus's coefficient (`serve_rft.trainer.policy.entropy_control`): fixed, or
adaptive to ``trainer.entropy_target`` (Skywork-OR1, arXiv 2505.22312, "Adaptive Entropy
Control"), alone and inside `PolicyTrainer.step`."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from serve_rft.trainer.policy.entropy_control import EntropyControl


def test_fixed_is_the_configured_coefficient_whatever_the_entropy():
    ctl = EntropyControl(0.03)
    for h in (5.0, 0.0, math.nan, 0.001):
        assert ctl.coef() == 0.03
        ctl.update(h)
    assert ctl.coef() == 0.03


def test_adaptive_starts_off_then_grows_below_the_target_and_shrinks_above_it():
    ctl = EntropyControl(0.3, target=1.0, delta=0.1)
    assert ctl.coef() == 0.0  # no step seen yet: no bonus
    ctl.update(2.0)  # above: c stays at 0, no bonus
    assert (ctl.c, ctl.coef()) == (0.0, 0.0)
    for want in (0.1, 0.2, 0.3, 0.3):  # below: up by delta, never past the bound
        ctl.update(0.5)
        assert ctl.coef() == pytest.approx(want)
    ctl.update(1.0)  # at the target counts as above: c down one step and the gate shut
    assert ctl.c == pytest.approx(0.2) and ctl.coef() == 0.0
    ctl.update(math.nan)  # a step without tokens changes nothing
    assert ctl.c == pytest.approx(0.2) and ctl.coef() == 0.0
    ctl.update(0.9)
    assert ctl.coef() == pytest.approx(0.3)


@settings(max_examples=200, deadline=None)
@given(c_max=st.floats(0.0, 1.0), target=st.floats(0.01, 10.0), delta=st.floats(1e-4, 0.5),
       entropies=st.lists(st.one_of(st.floats(0.0, 12.0), st.just(math.nan)), max_size=60))
def test_the_coefficient_stays_in_its_bound_and_is_applied_only_below_the_target(c_max, target, delta, entropies):
    ctl = EntropyControl(c_max, target=target, delta=delta)
    last = None
    for h in entropies:
        before = ctl.c
        ctl.update(h)
        if math.isfinite(h):
            last = h
            want = min(c_max, max(0.0, before + (delta if h < target else -delta)))
            assert ctl.c == pytest.approx(want)
        else:
            assert ctl.c == before
        assert 0.0 <= ctl.coef() <= c_max
        if last is None or last >= target:
            assert ctl.coef() == 0.0
        else:
            assert ctl.coef() == ctl.c


def test_in_closed_loop_it_holds_an_entropy_that_would_collapse_near_the_target():
    """A simulated policy whose entropy falls 0.05 nats a step with no bonus and rises 10 nats
    per unit of coefficient: without control it reaches 0 in 40 steps; under the control it
    settles near the 0.5-nat target and stays there."""
    ctl = EntropyControl(0.05, target=0.5, delta=0.002)
    h, seen = 2.0, []
    for _ in range(400):
        h = max(0.0, h - 0.05 + 10.0 * ctl.coef())
        ctl.update(h)
        seen.append(h)
    assert min(seen[200:]) > 0.2 and max(seen[200:]) < 0.8
    assert abs(sum(seen[200:]) / 200 - 0.5) < 0.1


def test_bad_settings_are_refused():
    from pydantic import ValidationError

    from serve_rft.config.trainer import TrainerConfig

    with pytest.raises(ValueError):
        EntropyControl(-0.1)
    with pytest.raises(ValueError):
        EntropyControl(0.1, target=0.0, delta=0.1)
    with pytest.raises(ValueError):
        EntropyControl(0.1, target=1.0, delta=0.0)
    with pytest.raises(ValidationError, match="entropy_coef > 0"):
        TrainerConfig(entropy_target=0.5)
    for bad in ({"entropy_target": -1.0, "entropy_coef": 0.1}, {"entropy_target": 0.5, "entropy_coef": 0.1,
                                                                "entropy_coef_delta": 0.0}):
        with pytest.raises(ValidationError):
            TrainerConfig(**bad)
    assert TrainerConfig(entropy_target=0.5, entropy_coef=0.05).entropy_coef_delta == 0.001


def test_a_trainer_applies_the_adaptive_coefficient_step_by_step(embedded_model):
    """`PolicyTrainer.step` with the target above any entropy the model has (20 nats): the first
    step applies no bonus, each next one ``delta`` more up to the bound, and the loss moves by
    the coefficient times the step's token-mean entropy (lr 0: the policy does not change).
    Shown failing with the step applying ``trainer.entropy_coef`` instead of the control's."""
    from serve_rft.config import load_config
    from serve_rft.trainer.policy.policy import PolicyTrainer
    from tests.support.batches import small_batch

    sets = ["trainer.lr=0", "trainer.entropy_coef=0.25", "trainer.entropy_target=20",
            "trainer.entropy_coef_delta=0.1"]
    trainer = PolicyTrainer(load_config(None, sets), str(embedded_model))
    batch = small_batch()
    steps = [trainer.step(batch) for _ in range(4)]
    assert [s["entropy_coef"] for s in steps] == pytest.approx([0.0, 0.1, 0.2, 0.25])
    h = steps[0]["entropy"]
    assert 0 < h < 20 and all(s["entropy"] == pytest.approx(h, rel=1e-5) for s in steps)
    for s in steps[1:]:
        assert s["loss"] - steps[0]["loss"] == pytest.approx(-s["entropy_coef"] * h, rel=1e-4, abs=1e-6)

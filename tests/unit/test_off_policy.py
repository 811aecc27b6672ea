"""Bounded updates and off-policy correction (serve_rft/trainer/algorithms/losses.py, off_policy.py)
on hand-made batches, against values computed by hand. Each of these failed before the dual clip,
the log-ratio clamp, the k3 clamp and the off-policy modes existed (today's loss gave, for A = -1
at ratio 50, loss 50 and gradient 25 on that token; at log-ratio 100 a NaN)."""

import math

import pytest
import torch

from serve_rft.trainer.algorithms.losses import kl_k3, ppo_clip_loss
from serve_rft.trainer.algorithms.off_policy import policy_gradient_loss

CLIP = dict(clip_low=0.2, clip_high=0.28)


def _grad(ratios: list[float], adv: float, **kw):
    """(loss, d loss / d logp per token) of one answer whose tokens have ``ratios`` to behaviour."""
    logp = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    behaviour = torch.zeros_like(logp)
    mask = torch.ones_like(logp)
    loss, stats = ppo_clip_loss(logp, behaviour, torch.tensor([adv], dtype=torch.float64), mask, **CLIP,
                                agg="seq_mean_token_sum", **kw)
    loss.backward()
    return float(loss), logp.grad[0].tolist(), stats


def test_dual_clip_bounds_a_negative_advantage_token_whatever_its_ratio():
    # A = -1; ratios 0.5, 1, 50. Per token l = max(r, clip(r, 0.8, 1.28)) then min(., 3):
    # 0.5 -> max(0.5, 0.8) = 0.8 (clipped: no gradient); 1 -> 1 (gradient r = 1); 50 -> min(50, 3) = 3 (none)
    loss, grad, stats = _grad([0.5, 1.0, 50.0], -1.0, clip_ratio_c=3.0)
    assert loss == pytest.approx(0.8 + 1.0 + 3.0)
    assert grad == pytest.approx([0.0, 1.0, 0.0])
    assert stats["pg_clipfrac_lower"] == pytest.approx(1 / 3)
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    # without the dual clip the stale token steers: loss 50 and gradient 50 (d(r)/d logp = r)
    loss, grad, stats = _grad([0.5, 1.0, 50.0], -1.0, clip_ratio_c=None)
    assert loss == pytest.approx(0.8 + 1.0 + 50.0) and grad == pytest.approx([0.0, 1.0, 50.0])
    assert stats["pg_clipfrac_lower"] == 0.0


def test_dual_clip_leaves_positive_advantages_as_ppo():
    # A = +1: l = max(-r, -clip(r)): 0.5 -> -0.5 (gradient -0.5), 1 -> -1 (-1), 50 -> -1.28 (clipped)
    loss, grad, _ = _grad([0.5, 1.0, 50.0], 1.0, clip_ratio_c=3.0)
    assert loss == pytest.approx(-0.5 - 1.0 - 1.28)
    assert grad == pytest.approx([-0.5, -1.0, 0.0])


def test_the_log_ratio_is_clamped_so_no_token_makes_a_nan():
    # log-ratio 100 with A = 0 was exp(100) * 0: inf * 0 = NaN for the whole step
    logp = torch.tensor([[100.0, -100.0, 0.0]], requires_grad=True)
    for adv in (0.0, -1.0, 1.0):
        loss, stats = ppo_clip_loss(logp, torch.zeros_like(logp), torch.tensor([adv]), torch.ones_like(logp), **CLIP)
        loss.backward()
        assert math.isfinite(float(loss)) and torch.isfinite(logp.grad).all()
        assert stats["ratio_max"] == pytest.approx(math.exp(20), rel=1e-5)
        logp.grad = None


def test_k3_against_its_formula_and_its_clamps():
    logp = torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.5, -1.0, 15.0, -30.0], dtype=torch.float64)
    kl = kl_k3(logp, ref)
    d = ref.clamp(-20, 20)
    expect = (torch.exp(d) - d - 1).clamp(-10, 10)
    assert kl.tolist() == pytest.approx(expect.tolist())
    assert float(kl[0]) == pytest.approx(math.exp(0.5) - 1.5) and float(kl[2]) == 10.0  # exp(15) - 16 = 3.3e6 clamped
    kl.sum().backward()
    # d/dlogp (exp(d) - d - 1) = -(exp(d) - 1) inside the clamps; 0 where clamped
    assert logp.grad.tolist() == pytest.approx([-(math.exp(0.5) - 1), -(math.exp(-1.0) - 1), 0.0, 0.0])


# One fixed batch for every mode: two answers of 3 tokens, ratios pi/mu per token below, A = [+1, -1]
RATIOS = [[1.0, 1.5, 4.0], [0.9, 1.1, 0.2]]
ADV = [1.0, -1.0]


def _mode(mode: str, **kw):
    logp = torch.tensor([[math.log(r) for r in row] for row in RATIOS], dtype=torch.float64, requires_grad=True)
    behaviour = torch.zeros_like(logp)
    args = dict(clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0, is_cap=2.0, agg="token_mean", n_tokens=6.0,
                n_seqs=2.0)
    args.update(kw)
    loss, stats = policy_gradient_loss(mode, logp, behaviour, torch.tensor(ADV, dtype=torch.float64),
                                       torch.ones_like(logp), **args)
    loss.backward()
    return float(loss), logp.grad.flatten().tolist(), stats


def test_ppo_mode_on_the_fixed_batch():
    # answer 0 (A=+1): -1 (grad -1), -1.28 clipped (0), -1.28 clipped (0)
    # answer 1 (A=-1): 0.9 (grad 0.9), 1.1 (1.1), max(0.2, 0.8) = 0.8 clipped (0); all / 6 tokens
    loss, grad, stats = _mode("ppo")
    assert loss == pytest.approx((-1 - 1.28 - 1.28 + 0.9 + 1.1 + 0.8) / 6)
    assert grad == pytest.approx([-1 / 6, 0, 0, 0.9 / 6, 1.1 / 6, 0])
    assert stats["is_masked_fraction"] == 0.0 and stats["is_weight_max"] == pytest.approx(4.0)


def test_tis_mode_is_the_truncated_weight_times_the_policy_gradient():
    # weight min(r, 2): [1, 1.5, 2], [0.9, 1.1, 0.2]; loss -w A / 6 each; gradient -w A / 6
    loss, grad, stats = _mode("tis")
    w = [[1.0, 1.5, 2.0], [0.9, 1.1, 0.2]]
    assert loss == pytest.approx((-(1 + 1.5 + 2) + (0.9 + 1.1 + 0.2)) / 6)
    assert grad == pytest.approx([-x / 6 for x in w[0]] + [x / 6 for x in w[1]])
    assert stats["is_truncated_fraction"] == pytest.approx(1 / 6)


def test_mis_token_mode_drops_tokens_outside_the_bounds():
    # ratios 4 and 0.2 are outside [0.5, 2]: weight 0; the rest as ppo; normaliser still 6 tokens
    loss, grad, stats = _mode("mis_token")
    assert loss == pytest.approx((-1 - 1.28 + 0.9 + 1.1) / 6)
    assert grad == pytest.approx([-1 / 6, 0, 0, 0.9 / 6, 1.1 / 6, 0])
    assert stats["is_masked_fraction"] == pytest.approx(2 / 6)


def test_mis_sequence_mode_drops_whole_answers_by_the_geometric_mean_ratio():
    # geometric means: (1 * 1.5 * 4)^(1/3) = 1.817 (kept), (0.9 * 1.1 * 0.2)^(1/3) = 0.583 (kept) at
    # C=2; at C=1.75 ([0.571, 1.75]) the first is dropped whole
    loss, _, stats = _mode("mis_sequence")
    assert stats["is_masked_fraction"] == 0.0
    assert loss == pytest.approx(_mode("ppo")[0])
    loss, grad, stats = _mode("mis_sequence", is_cap=1.75)
    assert stats["is_masked_fraction"] == pytest.approx(0.5)
    assert loss == pytest.approx((0.9 + 1.1 + 0.8) / 6)
    assert grad == pytest.approx([0, 0, 0, 0.9 / 6, 1.1 / 6, 0])


def test_off_policy_sequence_masking_drops_stale_failures_only():
    # answer 1 (A = -1) has mean log(mu/pi) = -(ln .9 + ln 1.1 + ln .2) / 3 = 0.54 > 0.5: masked;
    # answer 0 (A = +1) is never masked however far it is
    loss, grad, stats = _mode("ppo", seq_mask_kl=0.5)
    assert stats["is_masked_fraction"] == pytest.approx(0.5)
    assert grad[3:] == [0.0, 0.0, 0.0] and grad[0] == pytest.approx(-1 / 6)
    _, grad, _ = _mode("ppo", seq_mask_kl=0.6)
    assert grad[3] == pytest.approx(0.9 / 6)


def test_unknown_mode_and_bad_cap_are_refused():
    with pytest.raises(ValueError, match="off-policy mode"):
        _mode("ppo2")
    with pytest.raises(ValueError, match="is_cap"):
        _mode("tis", is_cap=1.0)


def test_mismatch_and_drift_are_reported_apart_and_lags_bucketed():
    from serve_rft.trainer.policy.micro_batches import accumulate, finish
    from serve_rft.trainer.policy.objective import token_stats, token_versions
    from tests.support.experiences import experience

    # answer 0: 3 tokens of version 5 (the trainer's); answer 1: 2 tokens of version 4, 1 of version 1;
    # their lags in sync cycles (what the trainer's feed counts): 0, 1, 4
    LAGS = {5: 0, 4: 1, 1: 4}  # noqa: N806
    exps = [experience("c0", 0, versions=[(5, 0, 3)]), experience("c1", 0, versions=[(4, 0, 2), (1, 2, 3)])]
    versions = token_versions(exps, 4)
    assert versions.tolist() == [[5, 5, 5, -1], [4, 4, 1, -1]]
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 0]])
    behaviour = torch.zeros(2, 4)
    logp = torch.tensor([[0.01, -0.01, 0.0, 0.0], [0.5, 0.0, -1.0, 0.0]])
    totals: dict = {}
    accumulate(totals, token_stats(logp, behaviour, mask, versions, 5, LAGS, 0.2, 0.28), 6.0, 2, 6.0, 2.0)
    out = finish(totals)
    k3 = lambda x: math.exp(x) - 1 - x  # noqa: E731
    assert out["mismatch_k3"] == pytest.approx((k3(0.01) + k3(-0.01)) / 3, rel=1e-3)  # float32
    assert out["drift_k3"] == pytest.approx((k3(0.5) + k3(-1.0)) / 3)
    assert out["max_abs_mismatch"] == pytest.approx(0.01) and out["max_abs_drift"] == pytest.approx(1.0)
    # lag 0: 3 tokens, none clipped; lag 1: 2 tokens, exp(0.5) = 1.65 clipped; lag 4: 1 token, clipped
    assert out["clip_fraction_lag0"] == 0.0 and out["clip_fraction_lag1"] == 0.5
    assert out["clip_fraction_lag4p"] == 1.0 and "clip_fraction_lag2_3" not in out
    assert out["token_share_lag0"] == 0.5
    assert not any(k.startswith("sum_") for k in out)
    # a trainer that stepped since it published holds no served version: everything is drift
    out = finish(token_stats(logp, behaviour, mask, versions, None, LAGS, 0.2, 0.28))
    assert "mismatch_k3" not in out and out["drift_k3"] == pytest.approx(
        (k3(0.01) + k3(-0.01) + k3(0.5) + k3(-1.0)) / 6, rel=1e-5)


@pytest.mark.parametrize("dual_clip", [3.0, None])
def test_one_stale_token_does_not_steer_a_step_of_the_embedded_model(embedded_model, dual_clip):
    """A batch whose behaviour logprobs equal the trainer's (on-policy), and the same batch with
    one token of a failed answer sampled where ``pi / mu = 50`` (a stale sample): with the dual
    clip that token adds no gradient, so the gradient norm stays near the on-policy batch's;
    without it (the loss before the dual clip) that one token dominates the step."""
    from serve_rft.config import load_config
    from serve_rft.trainer.policy.policy import PolicyTrainer
    from serve_rft.trainer.policy.token_logprobs import response_logprobs
    from tests.support.batches import small_batch

    sets = ["trainer.lr=0", f"trainer.clip_ratio_c={dual_clip}" if dual_clip else "trainer.clip_ratio_c=null"]
    trainer = PolicyTrainer(load_config(None, sets), str(embedded_model))
    batch = small_batch()
    exps = [b.experience for b in batch]
    with torch.no_grad():
        logp, mask = response_logprobs(trainer.model, [e.prompt_token_ids for e in exps],
                                          [e.response_token_ids for e in exps], [1.0] * len(exps))
    for e, row, m in zip(exps, logp, mask):
        e.behaviour_logprobs = [float(x) for x, keep in zip(row, m) if keep]
    on_policy = trainer.step(batch)["grad_norm"]
    failed = next(e for b, e in zip(batch, exps) if b.reward == 0 and len(e.response_token_ids) == 1)
    failed.behaviour_logprobs[0] -= math.log(50.0)  # pi / mu = 50 on that token, A < 0
    stale = trainer.step(batch)
    if dual_clip:
        assert stale["grad_norm"] < 1.5 * on_policy and stale["pg_clipfrac_lower"] > 0
    else:
        assert stale["grad_norm"] > 3 * on_policy


def test_masked_tokens_stay_in_each_answers_length_under_seq_mean_token_mean():
    # one answer, 4 tokens at ratio 1, the last at ratio 4 (masked by mis_token): the 3 kept
    # tokens weigh 1/4 each, as under token_mean (not 1/3: survivors are not up-weighted)
    logp = torch.tensor([[0.0, 0.0, 0.0, math.log(4.0)]], dtype=torch.float64, requires_grad=True)
    for agg in ("token_mean", "seq_mean_token_mean"):
        loss, stats = policy_gradient_loss("mis_token", logp, torch.zeros_like(logp), torch.tensor([1.0], dtype=torch.float64),
                                           torch.ones_like(logp), clip_low=0.2, clip_high=0.28, clip_ratio_c=3.0,
                                           is_cap=2.0, agg=agg, n_tokens=4.0, n_seqs=1.0)
        assert float(loss) == pytest.approx(-0.75) and stats["is_masked_fraction"] == 0.25


@pytest.mark.parametrize("mode", ["ppo", "tis", "mis_token", "mis_sequence"])
def test_every_watchable_statistic_of_a_step_reaches_the_status_and_a_gauge(embedded_model, mode):
    """A step of the embedded model on answers of two versions (the one the trainer holds and an
    older one) in each ``off_policy`` mode: the mismatch and drift statistics and the mode's
    importance-weight statistics come out of the step, `Trainer.service_status` keeps them (its
    `STEP_STATS` filter) and `TrainerMetrics` sets one gauge each. Shown failing with
    ``mismatch_k3`` taken out of `STEP_GAUGES`: the step reported it, `STEP_STATS` lacked it."""
    from unittest import mock

    from serve_rft.config import load_config
    from serve_rft.observability import trainer_metrics
    from serve_rft.trainer.policy.policy import PolicyTrainer
    from tests.support.batches import small_batch

    trainer = PolicyTrainer(load_config(None, ["trainer.lr=0", f"trainer.off_policy={mode}"]), str(embedded_model))
    batch = small_batch()
    for b in batch[3:]:  # the second group sampled by version 1, the trainer holds version 2
        b.experience.token_versions = [(1, 0, len(b.experience.response_token_ids))]
    for b in batch[:3]:
        b.experience.token_versions = [(2, 0, len(b.experience.response_token_ids))]
    stats = trainer.step(batch, held_version=2, version_lags={2: 0, 1: 1})
    watched = {"mismatch_k3", "max_abs_mismatch", "drift_k3", "max_abs_drift", "clip_fraction_lag0",
               "clip_fraction_lag1", "grad_norm", "entropy", "entropy_coef"}
    watched |= {"ppo": {"approx_kl"}, "tis": {"is_weight_mean", "is_weight_max", "is_truncated_fraction"}}.get(
        mode, {"approx_kl", "is_weight_mean", "is_weight_max", "is_masked_fraction"})  # tis: no PPO ratio
    assert watched <= {k for k, v in stats.items() if isinstance(v, float) and math.isfinite(v)}, watched - set(stats)
    assert watched <= set(trainer_metrics.STEP_STATS)

    set_values: dict[str, float] = {}

    class Recorder:
        def __init__(self, name, description="", boundaries=None, tag_keys=()):
            self.name = name

        def set(self, value, tags=None):
            set_values[self.name] = value

        def inc(self, value=1.0, tags=None):
            pass

        def observe(self, value, tags=None):
            pass

    with mock.patch.multiple(trainer_metrics, Counter=Recorder, Gauge=Recorder, Histogram=Recorder):
        trainer_metrics.TrainerMetrics().step(stats)
    for stat in watched:
        assert set_values[trainer_metrics.STEP_GAUGES[stat][0]] == pytest.approx(stats[stat]), stat

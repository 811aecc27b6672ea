import math

import pytest
import torch

from serve_rft.trainer.algorithms.advantages import RunningBaseline, compute_advantages, group_advantages
from serve_rft.trainer.algorithms.losses import ppo_clip_loss
from serve_rft.types import GroupReward
from tests.support.tiny_lm import PROMPTS, RESPONSES, TEMPS, TOP_PS, tiny_causal_lm


def test_group_normalised_advantages():
    b = RunningBaseline()
    adv = compute_advantages([1.0, 0.0, 0.5, 0.5], ["g", "g", "g", "g"], b)
    rs = torch.tensor([1.0, 0.0, 0.5, 0.5])
    expected = (rs - rs.mean()) / (rs.std() + 1e-6)
    assert torch.allclose(adv, expected, atol=1e-5)
    assert abs(float(adv.sum())) < 1e-5


def test_singletons_use_running_baseline_from_before_the_batch():
    b = RunningBaseline(momentum=0.5)
    adv = compute_advantages([1.0], ["a"], b, scale="none")
    assert float(adv[0]) == 1.0  # no baseline yet: b = 0
    assert b.value == 1.0
    adv = compute_advantages([0.0, 3.0], ["x", "y"], b, scale="none")
    assert adv.tolist() == [-1.0, 2.0]
    assert b.value == pytest.approx(0.5 * (0.5 * 1.0 + 0.5 * 0.0) + 0.5 * 3.0)


def test_equal_and_near_equal_rewards_in_a_group_give_exactly_zero_and_are_counted():
    # before: +-1.4e-11 for equal rewards, and up to 1.25 for [0, 0, 0, 1e-5] (noise amplified)
    for rewards in ([0.3, 0.3], [0.0, 0.0, 0.0, 1e-5]):
        made = group_advantages(rewards, ["g"] * len(rewards), RunningBaseline())
        assert made.values.tolist() == [0.0] * len(rewards) and made.zero_variance_groups == 1


def test_singletons_are_scaled_like_group_members():
    """With rewards in [0, 10] a singleton's r - b was in reward units while group members got
    z-scores (7x the weight); under scale_rewards=group it is divided by the running std."""
    b = RunningBaseline(momentum=0.5)
    b.update([0.0, 10.0])  # value 0.5 * 0 + 0.5 * 10 = 5; var starts at the second: (10 - 0)^2 = 100
    assert b.value == 5.0 and b.std == 10.0
    made = group_advantages([10.0, 0.0, 10.0, 0.0, 10.0], ["s", "g", "g", "g", "g"], b)
    rs = [0.0, 10.0, 0.0, 10.0]
    z = (10.0 - 5.0) / (_std(rs) + 1e-6)
    assert made.values.tolist() == pytest.approx([(10.0 - 5.0) / 10.0, -z, z, -z, z], rel=1e-5)
    assert group_advantages([10.0, 0.0, 10.0, 0.0, 10.0], ["s", "g", "g", "g", "g"], RunningBaseline(0.5),
                            scale="none").values.tolist() == [10.0, -5.0, 5.0, -5.0, 5.0]  # b = 0 at start


def test_batch_scale_divides_everyone_by_the_batch_std():
    rewards = [1.0, 0.0, 0.0, 0.0, 2.0]
    made = group_advantages(rewards, ["g"] * 4 + ["s"], RunningBaseline(), scale="batch")
    s = _std(rewards)
    assert made.values.tolist() == pytest.approx([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 2.0 / s], rel=1e-5)


def test_the_stores_group_statistics_win_over_the_members_in_the_batch():
    """A group rewarded [1, 0, 0, 0] read 3 + 1 or 1 + 3 gets the whole group's advantages, as when
    read whole (before: [1.155, -0.577, -0.577] + [-0.445], or [0.5] + [0, 0, 0])."""
    whole = GroupReward(size=4, mean=0.25, std=0.5)
    expected = [1.5, -0.5, -0.5, -0.5]
    for split in (3, 1):
        b = RunningBaseline()
        got = []
        for part in ([1.0, 0.0, 0.0, 0.0][:split], [1.0, 0.0, 0.0, 0.0][split:]):
            got += group_advantages(part, ["g"] * len(part), b, [whole] * len(part)).values.tolist()
        assert got == pytest.approx(expected, rel=1e-5)


def _std(xs):
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


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


# --- the chunked logprobs (serve_rft/trainer/policy/token_logprobs.py) against the full-logits path ---

def _run(model, impl: str, chunk: int = 3, top_ps=TOP_PS):
    """Logprobs, mask, entropy, and the gradients of ``sum(logp * adv * mask)`` by parameter name."""
    from serve_rft.trainer.policy.token_logprobs import response_logprobs

    model.zero_grad(set_to_none=True)
    lp, mask, ent = response_logprobs(model, PROMPTS, RESPONSES, TEMPS, with_entropy=True, top_ps=top_ps,
                                      chunk_tokens=chunk, impl=impl)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0, 0.3]).unsqueeze(1)
    (lp * adv * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), mask, ent, grads


@pytest.mark.parametrize("kind", ["qwen2", "llama_tied", "lora"])
@pytest.mark.parametrize("chunk", [3, 1024])
def test_chunked_logprobs_and_gradients_equal_the_full_logits_path(kind, chunk):
    from serve_rft.trainer.policy.token_logprobs import lm_parts

    model = tiny_causal_lm(kind)
    assert lm_parts(model) is not None  # the chunked path is really taken
    lp, mask, ent, grads = _run(model, "chunked", chunk)
    ref_lp, ref_mask, ref_ent, ref_grads = _run(model, "full")
    assert torch.equal(mask, ref_mask) and mask.sum() == sum(len(r) for r in RESPONSES)
    assert torch.allclose(lp, ref_lp, atol=1e-5, rtol=0)
    assert torch.allclose(ent, ref_ent, atol=1e-5, rtol=0)
    assert float((lp * (1 - mask)).abs().sum()) == 0.0 and float((ent * (1 - mask)).abs().sum()) == 0.0
    assert grads.keys() == ref_grads.keys() and grads
    if kind == "lora":
        assert all("lora_" in n for n in grads)  # the frozen head gets no gradient at all
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-5, rtol=1e-4), name
    # the nucleus masks dropped words (top_p < 1 changes the logprobs) and the sampled token kept
    untruncated = _run(model, "chunked", chunk, top_ps=None)[0]
    assert (lp - untruncated)[[2, 3, 4]].abs().max() > 1e-3 and torch.isfinite(lp).all()


@pytest.mark.parametrize("kind", ["qwen2", "llama_tied", "lora"])
@pytest.mark.parametrize("chunk", [3, 1024])
def test_the_entropy_bonus_gradient_of_the_chunked_path_equals_autograd_of_the_full_path(kind, chunk):
    """``trainer.entropy_coef``: the chunked backward's ``dH/dz = -p (log p + H)`` (masked words
    0) gives the gradients autograd takes through the full path's log-softmax entropy, nucleus
    masks included; without ``entropy_grad`` the entropy carries no graph. Shown to fail with the
    entropy term left out of the chunked backward (the gradients differ by the bonus)."""
    from serve_rft.trainer.policy.token_logprobs import response_logprobs

    model = tiny_causal_lm(kind)
    weights = torch.tensor([0.5, -1.0, 2.0, 1.5, 0.7]).unsqueeze(1)  # per answer; a negative one too

    def grads(impl):
        model.zero_grad(set_to_none=True)
        lp, mask, ent = response_logprobs(model, PROMPTS, RESPONSES, TEMPS, with_entropy=True, top_ps=TOP_PS,
                                          chunk_tokens=chunk, impl=impl, entropy_grad=True)
        ((0.3 * lp + ent * weights) * mask).sum().backward()
        return ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ent, got = grads("chunked")
    ref_ent, want = grads("full")
    assert torch.allclose(ent, ref_ent, atol=1e-5) and float(ent.sum()) > 0
    assert got.keys() == want.keys() and got
    for name, g in got.items():
        assert torch.allclose(g, want[name], atol=1e-5, rtol=1e-4), name
    for impl in ("chunked", "full"):
        _, _, plain = response_logprobs(model, PROMPTS, RESPONSES, TEMPS, with_entropy=True, top_ps=TOP_PS,
                                        chunk_tokens=chunk, impl=impl)
        assert not plain.requires_grad, impl


def test_the_entropy_bonus_lowers_the_loss_by_its_weight_and_a_step_raises_the_entropy():
    """``trainer.entropy_coef = 0.5`` with every advantage 0: the micro-batch loss is ``-0.5 x``
    the token-mean entropy, and one SGD step along its gradient raises the entropy."""
    from types import SimpleNamespace
    from contextlib import nullcontext

    from serve_rft.config.trainer import TrainerConfig
    from serve_rft.trainer.algorithms import get_algorithm
    from serve_rft.trainer.policy.objective import micro_batch_loss

    model = tiny_causal_lm("qwen2")
    exps = [SimpleNamespace(prompt_token_ids=p, response_token_ids=r, behaviour_logprobs=[0.0] * len(r),
                            sampling=SimpleNamespace(temperature=1.0, top_p=1.0), token_versions=[(0, 0, len(r))])
            for p, r in zip(PROMPTS, RESPONSES)]
    n_tokens = float(sum(len(r) for r in RESPONSES))

    def loss_of(coef):
        cfg = TrainerConfig(entropy_coef=coef)
        return micro_batch_loss(cfg, get_algorithm(cfg), model, None, 0, nullcontext, exps,
                                torch.zeros(len(exps)), [0.0] * len(exps), None, n_tokens, float(len(exps)))

    base, stats, _ = loss_of(0.0)
    loss, stats, _ = loss_of(0.5)
    assert float(loss - base) == pytest.approx(-0.5 * stats["entropy"], rel=1e-5)
    model.zero_grad(set_to_none=True)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    assert loss_of(0.5)[1]["entropy"] > stats["entropy"]


def test_lora_reference_with_the_adapter_disabled_is_the_base():
    from serve_rft.trainer.policy.token_logprobs import response_logprobs

    model = tiny_causal_lm("lora")
    with torch.no_grad():
        on, _ = response_logprobs(model, PROMPTS, RESPONSES, TEMPS, top_ps=TOP_PS, chunk_tokens=4)
        with model.disable_adapter():
            off, _ = response_logprobs(model, PROMPTS, RESPONSES, TEMPS, top_ps=TOP_PS, chunk_tokens=4)
            full, _ = response_logprobs(model, PROMPTS, RESPONSES, TEMPS, top_ps=TOP_PS, impl="full")
    assert torch.allclose(off, full, atol=1e-5) and (on - off).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["qwen2", "llama_tied", "lora"])
def test_chunked_under_bf16_autocast_matches_the_full_path(kind):
    """policy.py runs the logprobs under bf16 autocast: the head's matmul runs in bf16 in both
    paths (logits rounded to bf16, then fp32), so the logprobs agree to fp32 rounding; the
    gradients to bf16 rounding."""
    model = tiny_causal_lm(kind)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, mask, ent, grads = _run(model, "chunked", 3)
        ref_lp, _, ref_ent, ref_grads = _run(model, "full")
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all()
    assert torch.allclose(lp, ref_lp, atol=1e-4) and torch.allclose(ent, ref_ent, atol=1e-4)
    for name, g in grads.items():  # bf16 matmul gradients: the chunks' sum is kept in fp32 here
        assert g.dtype == torch.float32
        assert torch.allclose(g, ref_grads[name], atol=0.02 * float(ref_grads[name].abs().max()) + 1e-6), name


def test_all_empty_responses_and_an_empty_prompt():
    from serve_rft.trainer.policy.token_logprobs import response_logprobs

    model = tiny_causal_lm("qwen2")
    lp, mask, ent = response_logprobs(model, [[1, 2], [3]], [[], []], [1.0, 1.0], with_entropy=True)
    assert lp.shape == mask.shape == ent.shape == (2, 1) and float(mask.sum()) == 0.0
    with pytest.raises(ValueError, match="prompt token"):
        response_logprobs(model, [[]], [[5]], [1.0])


def test_models_without_the_plain_structure_take_the_full_path():
    from serve_rft.trainer.policy.token_logprobs import response_logprobs
    from serve_rft.trainer.policy.token_logprobs import lm_parts

    model = tiny_causal_lm("qwen2")
    model.lm_head = torch.nn.Linear(32, 97, bias=True)  # a head with a bias: not lm_head(h) = h @ W.T
    assert lm_parts(model) is None
    with torch.no_grad():
        got = response_logprobs(model, PROMPTS, RESPONSES, TEMPS, top_ps=TOP_PS)
        ref = response_logprobs(model, PROMPTS, RESPONSES, TEMPS, top_ps=TOP_PS, impl="full")
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_per_row_top_p_is_the_single_value_rule():
    from serve_rft.trainer.policy.nucleus import top_p_keep

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=g) * 3
    ps = torch.tensor([0.3, 0.5, 0.7, 0.9, 0.95, 0.99])
    rows = top_p_keep(logits, ps)
    for i, p in enumerate(ps.tolist()):
        assert torch.equal(rows[i], top_p_keep(logits[i : i + 1], p)[0])


def test_a_trainer_step_is_the_same_with_either_logprob_impl(embedded_model):
    """`PolicyTrainer` (trainer.logprob_impl): loss, statistics and every gradient agree, with
    the KL reference pass, mixed temperatures and top_p, and chunks smaller than the batch."""
    from serve_rft.config import load_config
    from serve_rft.trainer.policy.policy import PolicyTrainer
    from serve_rft.types import Experience, RewardedExperience, SamplingInfo

    batch = [RewardedExperience(
        experience=Experience(completion_id=f"c{i // 2}", choice_index=i % 2, group_id=f"c{i // 2}",
                              replica_id="r", prompt_token_ids=[1, 2, 3 + i], response_token_ids=r,
                              behaviour_logprobs=[-6.5] * len(r), token_versions=[(0, 0, len(r))],
                              sampling=SamplingInfo(temperature=TEMPS[i], top_p=TOP_PS[i], max_tokens=8),
                              finish_reason="length"),
        reward=float(i % 2), stream_id=f"0-{i}") for i, r in enumerate(RESPONSES)]
    sets = ["trainer.lr=0", "trainer.kl_coef=0.1", "trainer.logprob_chunk_tokens=4"]
    full = PolicyTrainer(load_config(None, sets + ["trainer.logprob_impl=full"]), str(embedded_model))
    chunked = PolicyTrainer(load_config(None, sets), str(embedded_model))
    a, b = full.step(batch), chunked.step(batch)
    for k in ("loss", "entropy", "kl_ref", "max_abs_logprob_diff", "grad_norm"):
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    for x, y in zip(full.model.parameters(), chunked.model.parameters()):
        assert torch.allclose(x.grad, y.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("vocab", [8, 97, 1024])
def test_nucleus_masks_survive_bit_packing(vocab):
    from serve_rft.trainer.policy.token_logprobs import _pack, _unpack

    keep = torch.rand(5, vocab, generator=torch.Generator().manual_seed(vocab)) < 0.3
    packed = _pack(keep)
    assert packed.dtype == torch.uint8 and packed.shape == (5, (vocab + 7) // 8)
    assert torch.equal(_unpack(packed, vocab), keep)


def test_a_singleton_after_a_plateau_is_clipped_not_blown_up():
    """A plateau of equal rewards shrinks the running spread (std 0.005 after 100 zeros): a
    singleton rewarded 1 would get A = 193 and steer the step; it is clipped at 3."""
    b = RunningBaseline()
    b.update([0.0, 1.0] + [0.0] * 100)
    assert b.std < 0.01
    assert group_advantages([1.0], ["s"], b).values.tolist() == [3.0]


def test_a_late_member_of_a_group_without_spread_is_scored_as_a_singleton():
    """The group's first release was [1, 1] (std 0): members with the same reward get 0; a late
    member rewarded 0 is not silenced with A = 0, it is compared with the running baseline."""
    flat = GroupReward(size=2, mean=1.0, std=0.0)
    b = RunningBaseline(momentum=0.5)
    b.update([1.0, 0.0])  # baseline 0.5, spread 1
    made = group_advantages([1.0, 0.0], ["g", "g"], b, [flat, flat])
    assert made.values.tolist() == [0.0, -0.5]


def test_filter_zero_variance_leaves_groups_without_spread_out_of_the_step(embedded_model):
    """trainer.filter_zero_variance (DAPO's dynamic sampling, arXiv 2503.14476, §3.2): a step on a
    group rewarded [1, 1, 1] (no spread) and two groups rewarded [0, 1, 2] has the loss and every
    gradient of a step on the two groups alone (the group without spread does not dilute the
    token-mean normaliser), counts the three left out, and keeps them in ``batch_size``; without
    the filter the same batch's gradient differs. A batch of only such groups trains whole.
    Shown to fail with the filter ignored (``kept`` always empty in `PolicyTrainer.step`): the
    three were not counted (``assert 0 == 3``): the whole batch was trained."""
    from serve_rft.config import load_config
    from serve_rft.trainer.policy.policy import PolicyTrainer
    from tests.support.batches import small_batch

    flat = [b.model_copy(update={"reward": 1.0}) for b in small_batch(1, 3)]
    spread = small_batch(0, 6)
    sets = ["trainer.lr=0", "trainer.kl_coef=0.1"]
    on = PolicyTrainer(load_config(None, sets + ["trainer.filter_zero_variance=true"]), str(embedded_model))
    alone = PolicyTrainer(load_config(None, sets), str(embedded_model))
    a, b = on.step(flat + spread), alone.step(spread)
    assert a["zero_variance_filtered"] == 3 and a["zero_variance_groups"] == 1 and a["batch_size"] == 9, a
    assert b["zero_variance_filtered"] == 0
    for k in ("loss", "entropy", "kl_ref", "grad_norm"):
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k
    for x, y in zip(on.model.parameters(), alone.model.parameters()):
        if x.grad is not None:
            assert torch.allclose(x.grad, y.grad, rtol=1e-4, atol=1e-7)
    alone.optimizer.zero_grad(set_to_none=True)
    c = alone.step(flat + spread)
    assert c["loss"] != pytest.approx(a["loss"], rel=1e-3), (c["loss"], a["loss"])
    only_flat = on.step(flat)
    assert only_flat["zero_variance_filtered"] == 0 and only_flat["batch_size"] == 3


@pytest.mark.parametrize("algorithm", ["opmd_kimi", "reinforce"])
def test_filter_zero_variance_is_refused_where_it_does_not_apply(algorithm):
    """opmd_kimi's consistency term has a gradient at advantage 0, reinforce has no groups: the
    filter would change the one's objective and do nothing for the other."""
    from serve_rft.config import load_config
    from serve_rft.trainer.algorithms import get_algorithm

    cfg = load_config(None, [f"trainer.algorithm={algorithm}", "trainer.filter_zero_variance=true"])
    with pytest.raises(ValueError, match="filter_zero_variance does not apply"):
        get_algorithm(cfg.trainer)
    assert get_algorithm(load_config(None, ["trainer.algorithm=opmd", "trainer.filter_zero_variance=true"]).trainer)

"""The policy losses and their aggregation (serve_rft/trainer/algorithms/), the algorithm registry,
and the trainer's micro-batching, LR schedule and dummy mode."""

import math

import pytest
import torch

from serve_rft.config import Config
from serve_rft.trainer.algorithms.advantages import RunningBaseline, compute_advantages
from serve_rft.trainer.algorithms.losses import aggregate, kl_k3, ppo_clip_loss
from serve_rft.trainer.algorithms.opmd import opmd_loss
from serve_rft.trainer.algorithms.opmd_kimi import group_tau_log_z, opmd_kimi_loss
from tests.support.batches import small_batch

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])


def test_aggregations():
    assert float(aggregate(PER_TOKEN, MASK, "token_mean", 4, 2)) == pytest.approx(10 / 4)
    assert float(aggregate(PER_TOKEN, MASK, "seq_mean_token_mean", 4, 2)) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(PER_TOKEN, MASK, "seq_mean_token_sum", 4, 2)) == pytest.approx((6 + 4) / 2)
    with pytest.raises(ValueError):
        aggregate(PER_TOKEN, MASK, "nope", 4, 2)


def test_split_batches_with_batch_normalisers_sum_to_the_whole():
    logp = torch.randn(2, 3, requires_grad=True)
    behaviour = logp.detach() + 0.05 * torch.randn(2, 3)
    adv = torch.tensor([1.0, -0.5])
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        whole, _ = ppo_clip_loss(logp, behaviour, adv, MASK, agg=agg)
        parts = sum(ppo_clip_loss(logp[i:i + 1], behaviour[i:i + 1], adv[i:i + 1], MASK[i:i + 1], agg=agg,
                                  n_tokens=4, n_seqs=2)[0] for i in range(2))
        assert float(whole.detach()) == pytest.approx(float(parts.detach()), abs=1e-6)


def test_opmd_gradient_is_the_group_mean_policy_gradient_scaled_by_1_over_1_plus_tau():
    """Seed 002 A.3: grad J = -1/(1+tau) sum_i (r_i - rbar) grad log pi(y_i|x)."""
    rewards = [1.0, 0.0, 0.5, 0.5]
    adv = compute_advantages(rewards, ["g"] * 4, RunningBaseline(), estimator="group_mean")
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    logp = torch.randn(4, 2, requires_grad=True)
    mask = torch.ones(4, 2)
    tau = 3.0
    loss, _ = opmd_loss(logp, adv, mask, tau)
    loss.backward()
    expected = -(adv / (1 + tau) / 4).unsqueeze(1).expand(4, 2)  # per token of log pi(y|x) = sum_t
    assert torch.allclose(logp.grad, expected)


def test_opmd_kimi_residual_is_zero_at_the_optimum_and_its_gradient_at_the_reference():
    """Seed 002 A.1: with pi_theta = pi_ref the residual is r_i - tau log Z_hat; the optimum
    pi* = pi_ref * exp(r / tau) / Z has residual 0."""
    tau = 0.5
    rewards = [1.0, 0.0, 0.2]
    tlz = group_tau_log_z(rewards, ["g"] * 3, tau)
    expected = tau * math.log(sum(math.exp(r / tau) for r in rewards) / 3)
    assert tlz.tolist() == pytest.approx([expected] * 3)
    r = torch.tensor(rewards)
    ref = torch.tensor([-3.0, -2.0, -4.0])
    optimum = ref + (r - tlz) / tau
    loss, _ = opmd_kimi_loss(optimum, ref, r, tlz, tau)
    assert float(loss) == pytest.approx(0.0, abs=1e-10)
    at_ref = ref.clone().requires_grad_(True)
    loss, _ = opmd_kimi_loss(at_ref, ref, r, tlz, tau)
    loss.backward()
    assert torch.allclose(at_ref.grad, -2 * tau * (r - tlz) / 3)


def test_baseline_estimator_ignores_groups_and_k3_kl():
    b = RunningBaseline(momentum=0.5)
    b.value = 1.0
    adv = compute_advantages([2.0, 0.0], ["g", "g"], b, estimator="baseline", scale="none")
    assert adv.tolist() == [1.0, -1.0]
    x = torch.tensor([[-1.0, -2.0]])
    assert float(kl_k3(x, x).abs().max()) == 0.0
    assert float(kl_k3(x, x - 0.3).min()) > 0.0


def _params(p):
    return [t.detach().clone() for t in p.model.parameters()]


@pytest.mark.parametrize("algorithm", ["grpo", "opmd", "opmd_kimi", "reinforce"])
def test_micro_batches_give_the_whole_batch_gradient(embedded_model, algorithm):
    from serve_rft.trainer.policy.policy import PolicyTrainer

    sets = [f"trainer.algorithm={algorithm}", "trainer.kl_coef=0.1", "trainer.lr=0"]  # compare grads
    from serve_rft.config import load_config

    whole = PolicyTrainer(load_config(None, sets), str(embedded_model))
    split = PolicyTrainer(load_config(None, sets + ["trainer.micro_batch_size=2"]), str(embedded_model))
    a, b = whole.step(small_batch()), split.step(small_batch())
    assert b["micro_batches"] == 3 and a["micro_batches"] == 1
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    for x, y in zip(whole.model.parameters(), split.model.parameters()):
        assert torch.allclose(x.grad, y.grad, rtol=1e-4, atol=1e-7)
    assert a["entropy"] > 0 and "kl_ref" in a


def test_lr_schedule_and_dummy_mode(embedded_model):
    from serve_rft.config import load_config
    from serve_rft.trainer.policy.policy import PolicyTrainer

    p = PolicyTrainer(load_config(None, ["trainer.lr_warmup_steps=4", "trainer.lr_schedule=cosine",
                                         "trainer.lr_decay_steps=10", "trainer.lr_min_ratio=0.1"]),
                      str(embedded_model))
    assert [p._lr_factor(s) for s in (0, 3)] == [0.25, 1.0]
    assert p._lr_factor(4 + 5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert p._lr_factor(4 + 10) == pytest.approx(0.1) == p._lr_factor(100)
    lrs = [p.step(small_batch(k))["lr"] for k in range(3)]
    assert lrs == pytest.approx([0.25e-3, 0.5e-3, 0.75e-3])

    dummy = PolicyTrainer(load_config(None, ["trainer.lr=0"]), str(embedded_model))
    before = _params(dummy)
    stats = dummy.step(small_batch())
    assert stats["grad_norm"] > 0  # all the work was done
    assert all(torch.equal(x, y) for x, y in zip(before, _params(dummy)))  # with fixed weights


def test_registry_finds_every_algorithm_with_its_defaults_and_settings():
    import pydantic

    from serve_rft.config import load_config
    from serve_rft.control import preflight
    from serve_rft.trainer.algorithms import algorithm_names, get_algorithm

    assert algorithm_names() == ["grpo", "opmd", "opmd_kimi", "reinforce"]
    assert get_algorithm(Config().trainer).aggregation == "token_mean"
    opmd = get_algorithm(load_config(None, ["trainer.algorithm=opmd", "trainer.algorithm_args.tau=0.5"]).trainer)
    assert opmd.aggregation == "seq_mean_token_sum" and opmd.settings.tau == 0.5
    assert get_algorithm(load_config(None, ["trainer.algorithm=opmd", "trainer.loss_agg=token_mean"]).trainer
                         ).aggregation == "token_mean"
    kimi_tau_0 = load_config(None, ["trainer.algorithm=opmd_kimi", "trainer.algorithm_args.tau=0"])
    with pytest.raises(pydantic.ValidationError, match="tau"):
        get_algorithm(kimi_tau_0.trainer)
    with pytest.raises(ValueError, match="algorithm_args of opmd_kimi"):
        preflight(kimi_tau_0)
    with pytest.raises(ValueError, match="choose one of grpo, opmd, opmd_kimi, reinforce"):
        preflight(load_config(None, ["trainer.algorithm=ppo2"]))
    with pytest.raises(pydantic.ValidationError):  # grpo has no settings: a typo is an error
        get_algorithm(load_config(None, ["trainer.algorithm_args.tua=1"]).trainer)


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.9, 0.99])
def test_top_p_keeps_exactly_what_vllms_sampler_keeps(top_p):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from serve_rft.trainer.policy.nucleus import top_p_keep

    g = torch.Generator().manual_seed(int(top_p * 100))
    logits = torch.randn(16, 500, generator=g) * 3
    theirs = apply_top_k_top_p_pytorch(logits.clone(), None, torch.full((16,), top_p), allow_cpu_sync=True)
    assert torch.equal(top_p_keep(logits, top_p), theirs > float("-inf"))


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.9, 0.99])
@pytest.mark.parametrize("k", [8, 64, 5000])
def test_nucleus_without_a_full_sort_keeps_what_vllms_sampler_keeps(top_p, k):
    """`nucleus_keep` (a top-k, the full sort only for rows whose nucleus reaches past k): the
    same masks as vLLM's sort on peaked and flat rows (its cumulative sums are rounded
    differently; on these 3 x 64 rows x 5,000 words no word falls on the other side)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from serve_rft.trainer.policy.nucleus import nucleus_keep

    g = torch.Generator().manual_seed(int(top_p * 100) + k)
    logits = torch.randn(64, 5000, generator=g) * torch.tensor([1.0, 3.0, 8.0, 12.0]).repeat(16).unsqueeze(1)
    ps = torch.full((64,), top_p)
    theirs = apply_top_k_top_p_pytorch(logits.clone(), None, ps, allow_cpu_sync=True) > float("-inf")
    assert torch.equal(nucleus_keep(logits, ps, k), theirs)
    assert torch.equal(nucleus_keep(logits, top_p, k), theirs)


def test_only_response_tokens_are_in_the_mask(embedded_model):
    """Each experience's prompt (for a multi-turn conversation: every earlier turn, user and
    assistant) is context only; the mask covers exactly its own response tokens."""
    from transformers import AutoModelForCausalLM

    from serve_rft.trainer.policy.token_logprobs import response_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(embedded_model), dtype=torch.float32)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2]]
    responses = [[9, 10], [11, 12, 13, 14]]
    lp, mask = response_logprobs(model, prompts, responses, [1.0, 1.0])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert float(lp[0, 2:].abs().sum()) == 0.0
    # the response logprobs do not depend on what comes after them in the padded batch
    alone, _ = response_logprobs(model, prompts[:1], responses[:1], [1.0])
    assert torch.allclose(alone[0, :2], lp[0, :2], atol=1e-5)


def test_bf16_autocast_trains_with_fp32_weights(embedded_model):
    """trainer.precision=bf16 (auto picks it on CUDA; exercised here on CPU autocast): forward
    passes in bf16, weights and optimizer in fp32, statistics close to the fp32 run's."""
    from serve_rft.config import load_config
    from serve_rft.trainer.policy.policy import PolicyTrainer

    fp32 = PolicyTrainer(load_config(None, ["trainer.lr=0.001"]), str(embedded_model))
    bf16 = PolicyTrainer(load_config(None, ["trainer.lr=0.001", "trainer.precision=bf16"]), str(embedded_model))
    assert not fp32.bf16 and bf16.bf16
    before = _params(bf16)
    a, b = fp32.step(small_batch()), bf16.step(small_batch())
    assert math.isfinite(b["loss"]) and b["grad_norm"] > 0
    assert b["max_abs_logprob_diff"] == pytest.approx(a["max_abs_logprob_diff"], abs=0.1)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=0.1)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert any(not torch.equal(x, y) for x, y in zip(_params(bf16), before))  # it trained

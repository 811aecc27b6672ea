"""The trainer never applies, publishes or saves a non-finite update (`serve_rft.trainer.policy.finite`).

A finite reward beyond float32's range (1e39) on a singleton: its advantage ``r - b`` is cast to
float32 (inf), and one applied step turns every parameter and AdamW moment into NaN, the running
baseline into ~1e38, and the saved state carries both into every restart. The step must be
skipped with everything left as it was."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from serve_rft.config import Config, load_config
from serve_rft.trainer.algorithms.advantages import RunningBaseline
from serve_rft.trainer.policy.finite import NonFiniteState
from serve_rft.trainer.policy.policy import PolicyTrainer
from serve_rft.trainer.publishing.state import latest_state, published_floor, save_state
from serve_rft.types import Experience, RewardedExperience, SamplingInfo


def _single(cid: str, reward: float, resp=(10, 20, 30)) -> RewardedExperience:
    """A singleton (its own group, as most online traffic)."""
    return RewardedExperience(
        experience=Experience(completion_id=cid, choice_index=0, group_id=cid, replica_id="r",
                              prompt_token_ids=[1, 2, 3], response_token_ids=list(resp),
                              behaviour_logprobs=[-3.0, -2.5, -4.0][: len(resp)], token_versions=[(0, 0, len(resp))],
                              sampling=SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=3),
                              finish_reason="length"),
        reward=reward, stream_id=f"{cid}-0")


def _snapshot(p: PolicyTrainer) -> dict:
    """Weights, AdamW state, LR schedule and running baseline: everything a step may change."""
    adam = {f"{n}.{k}": v.detach().clone() for n, t in p.model.named_parameters()
            for k, v in p.optimizer.state.get(t, {}).items() if torch.is_tensor(v)}
    return {"params": {n: t.detach().clone() for n, t in p.model.named_parameters()}, "adam": adam,
            "sched": p.scheduler.state_dict()["last_epoch"], "baseline": p.baseline.value}


def _same(a: dict, b: dict) -> bool:
    return (a["baseline"] == b["baseline"] and a["sched"] == b["sched"] and a["adam"].keys() == b["adam"].keys()
            and all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
            and all(torch.equal(a["adam"][n], b["adam"][n]) for n in a["adam"]))


def _all_finite(p: PolicyTrainer) -> bool:
    s = _snapshot(p)
    return all(bool(torch.isfinite(t).all()) for t in [*s["params"].values(), *s["adam"].values()])


@pytest.fixture
def trainer(embedded_model):
    cfg = load_config(None, ["trainer.algorithm=grpo", "trainer.lr=1e-3"])
    p = PolicyTrainer(cfg, str(embedded_model))
    p.step([_single("c0", 1.0), _single("c1", 0.0, (11, 21, 31))])  # AdamW has moments now
    p.run_cfg = cfg
    return p


def test_a_reward_beyond_float32_on_a_singleton_skips_the_step_and_saves_nothing_nan(trainer, tmp_path, embedded_model):
    before = _snapshot(trainer)
    stats = trainer.step([_single("huge", 1e39)])
    assert "advantage" in stats["skipped"]
    after = _snapshot(trainer)
    assert _same(before, after), "a skipped step changed the weights, AdamW, the schedule or the baseline"
    assert _all_finite(trainer) and trainer.baseline.value is not None and abs(trainer.baseline.value) < 10
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer.check_finite()
    path = save_state(tmp_path, trainer.model, trainer.optimizer, 2, 2, trainer.baseline.value, [], embedded_model)
    resumed = PolicyTrainer(trainer.run_cfg, str(embedded_model), resume=latest_state(tmp_path))
    assert path == resumed.resumed.path and _all_finite(resumed)
    assert math.isfinite(resumed.baseline.value)
    assert "skipped" not in trainer.step([_single("c2", 0.5)])  # training goes on
    assert _all_finite(trainer)


def test_a_huge_reward_in_a_group_is_normalised_and_trains(trainer):
    """GRPO's group normalisation absorbs a huge reward in an ``n = 2`` group: finite, trained."""
    a, b = _single("g", 1e30), _single("g", 0.0, (11, 21, 31))
    b.experience.choice_index = 1
    stats = trainer.step([a, b])
    assert "skipped" not in stats and _all_finite(trainer)


def test_a_non_finite_loss_skips_the_step(trainer, monkeypatch):
    before = _snapshot(trainer)
    real = trainer._micro_step

    def nan_loss(*args, **kw):
        loss, stats, tokens = real(*args, **kw)
        return loss * float("nan"), stats, tokens
    monkeypatch.setattr(trainer, "_micro_step", nan_loss)
    stats = trainer.step([_single("c3", 1.0)])
    assert "loss" in stats["skipped"] and _same(before, _snapshot(trainer))


def test_a_non_finite_gradient_with_a_finite_loss_skips_the_step(trainer):
    """An overflow in the backward alone (a bf16 activation gradient, a degenerate ratio)."""
    before = _snapshot(trainer)
    weight = next(p for p in trainer.model.parameters() if p.requires_grad)
    hook = weight.register_hook(lambda g: g * float("inf"))
    try:
        stats = trainer.step([_single("c4", 1.0)])
    finally:
        hook.remove()
    assert "gradient norm" in stats["skipped"] and _same(before, _snapshot(trainer))
    assert "skipped" not in trainer.step([_single("c5", 1.0)])


def test_non_finite_weights_or_adam_moments_are_refused(trainer):
    trainer.check_finite()
    p = next(p for p in trainer.model.parameters() if p.requires_grad)
    moment = trainer.optimizer.state[p]["exp_avg_sq"]
    moment.view(-1)[3] = float("nan")
    with pytest.raises(NonFiniteState, match="exp_avg_sq"):
        trainer.check_finite()
    moment.view(-1)[3] = 0.0
    with torch.no_grad():
        p.view(-1)[5] = float("inf")
    with pytest.raises(NonFiniteState):
        trainer.check_finite()


def test_a_publish_refuses_non_finite_weights_before_anything_is_sent_or_saved(tmp_path):
    from tests.support.trainers import PublishingTrainer, StandInPolicy, StandInSynchronizer

    from serve_rft.weights import CheckpointMethod

    class _Poisoned(StandInPolicy):
        def check_finite(self):
            raise NonFiniteState("1 trainer tensors hold NaN or infinity")

    log: list = []
    trainer = PublishingTrainer(tmp_path, log)
    weights = CheckpointMethod(tmp_path / "weights")
    weights.prepare()
    with pytest.raises(NonFiniteState):
        asyncio.run(trainer._publish(_Poisoned(), weights, StandInSynchronizer(log), trainer.feed.store))
    assert log == [] and weights.latest_version() == 0 and latest_state(trainer.state_root) is None
    assert published_floor(trainer.state_root) == 0  # not even the version number is taken


def test_the_running_baseline_never_absorbs_a_non_finite_or_overflowing_reward():
    b = RunningBaseline(0.9)
    b.update([1.0, float("inf"), float("nan"), 1e39, -1e39, 2.0])
    assert b.value == pytest.approx(0.9 * 1.0 + 0.1 * 2.0)


def test_the_trainer_refuses_rewards_beyond_its_bound():
    from serve_rft.trainer.intake.admission import untrainable

    cfg = Config().trainer
    assert untrainable(_single("ok", cfg.max_abs_reward), 1024, cfg.max_abs_reward) is None
    assert "max_abs_reward" in untrainable(_single("big", -2 * cfg.max_abs_reward), 1024, cfg.max_abs_reward)
    assert "non-finite" in untrainable(_single("inf", float("inf")), 1024, cfg.max_abs_reward)


def test_a_skipped_step_dead_letters_its_batch_with_why_counted(redis_server):
    """The trainer actor's side (`Trainer._skipped`): the batch goes to ``P:dead`` with the
    reason, the skip is counted in its status (``skipped_steps``, shown by ``/v1/status``)."""
    import types
    import uuid

    from serve_rft.buffer.store import ExperienceStore
    from serve_rft.trainer.actor import Trainer
    from serve_rft.trainer.intake.feed import ExperienceFeed

    class _Metrics:
        skips = 0

        def skipped(self):
            self.skips += 1

    async def go():
        store = ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
        exp = _single("chatcmpl-huge", 1.0).experience
        await store.log_experiences([exp])
        await store.ready.ensure_group()
        await store.post_reward("chatcmpl-huge", 0, 1.0)  # the store's own range is not under test
        batch = await store.ready.read_ready("trainer", 10, block_ms=10)
        assert len(batch) == 1
        actor = types.SimpleNamespace(feed=ExperienceFeed(Config().trainer, store.ready), skipped_steps=0,
                                      last_skipped=None, metrics=_Metrics())
        skipped = Trainer.__ray_metadata__.modified_class._skipped
        await skipped(actor, batch, {"skipped": "non-finite advantage (1 of 1)"})
        assert actor.skipped_steps == 1 and actor.metrics.skips == 1 and actor.feed.dead_lettered == 1
        assert actor.last_skipped["reason"] == "non-finite advantage (1 of 1)"
        dead = await store.ready.dead_letters()
        assert dead[0]["member"] == "chatcmpl-huge:0" and dead[0]["reason"].startswith("step skipped: non-finite")
        assert await store.ready.delivered("trainer") == []  # acknowledged: never redelivered
        await store.close()
    asyncio.run(go())


def test_a_state_holding_nan_is_refused_at_resume(trainer, tmp_path, embedded_model):
    """A state saved before these guards (NaN weights or moments) stops the trainer at setup,
    where the error stays visible, instead of a restart loop that dead-letters every batch."""
    p = next(p for p in trainer.model.parameters() if p.requires_grad)
    trainer.optimizer.state[p]["exp_avg"].view(-1)[0] = float("nan")
    path = save_state(tmp_path, trainer.model, trainer.optimizer, 3, 3, trainer.baseline.value, [], embedded_model)
    with pytest.raises(NonFiniteState, match="exp_avg"):
        PolicyTrainer(trainer.run_cfg, str(embedded_model), resume=path)


def test_a_state_with_a_non_finite_baseline_is_not_written(trainer, tmp_path):
    with pytest.raises(ValueError, match="baseline"):
        save_state(tmp_path, trainer.model, trainer.optimizer, 3, 3, float("inf"), [], None)
    assert latest_state(tmp_path) is None


def test_the_spike_guard_skips_a_norm_far_above_the_recent_median_and_accepts_a_lasting_shift():
    from serve_rft.trainer.policy.finite import GradNormGuard

    off = GradNormGuard(None, 4)
    assert all(off.reason(n) is None for n in [1.0, 1.0, 1.0, 1.0, 1e6])
    g = GradNormGuard(10.0, 4)
    assert [g.reason(n) for n in [1.0, 2.0, 1.5, 0.5]] == [None] * 4  # not full yet: never skips
    assert g.reason(12.0) is None  # 12 <= 10 x median 1.25
    assert "times the median" in g.reason(1000.0)
    g = GradNormGuard(10.0, 4)
    for _ in range(4):
        g.reason(1.0)
    shifted = [g.reason(50.0) is not None for _ in range(4)]  # the norms moved up for good
    assert shifted == [True, True, False, False]  # accepted after half a window
    zero = GradNormGuard(10.0, 4)
    assert [zero.reason(n) for n in [0.0, 0.0, 0.0, 0.0, 3.0]] == [None] * 5  # a zero median never skips


def test_a_spike_skips_the_step_with_everything_unchanged(embedded_model):
    cfg = load_config(None, ["trainer.algorithm=grpo", "trainer.lr=1e-3", "trainer.grad_norm_spike=5",
                             "trainer.grad_norm_window=4"])
    p = PolicyTrainer(cfg, str(embedded_model))
    for i in range(4):  # rewards above the running baseline: PPO-clip leaves a gradient
        assert "skipped" not in p.step([_single(f"c{i}", float(i + 1))])
    before = _snapshot(p)
    real = p._micro_step

    def spiking(*args, **kw):
        loss, stats, tokens = real(*args, **kw)
        return loss * 1e4, stats, tokens
    p._micro_step = spiking
    stats = p.step([_single("spike", 6.0)])
    assert "times the median" in stats["skipped"] and _same(before, _snapshot(p))

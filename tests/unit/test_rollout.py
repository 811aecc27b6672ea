"""Canary promotion, rollback, pins and the canary verdict (pure state machine, simulated clock)."""

from __future__ import annotations

import pytest

from serve_rft.config import CanaryConfig, SynchronizerConfig
from serve_rft.synchronizer.canary import ArmStats, judge
from serve_rft.synchronizer.simulation import Fleet


def _arm(rewards, requests=0, errors=0, latency=0.0):
    return ArmStats(len(rewards), sum(rewards), sum(r * r for r in rewards), requests, errors, latency)


def _canary_fleet(n=3, **canary):
    cfg = SynchronizerConfig(sync_style="trainer_driven", rollout="canary",
                             canary=CanaryConfig(window_s=30, min_rewards=20, reward_wait_s=60, **canary))
    f = Fleet(cfg, lambda rng: 0.1)
    for _ in range(n):
        f.add_replica()
    f.advance(6)
    return f


def _versions(f):
    return sorted(r.version for r in f.replicas.values() if r.up)


def test_judge_promotes_unless_the_candidate_is_significantly_worse():
    cfg = CanaryConfig(min_rewards=20, min_requests=10)
    same = judge(_arm([0.5, 0.6] * 20), _arm([0.5, 0.6] * 20), cfg, past_deadline=False)
    assert same.decision == "promote"
    noisy_drop = judge(_arm([0.0, 1.0] * 10 + [0.0]), _arm([0.0, 1.0] * 11), cfg, past_deadline=False)
    assert noisy_drop.decision == "promote"  # a small drop inside the noise promotes
    collapse = judge(_arm([0.0, 0.1] * 20), _arm([0.8, 0.9] * 20), cfg, past_deadline=False)
    assert collapse.decision == "rollback" and "mean reward" in collapse.reason
    wait = judge(_arm([1.0] * 5), _arm([1.0] * 30), cfg, past_deadline=False)
    assert wait.decision is None
    assert judge(_arm([1.0] * 5), _arm([1.0] * 30), cfg, past_deadline=True).decision == "rollback"
    errors = judge(_arm([1.0] * 30, requests=100, errors=20, latency=10.0),
                   _arm([1.0] * 30, requests=100, errors=0, latency=10.0), cfg, past_deadline=False)
    assert errors.decision == "rollback" and "error rate" in errors.reason
    slow = judge(_arm([1.0] * 30, requests=100, latency=50.0), _arm([1.0] * 30, requests=100, latency=10.0),
                 cfg, past_deadline=False)
    assert slow.decision == "rollback" and "latency" in slow.reason


def test_candidate_goes_to_one_canary_then_is_promoted_everywhere():
    f = _canary_fleet()
    v1 = f.publish()
    f.advance(5)
    assert _versions(f) == [0, 0, v1]  # one canary; the incumbent (v0) keeps the rest
    st = f.state
    assert st.candidate == v1 and st.rollout.canary_since is not None
    v2 = f.publish()  # published during the window: waits for the verdict
    f.advance(5)
    assert _versions(f) == [0, 0, v1]
    assert st.decide(f.now) is None  # window still open
    f.advance(30)
    st.record_traffic({v1: (40, 0, 4.0), 0: (80, 0, 8.0)})
    verdict = st.decide(f.now, {v1: _arm([0.7, 0.8] * 15), 0: _arm([0.7, 0.8] * 15)})
    assert verdict.decision == "promote"
    assert st.incumbent == v1
    f.advance(5)
    # the next candidate is the newest version then (v2) on one canary; the rest moved to v1
    assert st.candidate == v2 and _versions(f) == [v1, v1, v2]
    kinds = [e.kind for e in st.events if e.component == "synchronizer"]
    assert kinds[:3] == ["candidate", "canary_started", "promoted"]


def test_bad_candidate_is_rolled_back_and_its_canary_returns_to_the_incumbent():
    f = _canary_fleet()
    bad = f.publish()
    f.advance(35)
    verdict = f.state.decide(f.now, {bad: _arm([0.0, 0.05] * 15), 0: _arm([0.8, 0.9] * 15)})
    assert verdict.decision == "rollback"
    f.advance(5)
    assert _versions(f) == [0, 0, 0]
    assert f.state.versions.get(bad).rejected and f.state.candidate is None
    good = f.publish()  # the trainer goes on; its next version gets its own canary
    f.advance(5)
    assert f.state.candidate == good and _versions(f) == [0, 0, good]


def test_too_few_rewards_by_the_deadline_rolls_back_by_default():
    f = _canary_fleet()
    v = f.publish()
    f.advance(35)
    assert f.state.decide(f.now, {v: _arm([1.0] * 3), 0: _arm([1.0] * 30)}) is None  # late rewards may come
    f.advance(60)
    assert f.state.decide(f.now, {v: _arm([1.0] * 3), 0: _arm([1.0] * 30)}).decision == "rollback"


def test_paused_promotion_holds_the_verdict():
    f = _canary_fleet()
    v = f.publish()
    f.advance(35)
    f.state.set_promotion_paused(True, f.now)
    assert f.state.decide(f.now, {v: _arm([1.0] * 30), 0: _arm([1.0] * 30)}) is None
    f.state.set_promotion_paused(False, f.now)
    assert f.state.decide(f.now, {v: _arm([1.0] * 30), 0: _arm([1.0] * 30)}).decision == "promote"


def test_canary_never_takes_the_last_incumbent_replica():
    f = _canary_fleet(n=2, replicas=1)
    v = f.publish()
    f.advance(5)
    assert _versions(f) == [0, v]
    rid = next(r.rid for r in f.replicas.values() if r.version == 0)
    f.kill(next(r.rid for r in f.replicas.values() if r.version == v))
    f.advance(5)
    assert f.replicas[rid].version == 0  # a lone replica stays on the incumbent


def test_pin_and_operator_rollback():
    f = Fleet(SynchronizerConfig(sync_style="trainer_driven", retain_versions=3), lambda rng: 0.1)
    for _ in range(2):
        f.add_replica()
    f.advance(2)
    v1 = f.publish()
    f.advance(3)
    f.state.pin(v1, f.now)
    v2 = f.publish()
    f.advance(3)
    assert _versions(f) == [v1, v1]  # pinned: the new version waits
    assert f.state.initial().version == v1  # a replica starting now loads the pinned version
    f.state.pin(None, f.now)
    f.advance(3)
    assert _versions(f) == [v2, v2]
    v3 = f.publish()
    f.advance(3)
    assert f.state.rollback(v1, f.now) == [v2, v3]
    f.advance(3)
    assert _versions(f) == [v1, v1]
    v4 = f.publish()
    f.advance(3)
    assert _versions(f) == [v4, v4]  # later versions roll as usual
    with pytest.raises(ValueError):
        f.state.pin(999, f.now)


def test_memory_handles_are_released_once_no_replica_needs_them_checkpoint_ones_kept_for_rollback():
    from serve_rft.synchronizer.versions import Versions

    for method, kept in (("memory", [0, 5, 6]), ("checkpoint", [0, 2, 3, 4, 5, 6])):
        vs = Versions(retain=3)
        for v in range(7):
            vs.add(v, {"method": method} if v else {"method": "checkpoint", "path": "/base"}, float(v))
        vs.retain_only(needed={5, 6}, floor=5)  # replicas serve 5, the latest is 6
        assert sorted(v for v, i in vs.by_version.items() if i.handle is not None) == kept, method


def test_a_pin_ends_an_open_canary_without_a_verdict_and_a_rollback_clears_failures():
    f = _canary_fleet()
    v1 = f.publish()
    f.advance(5)
    assert f.state.candidate == v1
    f.state.pin(0, f.now)
    assert f.state.candidate is None and not f.state.rollout.verdicts
    f.state.pin(None, f.now)
    f.advance(5)
    assert f.state.candidate == v1  # not rejected: it gets its canary again
    f.state.versions.get(v1).failures = 3
    f.state.rollback(v1, f.now)
    assert f.state.versions.get(v1).failures == 0

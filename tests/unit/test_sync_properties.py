"""Property tests of the synchronizer's state machine on a simulated clock.

A hypothesis `RuleBasedStateMachine` drives `serve_rft.synchronizer.simulation.Fleet` (replicas
and a trainer playing the synchronizer protocol against the real `SyncState`) with publishes, polls,
deaths, joins, slow and failing loads, scale-downs, operator drains and synchronizer restarts,
and checks the invariants after every step:

- with two or more live replicas the ingress routes to, a grant never leaves none in rotation,
  and no live replica is out of rotation for a sync beyond ``max_unavailable`` (new replicas
  become routable 0.5-3 s after they register, as HAProxy adds them);
- a replica Ray reported dead never counts as serving;
- no version a live replica serves, restores to, or is granted has its checkpoint pruned;
- once the system is quiet, every published version that is not quarantined reaches every live
  replica within ``max_version_lag_s`` (loads shorter than a second);
- a version that always fails to load is quarantined after ``max_load_attempts`` failures;
- in the canary rollout a candidate reaches at most ``canary.replicas`` replicas before its
  verdict.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from serve_rft.config import CanaryConfig, SynchronizerConfig
from serve_rft.synchronizer.canary import ArmStats
from serve_rft.synchronizer.simulation import Fleet
from serve_rft.types import ComponentState

LAG_S = 10.0


class FleetMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.fleet: Fleet | None = None
        self.slow = False

    @rule(n=st.integers(1, 5), max_unavailable=st.integers(1, 2),
          style=st.sampled_from(["fixed", "trainer_driven", "explorer_driven"]), seed=st.integers(0, 10**6),
          rollout=st.sampled_from(["rolling", "rolling", "canary"]))
    @precondition(lambda self: self.fleet is None)
    def start(self, n, max_unavailable, style, seed, rollout):
        cfg = SynchronizerConfig(sync_style=style, sync_interval=3, max_unavailable=max_unavailable,
                                 max_version_lag_s=LAG_S, replica_timeout_s=5.0, lease_s=10.0,
                                 retry_backoff_s=1.0, max_load_attempts=3, rollout=rollout,
                                 canary=CanaryConfig(window_s=20, min_rewards=5, reward_wait_s=10))
        self.fleet = Fleet(cfg, self._load_time, seed=seed)
        for _ in range(n):
            self.fleet.add_replica()

    def _load_time(self, rng):
        return rng.uniform(5.0, 30.0) if self.slow else rng.uniform(0.05, 0.9)

    def _up(self):
        return sorted(r.rid for r in self.fleet.replicas.values() if r.up)

    @rule(bad=st.booleans())
    @precondition(lambda self: self.fleet is not None)
    def publish(self, bad):
        self.fleet.publish(bad=bad)

    @rule(dt=st.floats(0.1, 4.0))
    @precondition(lambda self: self.fleet is not None)
    def tick(self, dt):
        self.fleet.advance(dt)

    @rule(i=st.integers(0, 10), reported=st.booleans())
    @precondition(lambda self: self.fleet is not None and len(self._up()) > 0)
    def kill(self, i, reported):
        up = self._up()
        self.fleet.kill(up[i % len(up)], reported=reported)

    @rule(i=st.integers(0, 10))
    @precondition(lambda self: self.fleet is not None and len(self._up()) > 0)
    def stall(self, i):
        up = self._up()
        self.fleet.stall(up[i % len(up)])

    @rule(i=st.integers(0, 10))
    @precondition(lambda self: self.fleet is not None and len(self._up()) > 1)
    def scale_down(self, i):
        up = self._up()
        self.fleet.scale_down(up[i % len(up)])

    @rule()
    @precondition(lambda self: self.fleet is not None and len(self._up()) < 6)
    def join(self):
        self.fleet.add_replica()

    @rule(i=st.integers(0, 10), drained=st.booleans())
    @precondition(lambda self: self.fleet is not None and len(self._up()) > 0)
    def drain(self, i, drained):
        up = self._up()
        self.fleet.drain(up[i % len(up)], drained)

    @rule(slow=st.booleans())
    def loads_become(self, slow):
        self.slow = slow

    @rule()
    @precondition(lambda self: self.fleet is not None)
    def synchronizer_restarts(self):
        self.fleet.restart_synchronizer()

    @rule(promote=st.booleans())
    @precondition(lambda self: self.fleet is not None and self.fleet.state.candidate is not None)
    def canary_verdict(self, promote):
        f = self.fleet
        f.advance(25.0)
        st_ = f.state
        if st_.candidate is None:
            return
        good, bad = ArmStats(10, 9.0, 8.2), ArmStats(10, 1.0, 0.2)
        verdict = st_.decide(f.now, {st_.candidate: good if promote else bad, st_.incumbent: good})
        if verdict is not None:
            assert verdict.decision == ("promote" if promote else "rollback")

    @rule()
    @precondition(lambda self: self.fleet is not None and not self.slow and len(self._up()) > 0
                  and self.fleet.cfg.rollout == "rolling")
    def quiet_publish_reaches_every_live_replica_in_time(self):
        """Undrain everything, let the fleet settle, then publish a good version: it reaches
        every live replica within the lag bound without any traffic."""
        f = self.fleet
        f.advance(3.0)  # after a synchronizer restart replicas introduce themselves (poll or renewal)
        for rid in self._up():
            assert f.drain(rid, False) or not f.replicas[rid].drained
        f.advance(60.0)  # backoffs, quarantines, timeouts of stalled replicas settle
        assert f.converged(), f.state.status(f.now)
        v = f.publish()
        t0 = f.now
        while f.now - t0 < LAG_S:
            f.advance(0.25)
            if all(f.replicas[rid].version >= v for rid in self._up()):
                break
        live = [rid for rid in self._up() if f.state.known(rid)]
        assert all(f.replicas[rid].version >= v for rid in live), (
            f"v{v} not everywhere after {f.now - t0:.1f} s", f.state.status(f.now))

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def grants_keep_one_serving_and_respect_max_unavailable(self):
        if self.fleet is not None:
            assert not self.fleet.violations, self.fleet.violations

    @invariant()
    def a_candidate_reaches_only_its_canaries(self):
        if self.fleet is None or self.fleet.state.candidate is None or self.fleet.state.pinned is not None:
            return
        f = self.fleet
        c = f.state.candidate
        on = [r for r in f.replicas.values() if r.up and c in (r.version, r.syncing)]
        assert len(on) <= f.cfg.canary.replicas, [(r.rid, r.version, r.syncing) for r in on]

    @invariant()
    def dead_replicas_never_count_as_serving(self):
        if self.fleet is None:
            return
        st_ = self.fleet.state
        for r in self.fleet.replicas.values():
            info = st_.members.get(r.rid)
            if not r.alive and info is not None and not info.alive:
                assert not info.in_rotation and info.state is ComponentState.STOPPED
        assert st_.members.n_in_rotation == sum(x.in_rotation for x in st_.members)
        assert st_.members.n_live == sum(x.live for x in st_.members)
        assert st_.members.n_warming == sum(x.live and x.warming and x.state is ComponentState.RUNNING
                                            for x in st_.members)

    @invariant()
    def versions_in_use_are_never_pruned(self):
        if self.fleet is None:
            return
        f = self.fleet
        for r in f.replicas.values():
            if r.up and f.state.known(r.rid):
                for v in (r.version, r.sync_from if r.syncing is not None else 0):
                    assert v == 0 or v in f.checkpoints, f"v{v} of {r.rid} was pruned"

    @invariant()
    def failing_versions_are_quarantined_after_the_attempts(self):
        if self.fleet is None:
            return
        for v in self.fleet.state.versions.by_version.values():
            assert v.failures <= self.fleet.cfg.max_load_attempts
            assert v.quarantined == (v.failures >= self.fleet.cfg.max_load_attempts)


TestFleet = FleetMachine.TestCase
# CI: 150 examples x 40 steps; a longer search: FLEET_EXAMPLES=3000 FLEET_STEPS=60 pytest ... -k TestFleet
TestFleet.settings = settings(max_examples=int(os.environ.get("FLEET_EXAMPLES", 150)),
                              stateful_step_count=int(os.environ.get("FLEET_STEPS", 40)), deadline=None,
                              suppress_health_check=list(HealthCheck))


def test_slow_sync_keeps_its_slot():
    """A sync that takes longer than replica_timeout_s renews its lease: its slot stays taken."""
    f = Fleet(SynchronizerConfig(sync_style="trainer_driven", max_version_lag_s=None), lambda rng: 40.0)
    for _ in range(3):
        f.add_replica()
    f.advance(2)
    f.publish()
    f.advance(35)
    assert sum(r.syncing is not None for r in f.replicas.values()) == 1
    assert f.state.members.n_out == 1 and not f.violations


def test_bad_version_backs_off_then_is_quarantined_and_newer_versions_roll():
    f = Fleet(SynchronizerConfig(sync_style="trainer_driven", retry_backoff_s=2.0, max_load_attempts=3),
              lambda rng: 0.1)
    for _ in range(2):
        f.add_replica()
    f.advance(2)
    bad = f.publish(bad=True)
    for _ in range(200):
        f.advance(0.1)
        if f.state.versions.get(bad).quarantined:
            break
    assert f.state.versions.get(bad).quarantined
    fails = [(e.component, e.t) for e in f.state.events if e.kind == "failed"]
    grants = [(e.component, e.t) for e in f.state.events if e.kind == "granted"]
    assert len(fails) == 3 and len(grants) == 3
    for rid in {c for c, _ in fails}:  # a replica retries no sooner than its backoff
        mine = sorted([(t, "f") for c, t in fails if c == rid] + [(t, "g") for c, t in grants if c == rid])
        for (t1, k1), (t2, k2) in zip(mine, mine[1:]):
            if k1 == "f" and k2 == "g":
                assert t2 - t1 >= 2.0, mine
    assert any(e.kind == "quarantined" for e in f.state.events)
    f.advance(5)
    assert f.state.grant("r00001", f.now) is None  # never granted again
    good = f.publish()
    f.advance(5)
    assert all(r.version == good for r in f.replicas.values())


def test_idle_fleet_converges_within_the_lag_bound_in_fixed_style():
    """FIXED style and no traffic: replicas never reach their sync step, yet the lag bound
    brings every published version to every replica."""
    f = Fleet(SynchronizerConfig(sync_style="fixed", sync_interval=10, max_version_lag_s=10.0), lambda rng: 0.1)
    for _ in range(2):
        f.add_replica()
    f.advance(2)
    f.publish()  # explorer step 0 is a FIXED sync point (offset 0): the first version syncs at once
    f.advance(2)
    v = f.publish()
    t0 = f.now
    while not all(r.version == v for r in f.replicas.values()):
        f.advance(0.25)
        assert f.now - t0 <= 10.0
    assert f.now - t0 >= 4.9  # half the bound is left to the style before the fallback


def test_autoscaling_counts_live_replicas_not_a_configured_number():
    f = Fleet(SynchronizerConfig(sync_style="trainer_driven"), lambda rng: 0.2)
    rids = [f.add_replica() for _ in range(2)]
    f.advance(2)
    f.scale_down(rids[1])  # one left: the lone replica may sync (it pauses; nothing fails)
    v = f.publish()
    f.advance(3)
    assert f.replicas[rids[0]].version == v
    for _ in range(3):
        f.add_replica()  # scale up: new replicas start on the latest version
    f.advance(2)
    assert {r.version for r in f.replicas.values() if r.up} == {v}
    f.publish()
    f.advance(5)
    assert f.converged() and not f.violations


def test_drain_refuses_to_take_the_last_serving_replica():
    f = Fleet(SynchronizerConfig(), lambda rng: 0.1)
    a, b = f.add_replica(), f.add_replica()
    f.advance(2)
    assert f.drain(a, True)
    assert not f.drain(b, True)
    with pytest.raises(ValueError):
        f.state.set_drained(b, True, f.now)


def test_a_replica_put_back_counts_once_it_stopped_refusing():
    """An operator puts a drained replica back while a version waits for its peer: the peer is
    granted only after the replica's own poll says it stopped refusing (it learns of the undrain
    from a poll answer; granted at once, the peer would refuse too and HAProxy's retries could
    meet two refusing replicas)."""
    f = Fleet(SynchronizerConfig(sync_style="trainer_driven", max_unavailable=1), lambda rng: 0.5, seed=1)
    a, b = f.add_replica(), f.add_replica()
    f.advance(5.0)
    assert f.drain(a, True)
    f.advance(2.0)
    f.publish()
    f.advance(3.0)  # the drained replica synced (it costs nothing); its peer may not leave rotation
    assert (f.replicas[a].version, f.replicas[b].version) == (1, 0)
    assert f.drain(a, False)
    assert f.state.members.get(a).undraining and not f.state.members.get(a).in_rotation
    f.advance(3.0)
    assert f.replicas[b].version == 1 and not f.violations, f.violations
    assert not f.state.members.get(a).undraining


def test_a_drained_replica_that_serves_anyway_takes_a_sync_slot():
    """Found by the fleet search: a replica drained while warming turns ready while its only peer
    syncs; its drain does not hold (nobody else serves), so it serves, and a sync of it is a second
    replica out of rotation (max_unavailable 1). It was granted as if drained (costless)."""
    f = Fleet(SynchronizerConfig(sync_style="trainer_driven", max_unavailable=1, max_version_lag_s=None),
              lambda rng: 20.0, seed=1)
    a, b = f.add_replica(), f.add_replica()
    assert f.drain(b, True)  # both warming: allowed
    f.publish()
    f.advance(5.0)
    syncing = [r.rid for r in f.replicas.values() if r.syncing is not None]
    assert syncing == [a] and not f.violations, (syncing, f.violations)
    assert not f.state.drain_holds(b)  # it serves while a syncs
    f.advance(60.0)
    assert f.converged() and not f.violations


def test_an_undrain_after_a_synchronizer_restart_is_kept_when_the_replica_reintroduces_itself():
    """Found by the fleet search: the synchronizer restarts while a drained replica syncs (it
    learns of it from the lease renewal), an operator puts it back, and the replica's registration
    after the sync (from its stale drained flag) must not drain it again: with max_unavailable 1
    a held drain blocks every other replica's sync."""
    f = Fleet(SynchronizerConfig(sync_style="trainer_driven", max_unavailable=1, max_version_lag_s=None,
                                 lease_s=10.0), lambda rng: 6.0, seed=0)
    a, b, c = f.add_replica(), f.add_replica(), f.add_replica()
    f.advance(5.0)
    assert f.drain(a, True)
    f.advance(2.0)  # a learns of its drain
    f.publish()
    f.advance(1.5)
    assert f.replicas[a].syncing is not None  # a held drain syncs without a slot
    f.restart_synchronizer()
    f.advance(3.0)  # a's renewal re-introduces it (drained)
    assert f.state.members.get(a).drained
    assert f.drain(a, False)
    f.advance(40.0)
    assert not f.state.members.get(a).drained and f.converged(), f.state.status(f.now)
    assert all(r.version == 1 for r in f.replicas.values())


def test_a_drain_is_kept_when_a_restarted_synchronizer_first_hears_the_replica_report_its_sync():
    """Review finding: the synchronizer restarts, the drained replica's sync ends before its first
    renewal, so the restarted state first learns of it from ``synced`` (nothing about its drain);
    its registration after that carries the drain and must keep it."""
    from serve_rft.synchronizer.state import SyncState
    from serve_rft.types import PublishedVersion

    st = SyncState(SynchronizerConfig(sync_style="trainer_driven"))
    st.restarted(0.0)
    st.publish(PublishedVersion(1, {"method": "checkpoint", "path": "/v1"}, 0.0), 0.0)
    st.synced("a", 1, 0.5, handle={"method": "checkpoint", "path": "/v1"})
    st.register("a", 1, 1.0, base_handle={"method": "checkpoint", "path": "/base"}, drained=True)
    r = st.members.get("a")
    assert r.drained and not r.undraining
    # and an operator's undrain between the report and the registration is kept
    st2 = SyncState(SynchronizerConfig(sync_style="trainer_driven"))
    st2.restarted(0.0)
    st2.synced("b", 0, 0.5)
    st2.set_drained("b", False, 0.7)
    st2.register("b", 0, 1.0, drained=True)
    assert not st2.members.get("b").drained and st2.members.get("b").undraining

"""The synchronizer's state machine, rule by rule (simulated clock; property tests in
test_sync_properties.py)."""

import pytest

from serve_rft.config import SynchronizerConfig
from serve_rft.synchronizer.state import SyncState
from serve_rft.types import ComponentState, PublishedVersion


def _state(n=2, max_unavailable=1, **kw):
    s = SyncState(SynchronizerConfig(max_unavailable=max_unavailable, replica_timeout_s=10,
                                     sync_style="trainer_driven", **kw))
    for i in range(n):
        s.register(f"r{i}", 0, now=100.0, base_handle={"method": "checkpoint", "path": "/base"})
    return s


def _pub(s, v, now=100.0):
    s.publish(PublishedVersion(version=v, handle={"method": "checkpoint", "path": f"/v{v}"}, published_at=now), now)


def test_no_grant_without_a_newer_version():
    s = _state()
    assert s.grant("r0", now=101) is None
    _pub(s, 1, 101)
    order = s.grant("r0", now=102)
    assert order is not None and order.version == 1 and order.handle["path"] == "/v1"
    assert s.replicas["r0"].state is ComponentState.REQUIRE_SYNC


def test_rolls_one_replica_at_a_time_and_keeps_one_serving():
    s = _state(n=2)
    _pub(s, 1)
    assert s.grant("r0", now=101) is not None
    assert s.grant("r1", now=101) is None  # r0 is syncing: r1 must keep serving
    assert s.serving() == 1
    s.synced("r0", 1, now=102)
    assert s.replicas["r0"].state is ComponentState.RUNNING
    assert s.grant("r1", now=103) is not None
    s.synced("r1", 1, now=104)
    assert all(e.serving >= 1 for e in s.events)
    assert s.rollout.version_lag() == {1: 4.0}


def test_max_unavailable_two_of_three():
    s = _state(n=3, max_unavailable=2)
    _pub(s, 1)
    assert s.grant("r0", 101) and s.grant("r1", 101)
    assert s.grant("r2", 101) is None
    assert s.serving() == 1


def test_never_zero_serving_even_with_high_max_unavailable():
    s = _state(n=2, max_unavailable=5)
    _pub(s, 1)
    assert s.grant("r0", 101) is not None
    assert s.grant("r1", 101) is None


def test_single_live_replica_may_sync():
    s = _state(n=1)
    _pub(s, 1)
    order = s.grant("r0", 101)
    assert order is not None and order.others_serving is False


def test_failed_load_returns_replica_to_running_backs_off_and_counts():
    s = _state()
    _pub(s, 1)
    s.grant("r0", 101)
    s.failed("r0", 1, "boom", now=102)
    r = s.replicas["r0"]
    assert r.state is ComponentState.RUNNING and r.failures == 1 and r.policy_version == 0
    assert s.status(now=102)["replicas"][0]["last_error"] == "boom"
    assert s.grant("r0", 103) is None  # backoff: retry_backoff_s (2 s) after the failure
    assert s.grant("r0", 104.1) is not None


def test_a_replica_reported_dead_never_counts_as_serving():
    s = _state(n=2)
    _pub(s, 1)
    s.lost("r1", now=101)
    assert s.serving() == 1 and not s.replicas["r1"].live
    order = s.grant("r0", 101)  # the lone live replica may sync; it may not refuse requests
    assert order is not None and order.others_serving is False
    s.heartbeat("r1", 0, 0, now=102)  # a dead id never comes back
    assert s.replicas["r1"].state is ComponentState.STOPPED


def test_silent_replica_is_stopped_then_comes_back():
    s = _state()
    _pub(s, 1)
    s.heartbeat("r1", 0, 0, now=120)
    assert s.expire(now=120) == ["r0"]
    assert s.replicas["r0"].state is ComponentState.STOPPED
    assert s.in_use_floor(now=120) == 0  # it may come back: its version stays loadable
    s.heartbeat("r0", 0, 0, now=122)
    assert s.replicas["r0"].state is ComponentState.RUNNING
    assert s.grant("r1", now=123) is not None


def test_a_syncing_replica_keeps_its_slot_while_it_renews_its_lease():
    s = _state(n=3, lease_s=10)
    _pub(s, 1)
    assert s.grant("r0", now=101) is not None
    for t in range(102, 140, 2):  # a slow load: 40 s, lease renewed every 2 s
        assert s.renew("r0", 0, 1, now=t) is True
        s.heartbeat("r1", 0, 0, now=t)
        s.heartbeat("r2", 0, 0, now=t)
        s.expire(now=t)
        assert s.grant("r1", now=t) is None  # the slot stays taken
    s.expire(now=151)  # renewals stopped for > lease_s: it is gone, the slot frees
    assert s.replicas["r0"].state is ComponentState.STOPPED


def test_drained_replica_is_out_of_rotation_and_may_sync_without_a_slot():
    s = _state(n=3)
    s.set_drained("r2", True, now=101)
    assert s.serving() == 2
    _pub(s, 1, 101)
    assert s.grant("r0", 101) is None  # the drain already takes the one slot
    assert s.grant("r2", 101) is not None  # out of rotation anyway: costs no capacity
    with pytest.raises(ValueError):
        _state(n=2).set_drained("r0", True, 101) or None  # fine: another serves
        s2 = _state(n=2)
        s2.set_drained("r0", True, 101)
        s2.set_drained("r1", True, 101)


def test_publish_must_increase():
    s = _state()
    _pub(s, 2)
    with pytest.raises(ValueError):
        _pub(s, 2)


def test_lag_counts_skipped_versions_once_everyone_is_past_them():
    s = _state()
    _pub(s, 1, 100)
    _pub(s, 2, 101)
    s.grant("r0", now=102)
    s.synced("r0", 2, now=103)
    s.grant("r1", now=103)
    s.synced("r1", 2, now=105)
    assert s.rollout.version_lag() == {1: 5.0, 2: 4.0}


def test_order_says_whether_another_replica_serves():
    """A granted replica may refuse new requests (HAProxy re-sends them) only if another serves."""
    s = _state(n=2)
    _pub(s, 1)
    assert s.grant("r0", 101).others_serving is True
    assert s.renew("r0", 0, 1, now=102) is True
    s.lost("r1", now=103)
    assert s.renew("r0", 0, 1, now=104) is False  # the other died: hold requests, do not refuse


def test_restarted_synchronizer_waits_for_syncs_in_flight_to_renew():
    s = SyncState(SynchronizerConfig(sync_style="trainer_driven", lease_s=10))
    s.restarted(now=100)
    _pub(s, 3, 100)
    s.register("r1", 2, 100.5, handle={"method": "checkpoint", "path": "/v2"})
    s.register("r2", 2, 100.5, handle={"method": "checkpoint", "path": "/v2"})
    assert s.grant("r1", 101) is None  # r0 may be mid-sync: wait half a lease
    assert s.in_use_floor(now=101) == 0  # and prune nothing yet
    s.renew("r0", 2, 3, now=102)
    assert s.grant("r1", 106) is None  # r0 holds the slot
    assert not s.known("r0")  # it registers with its handles on its next poll
    s.synced("r0", 3, now=107)
    assert s.grant("r1", 107) is not None


def test_a_late_renewal_does_not_reopen_a_finished_sync_and_failures_report_what_is_served():
    s = _state(n=2)
    _pub(s, 1)
    assert s.grant("r0", 101) is not None
    s.synced("r0", 1, now=102)
    s.renew("r0", 0, 1, now=102.1)  # sent before the outcome, delivered after it
    assert s.replicas["r0"].state is ComponentState.RUNNING and s.replicas["r0"].policy_version == 1
    _pub(s, 2, 103)
    assert s.grant("r1", 103) is not None
    s.failed("r1", 2, "probe mismatch", now=104, serving=0)
    assert s.replicas["r1"].policy_version == 0 and s.replicas["r1"].state is ComponentState.RUNNING
    s.heartbeat("r1", 0, 0, now=105)
    assert s.replicas["r1"].policy_version == 0
    assert s.grant("r1", 106.5) is not None
    s.failed("r1", 2, "restore failed", now=107, broken=True)  # out until Serve replaces it
    assert s.replicas["r1"].state is ComponentState.STOPPED and s.serving() == 1


def test_a_version_being_loaded_stays_loadable():
    s = _state(n=2)
    _pub(s, 1)
    assert s.grant("r0", 101).version == 1
    for v in range(2, 9):
        _pub(s, v, 101)  # the incumbent moves on while r0 still loads v1
    s.lost("r1", now=102)
    assert s.versions.get(1).handle is not None  # r0 is loading it: not released ...
    assert s.in_use_floor(now=102) == 0  # ... nor pruned (r0 restores v0 on failure)
    assert s.versions.get(4).handle is None  # neither served, loaded, nor among the newest 3


def test_a_new_replica_counts_as_serving_only_once_a_request_reached_it():
    """Found by the kill test: the replacement of a killed replica registered before HAProxy
    routed to it; counted as serving, it let the last routable replica refuse requests."""
    s = _state(n=1)
    s.register("new", 0, now=100.5, warming=True)
    _pub(s, 1, 101)
    order = s.grant("r0", 101)
    assert order is not None and order.others_serving is False  # hold requests, do not refuse
    assert s.renew("r0", 0, 1, now=102) is False
    s.synced("r0", 1, now=103)
    s.heartbeat("new", 0, 0, now=104, ready=True)
    assert s.serving() == 2 and any(e.kind == "ready" for e in s.events)
    _pub(s, 2, 105)
    s.heartbeat("r0", 1, 0, now=106)  # its poll
    assert s.grant("r0", 106).others_serving is True


def test_a_stall_of_the_synchronizer_itself_is_pardoned_not_counted_as_the_replicas_silence():
    """The synchronizer stuck for 30 s (SIGSTOP) while r0 syncs and r1 serves: without the pardon
    both time out on resuming and r1 gets a sync slot while r0 is still loading (two out of
    rotation); with it neither does, and a replica that stays silent afterwards still times out."""
    def stuck_at(t_stop: float, pardon: bool):
        s = _state(n=2, lease_s=10)
        _pub(s, 1)
        assert s.grant("r0", now=101) is not None
        for t in range(102, int(t_stop) + 1, 2):
            s.renew("r0", 0, 1, now=t)
            s.heartbeat("r1", 0, 0, now=t)
            s.expire(now=t)
        resumed = t_stop + 30.0
        if pardon:
            s.members.pardon(30.0, resumed)
        return s, s.expire(now=resumed), resumed

    s, stopped, _ = stuck_at(110.0, pardon=False)
    assert set(stopped) == {"r0", "r1"}  # what a stall did before: every replica timed out at once
    s.heartbeat("r1", 0, 0, now=141)
    assert s.grant("r1", now=141) is not None  # ... and r1 syncs while r0 still loads

    s, stopped, resumed = stuck_at(110.0, pardon=True)
    assert stopped == [] and s.replicas["r0"].state is ComponentState.REQUIRE_SYNC
    s.heartbeat("r1", 0, 0, now=resumed + 1)
    assert s.grant("r1", now=resumed + 1) is None  # r0's slot is still taken
    s.renew("r0", 0, 1, now=resumed + 2)
    s.synced("r0", 1, now=resumed + 3)
    assert s.grant("r1", now=resumed + 4) is not None
    # silence after the resume counts: r0 stops polling and times out replica_timeout_s later
    s.heartbeat("r1", 0, 0, now=resumed + 12)
    assert s.expire(now=resumed + 14) == ["r0"]


def test_replica_events_work_from_the_collaborators_they_are_given():
    """`ReplicaEvents` is a component: built from a config, a membership, versions, a rollout and
    an update function alone (no SyncState), it registers, hears, expires and loses replicas, and
    every change reaches the membership's on_change with the change's own time."""
    from serve_rft.synchronizer.membership import Membership
    from serve_rft.synchronizer.replica_events import ReplicaEvents
    from serve_rft.synchronizer.rollout import Rollout
    from serve_rft.synchronizer.versions import Versions

    cfg = SynchronizerConfig(sync_style="trainer_driven", replica_timeout_s=10)
    changes = []
    members = Membership(cfg.replica_timeout_s, lambda r, kind, detail, now: changes.append((r.replica_id, kind, now)))
    versions = Versions()
    rollout = Rollout(cfg, versions, members, lambda *a: None, lambda now: False)
    ev = ReplicaEvents(cfg, members, versions, rollout, members.update)
    ev.register("r0", 0, 100.0, base_handle={"method": "checkpoint", "path": "/base"})
    ev.register("r1", 2, 100.5, handle={"method": "checkpoint", "path": "/v2"})
    assert ev.known("r0") and ev.known("r1") and members.n_live == members.n_in_rotation == 2
    assert ev.initial() is None  # the incumbent is the initial weights
    rollout.pin(2, 101.0)
    assert ev.initial().version == 2 and ev.initial().handle == {"method": "checkpoint", "path": "/v2"}
    ev.heartbeat("r1", 2, 0, 105.0)
    assert ev.expire(111.0) == ["r0"]  # unheard for more than replica_timeout_s
    ev.lost("r1", 112.0)
    assert not members.get("r1").alive and members.n_live == 0
    assert changes == [("r0", "joined", 100.0), ("r1", "joined", 100.5), ("r0", "timeout", 111.0),
                       ("r1", "lost", 112.0)]

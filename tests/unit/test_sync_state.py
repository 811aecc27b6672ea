from serve_rft.synchronizer.state import SyncState
from serve_rft.types import ComponentState, PublishedVersion


def _state(n=2, max_unavailable=1):
    s = SyncState(max_unavailable=max_unavailable, replica_timeout_s=10, num_replicas=n)
    for i in range(n):
        s.register(f"r{i}", 0, now=100.0)
    return s


def test_no_grant_without_a_newer_version():
    s = _state()
    assert s.grant("r0", now=101) is None
    s.publish(PublishedVersion(version=1, handle={"method": "checkpoint", "path": "/v1"}, published_at=101), now=101)
    order = s.grant("r0", now=102)
    assert order is not None and order.version == 1 and order.handle["path"] == "/v1"
    assert s.replicas["r0"].state is ComponentState.REQUIRE_SYNC


def test_rolls_one_replica_at_a_time_and_keeps_one_serving():
    s = _state(n=2)
    s.publish(PublishedVersion(version=1, handle={"method": "checkpoint", "path": "/v1"}, published_at=100), now=100)
    assert s.grant("r0", now=101) is not None
    assert s.grant("r1", now=101) is None  # r0 is syncing: r1 must keep serving
    assert s.serving() == 1
    s.synced("r0", 1, now=102)
    assert s.replicas["r0"].state is ComponentState.RUNNING
    assert s.grant("r1", now=103) is not None
    s.synced("r1", 1, now=104)
    assert all(e.serving >= 1 for e in s.events)
    assert s.version_lag() == {1: 4.0}


def test_max_unavailable_two_of_three():
    s = _state(n=3, max_unavailable=2)
    s.publish(PublishedVersion(version=1, handle={"method": "checkpoint", "path": "/v1"}))
    assert s.grant("r0") and s.grant("r1")
    assert s.grant("r2") is None
    assert s.serving() == 1


def test_never_zero_serving_even_with_high_max_unavailable():
    s = _state(n=2, max_unavailable=5)
    s.publish(PublishedVersion(version=1, handle={"method": "checkpoint", "path": "/v1"}))
    assert s.grant("r0") is not None
    assert s.grant("r1") is None


def test_single_replica_may_sync():
    s = _state(n=1)
    s.publish(PublishedVersion(version=1, handle={"method": "checkpoint", "path": "/v1"}))
    assert s.grant("r0") is not None


def test_failed_load_returns_replica_to_running_and_counts():
    s = _state()
    s.publish(PublishedVersion(version=1, handle={"method": "checkpoint", "path": "/v1"}))
    s.grant("r0")
    s.failed("r0", 1, "boom")
    r = s.replicas["r0"]
    assert r.state is ComponentState.RUNNING and r.failures == 1 and r.policy_version == 0
    assert s.status()["replicas"][0]["last_error"] == "boom"


def test_silent_replica_is_stopped_and_frees_its_slot():
    s = _state()
    s.publish(PublishedVersion(version=1, handle={"method": "checkpoint", "path": "/v1"}), now=100)
    s.grant("r0", now=100)
    s.heartbeat("r1", 0, now=120)
    assert s.expire(now=120) == ["r0"]
    assert s.replicas["r0"].state is ComponentState.STOPPED
    # r1 is the only one serving: it must not sync until r0 is back
    assert s.grant("r1", now=121) is None
    s.heartbeat("r0", 0, now=122)
    assert s.replicas["r0"].state is ComponentState.RUNNING
    assert s.grant("r1", now=123) is not None


def test_publish_must_increase():
    s = _state()
    s.publish(PublishedVersion(version=2, handle={"method": "checkpoint", "path": "/v2"}))
    import pytest

    with pytest.raises(ValueError):
        s.publish(PublishedVersion(version=2, handle={"method": "checkpoint", "path": "/v2b"}))


def test_lag_counts_skipped_versions_once_everyone_is_past_them():
    s = _state()
    s.publish(PublishedVersion(version=1, handle={"method": "checkpoint", "path": "/v1"}, published_at=100), now=100)
    s.publish(PublishedVersion(version=2, handle={"method": "checkpoint", "path": "/v2"}, published_at=101), now=101)
    s.grant("r0", now=102)
    s.synced("r0", 2, now=103)
    s.grant("r1", now=103)
    s.synced("r1", 2, now=105)
    assert s.version_lag() == {1: 5.0, 2: 4.0}


def test_order_says_whether_another_replica_serves():
    """A granted replica may refuse new requests (HAProxy re-sends them) only if another serves."""
    s = _state(n=2)
    s.publish(PublishedVersion(version=1, handle={"method": "checkpoint", "path": "/v1"}))
    assert s.grant("r0").others_serving is True
    single = _state(n=1)
    single.publish(PublishedVersion(version=1, handle={"method": "checkpoint", "path": "/v1"}))
    assert single.grant("r0").others_serving is False

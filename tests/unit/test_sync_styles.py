"""Each sync style's schedule (serve_rft.synchronizer.styles) and its effect on grants."""

import pytest

from serve_rft.config import SynchronizerConfig, SyncStyle
from serve_rft.synchronizer.state import SyncState
from serve_rft.synchronizer.styles import ReplicaSchedule, fixed_scheduled_step
from serve_rft.types import PublishedVersion


@pytest.mark.parametrize("step,interval,offset,expected", [
    (0, 10, 5, None), (4, 10, 5, None), (5, 10, 5, 5), (14, 10, 5, 5), (15, 10, 5, 15), (27, 10, 5, 25),
    (0, 10, 0, 0), (9, 10, 0, 0), (10, 10, 0, 10), (3, 1, 0, 3),
])
def test_fixed_schedule_arithmetic(step, interval, offset, expected):
    assert fixed_scheduled_step(step, interval, offset) == expected


def test_fixed_interval_10_offset_5_syncs_at_5_15_25():
    """Seed 000's table: the explorer runs 5 steps first, then syncs every 10."""
    sch = ReplicaSchedule()
    due_at = []
    for step in range(0, 40):
        sch.observe(SyncStyle.FIXED, step, 0, 10, 5, 30.0, now=float(step))
        if sch.due:
            due_at.append(step)
            sch.synced()
    assert due_at == [5, 15, 25, 35]


def test_trainer_publish_schedules():
    assert [s for s in range(1, 13) if SyncStyle.FIXED.trainer_publishes(s, 4, False)] == [4, 8, 12]
    assert [s for s in range(1, 7) if SyncStyle.TRAINER_DRIVEN.trainer_publishes(s, 2, False)] == [2, 4, 6]
    assert not SyncStyle.EXPLORER_DRIVEN.trainer_publishes(4, 4, False)
    assert SyncStyle.EXPLORER_DRIVEN.trainer_publishes(3, 4, True)


def test_explorer_driven_request_timeout_and_retry():
    sch = ReplicaSchedule()
    obs = lambda step, now: sch.observe(SyncStyle.EXPLORER_DRIVEN, step, 0, 3, 0, 10.0, now)  # noqa: E731
    obs(2, 0.0)
    assert not sch.open_request()
    obs(3, 1.0)
    assert sch.open_request() and sch.due and sch.history == [3]
    obs(4, 12.0)  # timed out: keep serving, retry next cycle (3 more steps)
    assert not sch.open_request() and sch.timeouts == 1
    obs(6, 13.0)
    assert not sch.open_request()
    obs(7, 14.0)
    assert sch.open_request() and sch.history == [3, 7]
    sch.synced()
    assert not sch.due


def _state(style, interval=1, offset=0, n=2):
    s = SyncState(SynchronizerConfig(sync_style=style, sync_interval=interval, sync_offset=offset,
                                     sync_timeout_s=10, max_version_lag_s=None))
    for i in range(n):
        s.register(f"r{i}", 0, now=100.0)
    return s


def test_fixed_replica_waits_for_its_scheduled_step():
    s = _state(SyncStyle.FIXED, interval=4, offset=2)
    s.publish(PublishedVersion(version=1, handle={"method": "checkpoint"}), now=100)
    s.heartbeat("r0", 0, 1, now=101)
    assert s.grant("r0", now=101) is None  # before its offset
    s.heartbeat("r0", 0, 2, now=102)
    assert s.grant("r0", now=102).version == 1
    s.synced("r0", 1, now=103)
    s.publish(PublishedVersion(version=2, handle={"method": "checkpoint"}), now=104)
    s.heartbeat("r0", 1, 5, now=105)
    assert s.grant("r0", now=105) is None  # next sync point is step 6
    s.heartbeat("r0", 1, 6, now=106)
    assert s.grant("r0", now=106).version == 2


def test_explorer_driven_request_is_visible_to_the_trainer():
    s = _state(SyncStyle.EXPLORER_DRIVEN, interval=2)
    assert not s.sync_requested()
    s.heartbeat("r0", 0, 2, now=101)
    assert s.sync_requested()
    assert s.grant("r0", now=101) is None  # nothing newer yet
    s.publish(PublishedVersion(version=5, handle={"method": "checkpoint"}), now=102)
    assert not s.sync_requested()  # answered
    assert s.grant("r0", now=102).version == 5
    s.synced("r0", 5, now=103)
    assert s.status()["replicas"][0]["sync_requested"] is False


def test_trainer_driven_replicas_pick_up_every_version():
    s = _state(SyncStyle.TRAINER_DRIVEN)
    s.publish(PublishedVersion(version=1, handle={"method": "checkpoint"}), now=100)
    assert s.grant("r0", now=100) is not None


def test_nccl_trainer_waits_only_for_live_replicas_that_are_due():
    s = _state(SyncStyle.FIXED, interval=4, offset=2)
    s.publish(PublishedVersion(version=1, handle={"method": "checkpoint"}), now=100)
    assert s.lagging(1) == 0  # neither replica reached its sync step
    s.heartbeat("r0", 0, 2, now=101)
    assert s.lagging(1) == 1
    s.grant("r0", now=101)
    s.synced("r0", 1, now=102)
    assert s.lagging(1) == 0
    s.heartbeat("r1", 0, 2, now=103)
    assert s.lagging(1) == 1
    s.expire(now=1000)  # r1 went silent: STOPPED, not waited for
    assert s.lagging(1) == 0

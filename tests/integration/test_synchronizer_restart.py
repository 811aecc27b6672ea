"""The synchronizer survives being killed: Ray restarts it, it rebuilds the latest version from
the trainer and the replicas' state from their next polls (a replica it does not know registers
again with its handles), grants nothing until syncs in flight renewed their leases, and in-flight
calls are retried; with its store it takes back its saved rollout (an open canary, a pin)."""

from __future__ import annotations

import time
import uuid

import pytest
import ray

from serve_rft.config import BufferConfig, SynchronizerConfig
from serve_rft.service.ray_start import init_local_ray
from serve_rft.synchronizer.actor import NAMESPACE, get_or_create_synchronizer
from serve_rft.trainer.actor import TRAINER_NAME
from serve_rft.types import PublishedVersion

pytestmark = pytest.mark.integration


@ray.remote(num_cpus=0)
class _StandInTrainer:
    """Only what the synchronizer asks a trainer for (a fake inside a test)."""

    def __init__(self):
        self.published = None

    def set(self, version: int, handle: dict) -> None:
        self.published = PublishedVersion(version=version, handle=handle)

    def latest_published(self):
        return self.published


@pytest.fixture
def ray_local():
    init_local_ray(ray.init, num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


CFG = SynchronizerConfig(sync_style="trainer_driven", lease_s=2.0)
BASE = {"method": "checkpoint", "path": "/base"}


def _poll(sync, rid, version=0):
    return ray.get(sync.poll.remote(rid, version, 0, 0.1))


def _kill_and_wait_restart(sync) -> None:
    """Kill the actor (Ray restarts it) and return once the new instance answers with a fresh
    membership (it knows no replica yet)."""
    old_pid = ray.get(sync.status.remote())["synchronizer"]["pid"]
    ray.kill(sync, no_restart=False)
    deadline = time.monotonic() + 60
    while True:
        try:
            st = ray.get(sync.status.remote(), timeout=10)
            if st["replicas"] == [] and st["synchronizer"]["pid"] != old_pid:
                return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "synchronizer did not restart"
        time.sleep(0.2)


def test_restarted_synchronizer_rebuilds_and_keeps_rolling(ray_local):
    trainer = _StandInTrainer.options(name=TRAINER_NAME, namespace=NAMESPACE).remote()
    sync = get_or_create_synchronizer(CFG)
    for rid in ("r0", "r1", "r2"):
        ray.get(sync.register.remote(rid, 0, BASE))
    handle = {"method": "checkpoint", "path": "/ckpt/v000003"}
    ray.get(trainer.set.remote(3, handle))
    ray.get(sync.publish.remote(3, handle))
    reply = _poll(sync, "r0")
    assert reply.order is not None and reply.order.version == 3

    _kill_and_wait_restart(sync)  # until the restarted instance answers (with a fresh state)
    # replicas it does not know are asked to register again (with the handles they hold)
    assert _poll(sync, "r1").known is False
    for rid in ("r1", "r2"):
        ray.get(sync.register.remote(rid, 0, BASE))
    # r0 is still loading v3: until its lease renewal arrives nothing is granted ...
    assert _poll(sync, "r1").order is None
    assert ray.get(sync.renew.remote("r0", 0, 3)) is True  # others serve: it may refuse requests
    time.sleep(1.1)  # ... and after it, its slot is taken
    assert _poll(sync, "r1").order is None
    ray.get(sync.synced.remote("r0", 3, None, handle))
    reply = _poll(sync, "r1")
    assert reply.order is not None and reply.order.version == 3 and reply.order.handle == handle
    assert _poll(sync, "r2").order is None  # r1 is syncing: r2 keeps serving
    ray.get(sync.synced.remote("r1", 3))
    assert _poll(sync, "r2").order.version == 3
    ray.get(sync.publish.remote(3, handle))  # a retried publish is idempotent
    st = ray.get(sync.status.remote())
    assert st["policy_version"] == 3 and len(st["replicas"]) == 3


# a short window with no rewards ends, at once, in the undecided verdict (promote): only a pause
# holds a candidate on its one canary
CANARY_CFG = SynchronizerConfig(sync_style="trainer_driven", lease_s=2.0, rollout="canary",
                                canary={"replicas": 1, "window_s": 1.0, "reward_wait_s": 0.0,
                                        "undecided": "promote"})


def test_a_pause_holds_the_rollout_and_a_restart_takes_back_the_canary_and_the_pin(ray_local, redis_server):
    """The canary synchronizer with its store (the session's redis-server); no trainer runs, so
    the saved rollout is the only source of what a restarted instance knows.

    A pause stops the rollout: v1 published while paused goes to its one canary (r0) and, its
    window over, no further: r1 stays on v0, before and after a restart; resumed, v1 is promoted
    and r1 is ordered to it. Killed with the canary open (and paused), the restarted instance,
    once the replicas registered again (as a replica does when its poll finds itself unknown;
    that rebuilds the state), has the same candidate, window start and pause. Killed again after
    an operator's pin, it has the pin back, and the pin holds: a newly published v2 does not
    roll, r1 is moved down to the pinned v0 instead.

    Shown to fail with the restore disabled (`ExperienceStore.load_rollout` made to return None):
    ``{'candidate': None} != {'candidate': 1}`` (the window and the pause lost as well) right
    after the first restart; with only the pin left out of `Rollout.restore`: ``assert (None ==
    0)`` after the second; with the pause ignored by `Rollout.decide`: v1 was promoted while
    paused (``incumbent 1, candidate None``) once its window was over."""
    buffer = BufferConfig(redis_url=redis_server.url, key_prefix=f"sr{uuid.uuid4().hex[:8]}")
    sync = get_or_create_synchronizer(CANARY_CFG, buffer)
    h1 = {"method": "checkpoint", "path": "/ckpt/v000001"}

    def register_all(r1_version=0, r1_handle=None):  # what each replica does when its poll finds itself unknown
        ray.get(sync.register.remote("r0", 1, BASE, h1))
        ray.get(sync.register.remote("r1", r1_version, BASE, r1_handle))
        ray.get(sync.register.remote("r2", 0, BASE))

    for rid in ("r0", "r1", "r2"):
        ray.get(sync.register.remote(rid, 0, BASE))
    ray.get(sync.pause_promotion.remote(True))
    ray.get(sync.publish.remote(1, h1))
    assert _poll(sync, "r0").order.version == 1  # the one canary slot
    ray.get(sync.synced.remote("r0", 1, None, h1))  # its window opens
    time.sleep(CANARY_CFG.canary.window_s + 1.5)  # the window is over; the monitor judged since
    before = ray.get(sync.rollout.remote())
    assert before["candidate"] == 1 and before["incumbent"] == 0 and before["verdicts"] == [], before
    assert _poll(sync, "r1").order is None  # paused: v1 goes no further than its canary

    _kill_and_wait_restart(sync)
    register_all()
    after = ray.get(sync.rollout.remote())
    assert {k: after[k] for k in ("candidate", "incumbent", "canary_window", "promotion_paused")} == {
        "candidate": 1, "incumbent": 0, "canary_window": before["canary_window"], "promotion_paused": True}
    time.sleep(CANARY_CFG.lease_s / 2 + 1.1)  # past the restarted instance's hold, and a monitor period
    assert _poll(sync, "r1").order is None  # still paused after the restart

    ray.get(sync.pause_promotion.remote(False))
    deadline = time.monotonic() + 10
    while ray.get(sync.rollout.remote())["incumbent"] != 1:  # the next monitor period's verdict
        assert time.monotonic() < deadline, ray.get(sync.rollout.remote())
        time.sleep(0.2)
    reply = _poll(sync, "r1")
    assert reply.order is not None and reply.order.version == 1  # resumed: v1 rolls on

    ray.get(sync.synced.remote("r1", 1, None, h1))
    ray.get(sync.pin.remote(0))
    _kill_and_wait_restart(sync)
    register_all(1, h1)
    after = ray.get(sync.rollout.remote())
    assert after["pinned"] == 0 and after["candidate"] is None, after
    ray.get(sync.publish.remote(2, {"method": "checkpoint", "path": "/ckpt/v000002"}))
    time.sleep(CANARY_CFG.lease_s / 2 + 0.1)  # past the restarted instance's hold on grants
    reply = _poll(sync, "r1", 1)
    assert reply.order is not None and reply.order.version == 0  # pinned: not the new v2


def test_states_are_exported_as_prometheus_metrics(monkeypatch):
    import httpx

    from serve_rft.buffer.redis_server import free_port

    monkeypatch.setenv("RAY_metrics_report_interval_ms", "500")
    port = free_port()
    init_local_ray(ray.init, num_cpus=2, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=port)
    try:
        sync = get_or_create_synchronizer(CFG)
        for rid in ("r0", "r1"):
            ray.get(sync.register.remote(rid, 0, BASE))
        ray.get(sync.publish.remote(1, {"method": "checkpoint", "path": "/x"}))
        assert _poll(sync, "r0").order.version == 1
        ray.get(sync.synced.remote("r0", 1, {"total_s": 0.5, "load_s": 0.1, "bytes": 1000.0}))
        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            if "serve_rft_sync_seconds" in text and "serve_rft_replica_state" in text:
                break
            time.sleep(0.5)
        lines = [ln for ln in text.splitlines() if ln.startswith("ray_serve_rft_")]
        assert any('replica="r0"' in ln and 'state="RUNNING"' in ln and ln.endswith(" 1.0") for ln in lines
                   if ln.startswith("ray_serve_rft_replica_state")), lines
        assert any(ln.startswith("ray_serve_rft_replica_policy_version") and 'replica="r0"' in ln
                   and ln.endswith(" 1.0") for ln in lines), lines
        assert any(ln.startswith("ray_serve_rft_sync_seconds_count") and 'phase="total"' in ln for ln in lines), lines
    finally:
        ray.shutdown()

"""The synchronizer survives being killed: Ray restarts it, it rebuilds the latest version from
the trainer and the replicas' state from their next polls (a replica it does not know registers
again with its handles), grants nothing until syncs in flight renewed their leases, and in-flight
calls are retried."""

from __future__ import annotations

import time

import pytest
import ray

from serve_rft.config import SynchronizerConfig
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
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


CFG = SynchronizerConfig(sync_style="trainer_driven", lease_s=2.0)
BASE = {"method": "checkpoint", "path": "/base"}


def _poll(sync, rid, version=0):
    return ray.get(sync.poll.remote(rid, version, 0, 0.1))


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

    ray.kill(sync, no_restart=False)
    deadline = time.monotonic() + 60
    while True:  # until the restarted instance answers (with a fresh state)
        try:
            st = ray.get(sync.status.remote(), timeout=10)
            if st["replicas"] == []:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "synchronizer did not restart"
        time.sleep(0.2)
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


def test_states_are_exported_as_prometheus_metrics(monkeypatch):
    import httpx

    from serve_rft.buffer.redis_server import free_port

    monkeypatch.setenv("RAY_metrics_report_interval_ms", "500")
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
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

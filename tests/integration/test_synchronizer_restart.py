"""The synchronizer survives being killed: Ray restarts it, it rebuilds the latest version from
the trainer and the replicas' state from their next polls, and in-flight calls are retried."""

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


def test_restarted_synchronizer_rebuilds_and_keeps_rolling(ray_local):
    trainer = _StandInTrainer.options(name=TRAINER_NAME, namespace=NAMESPACE).remote()
    sync = get_or_create_synchronizer(SynchronizerConfig(sync_style="trainer_driven"), num_replicas=2)
    for rid in ("r0", "r1"):
        ray.get(sync.register.remote(rid, 0))
    handle = {"method": "checkpoint", "path": "/ckpt/v000003"}
    ray.get(trainer.set.remote(3, handle))
    ray.get(sync.publish.remote(3, handle))
    order = ray.get(sync.poll.remote("r0", 0, 0, 0.1))
    assert order is not None and order.version == 3

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
    # ... rebuilt from the trainer and from the replicas' next polls; until a second replica
    # has reported in, the only known one must keep serving
    assert ray.get(sync.poll.remote("r0", 0, 0, 0.1)) is None
    order = ray.get(sync.poll.remote("r1", 0, 0, 0.1))
    assert order is not None and order.version == 3 and order.handle == handle
    assert ray.get(sync.poll.remote("r0", 0, 0, 0.1)) is None  # r1 is syncing: r0 keeps serving
    ray.get(sync.synced.remote("r1", 3))
    assert ray.get(sync.poll.remote("r0", 0, 0, 0.1)).version == 3
    ray.get(sync.publish.remote(3, handle))  # a retried publish is idempotent
    st = ray.get(sync.status.remote())
    assert st["policy_version"] == 3 and len(st["replicas"]) == 2


def test_states_are_exported_as_prometheus_metrics(monkeypatch):
    import httpx

    from serve_rft.buffer.redis_server import free_port

    monkeypatch.setenv("RAY_metrics_report_interval_ms", "500")
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=port)
    try:
        sync = get_or_create_synchronizer(SynchronizerConfig(sync_style="trainer_driven"), num_replicas=2)
        for rid in ("r0", "r1"):
            ray.get(sync.register.remote(rid, 0))
        ray.get(sync.publish.remote(1, {"method": "checkpoint", "path": "/x"}))
        assert ray.get(sync.poll.remote("r0", 0, 0, 0.1)).version == 1
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

"""The synchronizer's monitor loop: a Redis outage never holds up the death checks."""

from __future__ import annotations

import asyncio
import time

from serve_rft.config import SynchronizerConfig
from serve_rft.synchronizer import actor as sync_actor
from serve_rft.synchronizer import monitor


class _Hanging:
    """A store whose every call hangs (Redis away; the client retries for buffer.reconnect_s)."""

    async def version_rewards(self, *_a, **_k):
        await asyncio.sleep(3600)

    async def save_rollout(self, *_a, **_k):
        await asyncio.sleep(3600)


class _State:
    """Counts the death checks (`SyncState.expire`) the monitor runs."""

    def __init__(self):
        self.expired_at: list[float] = []
        self.rollout = type("R", (), {"snapshot": lambda _self: {"changed": time.monotonic()},
                                      "canary_window": lambda _self: None})()

    def expire(self, now: float, every_s: float = 0.0) -> None:
        self.expired_at.append(now)


def test_the_death_checks_run_every_period_while_redis_hangs(monkeypatch):
    monkeypatch.setattr(monitor, "MONITOR_PERIOD_S", 0.05)
    monkeypatch.setattr(monitor, "STORE_STEP_S", 0.1)
    sync = object.__new__(sync_actor.Synchronizer.__ray_metadata__.modified_class)
    sync.state, sync._ran_at = _State(), time.time()

    async def nothing(*_a, **_k):
        return True

    # the actor's own expiry (its stall pardon, then the state's), as the actor wires it
    mon = monitor.SyncMonitor(SynchronizerConfig(), sync.state, _Hanging(), None, sync._expire, nothing)
    assert sync.state.hold_grants_until == float("inf")  # nothing granted before the rebuild
    mon._rebuilt = True  # rebuilt: the rollout is saved every period (and the save hangs)
    mon.rebuild = mon.check_ray = nothing

    async def go():
        task = asyncio.create_task(mon.watch())
        await asyncio.sleep(1.5)
        task.cancel()

    asyncio.run(go())
    # each period: 0.05 s sleep + at most 0.1 s of store step; a hanging save would allow one
    assert len(sync.state.expired_at) >= 8, sync.state.expired_at

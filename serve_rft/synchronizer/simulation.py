"""A simulated replica fleet driven by the synchronizer's own state machine, on a simulated clock.

`Fleet` plays every replica and the trainer against the real
`serve_rft.synchronizer.state.SyncState`, exactly as the actors do: a replica polls (``expire``,
``heartbeat``, ``grant``); while it syncs it renews its lease and reports ``synced`` / ``failed``;
Ray reports deaths with ``lost``; the trainer publishes versions and prunes checkpoints below the
in-use floor. World events (kills, stalls, scale-downs, operator drains, synchronizer restarts,
versions whose load always fails) are methods; `Fleet.advance` runs the event queue on the
simulated clock (seconds). Nothing here touches Ray, Redis or vLLM: the state machine is the
only real part.

`SimReplica` holds the truth about one replica, and with ``check=True`` every grant is checked
against it (no grant leaves no replica serving, at most ``max_unavailable`` syncing, no granted
version whose checkpoint was pruned); violations are collected in ``Fleet.violations``.

Used by tests/unit/test_sync_properties.py (hypothesis invariants step by step),
tests/unit/test_rollout.py (canary promotion and rollback) and benchmarks/rollout_sim.py (version
lag and capacity lost to syncs for fleets of 8 to 4,096 replicas).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass
from typing import Callable

from serve_rft.config import SynchronizerConfig
from serve_rft.synchronizer.state import SyncState
from serve_rft.types import PublishedVersion


@dataclass
class SimReplica:
    """The truth about one simulated replica (the state machine only sees what it reports)."""

    rid: str
    version: int = 0
    alive: bool = True
    stuck: bool = False  # alive to Ray but its event loop no longer runs: no polls, no renewals
    stuck_at: float = 0.0
    syncing: int | None = None
    sync_from: int = 0
    sync_done_at: float = 0.0
    drained: bool = False  # holds an operator's drain: learned from its last poll answer, as a replica does
    routable: bool = False  # the ingress routes to it (a moment after it registered)
    routable_at: float = float("inf")

    @property
    def up(self) -> bool:
        return self.alive and not self.stuck

    @property
    def serving(self) -> bool:
        return self.up and self.routable and self.syncing is None and not self.drained


class Fleet:
    """Replicas, a trainer and a `SyncState` on one simulated clock.

    Args:
        cfg: the synchronizer's settings.
        load_time: draws one sync's duration in seconds (drain + load + verify).
        seed: the random generator's seed.
        poll_s: seconds between a replica's polls (the actor long-polls for 1 s).
        keep_checkpoints: the trainer's ``keep_checkpoints`` (pruning below the in-use floor).
        check: check every grant against the replicas' truth (O(replicas) per grant) and record
            violations in ``violations``; off for large benchmark fleets.
    """

    def __init__(self, cfg: SynchronizerConfig, load_time: Callable[[random.Random], float],
                 seed: int = 0, poll_s: float = 1.0, keep_checkpoints: int = 5, check: bool = True):
        self.cfg = cfg
        self.load_time = load_time
        self.rng = random.Random(seed)
        self.poll_s = poll_s
        self.keep = keep_checkpoints
        self.check = check  # check every grant against the truth (O(replicas) per grant)
        self.now = 1000.0
        self.state = SyncState(cfg)
        self.replicas: dict[str, SimReplica] = {}
        self.bad: set[int] = set()  # versions whose load always fails (e.g. a corrupted file)
        self.checkpoints: set[int] = set()  # committed version folders on disk
        self.version = 0
        self.grants: list[tuple[float, str, int, bool]] = []  # (t, replica, version, others serving)
        self.violations: list[str] = []
        self._heap: list[tuple[float, int, str, str]] = []
        self._seq = 0
        self._n = 0
        self._waiting: dict[str, None] = {}  # replicas whose last poll was refused (long-polling)
        self._unreported: set[str] = set()  # killed, Ray not asked yet
        self.live_s = 0.0  # replica-seconds live, and out of rotation (the capacity syncs cost)
        self.out_s = 0.0

    # -- world events ------------------------------------------------------------------
    def _push(self, t: float, kind: str, rid: str) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, rid))

    def add_replica(self) -> str:
        """A replica starts: it loads what the synchronizer says a new replica loads, then registers."""
        self._n += 1
        rid = f"r{self._n:05d}"
        init = self.state.initial()
        r = self.replicas[rid] = SimReplica(rid, init.version if init else 0)
        self.state.register(rid, r.version, self.now, base_handle={"method": "checkpoint", "path": "/base"},
                            warming=True)
        self._push(self.now + self.rng.random() * self.poll_s, "poll", rid)
        self._push(self.now + self.rng.uniform(0.5, 3.0), "routable", rid)
        return rid

    def publish(self, bad: bool = False) -> int:
        """The trainer publishes the next version (pruning checkpoints below the in-use floor)."""
        self.version += 1
        v = self.version
        if bad:
            self.bad.add(v)
        self.checkpoints.add(v)
        floor = self.state.in_use_floor(self.now)
        for old in sorted(self.checkpoints)[:-self.keep]:
            if old < floor:
                self.checkpoints.discard(old)
        self.state.publish(PublishedVersion(v, {"method": "checkpoint", "path": f"/v{v}"}, self.now), self.now)
        self._wake()
        return v

    def kill(self, rid: str, reported: bool = True) -> None:
        """kill -9. Ray reports the dead actor at once (``reported``), or the synchronizer finds
        it dead when it checks Ray before its next grant (`_ray_check`)."""
        self.replicas[rid].alive = False
        if reported:
            self.state.lost(rid, self.now)
            self._wake()
        else:
            self._unreported.add(rid)

    def _ray_check(self) -> None:
        """The synchronizer asks Ray which replica actors are alive before it grants a sync."""
        for rid in sorted(self._unreported):  # a fixed order: a seed replays the same run
            self.state.lost(rid, self.now)
        self._unreported.clear()

    def stall(self, rid: str) -> None:
        """The replica's event loop stops (alive to Ray): it counts as serving until
        ``replica_timeout_s`` passes without a poll."""
        self.replicas[rid].stuck = True
        self.replicas[rid].stuck_at = self.now

    def scale_down(self, rid: str) -> None:
        """Ray Serve stops a replica gracefully."""
        self.replicas[rid].alive = False
        self.state.left(rid, self.now)
        self._wake()

    def drain(self, rid: str, drained: bool) -> bool:
        """An operator drains (``drained``) or undrains replica ``rid``; False when the state
        machine refuses it (unknown replica, or a drain that would leave none in rotation)."""
        try:
            self.state.set_drained(rid, drained, self.now)
        except (KeyError, ValueError):
            return False
        if not drained:  # the replica itself learns either from its next poll answer (`_poll`)
            self._wake()
        return True

    def restart_synchronizer(self) -> None:
        """Ray restarts the synchronizer: fresh state, rebuilt from its saved rollout, the
        trainer's latest version and the replicas' next polls and renewals (as the actor does)."""
        snap = self.state.rollout.snapshot()
        self.state = SyncState(self.cfg)
        self.state.restarted(self.now)
        self.state.rollout.restore(snap, self.now)
        if self.version:
            self.state.publish(PublishedVersion(self.version, {"method": "checkpoint", "path": f"/v{self.version}"},
                                                self.now), self.now)

    # -- the replicas' side of the protocol ---------------------------------------------
    def _poll(self, r: SimReplica) -> None:
        st = self.state
        st.expire(self.now, every_s=self.poll_s / 2)
        if not st.known(r.rid):
            st.register(r.rid, r.version, self.now, base_handle={"method": "checkpoint", "path": "/base"},
                        handle={"method": "checkpoint", "path": f"/v{r.version}"} if r.version else None,
                        drained=r.drained, warming=not r.routable)
        st.heartbeat(r.rid, r.version, 0, self.now, ready=r.routable, drained=r.drained)
        self._ray_check()
        order = st.grant(r.rid, self.now)
        r.drained = st.drain_holds(r.rid)  # the poll answer's drain (serve_rft/synchronizer/actor.py poll)
        if order is None:
            self._waiting[r.rid] = None
            return
        self._waiting.pop(r.rid, None)
        self._check_grant(r, order.version, order.others_serving)
        r.syncing, r.sync_from = order.version, r.version
        r.sync_done_at = self.now + self.load_time(self.rng)
        self._push(r.sync_done_at, "done", r.rid)
        self._push(self.now + self.cfg.lease_s / 4, "renew", r.rid)

    def _check_grant(self, r: SimReplica, version: int, others: bool) -> None:
        if not self.check:
            return
        up = [x for x in self.replicas.values() if x.up and x.routable]
        # a replica that turned routable counts once its next heartbeat (a poll, every poll_s) said
        # so: until then the synchronizer knows it as warming, and a lone ready replica may sync
        # (told that no other serves, it holds its requests rather than refusing them; documented)
        known_ready = [x for x in up if x is r or self.now - x.routable_at > self.poll_s]
        # a stalled replica counts as serving until replica_timeout_s without a poll, found by
        # the expiry scan that runs every half poll period (documented)
        slack = self.cfg.replica_timeout_s + self.poll_s / 2
        counted = [x for x in self.replicas.values() if x.alive and x.stuck and x.syncing is None and x.routable
                   and not x.drained and self.now - x.stuck_at <= slack]
        serving_after = [x for x in up + counted if x.serving or x in counted]
        serving_after = [x for x in serving_after if x is not r]
        if len(known_ready) >= 2 and r.routable and not r.drained and not serving_after:
            self.violations.append(f"t={self.now:.1f}: grant to {r.rid} left no replica serving")
        if version != 0 and version not in self.checkpoints:
            self.violations.append(f"t={self.now:.1f}: granted v{version}, whose checkpoint was pruned")
        syncing = sum(x.syncing is not None and not x.drained for x in up) + (not r.drained and r.routable)
        if syncing > self.cfg.max_unavailable:
            self.violations.append(f"t={self.now:.1f}: {syncing} replicas syncing at once")
        self.grants.append((self.now, r.rid, version, others))

    def _finish(self, r: SimReplica) -> None:
        v = r.syncing
        r.syncing = None
        if v in self.bad or (v != 0 and v not in self.checkpoints):
            self.state.failed(r.rid, v, "load failed", self.now, r.version)  # restored the previous version
        else:
            r.version = v
            self.state.synced(r.rid, v, self.now)
        self._push(self.now + self.rng.random() * 0.01, "poll", r.rid)
        self._wake()

    def _wake(self) -> None:
        """A state change wakes the long-polling replicas (the actor's condition variable); stop
        at the first one refused for want of a free slot: the others would be too."""
        for rid in list(self._waiting)[: 4 * self.cfg.max_unavailable + 4]:
            if self.state.members.n_out >= self.cfg.max_unavailable:
                return
            r = self.replicas.get(rid)
            if r is None or not r.up or r.syncing is not None:
                self._waiting.pop(rid, None)
                continue
            self._poll(r)

    # -- the clock ---------------------------------------------------------------------
    def advance(self, dt: float) -> None:
        """Run every event up to ``now + dt``."""
        end = self.now + dt
        while self._heap and self._heap[0][0] <= end:
            t, _, kind, rid = heapq.heappop(self._heap)
            self._account(t - self.now)
            self.now = t
            r = self.replicas.get(rid)
            if r is None or not r.up:
                continue
            if kind == "poll":
                if r.syncing is None:
                    self._poll(r)
                self._push(self.now + self.poll_s, "poll", rid)
            elif kind == "renew" and r.syncing is not None:
                self.state.renew(rid, r.sync_from, r.syncing, self.now, r.drained)
                self._push(self.now + self.cfg.lease_s / 4, "renew", rid)
            elif kind == "done" and r.syncing is not None and self.now >= r.sync_done_at:
                self._finish(r)
            elif kind == "routable":
                r.routable, r.routable_at = True, self.now
        self._account(end - self.now)
        self.now = end
        self.state.expire(self.now)

    def _account(self, dt: float) -> None:
        """Integrate live and out-of-rotation replica-seconds (the state's O(1) counts)."""
        if dt > 0:
            self.live_s += self.state.members.n_live * dt
            self.out_s += self.state.members.n_out * dt

    def converged(self) -> bool:
        """Every replica that is up serves what the synchronizer wants it to."""
        st = self.state
        return all(st.members.get(r.rid) is None or st.settled(st.members.get(r.rid))
                   for r in self.replicas.values() if r.up)

"""The synchronizer state's side that hears from the replicas: who is there, what each serves.

A component of `serve_rft.synchronizer.state.SyncState` (its module docstring gives the membership
rules): a replica registers (or re-introduces itself to a restarted synchronizer), polls with a
heartbeat, renews the lease of a sync in flight, is drained or undrained by an operator, leaves
gracefully, is reported dead by Ray, or expires unheard. Pure Python, every call takes ``now``
(unix seconds of the caller's clock). It holds no state of its own: the replicas live in the
`Membership`, the versions in `Versions`, the incumbent and pin in the `Rollout` it is given.
"""

from __future__ import annotations

from typing import Callable

from serve_rft.config import SynchronizerConfig
from serve_rft.synchronizer.membership import Membership, ReplicaInfo
from serve_rft.synchronizer.rollout import Rollout
from serve_rft.synchronizer.versions import Versions
from serve_rft.types import ComponentState, PublishedVersion


class ReplicaEvents:
    """The membership transitions (module docstring).

    Args:
        cfg: the synchronizer's settings (sync style, lease, rollout kind).
        members: the replicas (read, and changed through ``update``).
        versions: the version registry (a registering replica brings its handles).
        rollout: the incumbent and pinned versions (`initial`); its lag clocks close when a
            replica goes.
        update: ``(replica, now, kind="state", detail=None, **changes)``: every change of a
            replica's ``state`` / ``policy_version`` / ``drained`` / ``warming`` / ``undraining``
            goes through it (`Membership.update`, with the state's clock noted).
    """

    def __init__(self, cfg: SynchronizerConfig, members: Membership, versions: Versions, rollout: Rollout,
                 update: Callable[..., None]):
        self.cfg, self.members, self.versions, self.rollout = cfg, members, versions, rollout
        self._update = update

    def register(self, replica_id: str, version: int, now: float, base_handle: dict | None = None,
                 handle: dict | None = None, drained: bool = False, pid: int | None = None,
                 warming: bool = False, node_id: str | None = None) -> None:
        """A replica came up (or re-introduced itself to a restarted synchronizer) serving
        ``version``; ``base_handle`` loads its initial weights (version 0), ``handle`` the version
        it serves, ``drained`` whether it holds an operator's drain (a replica this state knows
        from a lease renewal keeps the drain the renewal or an operator gave it since: the
        replica's own flag is older), ``warming``: no request reached
        it yet (it is not counted in rotation until one does); ``pid`` / ``node_id``: its process and
        Ray node, kept for operators."""
        if base_handle is not None:
            self.versions.add(0, base_handle, now)
        if handle is not None and version > 0:
            self.versions.add(version, handle, now)
            if self.cfg.rollout == "rolling":  # it rolled once: a restarted synchronizer's fallback
                self.versions.promote(version, now)
        r = self.members.get(replica_id)
        kind = "state" if r is not None else "joined"
        r = r or self.members.add(replica_id, version, now)
        if not r.alive:
            return  # a replica Ray reported dead does not come back under the same id
        r.last_seen, r.introduced = now, True
        r.pid = pid if pid is not None else r.pid
        r.node_id = node_id if node_id is not None else r.node_id
        r.clear_sync()
        undraining = False
        if kind == "state" and r.drain_known:  # its renewal told the drain: an operator's word since is newer
            drained, undraining = r.drained, drained and not r.drained  # put back: it refuses until it says not
        r.drain_known = False
        self._update(r, now, kind, state=ComponentState.RUNNING, policy_version=version, drained=drained,
                     warming=warming, undraining=undraining)
        self._observe(r, r.schedule.explorer_step, now)

    def known(self, replica_id: str) -> bool:
        """False: the replica should `register` (with its handles) before it polls."""
        r = self.members.get(replica_id)
        return r is not None and r.alive and r.introduced

    def initial(self) -> PublishedVersion | None:
        """What a replica starting now loads before it serves: the pinned version, else the
        incumbent (None: its initial weights)."""
        pinned = self.rollout.pinned
        version = pinned if pinned is not None else self.rollout.incumbent
        v = self.versions.get(version)
        if version == 0 or v is None or v.handle is None:
            return None
        return PublishedVersion(version=version, handle=v.handle, published_at=v.published_at)

    def _observe(self, r: ReplicaInfo, step: int, now: float) -> None:
        c = self.cfg
        r.schedule.observe(c.sync_style, step, r.policy_version, c.sync_interval, c.sync_offset,
                           c.sync_timeout_s, now)

    def heartbeat(self, replica_id: str, version: int, explorer_step: int, now: float,
                  refused: int | None = None, ready: bool = True, drained: bool = False) -> None:
        """A replica's poll: it is alive, serves ``version``, reached ``explorer_step`` and has
        refused ``refused`` requests so far while out of rotation. Unknown replicas must
        `register` first (they send their handles then). ``ready``: a request reached it through
        the ingress (it leaves warming). ``drained``: whether it holds an operator's drain now
        (False ends *undraining*)."""
        r = self.members.get(replica_id)
        if r is None or not r.alive:
            return
        r.last_seen = now
        if ready and r.warming:
            self._update(r, now, "ready", warming=False)
        if r.undraining and not drained:
            self._update(r, now, "back", undraining=False)
        if refused is not None:
            r.refused = refused
        if r.state is not ComponentState.RUNNING:  # came back, or its sync ended unreported
            r.clear_sync()
            self._update(r, now, state=ComponentState.RUNNING, policy_version=version)
        elif r.policy_version != version:  # the replica knows best what it serves
            self._update(r, now, policy_version=version)
        self._observe(r, explorer_step, now)

    def renew(self, replica_id: str, version: int, granted: int, now: float, drained: bool = False) -> bool:
        """A syncing replica renews its lease (and is alive); ``version``: the version it serves
        (and restores on failure), ``granted``: the one it loads, ``drained``: an operator's
        drain it holds (a restarted synchronizer learns it here).

        Returns:
            Whether another replica is in rotation (behind HAProxy the syncing one may then
            refuse new requests; otherwise it holds them).
        """
        r = self.members.get(replica_id)
        if r is None:  # a restarted synchronizer: the sync in flight keeps its slot
            r = self.members.add(replica_id, version, now)
            r.introduced, r.drain_known = False, True
            self._update(r, now, drained=drained)
        elif r.state is ComponentState.RUNNING and r.granted != granted:
            r.last_seen = now  # a renewal that arrived after its sync ended (synced / failed)
            return self.members.serving_besides(r) > 0
        if r.alive:
            r.last_seen = now
            r.granted = granted
            r.sync_started = r.sync_started if r.sync_started is not None else now
            r.lease_until = now + self.cfg.lease_s
            self._update(r, now, state=ComponentState.REQUIRE_SYNC, policy_version=version)
        return self.members.serving_besides(r) > 0

    def set_drained(self, replica_id: str, drained: bool, now: float) -> None:
        """An operator takes a replica out of rotation (it refuses or holds new requests) or
        puts it back.

        Raises:
            KeyError: unknown replica.
            ValueError: draining it would leave no live replica in rotation.
        """
        r = self.members.replicas[replica_id]
        if not r.introduced:  # known from a renewal or a report: this word outlives its re-registration
            r.drain_known = True
        if r.drained == drained:
            return
        if drained and r.in_rotation and self.members.n_live >= 2 and self.members.serving_besides(r) == 0:
            raise ValueError(f"draining {replica_id} would leave no replica in rotation")
        # put back, it counts in rotation once its next poll says it stopped refusing (`heartbeat`)
        self._update(r, now, "drained" if drained else "undrained", drained=drained,
                     undraining=not drained)

    def left(self, replica_id: str, now: float) -> None:
        """Ray Serve stopped the replica gracefully (scale-down, redeploy)."""
        if self.members.gone(replica_id, now, "left"):
            self.rollout.close_lags(now)

    def lost(self, replica_id: str, now: float) -> None:
        """Ray reports the replica's actor dead."""
        if self.members.gone(replica_id, now, "lost"):
            self.rollout.close_lags(now)

    def expire(self, now: float, every_s: float = 0.0) -> list[str]:
        """`Membership.expire`: STOPPED for replicas unheard (or whose sync lease lapsed).

        Returns:
            The ids newly STOPPED.
        """
        stopped = self.members.expire(now, every_s)
        if stopped:
            self.rollout.close_lags(now)
        return stopped

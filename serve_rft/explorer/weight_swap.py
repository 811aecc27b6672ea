"""A replica's side of the synchronizer protocol: poll, drain, load, verify, serve.

`WeightSwap` runs in the replica's event loop next to its HTTP routes. It polls the
`Synchronizer` every second (a heartbeat that carries the replica's per-version request counts
for a canary); when granted a sync it

1. checks the version's checksums before anything else (CHECKPOINT; MEMORY checks each bucket as
   it arrives) and holds a *lease* it renews every ``lease_s / 4`` until the end, so a slow load
   keeps its slot and a dead replica loses it;
2. drains: new chat requests are refused with 503 (behind HAProxy, which re-sends them to another
   replica) while another replica serves, else held at a gate (they wait, none fail); a request
   too large for HAProxy to re-send is held too (`WeightSwap.admission`); the
   synchronizer's answer to each renewal says which, so a replica whose peer died stops refusing;
3. pauses vLLM (``wait``: in-flight requests finish first; ``keep``: they freeze and continue on
   the new weights), loads, resumes;
4. verifies: the probe logprobs against the trainer's (`serve_rft.weights.verify`),
   restoring the previous version if they differ;
5. opens the gate and reports ``synced`` (or ``failed``; the synchronizer backs off and
   quarantines).

Adapter-only LoRA sync registers the adapter without drain or pause and switches new requests to
it only after the probe passed. A sync that outlives ``load_timeout_s`` marks the replica broken:
its health check fails and Ray Serve replaces it. An operator's drain (``PollReply.drained``) uses
the same refusal path.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from typing import Callable

from serve_rft.config import Config
from serve_rft.explorer.http.ingress_mode import haproxy_enabled, refusals_are_retried
from serve_rft.types import PollReply, SyncOrder
from serve_rft.weights import EngineBroken, LoadFailed, load_or_restore, receiver_for
from serve_rft.weights.verify import ProbeMismatch, VersionCorrupt, check_probe

log = logging.getLogger("serve_rft.explorer")

POLL_S = 1.0
MAX_POLL_FAILURES_S = 120.0
REFUSED_IDS_KEPT = 4096
"""How many refused requests' ids a replica remembers (a request HAProxy brings back is not refused
again, `WeightSwap.admission`); at ~40 bytes each, bounded memory."""


class WeightSwap:
    """Drain state, the serving version and the sync loop of one replica.

    Args:
        replica_id: the Serve replica's id; ``actor_name``: its Ray actor name (namespace
            ``serve``), by which the synchronizer learns of its death.
        engine: the replica's `ExplorerEngine`; ``sync``: the `Synchronizer` handle.
        cfg: the run config; ``model_path``: the initial weights (version 0).
        explorer_step: returns the replica's explorer step (experiences logged / step size).
        node_id: the Ray node it runs on (reported to the synchronizer, shown in /v1/status).
    """

    def __init__(self, replica_id: str, actor_name: str | None, engine, sync, cfg: Config, model_path: str,
                 explorer_step: Callable[[], int], node_id: str | None = None):
        self.replica_id, self.actor_name, self.node_id = replica_id, actor_name, node_id
        self.engine, self.sync, self.cfg = engine, sync, cfg
        self.explorer_step = explorer_step
        self.base_handle = {"method": "checkpoint", "path": model_path}
        self.loaded = self.base_handle  # handle of the version served now
        self.verified_version = 0  # adapter-only sync: the adapter new requests get
        self.syncing = False
        self.operator_drained = False
        self.refuses = False  # while draining: refuse new chat requests (HAProxy re-sends them)
        self.gate = asyncio.Event()  # set while new requests may start
        self.gate.set()
        self.refused = 0  # refusals during the current sync
        self.refused_total = 0  # refusals since start (syncs and operator drains)
        self.refused_ids: OrderedDict[str, None] = OrderedDict()  # the last REFUSED_IDS_KEPT refused
        self.reached = False  # a request came through the ingress: the replica is routable
        self.role = "incumbent"
        self.last_sync: dict[str, float] = {}
        self.traffic: dict[int, list] = {}  # version -> [requests, errors, latency s] since last poll
        self.haproxy = haproxy_enabled()
        self.refusals_retried = refusals_are_retried()
        self.broken: BaseException | None = None
        self.task: asyncio.Task | None = None

    # -- what the HTTP routes ask ------------------------------------------------------
    @property
    def version(self) -> int:
        """The policy version a request starting now is answered with."""
        return self.verified_version if self.engine.adapter_sync else self.engine.policy_version

    @property
    def draining(self) -> bool:
        return self.syncing and not self.gate.is_set() or self.operator_drained

    def admission(self, retryable: bool = True, request_id: str | None = None) -> str:
        """``serve``, ``refuse`` (answer 503, HAProxy re-sends it) or ``hold`` (wait for the gate).

        A request is refused for a drain at most once. HAProxy re-sends a refusal to another
        replica; if that one is dead (killed while this one drains, before the synchronizer
        learns of it) or refuses too, HAProxy's next retry comes back here with the same id
        (``unique-id-header``, `serve_rft.service.ingress.RETRY_ON`), and is then held (or
        served, during an operator's drain) rather than refused into HAProxy's exhausted retries.

        Args:
            retryable: HAProxy could re-send this request (it fits its buffer,
                `serve_rft.explorer.http.ingress_mode.fits_a_retry`). One it could not is never
                refused for a drain: held while weights load, served during an operator's drain.
            request_id: the id HAProxy gave the request (`ingress_mode.haproxy_request_id`), if any.
        """
        if self.broken is not None:
            return "refuse"
        if not self.draining:
            return "serve"
        if not retryable or (request_id is not None and request_id in self.refused_ids):
            return "serve" if self.gate.is_set() else "hold"
        if self.refuses or (self.operator_drained and self.refusals_retried):
            self.refused += 1
            self.refused_total += 1
            if request_id is not None:
                self.refused_ids[request_id] = None
                if len(self.refused_ids) > REFUSED_IDS_KEPT:
                    self.refused_ids.popitem(last=False)
            return "refuse"
        return "hold"

    def record(self, version: int, ok: bool, seconds: float) -> None:
        """A request ended: counted per version for the synchronizer (canary verdicts)."""
        t = self.traffic.setdefault(version, [0, 0, 0.0])
        t[0] += 1
        t[1] += not ok
        t[2] += seconds

    # -- start and stop ----------------------------------------------------------------
    async def start(self) -> None:
        """Load what a new replica should serve (pinned, else the incumbent) with the same checks
        as a sync, register, poll. A version that fails them is reported (it counts toward its
        quarantine) and the replica starts on its initial weights instead."""
        initial = await self.sync.initial.remote()
        refused = None
        if initial is not None:
            order = SyncOrder(version=initial.version, handle=initial.handle, drain_mode="wait")
            try:  # nothing is served yet: no drain, no pause
                if self.cfg.synchronizer.verify:
                    await receiver_for(order.handle).precheck(order.handle)
                await load_or_restore(self.engine, order.handle, order.version, self.base_handle, 0)
                await self._verify(order, bool(order.handle.get("adapter")), self.base_handle, 0)
                self.loaded = order.handle
            except (VersionCorrupt, LoadFailed) as e:
                log.error("replica %s: initial version %s refused: %r", self.replica_id, order.version, e)
                refused = (order.version, repr(e))
        self.verified_version = self.engine.policy_version
        await self._register()
        if refused is not None:
            await self.sync.failed.remote(self.replica_id, refused[0], refused[1], self.engine.policy_version)
        self.task = asyncio.create_task(self._loop())

    async def _register(self) -> None:
        await self.sync.register.remote(
            self.replica_id, self.engine.policy_version, self.base_handle,
            self.loaded if self.engine.policy_version else None, self.operator_drained, self.actor_name,
            os.getpid(), not self.reached, self.node_id)

    def leave(self) -> None:
        """Ray Serve stops this replica: tell the synchronizer (fire and forget)."""
        try:
            self.sync.left.remote(self.replica_id)
        except Exception:  # noqa: BLE001 - Ray is shutting down: the synchronizer learns from Ray
            pass

    def check(self) -> None:
        """For Ray Serve's health check. Raises RuntimeError: the swap broke the engine or the
        loop ended (Serve replaces the replica, which loads the latest version first)."""
        if self.broken is not None:
            raise RuntimeError(f"weight swap broke this replica: {self.broken!r}")
        if self.task is not None and self.task.done():
            raise RuntimeError(f"sync loop ended: {self.task.exception()!r}")

    # -- the loop ----------------------------------------------------------------------
    async def _loop(self) -> None:
        """Poll, and apply what is granted. A failed poll (the synchronizer restarting, Ray busy)
        is retried every second for up to `MAX_POLL_FAILURES_S`; then the loop ends and the
        health check has Ray Serve replace this replica. A broken sync ends it at once."""
        failing_since = None
        while True:
            traffic, self.traffic = self.traffic, {}
            try:
                reply: PollReply = await self.sync.poll.remote(
                    self.replica_id, self.engine.policy_version, self.explorer_step(), POLL_S, traffic,
                    self.refused_total, self.reached, self.operator_drained)
                if not reply.known:  # a restarted synchronizer: introduce ourselves again
                    await self._register()
                    await asyncio.sleep(POLL_S)
                    continue
            except Exception:  # noqa: BLE001 - retried with a bound (above)
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > MAX_POLL_FAILURES_S:
                    raise
                log.exception("replica %s: poll failed; retrying", self.replica_id)
                await asyncio.sleep(POLL_S)
                continue
            failing_since = None
            self.operator_drained, self.role = reply.drained, reply.role
            if reply.order is not None:
                await self._apply(reply.order)

    async def _renew(self, order: SyncOrder, serving: int) -> None:
        """Hold the sync's lease (``serving``: the version restored on failure); follow whether
        another replica serves (refuse or hold). A failed renewal is retried next period (a
        restarted synchronizer learns of this sync from the next one)."""
        period = self.cfg.synchronizer.lease_s / 4
        while True:
            try:
                others = await self.sync.renew.remote(self.replica_id, serving, order.version,
                                                      self.operator_drained)
                self.refuses = self.refusals_retried and others
            except Exception:  # noqa: BLE001 - next period; the lease outlasts three misses
                log.exception("replica %s: lease renewal failed", self.replica_id)
            await asyncio.sleep(period)

    async def _apply(self, order: SyncOrder) -> None:
        """Precheck, drain, pause, load, verify, serve; report the outcome (module docstring).

        Raises:
            EngineBroken: the engine could not be restored, or the sync outlived
                ``load_timeout_s``; the health check then ends this replica.
        """
        scfg = self.cfg.synchronizer
        self.refuses = self.refusals_retried and order.others_serving
        self.refused = 0
        serving = self.engine.policy_version
        lease = asyncio.create_task(self._renew(order, serving))
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(scfg.load_timeout_s):
                timings = await self._swap(order)
        except (VersionCorrupt, LoadFailed) as e:
            log.error("replica %s refused version %s: %r", self.replica_id, order.version, e)
            await self._stop_lease(lease)
            await self.sync.failed.remote(self.replica_id, order.version, repr(e), self.engine.policy_version)
            return
        except Exception as e:  # timeout, EngineBroken, a failed restore, anything unexpected
            self.broken = e
            await self._stop_lease(lease)
            await self.sync.failed.remote(self.replica_id, order.version, repr(e), None, True)
            raise EngineBroken(f"sync to version {order.version} failed: {e!r}") from e
        finally:
            await self._stop_lease(lease)
            self.syncing = False
            self.gate.set()  # held requests go on (or, if broken, get 503: `admission`)
        self.last_sync = {**timings, "total_s": time.perf_counter() - t0, "refused": self.refused}
        # NCCL loads the trainer's current version, which may be newer than the order's.
        await self.sync.synced.remote(self.replica_id, self.engine.policy_version, self.last_sync,
                                      self.loaded if self.engine.policy_version else None)

    @staticmethod
    async def _stop_lease(lease: asyncio.Task) -> None:
        """Cancel the renewal task and wait for it: no renewal is sent after the outcome."""
        lease.cancel()
        try:
            await lease
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it was cancelled
            pass

    async def _swap(self, order: SyncOrder) -> dict[str, float]:
        scfg = self.cfg.synchronizer
        handle, adapter = order.handle, bool(order.handle.get("adapter"))
        receiver = receiver_for(handle)
        t0 = time.perf_counter()
        if scfg.verify:
            await receiver.precheck(handle)  # before the drain: a corrupt version costs no capacity
        t_drain = time.perf_counter()
        previous_handle, previous_version = self.loaded, self.engine.policy_version
        if not adapter:
            self.syncing = True
            self.gate.clear()
            if not self.haproxy:  # Serve's router reads routing stats every period: let it see the drain
                await asyncio.sleep(2 * self.cfg.explorer.routing_stats_period_s + 0.1)
        t_pause = time.perf_counter()
        if not adapter:
            await self.engine.pause(order.drain_mode)
        t_load = time.perf_counter()
        try:
            info = await load_or_restore(self.engine, handle, order.version, previous_handle, previous_version)
        except LoadFailed:
            if not adapter:
                await self.engine.resume()
            raise
        if not adapter:
            await self.engine.resume()
        t_verify = time.perf_counter()
        probe = await self._verify(order, adapter, previous_handle, previous_version)
        self.loaded = handle
        self.verified_version = self.engine.policy_version
        return {"precheck_s": t_drain - t0, "drain_s": t_pause - t_drain, "pause_s": t_load - t_pause,
                "load_s": info["seconds"], "verify_s": time.perf_counter() - t_verify,
                "probe_max_diff": probe, "bytes": info["bytes"]}

    async def _verify(self, order: SyncOrder, adapter: bool, previous_handle: dict, previous_version: int) -> float:
        """The probe check of a loaded version (`verify.check_probe`); on a mismatch the previous
        version is restored.

        Returns:
            The largest |logprob difference| (0 when there is nothing to check).
        Raises:
            LoadFailed: the weights in effect are not the published ones (previous restored).
        """
        probe = order.handle.get("probe")
        if not self.cfg.synchronizer.verify or not probe or self.engine.policy_version != order.version:
            return 0.0  # NCCL may have loaded a newer version than the probe's
        try:
            got = await self.engine.probe_logprobs(probe["token_ids"], order.version)
            return check_probe(probe, got, self.cfg.synchronizer.verify_tolerance)
        except ProbeMismatch as e:
            await self._restore(adapter, previous_handle, previous_version)
            raise LoadFailed(f"version {order.version} failed verification: {e}") from e

    async def _restore(self, adapter: bool, handle: dict, version: int) -> None:
        """Back to the previous version after a failed verification (adapter: switch back)."""
        if adapter:
            self.engine.policy_version = version
            return
        await self.engine.pause("wait")
        try:
            await receiver_for(handle).receive(self.engine, handle, version)
        except Exception as e:  # the previous weights cannot be loaded either: replace the replica
            raise EngineBroken(f"restoring version {version} after a failed verification: {e!r}") from e
        finally:
            await self.engine.resume()

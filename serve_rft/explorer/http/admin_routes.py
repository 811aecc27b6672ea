"""The replica's routes besides inference: rewards, experiences, status and the operator's
rollout routes. A mixin of `ExplorerReplica` (Ray Serve finds class-based routes through the
class's bases); each route is a thin shim over `serve_rft.explorer.http.rewards_api`, the
`ExperienceStore` or the `Synchronizer` actor (`serve_rft.explorer.http.sync_api`), and refusals are
raised as `ApiError` (answered by `serve_rft.explorer.http.app`).

Uses of the replica: ``cfg``, ``store``, ``sync`` (the synchronizer's handle), ``metrics``, ``costs``.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from redis.exceptions import RedisError

from serve_rft.explorer.http import rewards_api, sync_api
from serve_rft.explorer.http.app import AUTHORIZED, app
from serve_rft.explorer.http.auth import identity_of
from serve_rft.explorer.http.body import read_json
from serve_rft.explorer.http.protocol import ApiError, parse_reward_body


def _store_unavailable(advice: str) -> ApiError:
    """504 + Retry-After: the store did not answer in time. 504, not 503: HAProxy re-sends a 503
    to another replica, which waits on the same store."""
    return ApiError(504, "the experience store is unavailable" + advice, type_="service_unavailable",
                    code="store_unavailable", retry_after=2)


class AdminRoutes:
    """``/v1/rewards``, ``/v1/experiences/{id}``, ``/v1/status`` and ``/v1/sync/*``."""

    @app.post("/v1/rewards", dependencies=AUTHORIZED)
    async def rewards(self, request: Request) -> JSONResponse:
        """Post rewards (forms: `serve_rft.explorer.http.protocol.parse_reward_body`; semantics:
        `serve_rft.explorer.http.rewards_api`)."""
        t0 = time.perf_counter()
        try:
            response = await self._rewards(request)
        except ApiError as e:
            self.metrics.request("rewards", e.status, time.perf_counter() - t0)
            raise
        self.metrics.request("rewards", response.status_code, time.perf_counter() - t0)
        return response

    async def _rewards(self, request: Request) -> JSONResponse:
        """Raises:
            ApiError: 422 a malformed reward request, 504 the store did not answer in time
                (retry: items already recorded answer duplicate), 429 the caller's tenant keeps
                its limit of stored bytes (`serve_rft.explorer.http.costs.CostCheck.check_storage`).
        """
        try:
            req = parse_reward_body(await read_json(request))
        except ValidationError as e:
            raise ApiError.invalid(e, 422) from None
        except ValueError as e:
            raise ApiError(422, str(e)) from None
        await self.costs.check_storage(identity_of(request).tenant, "rewards")
        try:
            results = await asyncio.wait_for(rewards_api.post_rewards(self.store, req, identity_of(request)),
                                             self.cfg.buffer.store_wait_s)
        except (asyncio.TimeoutError, RedisError):
            raise _store_unavailable("; retry (items already recorded answer duplicate)") from None
        self.metrics.reward_results(results)
        status = rewards_api.batch_status(results)
        return JSONResponse(rewards_api.batch_body(results), status_code=status,
                            headers={"Retry-After": "5"} if status == 507 else None)

    @app.get("/v1/experiences/{completion_id}", dependencies=AUTHORIZED)
    async def experience(self, request: Request, completion_id: str) -> JSONResponse:
        """Each choice's state, reward, info and versions (`rewards_api.describe_completion`): a
        reward key reads its own tenant's completions (another's: 404), an admin key any.

        Raises:
            ApiError: 404 unknown (or another tenant's) completion, 504 the store did not answer
                within ``buffer.store_wait_s`` (with Retry-After).
        """
        try:
            body = await asyncio.wait_for(
                rewards_api.describe_completion(self.store, completion_id, identity_of(request)),
                self.cfg.buffer.store_wait_s)
        except (asyncio.TimeoutError, RedisError):
            raise _store_unavailable("; retry") from None
        return JSONResponse(body)

    @app.get("/v1/status", dependencies=AUTHORIZED)
    async def status(self) -> JSONResponse:
        """The synchronizer's view (replicas, versions, rollout), the store's counts (``store``:
        ok / unavailable) and the trainer's own report (`Trainer.service_status`; ``answered``:
        false when it did not answer within ``explorer.peer_wait_s``). Never a hang: each part
        is bounded.

        Raises:
            ApiError: 504 the synchronizer did not answer within ``explorer.peer_wait_s``.
        """
        from serve_rft.names import find_trainer

        wait_s = self.cfg.explorer.peer_wait_s
        status = await sync_api.call(self.sync.status.remote(), wait_s)
        try:
            counts = await asyncio.wait_for(self.store.counts(), self.cfg.buffer.store_wait_s)
            status["experiences"], status["store"] = counts.__dict__, "ok"
        except (asyncio.TimeoutError, RedisError):
            status["experiences"], status["store"] = None, "unavailable"
        trainer = find_trainer()  # None in serve-only mode
        if trainer is not None:
            status["trainer"].update(await _trainer_report(trainer, wait_s))
        return JSONResponse(status)

    @app.get("/v1/sync/events", dependencies=AUTHORIZED)
    async def sync_events(self, since: float = 0.0) -> JSONResponse:
        events = await sync_api.call(self.sync.events.remote(since), self.cfg.explorer.peer_wait_s)
        return JSONResponse({"events": events})

    @app.get("/v1/sync/rollout", dependencies=AUTHORIZED)
    async def sync_rollout(self) -> JSONResponse:
        """The rollout (`serve_rft.explorer.http.sync_api`)."""
        return JSONResponse(await sync_api.call(self.sync.rollout.remote(), self.cfg.explorer.peer_wait_s))

    @app.post("/v1/sync/pin", dependencies=AUTHORIZED)
    async def sync_pin(self, request: Request) -> JSONResponse:
        return await self._operator(request, sync_api.PinRequest, lambda b: self.sync.pin.remote(b.version))

    @app.post("/v1/sync/rollback", dependencies=AUTHORIZED)
    async def sync_rollback(self, request: Request) -> JSONResponse:
        return await self._operator(request, sync_api.RollbackRequest,
                                    lambda b: self.sync.rollback.remote(b.version))

    @app.post("/v1/sync/promotion", dependencies=AUTHORIZED)
    async def sync_promotion(self, request: Request) -> JSONResponse:
        return await self._operator(request, sync_api.PromotionRequest,
                                    lambda b: self.sync.pause_promotion.remote(b.paused))

    @app.post("/v1/sync/replicas/{replica_id}/drain", dependencies=AUTHORIZED)
    async def sync_drain(self, request: Request, replica_id: str) -> JSONResponse:
        return await self._operator(request, sync_api.DrainRequest,
                                    lambda b: self.sync.drain.remote(replica_id, b.drained))

    async def _operator(self, request: Request, model, action) -> JSONResponse:
        """An admin action on the synchronizer: parse the body, call, answer its result.

        Raises:
            ApiError: 400 a malformed body, 404 / 409 the synchronizer's refusals.
        """
        body = sync_api.parse(model, await read_json(request))
        return JSONResponse(await sync_api.call(action(body), self.cfg.explorer.peer_wait_s))


async def _trainer_report(trainer, wait_s: float) -> dict:
    """`Trainer.service_status` plus ``answered: true``, or ``answered: false`` with the reason
    when the trainer did not answer within ``wait_s`` seconds (a frozen or busy process) or its
    actor is gone (Ray restarts it)."""
    from ray.exceptions import RayActorError

    try:
        report = await asyncio.wait_for(trainer.service_status.remote(), wait_s)
    except asyncio.TimeoutError:
        return {"answered": False, "error": f"no answer within {wait_s:g} s"}
    except RayActorError as e:
        return {"answered": False, "error": f"trainer actor unavailable: {type(e).__name__}"}
    return {**report, "answered": True}

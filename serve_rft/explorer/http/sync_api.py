"""The operator's rollout routes (admin key), over the `Synchronizer` actor.

``GET /v1/sync/rollout``: incumbent, candidate, canary window and evidence, verdicts, pins and
versions (published / promoted / quarantined / rejected / loadable). ``POST /v1/sync/pin``
``{"version": N}`` serves N everywhere until ``{"version": null}``; ``POST /v1/sync/rollback``
``{"version": N}`` rejects every version above N (replicas move back; later versions roll as
usual); ``POST /v1/sync/promotion`` ``{"paused": true|false}`` holds canary verdicts;
``POST /v1/sync/replicas/{id}/drain`` ``{"drained": true|false}`` takes a replica out of rotation
(it refuses new requests, which HAProxy re-sends elsewhere) or back. Every action is an audit
event in ``/v1/sync/events``. Errors: 404 unknown replica, 409 a version that is not loadable
any more or a drain that would leave no replica serving, 400 a malformed body, 504 the
synchronizer did not answer within ``explorer.peer_wait_s`` (a stuck or restarting actor: an
action may still take effect; each is idempotent, so retrying is safe).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serve_rft.explorer.http.protocol import ApiError


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class PinRequest(_Body):
    version: int | None = Field(..., ge=0, description="The version to serve everywhere; null unpins.")


class RollbackRequest(_Body):
    version: int = Field(..., ge=0, description="Roll back to this version.")


class PromotionRequest(_Body):
    paused: bool


class DrainRequest(_Body):
    drained: bool


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """Raises:
        ApiError: 400 naming the field.
    """
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise ApiError.invalid(e) from None


async def call(remote: Awaitable[Any], wait_s: float) -> Any:
    """Await a synchronizer call for at most ``wait_s`` seconds; its refusals become client
    errors.

    Raises:
        ApiError: 404 (KeyError: unknown replica), 409 (ValueError: not loadable, last serving),
            504 ``synchronizer_unavailable`` (no answer within ``wait_s``: a frozen or restarting
            actor; the call itself is not withdrawn and may still take effect).
    """
    try:
        return await asyncio.wait_for(remote, wait_s)
    except asyncio.TimeoutError:
        raise ApiError(504, f"the synchronizer did not answer within {wait_s:g} s; retry (an action may "
                       "still take effect: check /v1/sync/rollout)", type_="service_unavailable",
                       code="synchronizer_unavailable", retry_after=2) from None
    except Exception as e:  # Ray wraps the actor's exception: look at its cause
        cause = getattr(e, "cause", None) or e
        if isinstance(cause, KeyError):
            raise ApiError(404, f"unknown replica {cause.args[0]!r}", code="not_found") from None
        if isinstance(cause, ValueError):
            raise ApiError(409, str(cause), code="conflict") from None
        raise

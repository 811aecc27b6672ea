"""``GET /v1/experiences/{id}`` with the store away: bounded by ``buffer.store_wait_s`` and
answered 504 + Retry-After (the OpenAI error JSON), as ``POST /v1/rewards`` is, never a hang or
a 500. The route runs directly against a store that hangs or refuses."""

import asyncio
import time
from types import SimpleNamespace

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from serve_rft.config import load_config
from serve_rft.explorer.http.admin_routes import AdminRoutes
from serve_rft.explorer.http.auth import OPEN
from serve_rft.explorer.http.protocol import ApiError


class HangingStore:
    async def completion_meta(self, completion_id):
        await asyncio.sleep(60)


class RefusingStore:
    async def completion_meta(self, completion_id):
        raise RedisConnectionError("Connection refused")


def _replica(store, wait_s):
    cfg = load_config(None, [f"buffer.store_wait_s={wait_s}"])
    return SimpleNamespace(cfg=cfg, store=store)


def _request():
    return SimpleNamespace(state=SimpleNamespace(identity=OPEN))


@pytest.mark.parametrize("store", [HangingStore(), RefusingStore()])
def test_store_away_is_a_504_with_retry_after_within_store_wait(store):
    t0 = time.monotonic()
    with pytest.raises(ApiError) as e:
        asyncio.run(AdminRoutes.experience(_replica(store, 0.5), _request(), "chatcmpl-x"))
    elapsed = time.monotonic() - t0
    assert e.value.status == 504 and e.value.code == "store_unavailable"
    assert e.value.retry_after is not None and e.value.retry_after > 0
    assert elapsed < 0.5 + 5.0, elapsed  # the bound, with slack for a loaded host; unbounded: 60 s here

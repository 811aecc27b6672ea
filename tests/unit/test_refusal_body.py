"""A refused request's body is read to keep the connection clean, but never past the body bound."""

import asyncio

import pytest

from serve_rft.explorer.http.body import MAX_BODY_BYTES
from serve_rft.explorer.http.openai_routes import OpenAIRoutes
from serve_rft.explorer.http.protocol import ApiError


class _Swap:
    broken = "sync loop failed"

    def admission(self, retryable=True, request_id=None):
        return "refuse"


class _Replica:
    replica_id = "r0"
    swap = _Swap()


class _Req:
    """What `OpenAIRoutes._admit` reads of a Starlette request; counts the body bytes it pulled."""

    method, url = "POST", type("U", (), {"path": "/v1/chat/completions", "query": ""})()

    def __init__(self, chunk: bytes, chunks: int):
        self.headers = _Headers()
        self.chunk, self.left, self.pulled = chunk, chunks, 0

    async def stream(self):
        while self.left:
            self.left -= 1
            self.pulled += len(self.chunk)
            yield self.chunk

    async def body(self):  # Starlette's read: the whole body, however large
        return b"".join([c async for c in self.stream()])


class _Headers(dict):
    raw: list = []

    def getlist(self, name):
        return []


def test_a_broken_replica_refuses_with_503_after_reading_a_small_body():
    req = _Req(b"x" * 1024, 4)
    with pytest.raises(ApiError) as e:
        asyncio.run(OpenAIRoutes._admit(_Replica(), req))
    assert e.value.status == 503 and req.pulled == 4096


def test_a_broken_replica_stops_reading_a_refused_body_at_the_bound():
    req = _Req(b"x" * (1 << 20), 1000)  # 1,000 MiB offered, no Content-Length
    with pytest.raises(ApiError) as e:
        asyncio.run(OpenAIRoutes._admit(_Replica(), req))
    assert e.value.status == 413
    assert req.pulled <= MAX_BODY_BYTES + (1 << 20)

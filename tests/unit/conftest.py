"""Fixtures the unit tests of the store share (the real redis-server comes from tests/conftest.py)."""

from __future__ import annotations

import asyncio
import uuid

import pytest


@pytest.fixture
def store_factory(redis_server):
    """``make(**kw)``: an `ExperienceStore` on the session's redis-server under a fresh key prefix,
    so tests never see each other's keys."""
    from serve_rft.buffer.store import ExperienceStore

    def make(**kw):
        return ExperienceStore(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}", **kw)
    return make


@pytest.fixture
def run(redis_server):
    """``run(test)``: awaits ``test(store)`` on a fresh `ExperienceStore` (its own key prefix, at
    most 3 turns a conversation), closed after (the tenant and key-ownership tests)."""
    from serve_rft.buffer.store import ExperienceStore

    def go(test):
        async def main():
            store = ExperienceStore(redis_server.url, prefix=f"r{uuid.uuid4().hex[:8]}", max_conversation_turns=3)
            try:
                await test(store)
            finally:
                await store.close()
        asyncio.run(main())
    return go

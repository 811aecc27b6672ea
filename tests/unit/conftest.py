"""Fixtures the unit tests of the store share (the real redis-server comes from tests/conftest.py)."""

from __future__ import annotations

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

"""Shared fixtures: a real redis-server per test session, started on a free port, ended by pid."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    from serve_rft.buffer.redis_server import start_redis

    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def embedded_model():
    """The embedded model directory (built once into the user cache, as the product does)."""
    from serve_rft.config import ModelConfig
    from serve_rft.model.embedded import ensure_embedded_model

    return ensure_embedded_model(ModelConfig().cache_dir)

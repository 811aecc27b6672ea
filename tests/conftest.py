"""Shared fixtures (a real redis-server per test session, started on a free port, ended by pid;
the embedded model) and the suite's schedule on two pytest-xdist workers (docs/testing.md).

The schedule (``-n 2 --dist loadscope --no-loadscope-reorder`` in pyproject.toml): each test
module runs whole on one worker (xdist's scope), so a module's stack is started once; the modules
are handed out in `SCHEDULE`'s order (this hook sorts them; xdist keeps the order); two run at
once, one per worker, except the tests of the modules in `EXCLUSIVE`, which hold the machine
alone (tests/integration/conftest.py: a shared lock per module, exclusive per such test). The
lists: tests/support/schedule.py.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import settings

from tests.support.schedule import rank

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Ray's own switch for tests (ray._private.parameter.RayParams): a cluster that ray.init starts
# takes its worker ports from the OS instead of the fixed 10002-19999 range, so two test clusters
# on one machine (one per xdist worker) never hand out the same port.
os.environ.setdefault("RAY_USE_RANDOM_PORTS", "1")

# Hypothesis's per-example deadline (200 ms by default) measures this machine's load, not the
# code: the unit tests share two cores with a stack starting on the other worker.
settings.register_profile("serve_rft", deadline=None)
settings.load_profile("serve_rft")


def pytest_runtest_logreport(report):
    """With ``SERVE_RFT_TEST_TIMELINE=FILE`` set, each worker (or the one process with ``-n 0``)
    appends one JSON line per test phase: worker, node id, phase, start and stop (epoch seconds).
    The suite's timeline, read to place the schedule (docs/testing.md)."""
    path = os.environ.get("SERVE_RFT_TEST_TIMELINE")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not path or (worker is None and hasattr(report, "node")):  # xdist's controller: a worker's report
        return
    with open(path, "a") as f:
        f.write(json.dumps({"worker": worker or "main", "nodeid": report.nodeid, "when": report.when,
                            "start": report.start, "stop": report.stop, "outcome": report.outcome}) + "\n")


def pytest_collection_modifyitems(config, items):
    """Order the items by `SCHEDULE` (stable within a module)."""
    items.sort(key=rank)


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

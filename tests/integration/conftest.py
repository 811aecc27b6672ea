"""The default stack for the integration tests (tests/support/stack.py): one per test module
that asks for ``stack``; a module that needs other settings defines its own with
`stack_fixture`. And each module's share of the machine (tests/conftest.py, the schedule)."""

from __future__ import annotations

import fcntl
import os

import pytest

from tests.support.schedule import EXCLUSIVE
from tests.support.stack import stack_fixture

stack = stack_fixture("run", [], doc="The default stack (CHECKPOINT, FIXED, wait drain); one per test "
                                     "module that uses it.")


@pytest.fixture(scope="module", autouse=True)
def machine_share(request, tmp_path_factory):
    """Hold the machine shared (or, for a module in `EXCLUSIVE`, alone) from before the
    module's first fixture to after its last teardown: an ``flock`` on a file every xdist worker
    of this run opens (in the run's shared temporary folder). Without xdist it never waits."""
    name = request.module.__name__.rsplit(".", 1)[-1]
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' folders (popen-gw0, ...) share their parent
    with open(root / "machine.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if name in EXCLUSIVE else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

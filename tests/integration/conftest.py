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
def machine_share(tmp_path_factory):
    """Hold the machine shared from before the module's first fixture (its stack's start) to
    after its last teardown: a shared ``flock`` on a file every xdist worker of this run opens (in
    the run's shared temporary folder). Yields the open lock file."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' folders (popen-gw0, ...) share their parent
    with open(root / "machine.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        try:
            yield f
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def machine_alone(request, machine_share):
    """A test of a module in `EXCLUSIVE` runs with the machine to itself: this worker's shared
    lock becomes exclusive for the test (flock converts it: it waits until the other worker's
    module has ended) and shared again after it. Its stack's start and stop are shared."""
    if request.module.__name__.rsplit(".", 1)[-1] not in EXCLUSIVE:
        yield
        return
    fcntl.flock(machine_share, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(machine_share, fcntl.LOCK_SH)

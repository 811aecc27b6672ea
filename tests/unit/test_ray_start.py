"""serve_rft.service.ray_start: the local Ray's start is tried again, a bounded number of times,
only when its raylet did not register in time, and what a failed start left is ended by pid."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from serve_rft.service.ray_start import init_local_ray

TIMED_OUT = ("The current node timed out during startup. This could happen because some of the raylet "
             "failed to startup or the GCS has become overloaded.")  # Ray 2.60, ray/_private/node.py


class Starts:
    """Stands in for ``ray.init``: each failing call leaves a process behind (as a half-started
    node leaves its GCS and raylet) and raises ``errors[i]``; then returns ``"started"``."""

    def __init__(self, *errors: Exception):
        self.errors, self.calls, self.left = list(errors), [], []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if self.errors:
            self.left.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
            raise self.errors.pop(0)
        return "started"

    def close(self) -> None:
        """End what the failing calls left that is still running (a failed assertion leaves it)."""
        for p in self.left:
            if p.poll() is None:
                p.kill()
                p.wait()


def _gone(p: subprocess.Popen) -> bool:
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_a_node_that_did_not_register_in_time_is_ended_and_started_again():
    starts = Starts(Exception(TIMED_OUT))
    keep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # there before: kept
    try:
        assert init_local_ray(starts, num_cpus=2) == "started"
        assert starts.calls == [{"address": "local", "num_cpus": 2}] * 2
        assert _gone(starts.left[0])
        assert psutil.Process(keep.pid).is_running() and keep.poll() is None
    finally:
        keep.kill()
        keep.wait()
        starts.close()


def test_any_other_error_propagates_at_once():
    starts = Starts(RuntimeError("port in use"))
    try:
        with pytest.raises(RuntimeError, match="port in use"):
            init_local_ray(starts)
        assert len(starts.calls) == 1
    finally:
        starts.close()


def test_the_timeout_is_raised_after_the_last_attempt():
    starts = Starts(*[Exception(TIMED_OUT)] * 3)
    try:
        with pytest.raises(Exception, match="timed out during startup"):
            init_local_ray(starts, attempts=3)
        assert len(starts.calls) == 3
        assert all(_gone(p) for p in starts.left)
    finally:
        starts.close()

"""Starting the local Ray of `serve-rft up` on a loaded machine.

``ray.init(address="local")`` starts the GCS and a raylet, then waits a fixed 30 s for the raylet
to register with the GCS and raises a plain ``Exception`` ("The current node timed out during
startup ...") past it (ray/_private/node.py, ``Node.__init__``; Ray 2.60). On two cores busy
with another stack's start it has run out (in the test suite) while the raylet was only slow.
The start is tried again, a bounded number of times, after the processes the failed one left
are ended by their pids; any other error propagates at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import psutil

log = logging.getLogger(__name__)

NODE_STARTUP_TIMEOUT = "timed out during startup"
"""Part of the message Ray's ``Node.__init__`` raises when its raylet did not register in time."""

ATTEMPTS = 3
"""Starts tried at most, the first included."""


def _children() -> dict[int, psutil.Process]:
    return {p.pid: p for p in psutil.Process().children(recursive=True)}


def init_local_ray(init: Callable[..., Any], attempts: int = ATTEMPTS, **kwargs) -> Any:
    """``init(address="local", **kwargs)`` (``ray.init``), started again up to ``attempts``
    times in all while it fails because the raylet did not register in time; before each new
    try, and after the last, the processes the failed start left (descendants of this process
    that were not there before it) are killed by pid. Returns what ``init`` returned.

    Raises:
        Exception: the last start's error once ``attempts`` have failed that way; any other
            error of ``init`` at once (what it left is the caller's to end, as without this).
        ValueError: ``attempts`` below 1.
    """
    for attempt in range(1, attempts + 1):
        before = set(_children())
        try:
            return init(address="local", **kwargs)
        except Exception as e:
            if NODE_STARTUP_TIMEOUT not in str(e):
                raise
            left = [p for pid, p in _children().items() if pid not in before]
            for p in left:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(left, timeout=10)
            log.warning("Ray's node did not register in time (try %d of %d); ended the %d processes it left",
                        attempt, attempts, len(left))
            if attempt == attempts:
                raise
    raise ValueError(f"attempts must be at least 1, not {attempts}")

"""Polling for a condition in tests that must not fail on the first miss (a restarted server,
a file a background thread writes)."""

from __future__ import annotations

import time
from typing import Callable


def until(pred: Callable[[], object], timeout_s: float = 15.0, period_s: float = 0.1) -> bool:
    """True as soon as ``pred()`` is truthy, polled every ``period_s`` s; False after
    ``timeout_s`` s (the caller asserts, naming what it waited for)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(period_s)
    return False

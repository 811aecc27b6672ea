"""Linux process ties the service's launchers use (the ground floor: imports nothing of serve_rft).

Two ``prctl(2)`` options: ``PR_SET_PDEATHSIG`` (a child gets a signal when the thread that forked
it ends: redis-server with its supervisor, the service process with `serve-rft up`'s keeper) and
``PR_SET_CHILD_SUBREAPER`` (orphaned descendants are re-parented to this process, not to init, so
the keeper can find and end them). Elsewhere than Linux both are no-ops.
"""

from __future__ import annotations

import ctypes
import signal
import sys
from typing import Callable

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def _libc_prctl():
    """libc's prctl, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


def set_child_subreaper() -> bool:
    """Make this process a child subreaper; True when the kernel accepted it."""
    prctl = _libc_prctl()
    return prctl is not None and prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for `subprocess.Popen` that has the child receive ``sig`` when its parent
    dies (None off Linux: pass it as is).

    The kernel sends it when the *thread* that forked the child ends, so a child started from a
    thread lives as long as that thread. prctl is looked up here, before the fork: the hook makes
    one foreign call and nothing else, so it is safe in a multi-threaded parent.
    """
    prctl = _libc_prctl()
    if prctl is None:
        return None

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return hook

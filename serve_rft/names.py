"""The names of the service's Ray actors and the lookups every role uses (the ground floor:
imports nothing of serve_rft).

The trainer and the synchronizer are named, detached actors in namespace `NAMESPACE`; replicas,
the trainer, the synchronizer's methods and the launcher find each other through these
functions, never by repeating names.
"""

from __future__ import annotations

import time

NAMESPACE = "serve_rft"
SYNCHRONIZER_NAME = "serve_rft_synchronizer"
TRAINER_NAME = "serve_rft_trainer"
"""Also the trainer's consumer name in the ready stream's consumer group."""


def find_actor(name: str):
    """The named actor ``name`` of `NAMESPACE`, or None when it does not exist."""
    import ray

    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def find_trainer():
    """The trainer actor, or None (serve-only mode, or not created yet)."""
    return find_actor(TRAINER_NAME)


def get_trainer():
    """The trainer actor.

    Raises:
        ValueError: there is none.
    """
    trainer = find_trainer()
    if trainer is None:
        raise ValueError(f"no actor {TRAINER_NAME!r} in namespace {NAMESPACE!r}")
    return trainer


def get_synchronizer(timeout_s: float = 60.0):
    """The synchronizer actor, waiting up to ``timeout_s`` seconds for it to exist.

    Raises:
        ValueError: it did not appear in time.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        sync = find_actor(SYNCHRONIZER_NAME)
        if sync is not None:
            return sync
        if time.monotonic() > deadline:
            raise ValueError(f"no actor {SYNCHRONIZER_NAME!r} in namespace {NAMESPACE!r} after {timeout_s} s")
        time.sleep(0.5)

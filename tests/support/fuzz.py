"""The seed of a randomized fuzz run (hypothesis and schemathesis tests over a running service):
``SERVE_RFT_FUZZ_SEED`` if set, else drawn; printed, so pytest shows it with a failure and the run
can be replayed by setting it."""

from __future__ import annotations

import os
import random

SEED_ENV = "SERVE_RFT_FUZZ_SEED"


def fuzz_seed(what: str) -> int:
    """The seed for the fuzz run ``what`` (a test's name, printed with the seed)."""
    chosen = int(os.environ.get(SEED_ENV) or random.randrange(2**32))
    print(f"{what}: fuzz seed {chosen} ({SEED_ENV}={chosen} replays this run)")
    return chosen

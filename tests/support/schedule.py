"""The suite's schedule on two pytest-xdist workers (tests/conftest.py applies it,
tests/integration/conftest.py holds each module's share of the machine; docs/testing.md)."""

from __future__ import annotations

import pytest

EXCLUSIVE = frozenset({"test_stack_faults", "test_durability"})
"""Integration modules whose tests run alone on the machine (their bounds are wall-clock seconds
near what the tested part takes); their stacks start and stop beside other work
(tests/integration/conftest.py). test_shutdown's bounds are the keeper's grace (60 s) and
3 s + 7 s for the reaper, several times what a stop takes (9-11 s, 5 s): it runs beside others."""

SCHEDULE = ("test_multinode", "test_stack", "test_shutdown", "test_stack_keep", "test_stack_canary",
            "test_stack_memory", "test_stack_lora", "test_serve_run", "test_logprob_agreement",
            "test_engine_weights", "test_engine_tensor_parallel", "test_swap_verification", "test_sharded_trainer_faults",
            "test_train_offline", "test_sharded_trainer", "test_synchronizer_restart",
            "test_haproxy_resend", "test_nccl_sync", "test_stack_faults", "unit", "test_durability",
            "unit_late")
"""The modules in the order they are handed out (``"unit"``: the unit-test modules but those of
`LATE_UNITS`, ``"unit_late"``: those): the longest shared ones first, then the exclusive ones,
which run one test at a time with the machine to themselves. The unit tests hold no lock: they
are handed out right after the first exclusive module, so the worker that is not running it runs
them instead of idling while the exclusive tests run in turn; the late ones are handed out after
the last exclusive module, so they fill the other worker while the last exclusive tests run
(a suite's timeline: ``SERVE_RFT_TEST_TIMELINE``, tests/conftest.py). A module not named here
runs after the named shared ones."""

LATE_UNITS = ("test_keeper", "test_docs_browser", "test_docs")
"""The longest unit-test modules (61, 24 and 17 s of a timeline), handed out last, in this order.
Handed out late, they fill the other worker while the last exclusive tests run instead of leaving
it idle then."""


def group_of(item: pytest.Item) -> str:
    """``"unit"`` (or ``"unit_late"``: `LATE_UNITS`) for a unit test, else its module's name
    (``"test_stack_faults"``)."""
    parts = item.nodeid.split("::", 1)[0].split("/")
    module = parts[-1].removesuffix(".py")
    if "unit" in parts[:-1]:
        return "unit_late" if module in LATE_UNITS else "unit"
    return module


def rank(item: pytest.Item) -> tuple[float, int]:
    """The item's place in `SCHEDULE` (a module not named there: after the named shared ones),
    then among `LATE_UNITS`."""
    order = {name: i for i, name in enumerate(SCHEDULE)}
    module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    late = LATE_UNITS.index(module) if group_of(item) == "unit_late" else 0
    return order.get(group_of(item), len(SCHEDULE) - len(EXCLUSIVE) - 1.5), late

"""The default stack for the integration tests (tests/support/stack.py): one per test module
that asks for ``stack``; a module that needs other settings defines its own with
`stack_fixture`."""

from __future__ import annotations

from tests.support.stack import stack_fixture

stack = stack_fixture("run", [], doc="The default stack (CHECKPOINT, FIXED, wait drain); one per test "
                                     "module that uses it.")

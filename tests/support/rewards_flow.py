"""Shared by the tenant and key-ownership unit tests (tests/unit/test_tenants.py,
test_key_owned_ids.py): the rewards API as the routes call it, a store's choice rewards, and a
metrics stand-in for the explorer's log."""

from __future__ import annotations

from serve_rft.explorer.http import rewards_api
from serve_rft.explorer.http.protocol import parse_reward_body


class NullMetrics:
    """The explorer metrics the experience log calls, recording nothing."""

    def served(self, *args, **kwargs):
        pass


async def post(store, body, who) -> list[dict]:
    """``POST /v1/rewards`` with ``body`` as caller ``who``: the per-item results."""
    return await rewards_api.post_rewards(store, parse_reward_body(body), who)


async def rewards(store, cid: str) -> list:
    """The rewards of completion ``cid``'s choices (None where none)."""
    return [c.reward for c in await store.choices(cid)]


class QuotaMetrics:
    """Records ``quota(scope, limit)`` calls (the replica's are Ray metrics): the quota and cost
    checks' unit tests (tests/unit/test_quota.py, test_costs.py)."""

    def __init__(self):
        self.calls: list[tuple[str, str | None]] = []

    def quota(self, scope, limit):
        self.calls.append((scope, limit))

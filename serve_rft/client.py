"""A small client of the rewards API for graders and apps (chat goes through the ``openai``
SDK, pointed at the service: ``openai.OpenAI(base_url=".../v1", api_key=KEY)``).

Every form of ``POST /v1/rewards`` (docs: API, Rewards and experiences) and
``GET /v1/experiences/{id}``, with the caller's key, over httpx. A reward is idempotent (the
same reward again answers ``duplicate``), so a request the service asks to repeat (429 with
``Retry-After``; 504 and 507: the store did not answer in time or is full) is sent again, at most
``retries`` times, after the wait it asked for (at most ``max_wait_s``). Any other refusal raises
`RewardError` with the service's OpenAI error JSON.

Example::

    from serve_rft.client import RewardClient

    grader = RewardClient("http://127.0.0.1:8000", api_key="sk-grader")
    grader.reward(comp.id, [1.0, 0.0])               # every choice of a completion
    grader.reward_conversation("conv-9", 1.0, discount=0.9)
"""

from __future__ import annotations

import time
from typing import Any

import httpx

RETRIED = {429, 504, 507}
"""Statuses answered with ``Retry-After`` that a repeated request may get past."""


class RewardError(Exception):
    """The service refused a reward request.

    Attributes:
        status: the HTTP status.
        code: OpenAI's error ``code`` (``reward_out_of_range``, ``ambiguous_conversation``, ...).
        body: the answer's JSON (``error``, and for reward requests every item's result in ``data``).
    """

    def __init__(self, status: int, body: dict):
        err = body.get("error") or {}
        self.status, self.code, self.body = status, err.get("code"), body
        super().__init__(f"{status} {self.code}: {err.get('message', '')}")


class RewardClient:
    """Rewards and experience reads of one key.

    Args:
        base_url: the service, e.g. ``http://127.0.0.1:8000`` (without ``/v1``).
        api_key: a reward (or admin) key; None for a service without keys.
        timeout_s: bound of one HTTP request, s.
        retries: repeats of a request answered 429 / 504 / 507 at most.
        max_wait_s: the longest ``Retry-After`` waited; a longer one raises at once, s.
        transport: an httpx transport (tests).
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 30.0, retries: int = 3,
                 max_wait_s: float = 30.0, transport: httpx.BaseTransport | None = None, sleep=time.sleep):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s,
                                 transport=transport)
        self.retries, self.max_wait_s, self.sleep = retries, max_wait_s, sleep

    def reward(self, completion_id: str, reward: float | list[float], choice_index: int = 0,
               info: dict | None = None) -> dict:
        """Reward choice ``choice_index`` of a completion, or with a list every choice in order.

        Returns:
            The answer's JSON (``data``: every item's result).
        Raises:
            RewardError: refused (404 unknown, 409 another reward recorded, 410 expired, 422 ...).
        """
        if isinstance(reward, list):
            body: dict[str, Any] = {"completion_id": completion_id, "rewards": reward}
        else:
            body = {"completion_id": completion_id, "choice_index": choice_index, "reward": reward}
        return self.post(body if info is None else {**body, "info": info})

    def reward_group(self, group_id: str, rewards: list[tuple[str, int, float]]) -> dict:
        """Reward members of a group: ``(completion_id, choice_index, reward)`` each."""
        return self.post({"group_id": group_id, "rewards": [
            {"completion_id": c, "choice_index": i, "reward": r} for c, i, r in rewards]})

    def reward_conversation(self, conversation_id: str, reward: float, discount: float = 1.0,
                            completion_id: str | None = None, info: dict | None = None) -> dict:
        """Reward a whole conversation: turn t of T gets ``reward * discount**(T-1-t)``
        (``completion_id``: one of its turns, to name it when several keys use the id)."""
        body: dict[str, Any] = {"conversation_id": conversation_id, "reward": reward, "discount": discount}
        if completion_id is not None:
            body["completion_id"] = completion_id
        return self.post(body if info is None else {**body, "info": info})

    def experience(self, completion_id: str) -> dict:
        """``GET /v1/experiences/{completion_id}``: each choice's state, reward, info, versions."""
        return self._send("GET", f"/v1/experiences/{completion_id}", None)

    def post(self, body: dict) -> dict:
        """``POST /v1/rewards`` with ``body`` (any of its forms), repeated as the module says."""
        return self._send("POST", "/v1/rewards", body)

    def _send(self, method: str, path: str, body: dict | None) -> dict:
        for attempt in range(self.retries + 1):
            r = self.http.request(method, path, json=body)
            if r.status_code < 400:
                return r.json()
            wait = float(r.headers.get("retry-after", "1") or 1)
            if r.status_code not in RETRIED or attempt == self.retries or wait > self.max_wait_s:
                raise RewardError(r.status_code, _json(r))
            self.sleep(wait)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "RewardClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _json(r: httpx.Response) -> dict:
    try:
        body = r.json()
    except ValueError:
        return {"error": {"message": r.text[:200], "code": None}}
    return body if isinstance(body, dict) else {"error": {"message": str(body)[:200], "code": None}}

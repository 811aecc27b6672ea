"""The rewards client (`serve_rft.client`): each form's body, the key sent, a request the service
asks to repeat (429 / 504 / 507 with Retry-After) sent again after the wait it asked for, at most
``retries`` times, and any other refusal raised with the service's error. Over httpx's mock
transport (a unit test's stand-in for the service; tests/integration/test_stack_keep.py posts
through the client to a real one)."""

from __future__ import annotations

import json

import httpx
import pytest

from serve_rft.client import RewardClient, RewardError


def _client(answers, **kw):
    """A client whose service answers ``answers`` in turn; the requests it saw and the waits."""
    seen, waits = [], []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        status, body, headers = answers.pop(0)
        return httpx.Response(status, json=body, headers=headers)

    client = RewardClient("http://svc/", api_key="sk-g", transport=httpx.MockTransport(handle),
                          sleep=waits.append, **kw)
    return client, seen, waits


OK = (200, {"object": "list", "data": [{"status": "recorded"}]}, {})


def test_each_form_posts_its_body_with_the_key():
    client, seen, _ = _client([OK] * 4 + [(200, {"choices": []}, {})])
    client.reward("chatcmpl-1", 1.0, choice_index=2)
    client.reward("chatcmpl-1", [1.0, 0.0], info={"judge": 1})
    client.reward_group("g", [("chatcmpl-1", 0, 1.0)])
    client.reward_conversation("c", 1.0, discount=0.9, completion_id="chatcmpl-7")
    assert client.experience("chatcmpl-1") == {"choices": []}
    bodies = [json.loads(r.content) if r.content else None for r in seen]
    assert bodies == [
        {"completion_id": "chatcmpl-1", "choice_index": 2, "reward": 1.0},
        {"completion_id": "chatcmpl-1", "rewards": [1.0, 0.0], "info": {"judge": 1}},
        {"group_id": "g", "rewards": [{"completion_id": "chatcmpl-1", "choice_index": 0, "reward": 1.0}]},
        {"conversation_id": "c", "reward": 1.0, "discount": 0.9, "completion_id": "chatcmpl-7"},
        None]
    assert {r.headers["authorization"] for r in seen} == {"Bearer sk-g"}
    assert [str(r.url) for r in seen][-1] == "http://svc/v1/experiences/chatcmpl-1"


def test_a_request_the_service_asks_to_repeat_is_sent_again_after_its_wait():
    store_away = (504, {"error": {"code": "store_unavailable", "message": "m"}}, {"Retry-After": "2"})
    limited = (429, {"error": {"code": "rate_limit_exceeded", "message": "m"}}, {"Retry-After": "3"})
    client, seen, waits = _client([store_away, limited, OK])
    assert client.reward("chatcmpl-1", 1.0)["data"] == [{"status": "recorded"}]
    assert len(seen) == 3 and waits == [2.0, 3.0]


def test_retries_are_bounded_and_other_refusals_raise_the_services_error():
    full = (507, {"error": {"code": "store_full", "message": "m"}, "data": []}, {"Retry-After": "5"})
    client, seen, waits = _client([full] * 3, retries=2)
    with pytest.raises(RewardError) as e:
        client.reward("chatcmpl-1", 1.0)
    assert (e.value.status, e.value.code, len(seen), waits) == (507, "store_full", 3, [5.0, 5.0])
    conflict = (409, {"error": {"code": "ambiguous_conversation", "message": "name a turn"}}, {})
    client, seen, waits = _client([conflict])
    with pytest.raises(RewardError, match="409 ambiguous_conversation: name a turn"):
        client.reward_conversation("c", 1.0)
    assert waits == []
    too_long = (429, {"error": {"code": "storage_quota_exceeded", "message": "m"}}, {"Retry-After": "600"})
    client, seen, waits = _client([too_long], max_wait_s=30)
    with pytest.raises(RewardError):  # a wait longer than max_wait_s is not waited
        client.reward("chatcmpl-1", 1.0)
    assert waits == []

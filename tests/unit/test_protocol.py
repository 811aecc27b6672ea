import pytest
from pydantic import ValidationError

from serve_rft.explorer.protocol import ChatCompletionRequest, parse_reward_body


def test_chat_request_accepts_openai_fields_and_extras():
    r = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}],
        "max_tokens": 5, "n": 2, "stop": "x", "logprobs": True, "top_logprobs": 3,
        "frequency_penalty": 0, "stream": False})
    assert r.messages[0].text() == "ab" and r.stop_list() == ["x"]


@pytest.mark.parametrize("bad", [
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": "x"}], "temperature": 3},
    {"messages": [{"role": "user", "content": "x"}], "n": 0},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21},
    {"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]},
    {"messages": "hello"},
])
def test_chat_request_rejects_bad_input(bad):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(bad)


def test_reward_body_single_and_batch():
    one = parse_reward_body({"completion_id": "c", "choice_index": 1, "reward": 0.5})
    assert [(x.completion_id, x.choice_index, x.reward) for x in one] == [("c", 1, 0.5)]
    many = parse_reward_body({"rewards": [{"completion_id": "c", "reward": 1}, {"completion_id": "d", "reward": 0}]})
    assert [x.choice_index for x in many] == [0, 0]
    with pytest.raises(ValidationError):
        parse_reward_body({"completion_id": "c", "reward": "lots"})
    with pytest.raises(ValidationError):
        parse_reward_body({"rewards": []})

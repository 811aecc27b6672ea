import pytest
from pydantic import ValidationError

from serve_rft.explorer.http.protocol import parse_reward_body


def test_reward_body_single_and_batch():
    from serve_rft.explorer.http.protocol import ChoiceRewards, ConversationReward, GroupRewards, RewardItem

    one = parse_reward_body({"completion_id": "c", "choice_index": 1, "reward": 0.5})
    assert isinstance(one, RewardItem) and (one.completion_id, one.choice_index, one.reward) == ("c", 1, 0.5)
    many = parse_reward_body({"rewards": [{"completion_id": "c", "reward": 1}, {"completion_id": "d", "reward": 0}]})
    assert [x.choice_index for x in many.rewards] == [0, 0]
    assert isinstance(parse_reward_body({"completion_id": "c", "rewards": [1, 0]}), ChoiceRewards)
    assert isinstance(parse_reward_body({"group_id": "g", "rewards": [{"completion_id": "c", "reward": 1}]}),
                      GroupRewards)
    assert parse_reward_body({"conversation_id": "v", "reward": 1, "discount": 0.5}).discount == 0.5
    assert isinstance(parse_reward_body({"conversation_id": "v", "reward": 1}), ConversationReward)
    with pytest.raises(ValidationError):
        parse_reward_body({"conversation_id": "v", "reward": 1, "discount": 2})
    with pytest.raises(ValidationError):
        parse_reward_body({"completion_id": "c", "reward": 1, "info": {"x": "y" * 20000}})
    with pytest.raises(ValueError):
        parse_reward_body([1, 2])
    with pytest.raises(ValidationError):
        parse_reward_body({"completion_id": "c", "reward": "lots"})
    with pytest.raises(ValidationError):
        parse_reward_body({"rewards": []})

"""serve_rft's own HTTP types: the reward requests and the OpenAI error JSON.

Chat and completion requests are vLLM's protocol classes (`serve_rft.explorer.http.openai_request`).
Anything a client can get wrong becomes an `ApiError` with a 4xx status and the OpenAI error
body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""``seed``'s range (vLLM: ``torch.iinfo(torch.long)``)."""


class ApiError(Exception):
    """A refusal, answered as OpenAI error JSON with ``status`` (and a ``Retry-After`` header of
    ``retry_after`` seconds when the client should try again: 503 / 504 / 507)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def invalid(cls, e: ValidationError, status: int = 400) -> "ApiError":
        """The first problem pydantic found, naming its field (``param``: the dotted location)."""
        err = e.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        return cls(status, f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param)


MAX_INFO_BYTES = 16 * 1024


def _small_info(v: dict | None) -> dict | None:
    if v is None:
        return v
    try:
        text = json.dumps(v, allow_nan=False)
    except ValueError:
        raise ValueError("info must hold finite numbers only (no NaN or Infinity)") from None
    if len(text) > MAX_INFO_BYTES:
        raise ValueError(f"info must serialize to at most {MAX_INFO_BYTES} bytes")
    return v


Info = Annotated[dict[str, Any] | None, AfterValidator(_small_info)]
"""Free-form reward metadata stored with the reward (at most 16 KiB of JSON)."""

Reward = Annotated[float, Field(strict=True)]
"""A reward: a JSON number (an integer is fine), never a string or a boolean (``"1.5"`` and
``true`` are refused, not coerced). Its range (``buffer.reward_range``) and finiteness are the
store's checks (`serve_rft.buffer.store.ExperienceStore.check_reward`)."""


class RewardItem(BaseModel):
    """One reward for one choice of one completion; ``info`` is stored with it."""

    model_config = ConfigDict(extra="forbid")
    completion_id: str = Field(min_length=1, max_length=256)
    choice_index: int = Field(0, ge=0, le=4096, strict=True)
    reward: Reward
    info: Info = None


class ChoiceRewards(BaseModel):
    """Rewards for the choices of one completion, in choice order: ``rewards[i]`` is choice i's."""

    model_config = ConfigDict(extra="forbid")
    completion_id: str = Field(min_length=1, max_length=256)
    rewards: list[Reward] = Field(min_length=1, max_length=4096)
    info: Info = None


class GroupRewards(BaseModel):
    """Rewards for the members of one group; each must belong to ``group_id`` (else 422)."""

    model_config = ConfigDict(extra="forbid")
    group_id: str = Field(min_length=1, max_length=256)
    rewards: list[RewardItem] = Field(min_length=1, max_length=4096)


class ConversationReward(BaseModel):
    """One reward for a whole conversation: turn t of T gets ``reward * discount**(T-1-t)``
    (the last turn the full reward; AReaL-style per-turn discount), every choice of the turn.
    ``completion_id``: any turn of it, naming the conversation when several keys of the tenant
    sent the same ``conversation_id`` (each key's conversation is its own)."""

    model_config = ConfigDict(extra="forbid")
    conversation_id: str = Field(min_length=1, max_length=256)
    completion_id: str | None = Field(None, min_length=1, max_length=256)
    reward: Reward
    discount: float = Field(1.0, ge=0.0, le=1.0, strict=True)
    info: Info = None


class RewardBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rewards: list[RewardItem] = Field(min_length=1, max_length=10_000)


RewardRequest = RewardItem | ChoiceRewards | GroupRewards | ConversationReward | RewardBatch


def parse_reward_body(body: Any) -> RewardRequest:
    """Pick the form of a ``POST /v1/rewards`` body by its keys:

    - ``{"completion_id", "choice_index"?, "reward", "info"?}``: one choice;
    - ``{"completion_id", "rewards": [float, ...], "info"?}``: every choice of a completion;
    - ``{"group_id", "rewards": [{...}, ...]}``: members of one group;
    - ``{"conversation_id", "completion_id"?, "reward", "discount"?, "info"?}``: all turns of a
      conversation;
    - ``{"rewards": [{...}, ...]}``: a batch of single rewards.

    Raises:
        pydantic.ValidationError: wrong shape, types or bounds.
        ValueError: the body is not a JSON object.
    """
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object")
    if "conversation_id" in body:
        return ConversationReward.model_validate(body)
    if "group_id" in body:
        return GroupRewards.model_validate(body)
    if "completion_id" in body and "rewards" in body:
        return ChoiceRewards.model_validate(body)
    if "rewards" in body:
        return RewardBatch.model_validate(body)
    return RewardItem.model_validate(body)

"""OpenAI-compatible HTTP types: chat requests, rewards, and the OpenAI error JSON.

Requests are validated here (types, bounds); anything a client can get wrong becomes an
`ApiError` with a 4xx status and the OpenAI error body
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ApiError(Exception):
    """A client error, answered as OpenAI error JSON with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message content as plain text (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` body: the OpenAI fields this service implements.

    Unknown OpenAI fields are accepted and ignored (as vLLM does), so the official client's
    extra fields never cause a 400.
    """

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class RewardItem(BaseModel):
    """One reward for one choice of one completion (``POST /v1/rewards``)."""

    model_config = ConfigDict(extra="forbid")
    completion_id: str = Field(min_length=1, max_length=256)
    choice_index: int = Field(0, ge=0)
    reward: float


class RewardBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rewards: list[RewardItem] = Field(min_length=1, max_length=10_000)


def parse_reward_body(body: Any) -> list[RewardItem]:
    """Accept a single reward object or ``{"rewards": [...]}``.

    Raises:
        pydantic.ValidationError: wrong shape or types.
    """
    if isinstance(body, dict) and "rewards" in body:
        return RewardBatch.model_validate(body).rewards
    return [RewardItem.model_validate(body)]

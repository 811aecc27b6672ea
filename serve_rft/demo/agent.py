"""A tool-using agent through the unchanged `openai` SDK, rewarded per conversation: the traffic
online RL for agents serves (the shape AReaL's online proxy, OpenPipe ART and agent-lightning
train on).

One episode: a user asks about a city's weather. Turn 1 the model calls the ``weather`` tool;
the call is forced with a named ``tool_choice`` and the tool is ``strict`` (OpenAI's flag: the
arguments must follow its schema), so that even a random-init model makes a valid call: vLLM samples
the whole ``<tool_call>`` block under a grammar built from the tool's parameters. The client runs the
tool and sends the call back as the assistant turn (``content: null`` + ``tool_calls``) and the
result as a ``tool`` message with the call's id. Turn 2 the model answers in text
(``tool_choice: none``). The conversation gets one reward through ``/v1/rewards``
(``conversation_id``; turn t of T gets ``reward * discount**(T-1-t)``).

Every turn is an experience of its own: the prompt ids exactly as the engine consumed them (the
earlier turns as the chat template renders them, the tool output included; prompt tokens are never
in the loss) and the sampled ids (``return_token_ids`` shows both to the client). A turn sampled
under a grammar is left out of the loss and counted (state ``constrained``): its behaviour
logprobs are of the masked distribution, which the trainer does not reproduce.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import httpx
import openai

CITIES = ["Paris", "Rome", "Oslo", "Lima"]
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Today's weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"], "additionalProperties": False}}}]
FORCED = {"type": "function", "function": {"name": "weather"}}


def weather(city: str) -> str:
    """The tool, run client-side: a deterministic forecast for ``city``."""
    return json.dumps({"city": city, "sky": ["sunny", "rainy", "cloudy", "windy"][len(city) % 4],
                       "celsius": 10 + 3 * len(city)})


def episode_reward(answer: str, tool_output: str) -> float:
    """1 if the answer names the forecast's sky, else the share of its characters that are
    lowercase vowels (dense, so a random-init model gets a signal), in [0, 1]."""
    sky = json.loads(tool_output)["sky"]
    if sky in answer:
        return 1.0
    return sum(ch in "aeiou" for ch in answer) / len(answer) if answer else 0.0


@dataclass
class Turn:
    """One assistant turn as the client saw it.

    Attributes:
        completion_id: the response id (what rewards and ``/v1/experiences/{id}`` name).
        prompt_token_ids: the prompt ids the engine consumed (``return_token_ids``).
        token_ids: the sampled ids, in order.
        finish_reason: OpenAI's.
        policy_version: from ``system_fingerprint`` (``policy-v{N}``).
    """

    completion_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    policy_version: int | None


@dataclass
class Episode:
    """A finished conversation: its turns, the tool call and result, the answer and reward."""

    conversation_id: str
    turns: list[Turn] = field(default_factory=list)
    tool_call: dict | None = None
    tool_output: str = ""
    answer: str = ""
    reward: float | None = None


def _version(fingerprint: str | None) -> int | None:
    return int(fingerprint.removeprefix("policy-v")) if fingerprint and fingerprint.startswith("policy-v") else None


def _messages(question: str, call, tool_output: str | None) -> list[dict]:
    msgs = [{"role": "system", "content": "You answer with the weather tool."},
            {"role": "user", "content": question}]
    if call is not None:
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call.id, "type": "function",
                      "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": tool_output}]
    return msgs


CALL_TOKENS = 600
"""``max_tokens`` of the forced call: vLLM's tool-call grammar lets whitespace into the JSON without
bound, and a random-init model at temperature 1 spends ~120 tokens on a call on average (16 of 16
calls finished within 600, measured on the embedded model; at temperature 0.3 only 6 of 16 did)."""


def run_episode(client: openai.OpenAI, conversation_id: str, city: str | None = None, *,
                model: str = "serve-rft", max_tokens: int = 24, temperature: float = 1.0) -> Episode:
    """Run one episode with the sync client (not streamed); see the module docstring.

    Raises:
        openai.APIError: the service refused a turn.
        ValueError: turn 1 ended without a tool call (`CALL_TOKENS` ran out).
    """
    city = city or random.choice(CITIES)
    question = f"What is the weather in {city} today?"
    ep = Episode(conversation_id)
    extra = {"conversation_id": conversation_id, "return_token_ids": True}
    r1 = client.chat.completions.create(model=model, messages=_messages(question, None, None), tools=TOOLS,
                                        tool_choice=FORCED, parallel_tool_calls=False, max_tokens=CALL_TOKENS,
                                        temperature=temperature, extra_body=extra)
    ep.turns.append(_turn(r1))
    calls = r1.choices[0].message.tool_calls
    if not calls:
        raise ValueError(f"turn 1 ended ({r1.choices[0].finish_reason}) without a tool call: "
                         f"{r1.choices[0].message.content!r}")
    call = calls[0]
    ep.tool_call = {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
    ep.tool_output = weather(**_arguments(call.function.arguments, r1))
    r2 = client.chat.completions.create(model=model, messages=_messages(question, call, ep.tool_output),
                                        tools=TOOLS, tool_choice="none", max_tokens=max_tokens,
                                        temperature=temperature, extra_body=extra)
    ep.turns.append(_turn(r2))
    ep.answer = r2.choices[0].message.content or ""
    ep.reward = episode_reward(ep.answer, ep.tool_output)
    return ep


async def run_episode_streamed(client: openai.AsyncOpenAI, conversation_id: str, city: str | None = None, *,
                               model: str = "serve-rft", max_tokens: int = 24,
                               temperature: float = 1.0) -> Episode:
    """The same episode with the async client, every turn streamed (tool-call deltas assembled
    as the openai SDK's users do). Turns carry no token ids (streams do not return them).

    Raises:
        openai.APIError: the service refused a turn; ValueError: turn 1 made no tool call.
    """
    city = city or random.choice(CITIES)
    question = f"What is the weather in {city} today?"
    ep = Episode(conversation_id)
    extra = {"conversation_id": conversation_id}

    async def turn(messages, tool_choice, n_tokens):
        stream = await client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
            max_tokens=n_tokens, temperature=temperature, stream=True, extra_body=extra)
        rid, text, finish, fingerprint, call = "", "", "", None, {"id": "", "name": "", "arguments": ""}
        async for chunk in stream:
            rid, fingerprint = chunk.id, chunk.system_fingerprint or fingerprint
            for c in chunk.choices:
                text += c.delta.content or ""
                for tc in c.delta.tool_calls or []:
                    call["id"] = tc.id or call["id"]
                    if tc.function is not None:
                        call["name"] += tc.function.name or ""
                        call["arguments"] += tc.function.arguments or ""
                finish = c.finish_reason or finish
        ep.turns.append(Turn(rid, [], [], finish, _version(fingerprint)))
        return text, call

    _, call = await turn(_messages(question, None, None), FORCED, CALL_TOKENS)
    if not call["name"]:
        raise ValueError(f"turn 1 ended ({ep.turns[-1].finish_reason}) without a tool call")
    ep.tool_call = call
    ep.tool_output = weather(**_arguments(call["arguments"], ep.turns[-1]))
    as_call = openai.types.chat.ChatCompletionMessageToolCall.model_validate(
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}})
    ep.answer, _ = await turn(_messages(question, as_call, ep.tool_output), "none", max_tokens)
    ep.reward = episode_reward(ep.answer, ep.tool_output)
    return ep


def _arguments(raw: str, seen) -> dict:
    """The tool call's arguments as a mapping.

    Raises:
        ValueError: they are not a JSON object (``seen``: what the service answered, for the message).
    """
    try:
        args = json.loads(raw)
    except json.JSONDecodeError:
        args = None
    if not isinstance(args, dict):
        raise ValueError(f"the tool call's arguments are not a JSON object: {raw!r} in {seen!r}")
    return args


def _turn(r) -> Turn:
    """A non-streamed response as a `Turn` (vLLM's ``return_token_ids`` fields are extras to the
    openai SDK: ``prompt_token_ids`` on the response, ``token_ids`` on the choice)."""
    c = r.choices[0]
    return Turn(r.id, list(getattr(r, "prompt_token_ids", None) or []), list(getattr(c, "token_ids", None) or []),
                c.finish_reason, _version(r.system_fingerprint))


def post_reward(base_url: str, episode: Episode, api_key: str | None = None, discount: float = 1.0) -> dict:
    """Reward the whole conversation (``POST /v1/rewards`` with ``conversation_id``).

    Returns:
        The service's JSON answer.
    Raises:
        httpx.HTTPStatusError: the reward was refused.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.post(f"{base_url}/v1/rewards", headers=headers, timeout=30, json={
        "conversation_id": episode.conversation_id, "reward": episode.reward, "discount": discount})
    r.raise_for_status()
    return r.json()

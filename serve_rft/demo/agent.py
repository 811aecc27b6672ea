"""A tool-using agent through the unchanged `openai` SDK, rewarded per conversation: the traffic
online RL for agents serves (the shape AReaL's online proxy, OpenPipe ART and agent-lightning
train on).

One episode, three assistant turns. A user asks about a city's weather. Turn 1 the model calls the
``weather`` tool; the call is forced with a named ``tool_choice`` and the tool is ``strict``
(OpenAI's flag: the arguments must follow its schema), so that even a random-init model makes a
valid call: vLLM samples the whole ``<tool_call>`` block under a grammar built from the tool's
parameters. The client runs the tool and sends the call back as the assistant turn
(``content: null`` + ``tool_calls``) and the result as a ``tool`` message with the call's id.
Turn 2 the model answers in text (``tool_choice: none``). Turn 3 the user follows up
(`FOLLOW_UP`) and the model answers again. The conversation gets one reward through
``/v1/rewards`` (``conversation_id``; turn t of T gets ``reward * discount**(T-1-t)``).

Every turn is an experience of its own: the prompt ids exactly as the engine consumed them (the
earlier turns as the chat template renders them, the tool output and the user's follow-up included;
prompt tokens are never in the loss) and the sampled ids (``return_token_ids`` shows both to the
client). A turn sampled under a grammar is left out of the loss and counted (state
``constrained``): its behaviour logprobs are of the masked distribution, which the trainer does
not reproduce.

The same script runs on the sync client (`run_episode`) and the async one (`run_episode_async`),
each streamed or not: `_script` is the conversation, the two drivers only send its requests.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Generator

import httpx
import openai

CITIES = ["Paris", "Rome", "Oslo", "Lima"]
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Today's weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                   "required": ["city"], "additionalProperties": False}}}]
FORCED = {"type": "function", "function": {"name": "weather"}}
FOLLOW_UP = "Thanks. Should I take an umbrella?"
"""The user's message of turn 3."""

CALL_TOKENS = 600
"""``max_tokens`` of the forced call: vLLM's tool-call grammar lets whitespace into the JSON without
bound, so a random-init model can spend many more tokens on a call than its JSON needs; 600 leaves
room for that on the embedded model at temperature 1."""


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
        text: the answer's text ("" for a tool call).
    """

    completion_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    policy_version: int | None
    text: str = ""


@dataclass
class Episode:
    """A finished conversation: its turns, the tool call and result, the answers and reward."""

    conversation_id: str
    turns: list[Turn] = field(default_factory=list)
    tool_call: dict | None = None
    tool_output: str = ""
    answer: str = ""
    follow_up_answer: str = ""
    reward: float | None = None


@dataclass
class _Ask:
    """One chat request of the script."""

    messages: list[dict]
    tool_choice: Any
    max_tokens: int


def _version(fingerprint: str | None) -> int | None:
    return int(fingerprint.removeprefix("policy-v")) if fingerprint and fingerprint.startswith("policy-v") else None


def _script(ep: Episode, city: str, max_tokens: int) -> Generator[_Ask, tuple[Turn, dict | None], None]:
    """The conversation: yields each request, receives ``(turn, tool call or None)``, fills ``ep``.

    Raises:
        ValueError: turn 1 ended without a tool call (`CALL_TOKENS` ran out), or its arguments are
            not a JSON object.
    """
    msgs = [{"role": "system", "content": "You answer with the weather tool."},
            {"role": "user", "content": f"What is the weather in {city} today?"}]
    turn, call = yield _Ask(msgs, FORCED, CALL_TOKENS)
    if not call or not call["name"]:
        raise ValueError(f"turn 1 ended ({turn.finish_reason}) without a tool call: {turn.text!r}")
    ep.tool_call = call
    ep.tool_output = weather(**_arguments(call["arguments"], turn))
    msgs = msgs + [{"role": "assistant", "content": None, "tool_calls": [
                        {"id": call["id"], "type": "function",
                         "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                   {"role": "tool", "tool_call_id": call["id"], "content": ep.tool_output}]
    turn, _ = yield _Ask(msgs, "none", max_tokens)
    ep.answer = turn.text
    msgs = msgs + [{"role": "assistant", "content": turn.text}, {"role": "user", "content": FOLLOW_UP}]
    turn, _ = yield _Ask(msgs, "none", max_tokens)
    ep.follow_up_answer = turn.text
    ep.reward = episode_reward(ep.answer, ep.tool_output)


def _request(ask: _Ask, model: str, temperature: float, stream: bool, conversation_id: str) -> dict:
    return dict(model=model, messages=ask.messages, tools=TOOLS, tool_choice=ask.tool_choice,
                max_tokens=ask.max_tokens, temperature=temperature, stream=stream,
                parallel_tool_calls=False,
                extra_body={"conversation_id": conversation_id, "return_token_ids": True})


def run_episode(client: openai.OpenAI, conversation_id: str, city: str | None = None, *, stream: bool = False,
                model: str = "serve-rft", max_tokens: int = 24, temperature: float = 1.0) -> Episode:
    """Run one episode with the sync client, every turn streamed or not; see the module docstring.

    Raises:
        openai.APIError: the service refused a turn.
        ValueError: turn 1 ended without a tool call.
    """
    ep = Episode(conversation_id)
    script = _script(ep, city or random.choice(CITIES), max_tokens)
    try:
        ask = next(script)
        while True:
            r = client.chat.completions.create(**_request(ask, model, temperature, stream, conversation_id))
            got = _from_chunks(list(r)) if stream else _from_response(r)
            ep.turns.append(got[0])
            ask = script.send(got)
    except StopIteration:
        return ep


async def run_episode_async(client: openai.AsyncOpenAI, conversation_id: str, city: str | None = None, *,
                            stream: bool = True, model: str = "serve-rft", max_tokens: int = 24,
                            temperature: float = 1.0) -> Episode:
    """`run_episode` on the async client.

    Raises:
        openai.APIError: the service refused a turn; ValueError: turn 1 made no tool call.
    """
    ep = Episode(conversation_id)
    script = _script(ep, city or random.choice(CITIES), max_tokens)
    try:
        ask = next(script)
        while True:
            r = await client.chat.completions.create(**_request(ask, model, temperature, stream, conversation_id))
            got = _from_chunks([c async for c in r]) if stream else _from_response(r)
            ep.turns.append(got[0])
            ask = script.send(got)
    except StopIteration:
        return ep


def _from_response(r) -> tuple[Turn, dict | None]:
    """A non-streamed response as a `Turn` and its first tool call (vLLM's ``return_token_ids``
    fields are extras to the openai SDK: ``prompt_token_ids`` on the response, ``token_ids`` on the
    choice)."""
    c = r.choices[0]
    calls = c.message.tool_calls
    call = ({"id": calls[0].id, "name": calls[0].function.name, "arguments": calls[0].function.arguments}
            if calls else None)
    return Turn(r.id, list(getattr(r, "prompt_token_ids", None) or []), list(getattr(c, "token_ids", None) or []),
                c.finish_reason, _version(r.system_fingerprint), c.message.content or ""), call


def _from_chunks(chunks: list) -> tuple[Turn, dict | None]:
    """Streamed chunks as a `Turn` and the tool call assembled from its deltas, as the openai SDK's
    users do (with ``return_token_ids`` the first chunk carries the prompt ids and each chunk its
    sampled ids, as vLLM streams them)."""
    rid, text, finish, fingerprint = "", "", "", None
    call = {"id": "", "name": "", "arguments": ""}
    prompt_ids: list[int] = []
    token_ids: list[int] = []
    for chunk in chunks:
        rid, fingerprint = chunk.id, chunk.system_fingerprint or fingerprint
        prompt_ids += getattr(chunk, "prompt_token_ids", None) or []
        for c in chunk.choices:
            token_ids += getattr(c, "token_ids", None) or []
            text += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return Turn(rid, prompt_ids, token_ids, finish, _version(fingerprint), text), call if call["name"] else None


def _arguments(raw: str, seen) -> dict:
    """The tool call's arguments as a mapping.

    Raises:
        ValueError: they are not a JSON object (``seen``: what the service answered, for the message).
    """
    try:
        args = json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        args = None
    if not isinstance(args, dict):
        raise ValueError(f"the tool call's arguments are not a JSON object: {raw!r} in {seen!r}")
    return args


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

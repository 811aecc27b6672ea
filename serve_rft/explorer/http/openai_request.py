"""What a chat, completion or responses request may ask of a service that trains on its answers.

Every request field is honoured, or refused with a 400 that names it and says why; nothing is
silently ignored. Honoured fields are vLLM's (its own protocol classes validate them) except
those that change the distribution tokens are sampled from in a way the trainer does not
reproduce: their behaviour logprobs would not be the policy's, and a PPO ratio against them
would be wrong without anybody noticing. Those are refused (`REFUSED`), each with its reason.
Structured outputs (``response_format``, ``structured_outputs``, a forced tool call with
``tool_choice`` ``required`` or a named function) are served; their experiences carry the
constraint and the trainer leaves them out of the loss, counted (`serve_rft.trainer.intake.feed`).

serve_rft's own request fields (`Extensions`) and OpenAI's ``store`` and ``metadata`` are taken
out before vLLM validates the rest; a field vLLM does not know is refused (vLLM would ignore it).
``user`` and ``metadata`` are kept with the experiences. vLLM's validation is lax where OpenAI is strict (``"stream": "yes"`` would
be true), so the fields a client most often gets wrong are checked strictly first (`_Strict`).

Fields kept with every choice's experience (``user``, ``stop``, ``response_format`` /
``structured_outputs``) or compiled into a grammar (``tools``) are bounded in size before
anything is generated (`check_limits`, `serve_rft.config.explorer.RequestLimits`), so one request
with ``n`` choices cannot multiply a large field into the store ``n`` times.

The ids a request names in the store are checked against it before anything is generated
(`check_against_store`): a ``group_size`` other than its group's recorded size, or one more turn
of a conversation at ``buffer.max_conversation_turns``, is refused with 409. Both ids are the
caller's key's own (`serve_rft.buffer.records.client_group`, `conversation_key`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator
from redis.exceptions import RedisError

from serve_rft.buffer.records import ConversationFull, GroupSizeConflict, client_group
from serve_rft.config.explorer import RequestLimits
from serve_rft.explorer.engine.engine_tap import RequestContext
from serve_rft.explorer.engine.reproducible import NOT_REPRODUCED
from serve_rft.explorer.http.protocol import INT64_MAX, INT64_MIN, ApiError


class Extensions(BaseModel):
    """serve_rft's request fields (the openai SDK sends them with ``extra_body``) and OpenAI's
    ``store`` and ``metadata``."""

    model_config = ConfigDict(extra="forbid")

    store: StrictBool | None = Field(None, description=(
        "OpenAI's flag: false = do not keep this conversation. Served, never logged as an "
        "experience (so never trained on); counted as unlogged."))
    group_id: str | None = Field(None, min_length=1, max_length=256, description=(
        "Put this request's answers in a client-named group, with the answers of other requests "
        "that carry the same group_id (GRPO compares the answers of one group)."))
    group_size: int | None = Field(None, ge=1, le=4096, description=(
        "How many answers (choices, over all requests) the group will have; the group is "
        "trained once all are rewarded. Without it, after buffer.group_timeout_s."))
    conversation_id: str | None = Field(None, min_length=1, max_length=256, description=(
        "Each assistant turn of a conversation is an experience; name the conversation to post "
        "one reward for all its turns."))
    metadata: dict[StrictStr, StrictStr] | None = Field(None, max_length=16, description=(
        "OpenAI's ``metadata`` (up to 16 pairs, keys up to 64 and values up to 512 characters): "
        "kept with the request's experiences."))

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        for key, value in (v or {}).items():
            if not key or len(key) > 64 or len(value) > 512:
                raise ValueError("metadata keys are 1-64 characters, values at most 512")
        return v


class _Strict(BaseModel):
    """Types OpenAI is strict about and vLLM's protocol is not (checked before vLLM's)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    stream: StrictBool | None = None
    echo: StrictBool | None = None
    n: StrictInt | None = Field(None, ge=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    seed: StrictInt | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="vLLM's bound: int64.")
    stop: StrictStr | list[StrictStr] | None = None
    user: StrictStr | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v == "" or (isinstance(v, list) and "" in v):
            raise ValueError("a stop sequence cannot be empty")
        return v


class _StrictChat(_Strict):
    messages: list[Any]
    logprobs: StrictBool | None = None


class _StrictCompletion(_Strict):
    logprobs: StrictInt | None = Field(None, ge=0)


class _StrictResponses(_Strict):
    input: StrictStr | list[Any]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20, description="OpenAI's bound.")
    background: StrictBool | None = None
    previous_response_id: StrictStr | None = None


STRICT = {"chat": _StrictChat, "completion": _StrictCompletion, "responses": _StrictResponses}


REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # field -> (its value leaves sampling alone, why another value is refused)
    # every sampling field the trainer does not reproduce, under its request name
    **{{"extra_args": "vllm_xargs"}.get(name, name): rule for name, rule in NOT_REPRODUCED.items()},
    "use_beam_search": (lambda v: not v, "beam search does not sample: its tokens have no behaviour "
                        "logprobs to train against"),
    "prompt_embeds": (lambda v: v is None, "an answer to embeddings has no prompt token ids to train on"),
    "cache_salt": (lambda v: v is None, "the prefix cache is salted by the service with the policy version"),
    "request_id": (lambda v: v is None, "the service names each request (its id names the experience)"),
    "kv_transfer_params": (lambda v: v is None, "disaggregated prefill is not served here"),
    "ec_transfer_params": (lambda v: v is None, "encoder-cache transfer is not served here"),
}

RESPONSES_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # fields of /v1/responses that need response state the service does not keep: vLLM keeps it
    # in the engine's memory only (VLLM_ENABLE_RESPONSES_API_STORE, unbounded, per replica),
    # outside the experience store, and another replica would not find it
    "previous_response_id": (lambda v: v is None, "no response is kept here to continue from: send the "
                             "earlier turns in input (and a conversation_id to reward the turns together)"),
    "previous_input_messages": (lambda v: v is None, "send the earlier turns in input"),
    "background": (lambda v: not v, "a background response would be kept by the engine, outside the "
                   "experience store; send the request and wait for its answer (or stream it)"),
    "prompt": (lambda v: v is None, "stored prompts (templates kept by OpenAI) are not served here: send "
               "the prompt in input"),
}
"""/v1/responses fields refused away from their neutral value (besides `REFUSED`), each with its reason."""

UNKNOWN_WHY = {
    "functions": "OpenAI's deprecated function calling is not served: use tools",
    "function_call": "OpenAI's deprecated function calling is not served: use tool_choice",
    "guided_json": "vLLM's old guided decoding fields are gone: use response_format or structured_outputs",
    "guided_regex": "vLLM's old guided decoding fields are gone: use structured_outputs",
    "guided_choice": "vLLM's old guided decoding fields are gone: use structured_outputs",
    "guided_grammar": "vLLM's old guided decoding fields are gone: use structured_outputs",
}
"""Request fields vLLM does not know (it would ignore them) with a hint; any other unknown field
is refused too, as OpenAI's API refuses one ("Unrecognized request argument supplied")."""


MAX_STOP = 4
"""Stop sequences per request: OpenAI's documented bound ("up to 4 sequences"), which vLLM's
request models enforce too."""


def _json_bytes(value: Any) -> int:
    """UTF-8 bytes of ``value`` as compact JSON."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def check_limits(body: dict[str, Any], limits: RequestLimits) -> None:
    """Refuse a request field over its size bound (`RequestLimits`). Types are checked before
    (`_Strict`) or after (vLLM) this; a field of another type is left to them.

    Raises:
        ApiError: 400 with ``param`` the field: ``user`` longer than ``max_user_chars``; more
            than `MAX_STOP` stop sequences or one longer than ``max_stop_chars``;
            ``response_format``, ``structured_outputs`` or (responses) ``text`` over
            ``max_schema_bytes``; more than
            ``max_tools`` tools or ``tools`` over ``max_tools_bytes``.
    """
    user = body.get("user")
    if isinstance(user, str) and len(user) > limits.max_user_chars:
        raise ApiError(400, f"user is {len(user)} characters, at most {limits.max_user_chars}", "user",
                       code="string_above_max_length")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"stop has {len(stops)} sequences, at most {MAX_STOP}", "stop",
                       code="array_above_max_length")
    for s in stops:
        if isinstance(s, str) and len(s) > limits.max_stop_chars:
            raise ApiError(400, f"a stop sequence is {len(s)} characters, at most {limits.max_stop_chars}",
                           "stop", code="string_above_max_length")
    for name in ("response_format", "structured_outputs", "text"):
        if body.get(name) is not None and (size := _json_bytes(body[name])) > limits.max_schema_bytes:
            raise ApiError(400, f"{name} is {size} bytes as JSON, at most {limits.max_schema_bytes}", name,
                           code="object_above_max_size")
    tools = body.get("tools")
    if isinstance(tools, list):
        if len(tools) > limits.max_tools:
            raise ApiError(400, f"tools has {len(tools)} tools, at most {limits.max_tools}", "tools",
                           code="array_above_max_length")
        if (size := _json_bytes(tools)) > limits.max_tools_bytes:
            raise ApiError(400, f"tools is {size} bytes as JSON, at most {limits.max_tools_bytes}", "tools",
                           code="object_above_max_size")


def parse_request(body: Any, kind: str, max_n: int, limits: RequestLimits | None = None):
    """A decoded JSON body -> (vLLM's request object, the `RequestContext`).

    Args:
        kind: ``chat`` (``ChatCompletionRequest``), ``completion`` (``CompletionRequest``) or
            ``responses`` (``ResponsesRequest``: one answer, named by its ``resp_...`` id; the fields
            that need response state kept by the engine are refused, `RESPONSES_REFUSED`).
        max_n: the largest ``n`` accepted.
        limits: size bounds of fields (`check_limits`; None: `RequestLimits` defaults).
    Raises:
        ApiError: 400 naming the field: not an object, a wrong type, a refused field
            (`REFUSED`, `RESPONSES_REFUSED`), a field vLLM does not know (`UNKNOWN_WHY`), ``n``
            too large, a field over its size bound, more than one prompt, vLLM's own validation,
            or (responses) an ``input`` vLLM cannot read into messages (`check_responses_input`).
    """
    from vllm.exceptions import VLLMClientError

    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    ours = {k: body.pop(k) for k in list(body) if k in Extensions.model_fields}
    try:
        ext = Extensions.model_validate(ours)
        STRICT[kind].model_validate(body)
    except ValidationError as e:
        raise ApiError.invalid(e) from None
    refused = {**REFUSED, **RESPONSES_REFUSED} if kind == "responses" else REFUSED
    for name, (neutral, why) in refused.items():
        if name in body and not neutral(body[name]):
            raise ApiError(400, f"{name} is not supported by this service: {why}", name, code="unsupported_parameter")
    model = _request_model(kind)
    for name in body:
        if name not in model.model_fields:
            why = UNKNOWN_WHY.get(name, f"not a parameter of {KIND_NAMES[kind]} here")
            raise ApiError(400, f"Unrecognized request argument supplied: {name} ({why})", name,
                           code="unknown_parameter")
    if (body.get("n") or 1) > max_n:
        raise ApiError(400, f"n must be <= {max_n}", "n")
    check_limits(body, limits or RequestLimits())
    if kind == "completion" and _several_prompts(body.get("prompt")):
        raise ApiError(400, "one prompt per request: each answer is an experience named by the response id",
                       "prompt", code="unsupported_parameter")
    named = {} if kind == "responses" else {"request_id": uuid.uuid4().hex}  # responses: vLLM's resp_... id
    try:
        req = model.model_validate({**body, **named})
    except ValidationError as e:
        raise ApiError.invalid(e) from None
    except (VLLMClientError, ValueError, TypeError) as e:  # vLLM's own validators raise these directly
        raise ApiError(400, str(e), getattr(e, "parameter", None)) from None
    if kind == "responses":
        check_responses_input(req)
    return req, RequestContext(store=ext.store, group_id=ext.group_id, group_size=ext.group_size,
                               conversation_id=ext.conversation_id, metadata=ext.metadata, user=req.user)


def check_responses_input(req) -> None:
    """Refuse a /v1/responses ``input`` that vLLM cannot read into chat messages, before anything
    is generated. vLLM's reader (``construct_input_messages``, which its renderer calls) takes an
    assistant output message's first content part's ``text`` unchecked: an output message with no
    content, or one whose first part is a ``refusal``, raises ``IndexError`` / ``AttributeError``
    there, which would be a 500. The named cases get a 400 saying what to send; the reader is then
    run here on the request (it only reads it), so any other input it cannot read is a 400 too.

    Args:
        req: vLLM's ``ResponsesRequest``, validated.
    Raises:
        ApiError: 400, param ``input`` (``input.{i}.content`` for a named case).
    """
    from openai.types.responses import ResponseOutputMessage, ResponseOutputText
    from vllm.entrypoints.openai.responses.utils import construct_input_messages
    from vllm.exceptions import VLLMClientError

    items = req.input if isinstance(req.input, list) else []
    for i, item in enumerate(items):
        if isinstance(item, ResponseOutputMessage) and (
                not item.content or not isinstance(item.content[0], ResponseOutputText)):
            raise ApiError(400, f"input[{i}] is an assistant output message whose first content part is "
                           "not output_text: send its text as an output_text part first",
                           f"input.{i}.content")
    try:
        construct_input_messages(request_instructions=req.instructions, request_input=req.input)
    except VLLMClientError as e:  # what vLLM's reader refuses itself (an unsupported item type)
        raise ApiError(400, str(e), getattr(e, "parameter", None) or "input") from None
    except (LookupError, AttributeError, TypeError, ValueError) as e:
        raise ApiError(400, f"input cannot be read as chat messages ({type(e).__name__}: {e})",
                       "input") from None


KIND_NAMES = {"chat": "chat completions", "completion": "text completions", "responses": "responses"}


def _request_model(kind: str):
    """vLLM's request model of ``kind``."""
    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest
    if kind == "completion":
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    return ResponsesRequest


def _several_prompts(prompt: Any) -> bool:
    """A completion ``prompt`` that is a list of prompts (strings or token-id lists) of length > 1."""
    return isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt)


async def check_against_store(store, ctx: RequestContext, wait_s: float) -> None:
    """Refuse, before anything is generated, a request the store would not take as asked (its
    ids in the caller's key's namespace, ``ctx.tenant`` and ``ctx.owner``). A request with ``store: false`` is
    never logged and not checked; with the store away (no answer within ``wait_s`` seconds, or
    a Redis error) it is not checked either: it is served as any request then (logged if the
    store is back in time, else counted unlogged).

    Args:
        store: the `serve_rft.buffer.store.ExperienceStore`.
    Raises:
        ApiError: 409 ``group_size_conflict`` (param ``group_size``): the group was logged with
            another size; 409 ``conversation_full`` (param ``conversation_id``): the conversation
            has ``buffer.max_conversation_turns`` turns.
    """
    if ctx.store is False or (ctx.group_id is None and ctx.conversation_id is None):
        return
    group = client_group(ctx.tenant, ctx.group_id, ctx.owner) if ctx.group_id is not None else None
    try:
        await asyncio.wait_for(store.check_request(ctx.tenant, group, ctx.group_size if group else None,
                                                   ctx.conversation_id, ctx.owner), wait_s)
    except GroupSizeConflict as e:
        raise ApiError(409, f"{e}: every request of a group must send the same group_size (or none)",
                       "group_size", code="group_size_conflict") from None
    except ConversationFull as e:
        raise ApiError(409, f"{e}: start a new conversation_id", "conversation_id",
                       code="conversation_full") from None
    except (asyncio.TimeoutError, RedisError):
        return

"""Conformance with vLLM's own OpenAI server: the same OpenAI requests against serve_rft and
vLLM's server (same install, same embedded model) give responses of the same JSON shape: chat
(n, logprobs), forced tool calls (named and required), ``tool_choice: auto`` and a conversation
that sends a tool call and its result back, honoured sampling fields (``ignore_eos``, ``stop``,
``stop_token_ids``, ``seed``, ``temperature: null``, ``response_format``, ``prompt_logprobs``),
text and token-id completions, stream chunks, models, errors; a forced call ends with the same
finish reason and tool on both servers; values that do not depend on the weights (the prompt ids
of tool conversations and completions, a length-capped answer's finish and token count) are
equal (`VALUES`); the two refusals vLLM does not make are listed (`DELIBERATE_STATUS`). The test is
`tests/integration/test_stack.py::test_responses_have_vllms_shape` (it shares that module's
stack); the shape diff is unit-tested in tests/unit/test_conformance_shape.py.

The shape of a JSON value is its type skeleton (objects by key, lists by their elements' shapes,
scalars by type). A key vLLM sends that we lack, or a shared key of another type, is a
difference; a ``null`` against a value is not (optional fields). What we send beyond vLLM (our
extensions) is allowed. Differences that are deliberate are listed in `ALLOWED` with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

_VLLM_ONLY = "a vLLM-only extension serve_rft does not serve (prompt extras, KV / EC transfer for " \
             "disaggregated serving, MoE routing, per-request engine metrics)"
ALLOWED: dict[str, str] = {
    **{f"{case}:$.{field}: missing": _VLLM_ONLY
       for case in ("chat", "chat_n_logprobs", "chat_stop_length")
       for field in ("prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params",
                     "ec_transfer_params", "metrics", "choices[].routed_experts")},
    "stream_role:$.prompt_token_ids: missing": _VLLM_ONLY,
    "stream_role:$.prompt_text: missing": _VLLM_ONLY,
    "stream_finish:$.choices[].delta.content: missing":
        "the finishing chunk carries the last token's text only if it has any (a token whose text is "
        "empty or held back gives an empty delta, on both servers: the same vLLM serving code); the "
        "two servers sample different tokens (the stack's weights have been trained)",
}
"""``case:difference`` -> why it is accepted."""


DATA_KEYED = {"$.prompt_logprobs[]", "$.choices[].logprobs.top_logprobs[]"}
"""Objects keyed by data (a token id or a token's text -> its logprob): their keys depend on the
weights and the sampled tokens, so their shape is ``{"*": merged value shape}``."""


def shape(value: Any, path: str = "$") -> Any:
    """The type skeleton of a JSON value: dict -> {key: shape}, list -> [merged element shapes],
    scalars -> "str" / "number" / "bool" / "null"; a dict at a `DATA_KEYED` path -> {"*": shape}."""
    if isinstance(value, dict):
        if path in DATA_KEYED:
            merged_value: Any = None
            for v in value.values():
                merged_value = _merge(merged_value, shape(v, f"{path}.*"))
            return {"*": merged_value} if value else {}
        return {k: shape(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        merged: Any = None
        for v in value:
            merged = _merge(merged, shape(v, f"{path}[]"))
        return [merged] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    return "str"


def _merge(a: Any, b: Any) -> Any:
    if a is None or a == "null":
        return b
    if b == "null":
        return a
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merge(a.get(k), b.get(k)) for k in a.keys() | b.keys()}
    if isinstance(a, list) and isinstance(b, list):
        return [_merge(a[0] if a else None, b[0] if b else None)] if (a or b) else []
    return a


def differences(ours: Any, theirs: Any, path: str = "$") -> list[str]:
    """Where ``ours`` lacks or mistypes what ``theirs`` (vLLM) has."""
    if theirs == "null" or ours == "null":
        return []
    if isinstance(theirs, dict):
        if not isinstance(ours, dict):
            return [f"{path}: object expected, got {ours!r}"]
        out = []
        for k, v in theirs.items():
            if k not in ours:
                out.append(f"{path}.{k}: missing")
            else:
                out += differences(ours[k], v, f"{path}.{k}")
        return out
    if isinstance(theirs, list):
        if not isinstance(ours, list):
            return [f"{path}: list expected, got {ours!r}"]
        if theirs and ours:
            return differences(ours[0], theirs[0], f"{path}[]")
        return []
    return [] if ours == theirs else [f"{path}: {theirs} expected, got {ours}"]


_TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Today's weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}]
_NAMED = {"type": "function", "function": {"name": "weather"}}
# a forced call of a strict tool: the random model needs room (vLLM's tool grammar lets whitespace
# into the JSON; serve_rft/demo/agent.py CALL_TOKENS)
_TOOL_CALL = {"model": "serve-rft", "messages": [{"role": "user", "content": "weather in Oslo?"}], "tools": _TOOLS,
              "parallel_tool_calls": False, "max_tokens": 600, "temperature": 1.0, "seed": 3}
TOOL_FINISH = {"chat_tool_named": "stop", "chat_tool_required": "tool_calls"}
"""A forced call's finish reason on both servers (OpenAI's: "stop" for a named function)."""

CASES: list[tuple[str, str, str, Any]] = [
    # (name, method, path, body)
    ("chat", "POST", "/v1/chat/completions",
     {"model": "serve-rft", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}),
    ("chat_n_logprobs", "POST", "/v1/chat/completions",
     {"model": "serve-rft", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hello"}],
      "max_tokens": 6, "n": 2, "logprobs": True, "top_logprobs": 2, "temperature": 0.8, "seed": 1}),
    ("chat_stop_length", "POST", "/v1/chat/completions",
     {"model": "serve-rft", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ("chat_tool_named", "POST", "/v1/chat/completions", {**_TOOL_CALL, "tool_choice": _NAMED}),
    ("chat_tool_required", "POST", "/v1/chat/completions", {**_TOOL_CALL, "tool_choice": "required"}),
    ("chat_tool_result", "POST", "/v1/chat/completions",
     {"model": "serve-rft", "max_tokens": 6, "tools": _TOOLS, "tool_choice": "none", "return_token_ids": True,
      "messages": [
         {"role": "user", "content": "weather in Oslo?"},
         {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "{\"sky\": \"windy\"}"}]}),
    ("chat_tool_auto", "POST", "/v1/chat/completions",
     {**_TOOL_CALL, "tool_choice": "auto", "max_tokens": 8, "return_token_ids": True}),
    # honoured sampling fields (the stack's weights move on while it trains: their values are
    # compared where they do not depend on the weights, see `VALUES`)
    ("chat_ignore_eos", "POST", "/v1/chat/completions",
     {"model": "serve-rft", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "ignore_eos": True,
      "temperature": 0, "return_token_ids": True}),
    ("chat_sampling_fields", "POST", "/v1/chat/completions",
     {"model": "serve-rft", "messages": [{"role": "user", "content": "x"}], "max_tokens": 6, "temperature": None,
      "top_p": 0.9, "seed": 5, "stop": ["\n\n"], "stop_token_ids": [0], "top_k": -1, "presence_penalty": 0,
      "include_stop_str_in_output": True, "skip_special_tokens": False}),
    ("chat_response_format", "POST", "/v1/chat/completions",
     {"model": "serve-rft", "messages": [{"role": "user", "content": "json"}], "max_tokens": 8,
      "response_format": {"type": "json_object"}}),
    ("chat_prompt_logprobs", "POST", "/v1/chat/completions",
     {"model": "serve-rft", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "prompt_logprobs": 1}),
    ("completion_text", "POST", "/v1/completions",
     {"model": "serve-rft", "prompt": "hello there", "max_tokens": 4, "return_token_ids": True, "logprobs": 1}),
    ("completion_token_ids", "POST", "/v1/completions",
     {"model": "serve-rft", "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True, "return_token_ids": True}),
    ("models", "GET", "/v1/models", None),
    ("error_not_json", "POST", "/v1/chat/completions", b"{not json"),
    ("error_no_messages", "POST", "/v1/chat/completions", {"model": "serve-rft", "max_tokens": 4}),
    ("error_bad_temperature", "POST", "/v1/chat/completions",
     {"model": "serve-rft", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
    ("error_too_long", "POST", "/v1/chat/completions",
     {"model": "serve-rft", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}),
    ("error_top_logprobs_alone", "POST", "/v1/chat/completions",
     {"model": "serve-rft", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    ("error_stream_options_alone", "POST", "/v1/chat/completions",
     {"model": "serve-rft", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}),
    ("refused_top_k", "POST", "/v1/chat/completions",
     {"model": "serve-rft", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "top_k": 5}),
    ("refused_unknown_field", "POST", "/v1/chat/completions",
     {"model": "serve-rft", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "service_tier": "auto"}),
]
DELIBERATE_STATUS: dict[str, tuple[int, int]] = {
    "refused_top_k": (400, 200),  # the trainer does not reproduce top_k (serve_rft/explorer/engine/reproducible.py)
    "refused_unknown_field": (400, 200),  # vLLM ignores a field it does not know; OpenAI (and we) refuse it
}
"""Cases where serve_rft answers differently on purpose: (ours, vLLM's) status."""
VALUES: dict[str, list[tuple]] = {
    # the same rendering of messages, tools and tool turns: the same prompt ids
    "chat_tool_result": [("prompt_token_ids",)],
    "chat_tool_auto": [("prompt_token_ids",)],
    "chat_ignore_eos": [("prompt_token_ids",), ("choices", 0, "finish_reason"), ("usage", "completion_tokens")],
    "completion_text": [("choices", 0, "prompt_token_ids")],
    "completion_token_ids": [("choices", 0, "prompt_token_ids"), ("choices", 0, "finish_reason"),
                             ("usage", "completion_tokens")],
}
"""Values that do not depend on the weights, compared between the servers: case -> paths."""
STREAM = {"model": "serve-rft", "messages": [{"role": "user", "content": "stream"}], "max_tokens": 12,
          "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 1}


def _at(value: Any, path: tuple) -> Any:
    """``value[path[0]][path[1]]...``, None where a step is missing."""
    for step in path:
        try:
            value = value[step]
        except (KeyError, IndexError, TypeError):
            return None
    return value


def _call(base: str, method: str, path: str, body: Any) -> tuple[int, Any]:
    if isinstance(body, bytes):
        r = httpx.request(method, base + path, content=body, headers={"content-type": "application/json"},
                          timeout=120)
    else:
        r = httpx.request(method, base + path, json=body, timeout=120)
    return r.status_code, r.json()


def _stream_chunks(base: str) -> dict[str, Any]:
    """Shapes of the first chunk (role), a content chunk, the finish chunk and the usage chunk."""
    chunks = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=STREAM, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    role = chunks[0]
    # a content chunk that is not also the finish chunk (vLLM holds back a partial UTF-8 tail, so
    # a short answer may have none: then there is no such part to compare)
    content = next((c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")
                    and not c["choices"][0].get("finish_reason")), None)
    finish = next(c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason"))
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]
    parts = {"role": shape(role), "finish": shape(finish), "usage": shape(usage)}
    if content is not None:
        parts["content"] = shape(content)
    return parts


def check(ours_url: str, vllm_url: str, report_path: Path) -> None:
    """Send every case and the stream to both servers; assert the same success / 4xx outcome
    and no shape difference outside `ALLOWED` (the whole report is written to ``report_path``)."""
    stack_url, plain_vllm = ours_url, vllm_url
    found: dict[str, list[str]] = {}
    statuses = {}
    calls = {}
    values = {}
    for name, method, path, body in CASES:
        ours_status, ours = _call(stack_url, method, path, body)
        theirs_status, theirs = _call(plain_vllm, method, path, body)
        statuses[name] = (ours_status, theirs_status)
        if name in DELIBERATE_STATUS:
            continue
        found[name] = differences(shape(ours), shape(theirs))
        for at in VALUES.get(name, []):
            values[f"{name}:{'.'.join(map(str, at))}"] = (_at(ours, at), _at(theirs, at))
        if name in TOOL_FINISH and ours_status == theirs_status == 200:
            calls[name] = [(c["finish_reason"], [t["function"]["name"] for t in c["message"]["tool_calls"]])
                           for c in (ours["choices"][0], theirs["choices"][0])]
    ours_stream, theirs_stream = _stream_chunks(stack_url), _stream_chunks(plain_vllm)
    for part in ours_stream.keys() & theirs_stream.keys():
        found[f"stream_{part}"] = differences(ours_stream[part], theirs_stream[part])
    report = {k: [d for d in v if f"{k}:{d}" not in ALLOWED] for k, v in found.items()}
    report_path.write_text(json.dumps({"statuses": statuses, "diffs": report, "tool_calls": calls,
                                       "values": values}, indent=1))
    for name, expected in DELIBERATE_STATUS.items():
        assert statuses[name] == expected, (name, statuses[name])
    for where, (ours_value, theirs_value) in values.items():
        assert ours_value == theirs_value and ours_value is not None, (where, ours_value, theirs_value)
    for name, answers in calls.items():  # both servers made the forced call, and end it as OpenAI does
        for finish, names in answers:
            if finish != "length":  # the call ran out of tokens (in whitespace) on one server
                assert (finish, names) == (TOOL_FINISH[name], ["weather"]), (name, answers)
    for name, (ours_status, theirs_status) in statuses.items():
        if name in DELIBERATE_STATUS:
            continue
        assert (ours_status < 400) == (theirs_status < 400), (name, ours_status, theirs_status)
        if name.startswith("error"):
            assert ours_status // 100 == 4 and theirs_status // 100 == 4, (name, ours_status, theirs_status)
    assert not any(report.values()), json.dumps(report, indent=1)

"""What a request may ask: vLLM's fields honoured, distribution changes the trainer does not
reproduce refused with a 400 that names the field, serve_rft's extensions taken out."""

import pytest

from serve_rft.explorer.engine.engine_tap import response_id, sampling_info
from serve_rft.explorer.http.openai_request import REFUSED, RESPONSES_REFUSED, parse_request
from serve_rft.explorer.http.protocol import ApiError

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("repetition_penalty", 1.2), ("logit_bias", {"5": 10}),
    ("top_k", 5), ("min_p", 0.1), ("min_tokens", 3), ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]),
    ("use_beam_search", True), ("cache_salt", "s"), ("request_id", "mine"), ("vllm_xargs", {"a": 1}),
    ("watermarking", {"seed": 1}), ("kv_transfer_params", {"x": 1}), ("ec_transfer_params", {"x": 1}),
    ("thinking_token_budget", 8),
])
def test_a_field_the_trainer_cannot_reproduce_is_refused_by_name(field, value):
    with pytest.raises(ApiError) as e:
        parse_request({**CHAT, field: value}, "chat", max_n=16)
    assert e.value.status == 400 and e.value.param == field and e.value.code == "unsupported_parameter"
    assert field in e.value.message and REFUSED[field][1] in e.value.message


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 0), ("repetition_penalty", 1.0), ("top_k", -1), ("top_k", 0), ("min_p", 0.0),
    ("logit_bias", {}), ("min_tokens", 0), ("temperature", None), ("top_p", 0.9), ("stop_token_ids", [7]),
    ("ignore_eos", True), ("return_token_ids", True), ("response_format", {"type": "json_object"}),
])
def test_neutral_or_reproduced_values_are_served(field, value):
    req, _ = parse_request({**CHAT, field: value}, "chat", max_n=16)
    assert req.request_id and len(req.request_id) == 32  # the service names every request


def test_extensions_and_store_are_taken_out_before_vllm():
    req, ctx = parse_request({**CHAT, "group_id": "g", "group_size": 4, "conversation_id": "c", "store": False,
                              "n": 2}, "chat", max_n=16)
    assert (ctx.group_id, ctx.group_size, ctx.conversation_id, ctx.store) == ("g", 4, "c", False)
    assert req.n == 2 and "group_id" not in (req.model_extra or {})
    for bad in ({"group_size": 0}, {"store": "no"}, {"n": 17}):
        with pytest.raises(ApiError) as e:
            parse_request({**CHAT, **bad}, "chat", max_n=16)
        assert e.value.status == 400 and e.value.param == next(iter(bad))


@pytest.mark.parametrize("field,hint", [
    ("functions", "use tools"), ("function_call", "use tool_choice"), ("guided_json", "response_format"),
    ("service_tier", "not a parameter"), ("prediction", "not a parameter"), ("foo", "not a parameter"),
])
def test_a_field_vllm_does_not_know_is_refused_as_openai_refuses_it(field, hint):
    with pytest.raises(ApiError) as e:  # vLLM would ignore it (and answer as if it were not there)
        parse_request({**CHAT, field: "x"}, "chat", max_n=16)
    assert e.value.status == 400 and e.value.param == field and e.value.code == "unknown_parameter"
    assert e.value.message.startswith(f"Unrecognized request argument supplied: {field}") and hint in e.value.message
    with pytest.raises(ApiError):
        parse_request({"prompt": "p", field: "x"}, "completion", max_n=16)


def test_user_and_metadata_are_kept_for_the_experiences():
    meta = {"tenant": "t1", "k" * 64: "v" * 512}
    req, ctx = parse_request({**CHAT, "user": "u-1", "metadata": meta}, "chat", max_n=16)
    assert (ctx.user, ctx.metadata) == ("u-1", meta) and "metadata" not in (req.model_extra or {})
    for bad in ({str(i): "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}, {"": "v"}, ["k"]):
        with pytest.raises(ApiError) as e:
            parse_request({**CHAT, "metadata": bad}, "chat", max_n=16)
        assert e.value.status == 400 and e.value.param.startswith("metadata"), bad


@pytest.mark.parametrize("body,param", [
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
])
def test_options_without_the_field_they_qualify_are_vllms_400(body, param):
    with pytest.raises(ApiError) as e:
        parse_request({**CHAT, **body}, "chat", max_n=16)
    assert e.value.status == 400 and param in e.value.message


def test_completions_take_one_prompt_text_or_token_ids():
    for prompt in ("hello", [1, 2, 3], ["hello"], [[1, 2]]):
        req, _ = parse_request({"prompt": prompt, "max_tokens": 4}, "completion", max_n=16)
        assert req.prompt == prompt
    for prompt in (["a", "b"], [[1], [2]]):
        with pytest.raises(ApiError) as e:
            parse_request({"prompt": prompt}, "completion", max_n=16)
        assert e.value.param == "prompt"
    with pytest.raises(ApiError) as e:
        parse_request({"prompt": "x", "logprobs": True}, "completion", max_n=16)  # an int there
    assert e.value.param == "logprobs"


def test_vllms_own_validation_is_a_400_naming_the_field():
    with pytest.raises(ApiError) as e:
        parse_request({"messages": "hello"}, "chat", max_n=16)
    assert e.value.status == 400 and e.value.param.startswith("messages")
    with pytest.raises(ApiError):
        parse_request([1, 2], "chat", max_n=16)


def test_the_response_id_names_a_completions_engine_request():
    assert response_id("cmpl-abc-0") == "cmpl-abc" and response_id("chatcmpl-abc") == "chatcmpl-abc"
    assert response_id("cmpl-0") == "cmpl-0"
    # vLLM's /v1/responses names its engine request resp_{id}_{turn}; the response's id is resp_{id}
    assert response_id("resp_9f2c_0") == "resp_9f2c" and response_id("resp_0") == "resp_0"


def test_sampling_info_keeps_a_grammar_constraint():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    info = sampling_info(SamplingParams(temperature=0.7, top_p=0.9, max_tokens=5, stop="x",
                                        structured_outputs=StructuredOutputsParams(json_object=True)))
    assert (info.temperature, info.top_p, info.max_tokens, info.stop) == (0.7, 0.9, 5, ["x"])
    assert info.structured_outputs == {"json_object": True}
    assert sampling_info(SamplingParams(max_tokens=5)).structured_outputs is None


# --- size bounds before anything is generated (RequestLimits) ---

from serve_rft.config.explorer import RequestLimits  # noqa: E402
from serve_rft.explorer.http.openai_request import check_limits  # noqa: E402

LIMITS = RequestLimits()
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}


@pytest.mark.parametrize("field,value,code", [
    ("user", "u" * (LIMITS.max_user_chars + 1), "string_above_max_length"),
    ("stop", ["a", "b", "c", "d", "e"], "array_above_max_length"),
    ("stop", "s" * (LIMITS.max_stop_chars + 1), "string_above_max_length"),
    ("stop", ["ok", "s" * (LIMITS.max_stop_chars + 1)], "string_above_max_length"),
    ("response_format", {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "object", "description": "d" * LIMITS.max_schema_bytes}}},
     "object_above_max_size"),
    ("structured_outputs", {"regex": "a" * LIMITS.max_schema_bytes}, "object_above_max_size"),
    ("tools", [TOOL] * (LIMITS.max_tools + 1), "array_above_max_length"),
    ("tools", [{**TOOL, "function": {**TOOL["function"], "description": "d" * LIMITS.max_tools_bytes}}],
     "object_above_max_size"),
])
def test_a_field_over_its_size_bound_is_a_400_naming_it(field, value, code):
    """The bounds hold for chat and completions alike (a request with n choices would store the
    field n times)."""
    with pytest.raises(ApiError) as e:
        parse_request({**CHAT, field: value, "n": 16}, "chat", max_n=16)
    assert e.value.status == 400 and e.value.param == field and e.value.code == code, e.value.message
    if field != "tools":
        with pytest.raises(ApiError) as e:
            parse_request({"prompt": "p", field: value}, "completion", max_n=16)
        assert e.value.param == field


def test_the_bounds_come_from_the_config():
    from serve_rft.config import load_config

    cfg = load_config(None, ["explorer.limits={max_stop_chars: 4096, max_user_chars: 4}"])
    parse_request({**CHAT, "stop": "s" * 4096}, "chat", max_n=16, limits=cfg.explorer.limits)
    with pytest.raises(ApiError) as e:
        parse_request({**CHAT, "user": "abcde"}, "chat", max_n=16, limits=cfg.explorer.limits)
    assert e.value.param == "user"


def test_what_well_behaved_clients_send_is_served():
    """OpenAI's own bounds (4 stop sequences, 128 tools, 16 metadata pairs of 64 / 512 characters)
    and realistic schemas pass."""
    body = {**CHAT, "user": "user-1234", "stop": ["\n\n", "ing", "###", "x" * LIMITS.max_stop_chars],
            "response_format": SCHEMA, "tools": [TOOL] * LIMITS.max_tools, "n": 16,
            "metadata": {f"k{i:062d}": "v" * 512 for i in range(16)}}
    req, ctx = parse_request(body, "chat", max_n=16)
    assert req.user == "user-1234" and len(req.stop) == 4 and len(ctx.metadata) == 16
    check_limits({"stop": None, "user": None, "tools": None}, LIMITS)  # absent fields: nothing to check


@pytest.mark.parametrize("metadata", [
    {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}, {"": "v"},
])
def test_metadata_over_openais_limits_is_a_400(metadata):
    with pytest.raises(ApiError) as e:
        parse_request({**CHAT, "metadata": metadata}, "chat", max_n=16)
    assert e.value.status == 400 and e.value.param.startswith("metadata")


@pytest.mark.parametrize("value", [5, ["a", 1]])
def test_user_and_stop_of_the_wrong_type_are_a_400(value):
    for field in ("user", "stop"):
        with pytest.raises(ApiError) as e:
            parse_request({**CHAT, field: value}, "chat", max_n=16)
        assert e.value.status == 400 and e.value.param.startswith(field)


@pytest.mark.parametrize("raw,param", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "user": "\\ud800"}', "user"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"k": "a\\udfffb"}}', "metadata.k"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"\\udc00": "v"}}', "metadata"),
    (b'{"messages": [{"role": "user", "content": "hi\\ud83d"}]}', "messages.0.content"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ude00x"]}', "stop.0"),
])
def test_text_that_cannot_be_stored_is_refused_before_generation(raw, param):
    """A lone surrogate escape parses in Python but fails UTF-8 encoding when the experience is
    serialised: refused at parsing, naming where it is."""
    from serve_rft.explorer.http.body import parse_json

    with pytest.raises(ApiError) as e:
        parse_request(parse_json(raw), "chat", max_n=16)
    assert e.value.status == 400 and e.value.param == param
    ok = parse_json(b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "user": "\\u00e9"}')
    req, _ = parse_request(ok, "chat", max_n=16)  # a surrogate pair is one character: served
    assert req.messages[0]["content"] == "\U0001F600" and req.user == "é"


RESPONSES = {"input": "hi", "max_output_tokens": 8}


def test_a_responses_request_is_vllms_with_its_own_resp_id_and_our_extensions_taken_out():
    req, ctx = parse_request({**RESPONSES, "conversation_id": "c", "group_id": "g", "store": False,
                              "metadata": {"k": "v"}, "user": "u"}, "responses", max_n=16)
    assert type(req).__name__ == "ResponsesRequest" and req.request_id.startswith("resp_")
    assert (ctx.conversation_id, ctx.group_id, ctx.store, ctx.metadata, ctx.user) == ("c", "g", False, {"k": "v"}, "u")
    req, _ = parse_request({"input": [{"role": "user", "content": "hi"}], "instructions": "be brief"},
                           "responses", max_n=16)
    assert req.instructions == "be brief"


@pytest.mark.parametrize("field,value", [
    ("previous_response_id", "resp_x"), ("background", True), ("prompt", {"id": "pmpt_1"}),
    ("previous_input_messages", [{"role": "user", "content": "x"}]),
    ("top_k", 5), ("repetition_penalty", 1.2), ("cache_salt", "s"), ("request_id", "resp_mine"),
])
def test_responses_refuse_what_needs_response_state_or_changes_sampling(field, value):
    """A field needing state the engine would keep outside the store, or one the trainer does not
    reproduce: 400 naming it, with the reason. (Fails without RESPONSES_REFUSED: vLLM answers
    previous_response_id with a 404 and runs background requests in its own task.)"""
    with pytest.raises(ApiError) as e:
        parse_request({**RESPONSES, field: value}, "responses", max_n=16)
    assert e.value.status == 400 and e.value.param == field and e.value.code == "unsupported_parameter"
    assert {**REFUSED, **RESPONSES_REFUSED}[field][1] in e.value.message


@pytest.mark.parametrize("body,param", [
    ({"input": 5}, "input"), ({**RESPONSES, "max_output_tokens": 0}, "max_output_tokens"),
    ({**RESPONSES, "top_logprobs": 21}, "top_logprobs"), ({**RESPONSES, "stream": "yes"}, "stream"),
    ({**RESPONSES, "n": 2}, "n"), ({**RESPONSES, "messages": []}, "messages"),
    ({**RESPONSES, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"description": "x" * 70000}}}},
     "text"),
])
def test_responses_fields_of_the_wrong_type_unknown_or_too_large_are_a_400(body, param):
    with pytest.raises(ApiError) as e:
        parse_request(dict(body), "responses", max_n=16)
    assert e.value.status == 400 and e.value.param.split(".")[0] == param, (e.value.param, e.value.message)


def test_neutral_values_of_refused_responses_fields_are_served():
    parse_request({**RESPONSES, "background": False, "previous_response_id": None, "top_k": -1}, "responses", max_n=16)


OUTPUT_MESSAGE = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed"}


@pytest.mark.parametrize("content", [
    [],  # the schemathesis case CI found: vLLM's reader raised IndexError (a 500)
    [{"type": "refusal", "refusal": "no"}],  # AttributeError there: a refusal has no text
])
def test_an_output_message_vllm_cannot_read_is_a_400_naming_it(content):
    body = {"input": [{"role": "user", "content": "hi"}, {**OUTPUT_MESSAGE, "content": content}]}
    with pytest.raises(ApiError) as e:
        parse_request(body, "responses", max_n=16)
    assert e.value.status == 400 and e.value.param == "input.1.content", (e.value.param, e.value.message)
    assert "output_text" in e.value.message


def test_an_input_item_vllm_does_not_serve_is_a_400_before_generation():
    with pytest.raises(ApiError) as e:
        parse_request({"input": [{"type": "item_reference", "id": "msg_1"}]}, "responses", max_n=16)
    assert e.value.status == 400 and e.value.param == "input" and "item_reference" in e.value.message


def test_an_earlier_assistant_turn_with_text_is_served():
    text = [{"type": "output_text", "text": "hello", "annotations": []}]
    req, _ = parse_request({"input": [{"role": "user", "content": "hi"}, {**OUTPUT_MESSAGE, "content": text},
                                      {"role": "user", "content": "again"}]}, "responses", max_n=16)
    assert len(req.input) == 3

"""The sampling the trainer reproduces: the model's generation-config defaults it does not are
dropped at start, and a request whose final vLLM SamplingParams it cannot reproduce is a 400."""

import pytest

from serve_rft.explorer.engine.reproducible import NOT_REPRODUCED, REPRODUCED_DEFAULTS, check, split_defaults

QWEN_INSTRUCT = {"repetition_penalty": 1.05, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "max_tokens": 512}
"""Qwen2.5-7B-Instruct's generation_config.json as vLLM's get_diff_sampling_param() reads it."""


def test_a_models_defaults_are_applied_only_where_the_trainer_reproduces_them():
    kept, dropped = split_defaults(QWEN_INSTRUCT)
    assert kept == {"temperature": 0.7, "top_p": 0.8, "max_tokens": 512}
    assert dropped == {"repetition_penalty": 1.05, "top_k": 20}
    assert split_defaults({"top_k": -1, "repetition_penalty": 1.0, "min_p": 0.0}) == (
        {"top_k": -1, "repetition_penalty": 1.0, "min_p": 0.0}, {})  # neutral values change nothing
    assert split_defaults({"some_new_knob": 3}) == ({}, {"some_new_knob": 3})  # unknown: not applied
    assert REPRODUCED_DEFAULTS.isdisjoint(NOT_REPRODUCED)


def test_vllms_request_to_sampling_params_with_the_dropped_defaults_would_be_refused():
    """What vLLM's serving layer does with defaults: a request that sets nothing inherits them."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.exceptions import VLLMValidationError

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(VLLMValidationError) as e:
        check(req.to_sampling_params(16, QWEN_INSTRUCT))
    assert e.value.parameter in ("top_k", "repetition_penalty")
    params = req.to_sampling_params(16, split_defaults(QWEN_INSTRUCT)[0])
    check(params)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.7, 0.8, 0, 1.0)


@pytest.mark.parametrize("name,value", [
    ("top_k", 20), ("min_p", 0.05), ("presence_penalty", 0.5), ("frequency_penalty", -0.5),
    ("repetition_penalty", 1.1), ("logit_bias", {3: 1.0}), ("min_tokens", 2), ("allowed_token_ids", [1]),
    ("bad_words", ["x"]), ("extra_args", {"k": 1}), ("thinking_token_budget", 4),
])
def test_a_setting_the_trainer_does_not_reproduce_is_a_400_naming_it(name, value):
    from vllm import SamplingParams
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    with pytest.raises(Exception) as e:
        check(SamplingParams(max_tokens=4, **{name: value}))
    err = create_error_response(e.value)  # how vLLM's serving layer (and the route) answers it
    assert err.error.code == 400 and err.error.param == name and NOT_REPRODUCED[name][1] in err.error.message


def test_reproduced_settings_pass():
    from vllm import SamplingParams

    check(SamplingParams(temperature=0.3, top_p=0.9, max_tokens=4, seed=1, stop=["x"], stop_token_ids=[5],
                         ignore_eos=True, logprobs=0, top_k=-1, repetition_penalty=1.0))

"""What of vLLM's sampling the trainer reproduces, checked on the sampling parameters vLLM uses.

The trainer recomputes a behaviour logprob as ``log_softmax(logits / temperature)`` of the
sampled token, renormalised over the top-p nucleus (`serve_rft.trainer.policy.token_logprobs.response_logprobs`); vLLM's
sampler does exactly that when nothing else touches the logits. vLLM's serving layer builds a
request's ``SamplingParams`` from the request's fields *and* the model's
``generation_config.json`` (``ModelConfig.get_diff_sampling_param``: ``top_k``, ``min_p``,
``repetition_penalty`` and penalties are common there, e.g. Qwen2.5-Instruct's ``top_k=20,
repetition_penalty=1.05``), after `serve_rft.explorer.http.openai_request` has checked the request.
So two checks keep a ratio from being silently wrong:

- `split_defaults` at start: the model's defaults the trainer reproduces (``temperature``,
  ``top_p``, ``max_tokens``) are applied as vLLM's server applies them; the others are dropped,
  and the replica logs each one it dropped.
- `check` on every logged request, in the engine tap, on the final ``SamplingParams``: a setting
  in `NOT_REPRODUCED` away from its neutral value is a 400 naming it (vLLM's
  ``VLLMValidationError``), never an experience with the wrong behaviour logprobs.

Grammar masks (``structured_outputs``) are not here: those answers are served and their
experiences left out of the loss, counted (`serve_rft.trainer.intake.feed`).
"""

from __future__ import annotations

from typing import Any, Callable

_PENALTY = "penalties change the sampling distribution; the trainer does not reproduce them"
NOT_REPRODUCED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # SamplingParams attribute -> (its value leaves the distribution alone, why)
    "top_k": (lambda v: v in (None, 0, -1), "top_k truncates the sampling distribution; the trainer "
              "reproduces top_p only"),
    "min_p": (lambda v: not v, "min_p truncates the sampling distribution; the trainer reproduces top_p only"),
    "presence_penalty": (lambda v: not v, _PENALTY),
    "frequency_penalty": (lambda v: not v, _PENALTY),
    "repetition_penalty": (lambda v: v in (None, 1.0), _PENALTY),
    "logit_bias": (lambda v: not v, "a logit bias changes the sampling distribution; the trainer does not "
                   "reproduce it"),
    "min_tokens": (lambda v: not v, "min_tokens masks the end of the answer for its first tokens; the "
                   "trainer does not reproduce that"),
    "allowed_token_ids": (lambda v: not v, "a token allow-list changes the sampling distribution"),
    "bad_words": (lambda v: not v, "banned words change the sampling distribution"),
    "extra_args": (lambda v: not v, "custom logits-processor arguments may change the sampling distribution"),
    "watermarking": (lambda v: v is None, "watermarking changes the sampling distribution"),
    "thinking_token_budget": (lambda v: v is None, "a thinking budget forces the end-of-thinking token; "
                              "forced tokens have no behaviour logprobs"),
}
"""``SamplingParams`` settings the trainer does not reproduce -> (neutral?, why)."""

REPRODUCED_DEFAULTS = frozenset({"temperature", "top_p", "max_tokens"})
"""Generation-config defaults applied as vLLM's server applies them."""


def split_defaults(defaults: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's sampling defaults (vLLM's ``get_diff_sampling_param()``) -> (applied, dropped).

    Applied: `REPRODUCED_DEFAULTS` and any other key at its neutral value; dropped: the rest.
    """
    kept, dropped = {}, {}
    for key, value in defaults.items():
        keep = key in REPRODUCED_DEFAULTS or (key in NOT_REPRODUCED and NOT_REPRODUCED[key][0](value))
        (kept if keep else dropped)[key] = value
    return kept, dropped


def check(params) -> None:
    """Refuse ``params`` (vLLM ``SamplingParams``) that the trainer cannot reproduce.

    Raises:
        vllm.exceptions.VLLMValidationError: the first setting of `NOT_REPRODUCED` away from its
            neutral value (vLLM's serving layer answers it as a 400 naming the parameter).
    """
    from vllm.exceptions import VLLMValidationError

    for name, (neutral, why) in NOT_REPRODUCED.items():
        value = getattr(params, name, None)
        if not neutral(value):
            raise VLLMValidationError(f"{name}={value!r} is not supported by this service: {why}",
                                      parameter=name, value=value)

"""vLLM's own OpenAI serving layer over the replica's engine tap.

The replica answers ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` and
``/v1/models`` with the classes vLLM's OpenAI server uses (``OpenAIServingChat``,
``OpenAIServingCompletion``, ``OpenAIServingResponses`` (without its in-memory response store,
vLLM's default), ``OpenAIServingModels``, the ``OnlineRenderer`` that applies chat templates and tool schemas,
the tool-call parser chosen by ``explorer.tool_call_parser``), built here as
``vllm.entrypoints.launchers.api_server.app_state.init_app_state`` builds them, so request
validation, sampling defaults (the model's ``generation_config.json``, those the trainer
reproduces: `serve_rft.explorer.engine.reproducible.split_defaults`), chat templates, tool
calls, structured outputs and every response shape are vLLM's. They reach the engine only through
`serve_rft.explorer.engine.engine_tap.EngineTap`, which logs each answer as experiences.

``system_fingerprint`` names the policy version that produced the answer (``policy-v{N}``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from serve_rft.config import Config
from serve_rft.explorer.engine.engine_tap import CURRENT
from serve_rft.explorer.engine.reproducible import split_defaults

log = logging.getLogger(__name__)


def fingerprint(version: int) -> str:
    """``system_fingerprint`` naming the policy version, e.g. ``policy-v3``."""
    return f"policy-v{version}"


def _policy_fingerprint(cls):
    """``cls`` with ``system_fingerprint`` read per request from the request's policy version."""

    class PolicyFingerprint(cls):
        @property
        def system_fingerprint(self) -> str | None:
            ctx = CURRENT.get()
            return fingerprint(ctx.version) if ctx is not None and ctx.version is not None else None

        @system_fingerprint.setter
        def system_fingerprint(self, _value) -> None:  # vLLM's constructor sets its own
            pass

    PolicyFingerprint.__name__ = cls.__name__
    return PolicyFingerprint


@dataclass
class OpenAIServing:
    """The serving objects of one replica."""

    models: object
    chat: object
    completion: object
    responses: object


def build_serving(cfg: Config, tap, model_path: str) -> OpenAIServing:
    """vLLM's serving objects over ``tap`` (an `EngineTap`), for the served name
    ``cfg.model.served_name`` and the tool parser / chat template of ``cfg.explorer``; the
    model's sampling defaults the trainer does not reproduce are dropped (logged)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.openai.responses.serving import OpenAIServingResponses
    from vllm.renderers.chat_utils import load_chat_template
    from vllm.renderers.online_renderer import OnlineRenderer

    ecfg = cfg.explorer
    template = load_chat_template(ecfg.chat_template)
    tools = ecfg.tool_call_parser is not None
    models = OpenAIServingModels(engine_client=tap, base_model_paths=[
        BaseModelPath(name=cfg.model.served_name, model_path=model_path)])
    renderer = OnlineRenderer(
        model_config=tap.model_config, renderer=tap.renderer, request_logger=None, chat_template=template,
        chat_template_content_format="auto", trust_request_chat_template=False, trust_request_mm_kwargs=False,
        enable_auto_tools=tools, exclude_tools_when_tool_choice_none=False, tool_parser=ecfg.tool_call_parser,
        tool_strict_level=ecfg.tool_strict_level, reasoning_parser="", default_chat_template_kwargs={}, log_error_stack=False)
    renderer.warmup()
    chat = _policy_fingerprint(OpenAIServingChat)(
        engine_client=tap, models=models, response_role="assistant", online_renderer=renderer,
        request_logger=None, chat_template=template, chat_template_content_format="auto",
        enable_auto_tools=tools, tool_parser=ecfg.tool_call_parser)
    completion = _policy_fingerprint(OpenAIServingCompletion)(
        tap, models, online_renderer=renderer, request_logger=None)
    responses = OpenAIServingResponses(
        tap, models, renderer, request_logger=None, chat_template=template, chat_template_content_format="auto",
        enable_auto_tools=tools, tool_parser=ecfg.tool_call_parser, tool_strict_level=ecfg.tool_strict_level)
    if responses.enable_store:
        raise ValueError("VLLM_ENABLE_RESPONSES_API_STORE is set: vLLM would keep every response in the "
                         "replica's memory, unbounded and outside the experience store; unset it")
    kept, dropped = split_defaults(chat.default_sampling_params)
    if dropped:
        log.warning("the model's sampling defaults %s are not applied: the trainer does not reproduce "
                    "them (applied: %s)", dropped, kept)
    chat.default_sampling_params, completion.default_sampling_params = kept, dict(kept)
    responses.default_sampling_params = dict(kept)
    return OpenAIServing(models=models, chat=chat, completion=completion, responses=responses)

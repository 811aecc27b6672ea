"""The engine tap: vLLM's OpenAI serving layer talks to the replica's engine through it, and every
answer it serves becomes experiences in the store before the answer ends.

vLLM's own serving classes (`serve_rft.explorer.engine.openai_serving`) render chat templates, parse
tool calls, apply structured outputs and shape every response and stream chunk exactly as vLLM's
server does. They call ``engine_client.generate(prompt, sampling_params, request_id, ...)``;
`EngineTap` is that engine client. For each call it

- labels the request with the policy version it is served with: full-weight sync salts the
  prefix cache with it (a KV block computed under one version is never reused under another);
  adapter-only LoRA sync answers with that version's adapter;
- salts the prefix cache with the caller's tenant too (`cache_salt`): one tenant's cached prefix
  is never reused for another's, so no tenant can learn from a faster first token that another
  sent a prompt (vLLM's ``cache_salt`` enters the hash of a prompt's blocks: docs.vllm.ai,
  design/prefix_caching, "Automatic Prefix Caching");
- refuses (400) sampling settings the trainer does not reproduce (`reproducible.check`): a
  backstop, since the request checks refuse them by name and the generation-config defaults
  that set them are dropped, so it fires only on a setting vLLM adds after those checks;
- asks vLLM for the sampled tokens' logprobs (the behaviour logprobs the trainer needs) even
  when the client did not (vLLM's serving layer shows logprobs only to clients that asked); those
  only the tap reads come in vLLM's flat container (`SamplingParams.flat_logprobs`: no object per
  token) and without their tokens decoded (the replica's engine skips them:
  `serve_rft.explorer.engine.vllm_engine.decode_no_tap_only_logprob_tokens`);
- accumulates what vLLM returns (token ids, logprobs, per-token weight-version spans) and, when
  the request finishes, logs one experience per choice through `ExperienceLog` *before* it
  yields the final output, so the client's last chunk (or the whole non-streamed answer) only
  leaves after the store has the experiences.

What the route knows and vLLM does not (group, conversation, ``store: false``) reaches the tap
through `CURRENT`, a context variable the route sets around the serving call; calls without it
(the probe, warm-up) are served and never logged.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from serve_rft.config.service import DEFAULT_TENANT
from serve_rft.explorer.engine import reproducible
from serve_rft.explorer.engine.experience_log import ExperienceLog, Sampled
from serve_rft.types import SamplingInfo


@dataclass
class RequestContext:
    """One HTTP request as the route saw it.

    Attributes:
        store: OpenAI's ``store`` flag (False: served, never logged).
        group_id, group_size, conversation_id: serve_rft's request extensions (GRPO groups
            across requests, multi-turn conversations rewarded as a whole).
        created_at: arrival, unix s.
        version: the policy version the answer is served with (set by the tap).
        logged: experiences the tap logged for it (set when the request finished).
        finished: the engine finished the request (a stream that ends without it failed).
        t0: arrival, `time.perf_counter` (for time to first token).
        metadata, user: OpenAI's request fields, kept with the experiences.
        tenant: the caller's tenant (`serve_rft.explorer.http.auth.Identity.tenant`): owns the
            experiences and namespaces the group and conversation ids; salts the prefix cache.
        owner: the caller's key (`serve_rft.explorer.http.auth.Identity.owner`; '' without
            keys): the group and conversation ids are its own within the tenant's.
        prompt_tokens, generated_tokens: what the engine used so far: the prompt's tokens and
            every answer's, counted as they come (what the caller's token budget is settled
            with: `serve_rft.explorer.http.costs`).
    """

    store: bool | None = None
    group_id: str | None = None
    group_size: int | None = None
    conversation_id: str | None = None
    created_at: float = field(default_factory=time.time)
    version: int | None = None
    logged: int = 0
    finished: bool = False
    t0: float = field(default_factory=time.perf_counter)
    metadata: dict[str, str] | None = None
    user: str | None = None
    tenant: str = DEFAULT_TENANT
    owner: str = ""
    prompt_tokens: int = 0
    generated_tokens: int = 0


CURRENT: ContextVar[RequestContext | None] = ContextVar("serve_rft_request", default=None)


def cache_salt(version: int, tenant: str = DEFAULT_TENANT) -> str:
    """vLLM's ``cache_salt`` of a request: ``policy-v{version}``, with ``-tenant-{tenant}`` added
    for any tenant but `DEFAULT_TENANT` (the version's digits end before it, so no two
    (version, tenant) pairs share a salt; only letters, digits, ``_ . -``). Requests share KV
    blocks only when they share the salt: the same policy version and the same tenant."""
    return f"policy-v{version}" if tenant == DEFAULT_TENANT else f"policy-v{version}-tenant-{tenant}"


def sampling_info(params) -> SamplingInfo:
    """What the trainer needs to know of vLLM ``SamplingParams`` to recompute the behaviour
    logprobs (temperature, top-p) or to know it cannot (``structured_outputs``: the tokens were
    sampled under a grammar mask)."""
    structured = None
    if params.structured_outputs is not None:
        so = params.structured_outputs
        structured = {k: v for k, v in vars(so).items() if not k.startswith("_") and v not in (None, False)}
    stop = params.stop if isinstance(params.stop, list) else ([params.stop] if params.stop else [])
    return SamplingInfo(temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens or 0,
                        seed=params.seed, stop=list(stop), structured_outputs=structured)


def response_id(request_id: str) -> str:
    """The response's ``id`` (what rewards name) for vLLM's engine request id: a completion's
    engine request is ``cmpl-{id}-{prompt index}`` (one prompt per request here), a chat's
    ``chatcmpl-{id}``, a /v1/responses one's ``resp_{id}_{turn}`` (one turn here: no built-in
    tool server)."""
    if request_id.startswith("resp_"):
        head, _, tail = request_id.rpartition("_")
        return head if tail.isdigit() and head != "resp" else request_id
    head, _, tail = request_id.rpartition("-")
    return head if request_id.startswith("cmpl-") and tail.isdigit() and head != "cmpl" else request_id


class EngineTap:
    """vLLM's ``EngineClient`` for the serving layer: the replica's `AsyncLLM` with experience
    logging (module docstring). Every other attribute is the `AsyncLLM`'s.

    Args:
        engine: the replica's `ExplorerEngine`.
        experience_log: where finished answers go.
        on_first_token: called with seconds from arrival to the first token of a streamed request.
    """

    def __init__(self, engine, experience_log: ExperienceLog, on_first_token=None):
        self._engine = engine
        self._log = experience_log
        self._on_first_token = on_first_token

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine.llm, name)

    def generate(self, prompt, sampling_params, request_id: str, lora_request=None, **kwargs) -> AsyncIterator:
        """vLLM's ``EngineClient.generate`` (called by the serving layer; ``prompt`` is its
        rendered engine input, a dict with ``prompt_token_ids``). Reads `CURRENT` now, at call
        time, in the route's context.

        Raises:
            vllm.exceptions.VLLMValidationError: a logged request whose sampling the trainer
                cannot reproduce (`serve_rft.explorer.engine.reproducible.check`).
        """
        from vllm.sampling_params import RequestOutputKind

        ctx = CURRENT.get()
        engine = self._engine
        version = engine.policy_version
        if engine.adapter_sync:  # a request keeps the adapter it started with
            lora_request = engine.adapters.get(version) if version > 0 else None
        prompt = dict(prompt)
        prompt["cache_salt"] = cache_salt(version, ctx.tenant if ctx is not None else DEFAULT_TENANT)
        if ctx is not None:
            reproducible.check(sampling_params)  # a 400 before anything is sampled
            ctx.version = version
            if sampling_params.num_logprobs is None:  # no logprobs, no logprob_token_ids asked
                sampling_params.logprobs = 0  # the sampled token's logprob, shown to nobody
                if sampling_params.prompt_logprobs is None and sampling_params.prompt_logprob_token_ids is None:
                    sampling_params.flat_logprobs = True  # the tap's alone: flat, not decoded
        cumulative = sampling_params.output_kind == RequestOutputKind.CUMULATIVE
        streamed = sampling_params.output_kind == RequestOutputKind.DELTA
        stream = engine.llm.generate(prompt, sampling_params, request_id, lora_request=lora_request, **kwargs)
        if ctx is None:
            return stream
        return self._logged(stream, ctx, sampling_params, request_id, version, cumulative, streamed)

    async def _logged(self, stream, ctx: RequestContext, params, request_id: str, version: int,
                      cumulative: bool, streamed: bool) -> AsyncIterator:
        choices: dict[int, Sampled] = {}
        first = True
        async for ro in stream:
            if not ctx.prompt_tokens:
                ctx.prompt_tokens = len(ro.prompt_token_ids or ())
            for out in ro.outputs:
                c = choices.get(out.index)
                if c is None:
                    c = choices[out.index] = Sampled(out.index, pinned=self._engine.adapter_sync)
                before = len(c.token_ids)
                c.add(out, replace=cumulative)
                ctx.generated_tokens += len(c.token_ids) - before
                if first and out.token_ids:
                    first = False
                    if streamed and self._on_first_token is not None:
                        self._on_first_token(time.perf_counter() - ctx.t0)
            if ro.finished:
                answers = [choices[i] for i in sorted(choices)]
                served = min((v for c in answers for v, _, _ in c.spans(version)), default=version)
                ctx.version = served
                ctx.logged = await self._log.log(ctx, response_id(request_id), list(ro.prompt_token_ids or []),
                                                 answers, sampling_info(params), served)
                ctx.finished = True
            yield ro

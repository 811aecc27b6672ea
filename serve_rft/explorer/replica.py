"""An explorer replica: the OpenAI HTTP API over one vLLM engine, logging every experience.

One Ray Serve replica = one `ExplorerEngine`. Requests arrive from HAProxy straight to this
replica's own HTTP server (Ray Serve's HAProxy mode, the default: serve_rft.service.ingress) or
through Ray Serve's Python proxy, routed around draining replicas by
`serve_rft.explorer.router.DrainAwareRouter`. Each completion's choices are written to the
`ExperienceStore` before the response ends. A background task long-polls the `Synchronizer`; when
granted a sync it drains (behind HAProxy: new chat requests get 503 and HAProxy re-sends them to
another replica, or, with no other replica serving, they wait; behind the proxy: it announces the
drain in its routing stats), pauses vLLM, reloads the weights of the new policy version, resumes
and reports back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from redis.exceptions import RedisError

from serve_rft.buffer.store import ExperienceStore, StoreFull
from serve_rft.config import Config
from serve_rft.explorer import openai_format as fmt
from serve_rft.explorer import openapi, rewards_api, sync_api
from serve_rft.explorer.auth import ApiKeys
from serve_rft.explorer.body import parse_json, read_body, read_json
from serve_rft.explorer.protocol import ApiError, ChatCompletionRequest, parse_reward_body
from serve_rft.observability.explorer_metrics import ExplorerMetrics
from serve_rft.explorer.weight_swap import WeightSwap
from serve_rft.types import SamplingInfo

log = logging.getLogger("serve_rft.explorer")

REPLICA_HEADER = "x-serve-rft-replica"
VERSION_HEADER = "x-serve-rft-policy-version"
app = FastAPI(title="serve_rft", version="0.1.0")
openapi.install(app)


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ())) or None
    return f"{param}: {err.get('msg')}" if param else str(err.get("msg")), param


def _error(e: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class ExplorerReplica:
    """The Serve deployment class (decorated in `serve_rft.service.app`)."""

    async def __init__(self, config_json: str, model_path: str | None):
        from ray import serve
        from transformers import AutoTokenizer

        from serve_rft.explorer.engine import ExplorerEngine
        from serve_rft.control import ensure_control

        self.cfg = Config.model_validate_json(config_json)
        if model_path is None:
            from serve_rft.model.embedded import resolve_model_path

            model_path = str(resolve_model_path(self.cfg.model.path, self.cfg.model.cache_dir))
        self.api_keys = ApiKeys(self.cfg.service.api_keys, self.cfg.service.admin_keys)
        self.model_path = model_path
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # one thread: the tokenizer is not shared across threads, and request order is kept
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.store = ExperienceStore.from_config(self.cfg.buffer)
        self.sync = ensure_control(self.cfg, model_path)  # `serve deploy`: nobody else starts them
        nccl = self.cfg.synchronizer.sync_method.value == "nccl"
        lora_rank = self.cfg.trainer.lora.vllm_max_lora_rank() if self.cfg.adapter_sync else None
        self.engine = await ExplorerEngine.create(model_path, self.cfg.explorer, replica_id=self.replica_id,
                                                  weight_transfer="nccl" if nccl else None,
                                                  lora_rank=lora_rank)
        self.experiences_logged = 0  # explorer step = this // synchronizer.explorer_step_experiences
        step = self.cfg.synchronizer.explorer_step_experiences
        self.swap = WeightSwap(self.replica_id, context.replica_id.to_full_id_str(), self.engine, self.sync,
                               self.cfg, model_path, lambda: self.experiences_logged // step)
        await self.swap.start()  # a restarted or new replica loads the incumbent version first
        self.metrics = ExplorerMetrics(self.replica_id)
        self._counts_task = asyncio.create_task(self._export_store_counts())

    # -- Ray Serve hooks ---------------------------------------------------------------
    def record_routing_stats(self) -> dict[str, Any]:
        """Read by `DrainAwareRouter`: a draining replica gets no new requests."""
        return {"draining": self.swap.draining, "policy_version": self.swap.version}

    async def check_health(self) -> None:
        """Serve's health check: raises if the sync loop failed or the vLLM engine died, so Serve
        replaces this replica (a dead EngineCore would otherwise answer every request with 503)."""
        self.swap.check()
        await self.engine.check_health()

    def __del__(self):
        swap = getattr(self, "swap", None)
        if swap is not None:
            swap.leave()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    async def _export_store_counts(self, period_s: float = 5.0) -> None:
        """Refresh the store-count gauges every ``period_s`` (a Redis outage only skips a beat)."""
        import redis.exceptions

        while True:
            try:
                self.metrics.store_counts(await self.store.counts())
            except redis.exceptions.RedisError:  # the store retries on its own; next beat
                pass
            await asyncio.sleep(period_s)

    # -- HTTP ----------------------------------------------------------------------------
    def _refused(self, request: Request) -> JSONResponse | None:
        """The 401 answer if this request lacks the key its path needs (`ApiKeys.check`).
        Every route but /health passes here: a request reached this replica, so the ingress
        routes to it (`WeightSwap.reached`)."""
        self.swap.reached = True
        try:
            self.api_keys.check(request.url.path, request.headers.get("authorization"))
        except ApiError as e:
            return _error(e)
        return None

    def _headers(self, version: int) -> dict[str, str]:
        return {REPLICA_HEADER: self.replica_id, VERSION_HEADER: str(version)}

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """Readiness: 503 when the engine died (nothing can be served here); 200 otherwise, with
        ``store`` ok / unavailable (chat is still served while the store is away, unlogged)."""
        engine_ok = not self.engine.llm.errored
        store_ok = await self._store_ok()
        return JSONResponse({"status": ("ok" if store_ok else "degraded") if engine_ok else "engine_dead",
                             "replica": self.replica_id, "policy_version": self.swap.version,
                             "draining": self.swap.draining, "engine": "ok" if engine_ok else "dead",
                             "store": "ok" if store_ok else "unavailable"},
                            status_code=200 if engine_ok else 503, headers=self._headers(self.swap.version))

    async def _store_ok(self, timeout_s: float = 0.5) -> bool:
        try:
            return await asyncio.wait_for(self.store.ping(), timeout_s)
        except (asyncio.TimeoutError, RedisError):
            return False

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        if (refused := self._refused(request)) is not None:
            return refused
        name = self.cfg.model.served_name
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "serve_rft",
             "root": self.model_path, "parent": None, "max_model_len": self.cfg.explorer.max_model_len,
             "permission": []}]})

    @app.get("/v1/status")
    async def status(self, request: Request) -> JSONResponse:
        if (refused := self._refused(request)) is not None:
            return refused
        sync_status = await self.sync.status.remote()
        try:
            counts = await asyncio.wait_for(self.store.counts(), self.cfg.buffer.store_wait_s)
            sync_status["experiences"], sync_status["store"] = counts.__dict__, "ok"
        except (asyncio.TimeoutError, RedisError):  # the store is away: say so, do not hang
            sync_status["experiences"], sync_status["store"] = None, "unavailable"
        trainer = self._trainer()
        if trainer is not None:
            t = await trainer.status.remote()
            sync_status["trainer"].update(staleness_trained=t["staleness_trained"],
                                          stale_dropped=t["stale_dropped"], error=t["error"],
                                          phase=t["phase"], resumed_from=t["resumed_from"],
                                          pid=t["pid"], redelivered=t["redelivered"],
                                          resume_acked=t["resume_acked"],
                                          dead_lettered=t["dead_lettered"], reacked=t["reacked"],
                                          resets=t["resets"], last_reset=t["last_reset"],
                                          sample_age_s={k: (t["last"] or {}).get(f"sample_age_s_{k}")
                                                        for k in ("mean", "max")})
        return JSONResponse(sync_status)

    def _trainer(self):
        """The trainer actor, or None (serve-only mode)."""
        from serve_rft.names import find_trainer

        return find_trainer()

    @app.get("/v1/sync/events")
    async def sync_events(self, request: Request, since: float = 0.0) -> JSONResponse:
        if (refused := self._refused(request)) is not None:
            return refused
        return JSONResponse({"events": await self.sync.events.remote(since)})

    @app.get("/v1/sync/rollout")
    async def sync_rollout(self, request: Request) -> JSONResponse:
        """The rollout (`serve_rft.explorer.sync_api`)."""
        if (refused := self._refused(request)) is not None:
            return refused
        return JSONResponse(await self.sync.rollout.remote())

    @app.post("/v1/sync/pin")
    async def sync_pin(self, request: Request) -> JSONResponse:
        return await self._operator(request, sync_api.PinRequest, lambda b: self.sync.pin.remote(b.version))

    @app.post("/v1/sync/rollback")
    async def sync_rollback(self, request: Request) -> JSONResponse:
        return await self._operator(request, sync_api.RollbackRequest,
                                    lambda b: self.sync.rollback.remote(b.version))

    @app.post("/v1/sync/promotion")
    async def sync_promotion(self, request: Request) -> JSONResponse:
        return await self._operator(request, sync_api.PromotionRequest,
                                    lambda b: self.sync.pause_promotion.remote(b.paused))

    @app.post("/v1/sync/replicas/{replica_id}/drain")
    async def sync_drain(self, request: Request, replica_id: str) -> JSONResponse:
        return await self._operator(request, sync_api.DrainRequest,
                                    lambda b: self.sync.drain.remote(replica_id, b.drained))

    async def _operator(self, request: Request, model, action) -> JSONResponse:
        """An admin action on the synchronizer: auth, body, call, errors as OpenAI JSON."""
        if (refused := self._refused(request)) is not None:
            return refused
        try:
            body = sync_api.parse(model, await read_json(request))
            return JSONResponse(await sync_api.call(action(body)))
        except ApiError as e:
            return _error(e)

    @app.post("/v1/rewards")
    async def rewards(self, request: Request) -> JSONResponse:
        """Post rewards (forms: `serve_rft.explorer.protocol.parse_reward_body`)."""
        t0 = time.perf_counter()
        response = await self._rewards(request)
        self.metrics.request("rewards", response.status_code, time.perf_counter() - t0)
        return response

    async def _rewards(self, request: Request) -> JSONResponse:
        if (refused := self._refused(request)) is not None:
            return refused
        try:
            body = await read_json(request)
            try:
                req = parse_reward_body(body)
            except ValidationError as e:
                msg, param = _validation_message(e)
                raise ApiError(422, msg, param) from None
            except ValueError as e:
                raise ApiError(422, str(e)) from None
            try:
                results = await asyncio.wait_for(rewards_api.post_rewards(self.store, req),
                                                 self.cfg.buffer.store_wait_s)
            except (asyncio.TimeoutError, RedisError):  # recorded items answer duplicate on retry
                # 504, not 503: HAProxy re-sends a 503 to another replica, which waits on the same store
                raise ApiError(504, "the experience store is unavailable; retry (items already recorded "
                               "answer duplicate)", type_="service_unavailable", code="store_unavailable") from None
        except ApiError as e:
            return _error(e, {"Retry-After": "2"} if e.status == 504 else None)
        self.metrics.reward_results(results)
        status = rewards_api.batch_status(results)
        body: dict = {"object": "list", "data": results}
        if status != 200:  # the refusal that decided the status, every item's result alongside
            first = next(r for r in results if r["status"] == "refused" and r["status_code"] == status)
            body = {"error": first["error"], "object": "list", "data": results}
        return JSONResponse(body, status_code=status, headers={"Retry-After": "5"} if status == 507 else None)

    @app.get("/v1/experiences/{completion_id}")
    async def experience(self, request: Request, completion_id: str) -> JSONResponse:
        """Each choice's state, reward, info and versions."""
        if (refused := self._refused(request)) is not None:
            return refused
        try:
            return JSONResponse(await rewards_api.describe_completion(self.store, completion_id))
        except ApiError as e:
            return _error(e)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        t0 = time.perf_counter()
        response = await self._chat(request, t0)
        if not isinstance(response, StreamingResponse):  # a stream records itself when it ends
            self.metrics.request("chat", response.status_code, time.perf_counter() - t0)
        return response

    async def _chat(self, request: Request, t0: float):
        if (refused := self._refused(request)) is not None:
            return refused
        admission = self.swap.admission()
        if admission == "hold":  # no other replica serves: wait for the new weights, do not fail
            await self.swap.gate.wait()
            admission = "refuse" if self.swap.broken is not None else "serve"
        if admission == "refuse":
            await request.body()  # consume it: the connection stays clean for HAProxy to reuse
            e = ApiError(503, f"replica {self.replica_id} is out of rotation (loading new weights or "
                         "drained); retry on another replica", type_="service_unavailable", code="replica_draining")
            return _error(e, {"Retry-After": "1"})
        try:
            raw = await read_body(request)
            # parsing, validation and the chat template run on the replica's tokenizer thread:
            # a multi-megabyte prompt never stalls the event loop that streams other answers
            req, prompt_ids, params, sampling = await asyncio.get_running_loop().run_in_executor(
                self._cpu, self._decode_chat, raw)
        except ApiError as e:
            return _error(e)
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(self._stream(req, cid, prompt_ids, params, sampling, t0),
                                     media_type="text/event-stream",
                                     headers=self._headers(self.swap.version))
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.exceptions import EngineDeadError

        version = self.swap.version
        try:
            response = await self._complete(req, cid, prompt_ids, params, sampling)
        except VLLMValidationError as e:  # the engine refused the request's values: the client's to fix
            return _error(ApiError(400, str(e), getattr(e, "parameter", None)))
        except EngineDeadError:  # nothing was sent: HAProxy re-sends a 503 to another replica,
            self.swap.record(version, False, time.perf_counter() - t0)  # and Serve replaces this
            return _error(ApiError(503, f"replica {self.replica_id}'s engine died; retry on another "
                                   "replica", type_="service_unavailable", code="engine_dead"), {"Retry-After": "1"})
        except Exception:
            self.swap.record(version, False, time.perf_counter() - t0)
            raise
        self.swap.record(version, True, time.perf_counter() - t0)
        return response

    def _decode_chat(self, raw: bytes):
        """Body bytes -> (request, prompt ids, `SamplingParams`, `SamplingInfo`); on the
        tokenizer thread.

        Raises:
            ApiError: 400 bad JSON or fields, 404 a model this service does not serve, 400 from
                `_prepare`.
        """
        try:
            req = ChatCompletionRequest.model_validate(parse_json(raw))
        except ValidationError as e:
            msg, param = _validation_message(e)
            raise ApiError(400, msg, param) from None
        if req.model is not None and req.model != self.cfg.model.served_name:
            raise ApiError(404, f"The model `{req.model}` does not exist.", "model", code="model_not_found")
        return (req, *self._prepare(req))

    def _prepare(self, req: ChatCompletionRequest):
        """Tokenize with the chat template and build vLLM `SamplingParams`.

        Raises:
            ApiError: 400 for ``n`` too large or a prompt that does not fit the context.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        ecfg = self.cfg.explorer
        if req.n > ecfg.max_n:
            raise ApiError(400, f"n must be <= {ecfg.max_n}", "n")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt_ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                            tokenize=True, return_dict=False)
        except Exception as e:  # a template that cannot render these messages
            raise ApiError(400, f"messages cannot be rendered by the chat template: {e}", "messages") from None
        if hasattr(prompt_ids, "keys"):
            prompt_ids = prompt_ids["input_ids"]
        prompt_ids = list(prompt_ids)
        room = ecfg.max_model_len - len(prompt_ids)
        asked = req.max_completion_tokens or req.max_tokens
        if room < 1 or (asked is not None and asked > room):
            raise ApiError(400, f"this model's maximum context length is {ecfg.max_model_len} tokens; "
                           f"the messages take {len(prompt_ids)} and max_tokens asks {asked or 1}",
                           "messages", code="context_length_exceeded")
        max_tokens = asked or min(ecfg.default_max_tokens, room)
        from vllm.exceptions import VLLMValidationError

        try:
            params = SamplingParams(
                n=req.n, temperature=req.temperature, top_p=req.top_p, max_tokens=max_tokens,
                stop=req.stop_list() or None, seed=req.seed,
                logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
                output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
            )
        except (VLLMValidationError, ValueError) as e:  # vLLM's own checks: a 400, as its server answers
            raise ApiError(400, str(e), getattr(e, "parameter", None)) from None
        sampling = SamplingInfo(temperature=req.temperature, top_p=req.top_p, max_tokens=max_tokens,
                                seed=req.seed, stop=req.stop_list())
        return prompt_ids, params, sampling

    async def _log(self, req, cid, prompt_ids, accs, sampling, created_at, version) -> None:
        if req.store is False:  # OpenAI's "do not keep my data": served, never logged nor trained
            self.metrics.served(len(prompt_ids), sum(len(c.token_ids) for c in accs), 0, unlogged=len(accs))
            return
        group = f"u:{req.group_id}" if req.group_id else None  # client groups never collide with ids
        exps = fmt.build_experiences(cid, self.replica_id, prompt_ids, accs, sampling, created_at, version,
                                     group)
        try:
            await asyncio.wait_for(self.store.log_experiences(exps, group_size=req.group_size if group else None,
                                                              conversation_id=req.conversation_id),
                                   self.cfg.buffer.store_wait_s)
        except (StoreFull, asyncio.TimeoutError, RedisError) as e:
            # the user is served, the loss counted: the store is full (buffer.maxmemory_mb) or
            # away longer than buffer.store_wait_s (a timed-out call may still have landed)
            reason = "store_full" if isinstance(e, StoreFull) else "store_unavailable"
            self.metrics.served(len(prompt_ids), sum(len(c.token_ids) for c in accs), 0,
                                unlogged=len(exps), reason=reason)
            log.warning("experience store %s: completion %s served, not logged", reason, cid)
            return
        self.experiences_logged += len(exps)
        self.metrics.served(len(prompt_ids), sum(len(c.token_ids) for c in accs), len(exps))

    async def _complete(self, req, cid, prompt_ids, params, sampling) -> JSONResponse:
        created_at = time.time()
        version = self.swap.version
        accs = {i: fmt.ChoiceAccumulator(i, pinned=self.engine.adapter_sync) for i in range(req.n)}
        async for ro in self.engine.generate(prompt_ids, params, cid, version):
            for out in ro.outputs:
                accs[out.index].add(out, req.top_logprobs)
        choices = list(accs.values())
        version = min((v for c in choices for v, _, _ in c.spans(version)), default=version)
        await self._log(req, cid, prompt_ids, choices, sampling, created_at, version)
        body = fmt.chat_response(cid, req.model or self.cfg.model.served_name, int(created_at), version,
                                 choices, len(prompt_ids), req.logprobs)
        return JSONResponse(body, headers=self._headers(version))

    def _unflushed_tail(self, c: fmt.ChoiceAccumulator, req: ChatCompletionRequest) -> str:
        """Text the streamed deltas lack at the end compared with the non-streaming text."""
        if req.stop:
            return ""
        full = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return full[len(c.text):] if full.startswith(c.text) else ""

    async def _stream(self, req, cid, prompt_ids, params, sampling, t0: float) -> AsyncIterator[str]:
        """SSE chunks of one streamed completion; records its metrics when it ends (``t0``: the
        request's arrival, `time.perf_counter`)."""
        created_at = time.time()
        created = int(created_at)
        version = self.swap.version
        model = req.model or self.cfg.model.served_name
        accs = {i: fmt.ChoiceAccumulator(i, pinned=self.engine.adapter_sync) for i in range(req.n)}

        def sse(obj: dict) -> str:
            return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

        for i in range(req.n):
            yield sse(fmt.chunk(cid, model, created, version, [
                fmt.stream_choice(i, {"role": "assistant", "content": ""})]))
        first_token = True
        try:
            async for ro in self.engine.generate(prompt_ids, params, cid, version):
                for out in ro.outputs:
                    entries = accs[out.index].add(out, req.top_logprobs)
                    if first_token and out.token_ids:
                        self.metrics.first_token(time.perf_counter() - t0)
                        first_token = False
                    if out.text or entries:
                        yield sse(fmt.chunk(cid, model, created, version, [fmt.stream_choice(
                            out.index, {"content": out.text},
                            {"content": entries} if req.logprobs else None)]))
            choices = list(accs.values())
            for c in choices:  # vLLM's incremental detokenizer holds back a trailing partial
                tail = self._unflushed_tail(c, req)  # UTF-8 sequence: send what the full text has
                if tail:
                    c.text += tail
                    yield sse(fmt.chunk(cid, model, created, version, [
                        fmt.stream_choice(c.index, {"content": tail})]))
            await self._log(req, cid, prompt_ids, choices, sampling, created_at, version)
        except Exception as e:  # engine failure mid-stream: tell the client, in-band
            log.exception("stream %s failed", cid)
            self.metrics.request("chat_stream", 500, time.perf_counter() - t0)
            self.swap.record(version, False, time.perf_counter() - t0)
            yield sse(ApiError(500, f"generation failed: {e!r}", type_="server_error").body())
            yield "data: [DONE]\n\n"
            return
        for c in choices:  # finish reasons only after the experiences are stored
            yield sse(fmt.chunk(cid, model, created, version, [fmt.stream_choice(
                c.index, {"content": ""}, finish=fmt.finish_reason(c.finish_reason),
                stop_reason=c.stop_reason)]))
        if req.stream_options and req.stream_options.include_usage:
            done = sum(len(c.token_ids) for c in choices)
            yield sse(fmt.chunk(cid, model, created, version, [], usage={
                "prompt_tokens": len(prompt_ids), "completion_tokens": done,
                "total_tokens": len(prompt_ids) + done}))
        self.metrics.request("chat_stream", 200, time.perf_counter() - t0)
        self.swap.record(version, True, time.perf_counter() - t0)
        yield "data: [DONE]\n\n"


@app.exception_handler(ApiError)
async def _api_error(_request: Request, e: ApiError) -> JSONResponse:
    return _error(e)


def _install_error_handlers() -> None:
    """Turn FastAPI's own 404/405/422 answers into OpenAI error JSON."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, e: HTTPException) -> JSONResponse:
        return _error(ApiError(e.status_code, str(e.detail)))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        return _error(ApiError(400, f"{param}: {err.get('msg')}", param))


_install_error_handlers()

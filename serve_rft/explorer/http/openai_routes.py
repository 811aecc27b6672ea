"""The OpenAI routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/models[/{id}]``.

A mixin of `ExplorerReplica`. A request passes the weight swap's admission (serve; hold while
this lone replica loads new weights, or while it drains a request too large for HAProxy to re-send;
or refuse with 503 while it drains, which HAProxy re-sends to a serving replica), is parsed on the replica's tokenizer thread (bounded JSON,
`serve_rft.explorer.http.body`; what may be asked, `serve_rft.explorer.http.openai_request`) and is answered
by vLLM's own serving classes (`serve_rft.explorer.engine.openai_serving`), whose engine calls go through
the tap that logs each answer as experiences before the answer ends
(`serve_rft.explorer.engine.engine_tap`). Every answer carries the replica and its policy version in
headers. ``/v1/responses`` is served without response state (vLLM's default: no response store):
one answer per request, logged and rewardable by its ``resp_...`` id like a chat completion; what
needs state kept by the engine is refused (`serve_rft.explorer.http.openai_request.RESPONSES_REFUSED`).

Uses of the replica: ``cfg``, ``swap``, ``serving``, ``metrics``, ``costs``, ``replica_id``, ``cpu`` (its
tokenizer thread), ``store`` and ``headers(version)``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from serve_rft.explorer.engine.engine_tap import CURRENT, RequestContext
from serve_rft.explorer.http.app import AUTHORIZED, app
from serve_rft.explorer.http.auth import identity_of
from serve_rft.explorer.http.body import parse_json, read_body
from serve_rft.explorer.http.ingress_mode import REQUEST_ID_HEADER, fits_a_retry, haproxy_request_id, head_bytes
from serve_rft.explorer.http.openai_request import check_against_store, parse_request
from serve_rft.explorer.http.protocol import ApiError

ROUTES = {"chat": "chat", "completion": "completions", "responses": "responses"}


def answer_bound(req) -> int | None:
    """The most tokens one answer of vLLM request ``req`` may have (``max_completion_tokens``,
    ``max_tokens`` or ``max_output_tokens``; None: up to the context length)."""
    return (getattr(req, "max_completion_tokens", None) or getattr(req, "max_tokens", None)
            or getattr(req, "max_output_tokens", None))


async def started(events: AsyncIterator, ctx: RequestContext) -> AsyncIterator:
    """``events`` (a /v1/responses stream) read until the engine has the request (the tap set
    ``ctx.version``, so the answer's headers name its version, and a refusal by the tap is an
    error answer rather than a broken stream), then the same stream from its start. vLLM starts
    a responses stream's engine request only when the stream is read; a chat stream's at once."""
    it = aiter(events)
    head = []
    while ctx.version is None:
        try:
            head.append(await anext(it))
        except StopAsyncIteration:
            break

    async def replay():
        for event in head:
            yield event
        async for event in it:
            yield event
    return replay()


async def sse_events(events) -> AsyncIterator[str]:
    """vLLM's /v1/responses stream events (pydantic objects) as server-sent events, each named by
    its type, as vLLM's own router sends them (``event: TYPE`` then ``data: JSON``)."""
    async for event in events:
        yield f"event: {getattr(event, 'type', 'unknown')}\ndata: {event.model_dump_json(indent=None, by_alias=True)}\n\n"


def used_tokens(ctx: RequestContext) -> int:
    """Tokens a request used so far: its prompt's and every answer's (`RequestContext`)."""
    return ctx.prompt_tokens + ctx.generated_tokens


class OpenAIRoutes:
    """``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``, ``/v1/models``, ``/v1/models/{id}``."""

    @app.post("/v1/chat/completions", dependencies=AUTHORIZED)
    async def chat_completions(self, request: Request):
        return await self._metered(request, "chat")

    @app.post("/v1/completions", dependencies=AUTHORIZED)
    async def completions(self, request: Request):
        return await self._metered(request, "completion")

    @app.post("/v1/responses", dependencies=AUTHORIZED)
    async def responses(self, request: Request):
        return await self._metered(request, "responses")

    @app.get("/v1/models", dependencies=AUTHORIZED)
    async def models(self) -> JSONResponse:
        listed = await self.serving.models.show_available_models()
        return JSONResponse(listed.model_dump())

    @app.get("/v1/models/{model_id:path}", dependencies=AUTHORIZED)
    async def model(self, model_id: str) -> JSONResponse:
        listed = await self.serving.models.show_available_models()
        for card in listed.data:
            if card.id == model_id:
                return JSONResponse(card.model_dump())
        raise ApiError(404, f"The model `{model_id}` does not exist.", "model", code="model_not_found")

    async def _metered(self, request: Request, kind: str):
        t0 = time.perf_counter()
        route = ROUTES[kind]
        try:
            response = await self._answer(request, kind, t0)
        except ApiError as e:
            self.metrics.request(route, e.status, time.perf_counter() - t0)
            raise
        if not isinstance(response, StreamingResponse):  # a stream records itself when it ends
            self.metrics.request(route, response.status_code, time.perf_counter() - t0)
        return response

    async def _answer(self, request: Request, kind: str, t0: float):
        """Raises:
            ApiError: 503 this replica is out of rotation or its engine died (HAProxy re-sends
                it), 400 / 413 from the request, 409 its group / conversation ids (the store's
                record of them: `check_against_store`), 429 / 413 what it may use is beyond its
                key's or tenant's limits (`serve_rft.explorer.http.costs`).
        """
        await self._admit(request)
        raw = await read_body(request)
        req, ctx = await asyncio.get_running_loop().run_in_executor(
            self.cpu, lambda: parse_request(parse_json(raw), kind, self.cfg.explorer.max_n,
                                            self.cfg.explorer.limits))
        who = identity_of(request)
        ctx.t0, ctx.tenant, ctx.owner = t0, who.tenant, who.owner
        await check_against_store(self.store, ctx, self.cfg.buffer.store_wait_s)
        await self.costs.check_storage(who.tenant, "inference")
        lease = await self.costs.admit(who.owner, who.tenant, len(raw), getattr(req, "n", None) or 1,
                                       answer_bound(req))
        try:
            response = await self._generate(req, ctx, kind, t0, lease)
        except BaseException:
            self.costs.settle_soon(lease, used_tokens(ctx))  # cancelled: no await may finish here
            raise
        if not isinstance(response, StreamingResponse):
            await self.costs.settle(lease, used_tokens(ctx))
        return response

    async def _generate(self, req, ctx: RequestContext, kind: str, t0: float, lease):
        """The answer of vLLM's serving classes to ``req``; a stream settles ``lease`` when it ends."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        token = CURRENT.set(ctx)
        try:
            if kind == "chat":
                result = await self.serving.chat.create_chat_completion(req, None)
            elif kind == "completion":
                result = await self.serving.completion.create_completion(req, None)
            else:
                result = await self.serving.responses.create_responses(req, None)
            if isinstance(result, ErrorResponse):
                self.swap.record(ctx.version if ctx.version is not None else self.swap.version, False,
                                 time.perf_counter() - t0)
                return JSONResponse(result.model_dump(), status_code=result.error.code)
            if isinstance(result, AsyncIterator):
                events = sse_events(await started(result, ctx)) if kind == "responses" else result
                return StreamingResponse(self._stream(events, ctx, kind, t0, lease),
                                         media_type="text/event-stream", headers=self.headers(ctx.version),
                                         background=BackgroundTask(self._settle_stream, lease, ctx))
        except EngineDeadError:  # nothing was sent: HAProxy re-sends a 503 to another replica,
            self.swap.record(self.swap.version, False, time.perf_counter() - t0)  # Serve replaces this
            raise ApiError(503, f"replica {self.replica_id}'s engine died; retry on another replica",
                           type_="service_unavailable", code="engine_dead", retry_after=1) from None
        except (VLLMClientError, ValueError, TypeError, OverflowError) as e:
            # what vLLM refused in the request's values: a 4xx in vLLM's own shape, as its server answers
            err = create_error_response(e)
            return JSONResponse(err.model_dump(), status_code=err.error.code)
        except Exception:
            self.swap.record(self.swap.version, False, time.perf_counter() - t0)
            raise
        finally:
            CURRENT.reset(token)
        self.swap.record(ctx.version, True, time.perf_counter() - t0)
        body = result.model_dump(mode="json", by_alias=True) if kind == "responses" else result.model_dump()
        return JSONResponse(body, headers=self.headers(ctx.version))

    async def _settle_stream(self, lease, ctx: RequestContext) -> None:
        """A stream's response ended (its body sent, or its client gone): settle its lease if
        the stream did not (it never started)."""
        await self.costs.settle(lease, used_tokens(ctx))

    async def _admit(self, request: Request) -> None:
        """Serve, hold (no other replica serves, or HAProxy could not re-send this request: wait for
        the new weights, do not fail), or refuse.

        Raises:
            ApiError: 503 + Retry-After while this replica is out of rotation; 413 a refused body
                over `serve_rft.explorer.http.body.MAX_BODY_BYTES` (what any replica answers it).
        """
        head = head_bytes(request.method, request.url.path + request.url.query, request.headers.raw)
        admission = self.swap.admission(fits_a_retry(request.headers.get("content-length"), head),
                                        haproxy_request_id(request.headers.getlist(REQUEST_ID_HEADER)))
        if admission == "hold":
            await self.swap.gate.wait()
            admission = "refuse" if self.swap.broken is not None else "serve"
        if admission == "refuse":
            # consume it, bounded: the connection stays clean for HAProxy to reuse
            await read_body(request)
            raise ApiError(503, f"replica {self.replica_id} is out of rotation (loading new weights or "
                           "drained); retry on another replica", type_="service_unavailable",
                           code="replica_draining", retry_after=1)

    async def _stream(self, chunks: AsyncIterator[str], ctx: RequestContext, kind: str, t0: float, lease
                      ) -> AsyncIterator[str]:
        """vLLM's SSE chunks, passed on; records the request when the stream ends (a stream that
        ends without the engine finishing it carried vLLM's in-band error: a failure). A client
        that goes away ends it without a record. The request's context is set again here: vLLM
        builds the chunks (their ``system_fingerprint``) in the task that sends them. Its quota
        lease is settled when it ends, however it ends (the response's background task settles
        one whose stream never started)."""
        CURRENT.set(ctx)
        try:
            async for chunk in chunks:
                yield chunk
        finally:  # a client that went away cancels this generator: settled in a task of its own
            self.costs.settle_soon(lease, used_tokens(ctx))
        ok = ctx.finished
        self.metrics.request(f"{ROUTES[kind]}_stream", 200 if ok else 500, time.perf_counter() - t0)
        self.swap.record(ctx.version, ok, time.perf_counter() - t0)

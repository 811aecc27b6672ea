"""The service's OpenAPI document, with the request bodies the routes parse themselves.

The routes read raw bodies (`serve_rft.explorer.http.body`: bounded size, depth and integers) and
validate them with the pydantic models of `serve_rft.explorer.http.protocol`, so FastAPI cannot see
the bodies; this module puts those models' JSON schemas into ``/openapi.json``. Clients and
schemathesis (tests/integration/test_stack.py) read it. The document and the pages that show
it (``/docs``: Swagger UI, ``/redoc``) take the admin scope when keys are on
(`serve_rft.explorer.http.auth`); a browser does not send the key with the page's own fetch of
``/openapi.json``, so with keys on read the document with a client that sends it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import TypeAdapter

from serve_rft.explorer.http.protocol import RewardRequest
from serve_rft.explorer.http.sync_api import DrainRequest, PinRequest, PromotionRequest, RollbackRequest

REF = "#/components/schemas/{model}"
BODIES: dict[str, Any] = {
    "/v1/rewards": RewardRequest,
    "/v1/sync/pin": PinRequest,
    "/v1/sync/rollback": RollbackRequest,
    "/v1/sync/promotion": PromotionRequest,
    "/v1/sync/replicas/{replica_id}/drain": DrainRequest,
}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """``app``'s OpenAPI 3.1 document with the JSON request bodies of `BODIES` (cached on
    ``app.openapi_schema``)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible chat with online RL (serve_rft).")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, body in {**BODIES, **_openai_bodies()}.items():
        if path not in doc["paths"]:
            continue
        schema = TypeAdapter(body).json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": schema}}}
    app.openapi_schema = doc
    return doc


DOC_PATH = "/openapi.json"


def install(app: FastAPI, dependencies: list) -> None:
    """Serve `build_openapi` at ``/openapi.json`` and FastAPI's ``/docs`` and ``/redoc`` pages,
    each behind ``dependencies`` (the key check). ``app`` must be built with
    ``openapi_url=None`` (FastAPI then adds no unchecked routes of its own)."""
    app.openapi = lambda: build_openapi(app)  # type: ignore[method-assign]

    @app.get(DOC_PATH, include_in_schema=False, dependencies=dependencies)
    async def openapi_document() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=dependencies)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=DOC_PATH, title=f"{app.title} - Swagger UI")

    @app.get("/redoc", include_in_schema=False, dependencies=dependencies)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=DOC_PATH, title=f"{app.title} - ReDoc")


def _openai_bodies() -> dict[str, Any]:
    """vLLM's chat, completion and responses request models with serve_rft's request extensions."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    from serve_rft.explorer.http.openai_request import Extensions

    def with_extensions(model):
        class Request(model, Extensions):  # the schema: vLLM's fields and ours
            model_config = {**model.model_config, "extra": "forbid"}  # unknown fields: 400
        Request.__name__ = model.__name__
        return Request

    return {"/v1/chat/completions": with_extensions(ChatCompletionRequest),
            "/v1/completions": with_extensions(CompletionRequest),
            "/v1/responses": with_extensions(ResponsesRequest)}

"""The replica's HTTP layer: the FastAPI app every route of the replica hangs on, one place that
turns every refusal into OpenAI error JSON, and the API-key check as one FastAPI dependency.

Routes raise `ApiError` and never build an error response themselves: the exception handlers
below answer it (with ``Retry-After`` where the client should try again), and FastAPI's own
404 / 405 / 422 answers get the same JSON shape. Routes that need a key declare
``dependencies=AUTHORIZED``; the dependency asks the replica serving the request
(`ExplorerReplica.authorize`: key scopes in `serve_rft.explorer.http.auth`; then
`ExplorerReplica.check_quota`: per-key quotas in `serve_rft.explorer.http.quota`). FastAPI's own
``/openapi.json``, ``/docs`` and ``/redoc`` are replaced by routes behind the same check
(`serve_rft.explorer.http.openapi.install`: the admin scope when keys are on).
"""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from serve_rft.explorer.http import openapi
from serve_rft.explorer.http.protocol import ApiError

REPLICA_HEADER = "x-serve-rft-replica"
VERSION_HEADER = "x-serve-rft-policy-version"

# openapi_url=None: FastAPI adds no open document routes; `openapi.install` adds them with the
# key check (docs_url stays set: Ray Serve reports it as the application's docs path)
app = FastAPI(title="serve_rft", version="0.1.0", openapi_url=None, docs_url="/docs", redoc_url="/redoc")


def error_response(e: ApiError) -> JSONResponse:
    """``e`` as OpenAI error JSON with its status (and ``Retry-After`` if it has one)."""
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def authorize(request: Request) -> None:
    """FastAPI dependency: the replica serving this request checks its key, then charges the
    key's quota (before the route reads the body or generates anything).

    Raises:
        ApiError: 401 / 403 (`serve_rft.explorer.http.auth.ApiKeys.check`); 429 / 413 (the key's quota:
            `serve_rft.explorer.http.quota.QuotaCheck.check`).
    """
    from ray import serve

    replica = serve.get_replica_context().servable_object
    replica.authorize(request)
    await replica.check_quota(request)


AUTHORIZED = [Depends(authorize)]
openapi.install(app, AUTHORIZED)


@app.exception_handler(ApiError)
async def _api_error(_request: Request, e: ApiError) -> JSONResponse:
    return error_response(e)


@app.exception_handler(HTTPException)
async def _http(_request: Request, e: HTTPException) -> JSONResponse:
    return error_response(ApiError(e.status_code, str(e.detail)))


@app.exception_handler(RequestValidationError)
async def _invalid(_request: Request, e: RequestValidationError) -> JSONResponse:
    err = e.errors()[0] if e.errors() else {}
    param = ".".join(str(p) for p in err.get("loc", ())) or None
    return error_response(ApiError(400, f"{param}: {err.get('msg')}", param))

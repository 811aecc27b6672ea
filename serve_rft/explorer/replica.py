"""An explorer replica: the OpenAI HTTP API over one vLLM engine, logging every experience.

One Ray Serve replica = one `ExplorerEngine`. The class assembles the replica's parts: its
routes come from mixins (`OpenAIRoutes`: inference through vLLM's own serving classes;
`AdminRoutes`: rewards, experiences, status, operator routes) on the app of
`serve_rft.explorer.http.app`; `EngineTap` stands between vLLM's serving layer and the engine and
hands every answer to `ExperienceLog`; `WeightSwap` owns the replica's side of every sync. Requests arrive from HAProxy straight
to this replica's own HTTP server (Ray Serve's HAProxy mode, the default: serve_rft.service.ingress) or
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
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import ray
from fastapi import Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from serve_rft.buffer.store import ExperienceStore
from serve_rft.config import Config
from serve_rft.explorer.engine.engine_tap import EngineTap
from serve_rft.explorer.engine.experience_log import ExperienceLog
from serve_rft.explorer.engine.openai_serving import build_serving
from serve_rft.explorer.http.admin_routes import AdminRoutes
from serve_rft.explorer.http.app import REPLICA_HEADER, VERSION_HEADER, app
from serve_rft.explorer.http.auth import ApiKeys
from serve_rft.explorer.http.openai_routes import OpenAIRoutes
from serve_rft.explorer.http.protocol import ApiError
from serve_rft.explorer.http.costs import CostCheck
from serve_rft.explorer.http.quota import QuotaCheck
from serve_rft.explorer.weight_swap import WeightSwap
from serve_rft.observability.explorer_metrics import ExplorerMetrics
from serve_rft.weights import method_class

log = logging.getLogger("serve_rft.explorer")

__all__ = ["ExplorerReplica", "app"]
METERED = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/rewards": "rewards"}
"""Paths whose refusals (401 included) the request metrics count, by route label."""


class ExplorerReplica(OpenAIRoutes, AdminRoutes):
    """The Serve deployment class (decorated in `serve_rft.service.app`)."""

    async def __init__(self, config_json: str, model_path: str | None, ensure_control: Callable[[Config, str], Any]):
        """Start the replica: its vLLM engine, its store client, and (through ``ensure_control``,
        which the service passes in: `serve_rft.control.ensure_control`) the synchronizer and
        trainer actors, found or created, so `serve deploy` needs nothing else.

        Args:
            config_json: the run's `Config` as JSON.
            model_path: the model directory, or None for the embedded model.
            ensure_control: ``(cfg, model_path) -> the synchronizer's handle``.
        """
        from ray import serve

        from serve_rft.explorer.engine.vllm_engine import ExplorerEngine

        self.cfg = Config.model_validate_json(config_json)
        if model_path is None:
            from serve_rft.model.embedded import resolve_model_path

            model_path = str(resolve_model_path(self.cfg.model.path, self.cfg.model.cache_dir))
        self.api_keys = ApiKeys.from_config(self.cfg.service)
        self.model_path = model_path
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        # request bodies are parsed and validated here, off the event loop, in arrival order
        self.cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parse")
        service = self.cfg.service
        self.store = ExperienceStore.from_config(  # the tenants' ledger where stored bytes are limited
            self.cfg.buffer, tenant_ledger=self.api_keys.enabled and service.quotas.stores_limited(service.tenants))
        self.sync = ensure_control(self.cfg, model_path)  # `serve deploy`: nobody else starts them
        transfer = method_class(self.cfg.synchronizer.sync_method).engine_transfer
        lora_rank = self.cfg.trainer.lora.vllm_max_lora_rank() if self.cfg.adapter_sync else None
        self.engine = await ExplorerEngine.create(model_path, self.cfg.explorer, replica_id=self.replica_id,
                                                  weight_transfer=transfer,
                                                  lora_rank=lora_rank)
        self.metrics = ExplorerMetrics(self.replica_id)
        self.quota = QuotaCheck.from_config(self.cfg, self.api_keys, self.metrics)
        self.costs = CostCheck(self.cfg.service.quotas, self.quota.buckets, self.cfg.buffer.key_prefix,
                               self.cfg.explorer.max_model_len, self.metrics, replicas=self.quota.local.replicas,
                               store=self.store, store_wait_s=self.cfg.buffer.store_wait_s,
                               tenants=self.cfg.service.tenants)
        self.experience_log = ExperienceLog(self.store, self.replica_id, self.metrics, self.cfg.buffer.store_wait_s)
        self.serving = build_serving(self.cfg, EngineTap(self.engine, self.experience_log, self.metrics.first_token),
                                     model_path)
        step = self.cfg.synchronizer.explorer_step_experiences
        self.swap = WeightSwap(self.replica_id, context.replica_id.to_full_id_str(), self.engine, self.sync,
                               self.cfg, model_path, lambda: self.experience_log.logged // step,
                               node_id=ray.get_runtime_context().get_node_id())
        await self.swap.start()  # a restarted or new replica loads the incumbent version first
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
        """Every ``period_s``: sweep the store (expiries, group timeouts, the ready bound) and
        refresh the tenants' stored-bytes gauges (a Redis outage only skips a beat). The store's
        experience counts are the synchronizer's to report (`serve_rft.observability.store_metrics`)."""
        while True:
            try:
                await self.store.sweep()
                if self.store.tenant_ledger:
                    self.metrics.stored_bytes(await self.store.tenant_bytes(*self.api_keys.tenant_names()))
            except RedisError:  # the store retries on its own; next beat
                pass
            await asyncio.sleep(period_s)

    # -- HTTP ----------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        """The API-key check of every route but /health (`serve_rft.explorer.http.app.authorize`);
        the caller's `serve_rft.explorer.http.auth.Identity` is kept on ``request.state.identity``.
        A request reached this replica, so the ingress routes to it (`WeightSwap.reached`).

        Raises:
            ApiError: 401 / 403 (`ApiKeys.check`); counted by the request metrics of `METERED` paths.
        """
        self.swap.reached = True
        try:
            # the caller's tenant and scopes, for the route (`serve_rft.explorer.http.auth.identity_of`)
            request.state.identity = self.api_keys.check(request.url.path, request.headers.get("authorization"))
        except ApiError as e:
            if request.url.path in METERED:
                self.metrics.request(METERED[request.url.path], e.status, 0.0)
            raise

    async def check_quota(self, request: Request) -> None:
        """The key's quota (`serve_rft.explorer.http.quota.QuotaCheck.check`), after `authorize`.

        Raises:
            ApiError: 429 / 413; counted by the request metrics of `METERED` paths.
        """
        try:
            await self.quota.check(request)
        except ApiError as e:
            if request.url.path in METERED:
                self.metrics.request(METERED[request.url.path], e.status, 0.0)
            raise

    def headers(self, version: int) -> dict[str, str]:
        """The replica and policy-version headers of an answer."""
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
                            status_code=200 if engine_ok else 503, headers=self.headers(self.swap.version))

    async def _store_ok(self, timeout_s: float = 0.5) -> bool:
        try:
            return await asyncio.wait_for(self.store.ping(), timeout_s)
        except (asyncio.TimeoutError, RedisError):
            return False

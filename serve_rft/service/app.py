"""The Ray Serve application: explorer replicas + the synchronizer and trainer actors.

`build_app` is what both `serve-rft up` and `serve deploy` / `serve run` / `serve build`
(`serve_rft.deploy`) call: it binds the explorer deployment (nothing starts, so `serve build` can
import it), after refusing to expose an open service: the HTTP servers bind the running Serve
instance's ``http_options.host`` (its proxies or HAProxy, and each replica's own server in
HAProxy mode), whatever ``service.host`` says, so that is the address checked
(`serve_rft.config.service.check_exposure`). The control actors (synchronizer, trainer) are created by
`serve_rft.control.ensure_control`, which every explorer replica calls when it starts.
"""

from __future__ import annotations

import logging
from pathlib import Path

from serve_rft.config import Config, ExplorerConfig
from serve_rft.config.service import check_exposure
from serve_rft.explorer.http.ingress_mode import haproxy_enabled

APP_NAME = "serve_rft"
log = logging.getLogger("serve_rft.service")


def serve_http_host(cfg: Config, timeout_s: float = 30.0) -> str | None:
    """The host Ray Serve's HTTP servers bind: the ``http_options.host`` of the Serve controller
    this process can reach (under `serve deploy` / `serve run` the builder runs in the cluster;
    `serve-rft up` asks after `serve.start`), else ``cfg.service.host`` (no Ray here: `serve
    build`). None: Serve binds every interface (Ray's HAProxy front end reads None as ``*``)."""
    import ray

    if not ray.is_initialized():
        return cfg.service.host
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:  # no Serve instance yet: `serve.start` will use service.host
        return cfg.service.host
    return ray.get(controller.get_http_config.remote(), timeout=timeout_s).host


def replica_env(ecfg: ExplorerConfig) -> dict[str, str]:
    """Environment variables of an explorer replica's process (merged into the job's by Ray: Ray
    docs, "Runtime environments", inheritance): Ray Serve reads
    ``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD`` when the replica imports it
    (``explorer.user_code_loop_thread``)."""
    return {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1" if ecfg.user_code_loop_thread else "0"}


def explorer_deployment(cfg: Config):
    """The `ExplorerReplica` class as a Serve deployment with its routing and scaling options
    (`DrainAwareRouter` unless this process runs Ray Serve's HAProxy mode: serve_rft.explorer.http.ingress_mode)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from serve_rft.explorer.replica import ExplorerReplica, app

    ecfg = cfg.explorer
    routing = {}
    if not haproxy_enabled():  # HAProxy balances by itself and refuses a custom Serve router
        routing["request_router_config"] = RequestRouterConfig(
            request_router_class="serve_rft.explorer.router.DrainAwareRouter",
            request_routing_stats_period_s=ecfg.routing_stats_period_s,
            request_routing_stats_timeout_s=max(1.0, 4 * ecfg.routing_stats_period_s),
        )
    if ecfg.autoscaling is not None:  # the synchronizer counts whatever replicas run
        a = ecfg.autoscaling
        scaling = {"autoscaling_config": {
            "min_replicas": a.min_replicas, "max_replicas": a.max_replicas, "initial_replicas": ecfg.num_replicas,
            "target_ongoing_requests": a.target_ongoing_requests, "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s}}
    else:
        scaling = {"num_replicas": ecfg.num_replicas}
    return serve.deployment(
        serve.ingress(app)(ExplorerReplica),
        name="explorer",
        **scaling,
        # the replica's tensor-parallel workers are its child processes: it holds all their resources,
        # so Ray places it where they fit and makes all its GPUs visible to them
        ray_actor_options={"num_cpus": ecfg.num_cpus_per_replica * ecfg.tensor_parallel_size,
                           "num_gpus": ecfg.num_gpus_per_replica * ecfg.tensor_parallel_size,
                           "runtime_env": {"env_vars": replica_env(ecfg)}},
        max_ongoing_requests=ecfg.max_ongoing_requests,
        **routing,
        health_check_period_s=10,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=30,
    )


def build_app(cfg: Config, model_path: str | Path | None = None):
    """The explorer deployment bound to its arguments (nothing starts until Serve deploys it).

    Requires ``cfg.buffer.redis_url`` to be set (the launcher starts an embedded Redis).
    ``model_path`` None: each replica resolves ``cfg.model`` itself (the embedded model is built
    once per machine, atomically). Logs a warning at every build that serves openly on a
    non-loopback address (``service.allow_unauthenticated``).

    Raises:
        ValueError: no Redis URL; Serve binds a non-loopback address (`serve_http_host`) and no
            key is configured, without ``service.allow_unauthenticated``.
    """
    if not cfg.buffer.redis_url:
        raise ValueError("buffer.redis_url must be set to build the application")
    warning = check_exposure(cfg.service, serve_http_host(cfg))
    if warning:
        log.warning(warning)
    from serve_rft.control import ensure_control

    return explorer_deployment(cfg).bind(cfg.model_dump_json(), None if model_path is None else str(model_path),
                                         ensure_control)

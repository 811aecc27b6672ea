"""The Ray Serve application: explorer replicas + the synchronizer and trainer actors.

`build_app` is what both `serve-rft up` and `serve deploy` / `serve run` / `serve build`
(deployments/app.py) call: it only binds the explorer deployment (no side effects, so `serve
build` can import it). The control actors (synchronizer, trainer) are created by
`serve_rft.control.ensure_control`, which every explorer replica calls when it starts.
"""

from __future__ import annotations

from pathlib import Path

from serve_rft.config import Config
from serve_rft.explorer.ingress_mode import haproxy_enabled

APP_NAME = "serve_rft"


def explorer_deployment(cfg: Config):
    """The `ExplorerReplica` class as a Serve deployment with its routing and scaling options
    (`DrainAwareRouter` unless this process runs Ray Serve's HAProxy mode: serve_rft.explorer.ingress_mode)."""
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
        ray_actor_options={"num_cpus": ecfg.num_cpus_per_replica, "num_gpus": ecfg.num_gpus_per_replica},
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
    once per machine, atomically).

    Raises:
        ValueError: no Redis URL.
    """
    if not cfg.buffer.redis_url:
        raise ValueError("buffer.redis_url must be set to build the application")
    return explorer_deployment(cfg).bind(cfg.model_dump_json(), None if model_path is None else str(model_path))

"""The Ray Serve application: explorer replicas + the synchronizer and trainer actors.

`build_app` is what both `serve-rft up` and `serve deploy` / `serve run` / `serve build`
(deployments/app.py) call: it only binds the explorer deployment (no side effects, so `serve
build` can import it). The control actors (synchronizer, trainer; named, detached,
``get_if_exists``) are created by `ensure_control`, which every explorer replica calls when it
starts; `serve-rft up` calls `start_training` first to surface a trainer that cannot start.
"""

from __future__ import annotations

from pathlib import Path

from serve_rft.config import Config
from serve_rft.service.ingress import haproxy_enabled

APP_NAME = "serve_rft"


def explorer_deployment(cfg: Config):
    """The `ExplorerReplica` class as a Serve deployment with its routing and scaling options
    (`DrainAwareRouter` unless this process runs Ray Serve's HAProxy mode: serve_rft.service.ingress)."""
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


def preflight(cfg: Config) -> None:
    """Refuse, before anything starts, a configuration this machine cannot run.

    Raises:
        ValueError: ``trainer.device=cuda`` or ``sync_method=nccl`` without CUDA (the message
            says what to use instead).
    """
    if cfg.synchronizer.sync_method.value == "nccl":
        from serve_rft.synchronizer.methods.nccl import NcclUnavailable, check_available

        try:
            check_available()
        except NcclUnavailable as e:
            raise ValueError(str(e)) from None
    if cfg.trainer.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but torch sees no CUDA device; use trainer.device=cpu")


def start_training(cfg: Config, model_path: str | Path):
    """Create (or find) the synchronizer and the trainer and wait until the training loop runs.

    Returns:
        The trainer actor handle.
    Raises:
        ValueError: no Redis URL.
        ray.exceptions.RayActorError: the trainer failed to start (its error is in the message).
    """
    import ray

    from serve_rft.synchronizer.actor import get_or_create_synchronizer
    from serve_rft.trainer.actor import get_or_create_trainer

    if not cfg.buffer.redis_url:
        raise ValueError("buffer.redis_url must be set to train")
    get_or_create_synchronizer(cfg.synchronizer, cfg.buffer)
    trainer = get_or_create_trainer(cfg, str(model_path))
    ray.get(trainer.start.remote())
    return trainer


def ensure_control(cfg: Config, model_path: str | Path):
    """Create (or find) the synchronizer and, if ``trainer.enabled``, the trainer; the trainer
    starts its loop on its own (`Trainer` begins in ``__init__``). Called by every explorer
    replica at start; idempotent (named actors, ``get_if_exists``).

    Returns:
        The synchronizer's handle.
    """
    from serve_rft.synchronizer.actor import get_or_create_synchronizer
    from serve_rft.trainer.actor import get_or_create_trainer

    sync = get_or_create_synchronizer(cfg.synchronizer, cfg.buffer)
    if cfg.trainer.enabled:
        get_or_create_trainer(cfg, str(model_path))
    return sync


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

"""The control plane: the synchronizer and trainer actors, found or created.

Below both the explorer replicas (each calls `ensure_control` when it starts, so `serve deploy`
needs nothing else) and the service launcher (`serve-rft up` runs `preflight`, then
`launch_training`, so the trainer loads its model while the replicas start, and waits for the
trainer's start before the replicas': a trainer that cannot start fails `up` with its error). The actors are
named, detached and ``get_if_exists`` (`serve_rft.names`): whoever comes first creates them.
"""

from __future__ import annotations

from pathlib import Path

from serve_rft.config import Config


def preflight(cfg: Config) -> None:
    """Refuse, before anything starts, a configuration this machine cannot run.

    Raises:
        ValueError: ``trainer.device=cuda`` or ``sync_method=nccl`` without CUDA (the message
            says what to use instead); ``explorer.engine_args`` names no vLLM engine argument;
            ``trainer.algorithm`` names no algorithm or ``trainer.algorithm_args`` are not its
            settings; ``model.path`` is neither a model directory nor a hub id that is cached or
            can be downloaded (`serve_rft.model.embedded.resolve_model_path`); a tracker of
            ``trainer.loggers`` is not installed; no ``buffer.redis_url`` and no ``redis-server``
            on PATH to start the embedded store with; ``explorer.tensor_parallel_size`` does not
            divide the model's attention heads (what vLLM checks when the engine starts).
    """
    import shutil

    import pydantic

    if not cfg.buffer.redis_url and shutil.which("redis-server") is None:
        from serve_rft.buffer.redis_server import MISSING

        raise ValueError(MISSING)

    model_dir = None
    if cfg.model.path:
        from serve_rft.model.embedded import resolve_model_path

        try:
            model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        except FileNotFoundError as e:
            raise ValueError(f"model.path: {e}") from None
    tp = cfg.explorer.tensor_parallel_size
    heads = attention_heads(model_dir)
    if heads is not None and heads % tp:
        raise ValueError(f"explorer.tensor_parallel_size={tp} does not divide the model's {heads} attention "
                         "heads (each worker holds a whole number of them)")

    from serve_rft.trainer.algorithms import get_algorithm

    try:
        get_algorithm(cfg.trainer)
    except pydantic.ValidationError as e:
        raise ValueError(f"trainer.algorithm_args of {cfg.trainer.algorithm}: {e}") from None
    if cfg.trainer.enabled and cfg.trainer.loggers:
        from serve_rft.observability.trackers import check_available

        check_available(cfg.trainer.loggers)
    if cfg.explorer.engine_args:
        from serve_rft.config.explorer import check_known

        check_known(cfg.explorer.engine_args)
    from serve_rft.weights import MethodUnavailable, method_class

    try:
        method_class(cfg.synchronizer.sync_method).check_available()
    except MethodUnavailable as e:
        raise ValueError(str(e)) from None
    if cfg.trainer.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but torch sees no CUDA device; use trainer.device=cpu")


def attention_heads(model_dir: Path | None) -> int | None:
    """The attention heads of the model in ``model_dir`` (its ``config.json``, or its
    ``text_config``), of the embedded model for None; None where the config names none."""
    import json

    if model_dir is None:
        from serve_rft.model.embedded import ARCH

        return ARCH["num_attention_heads"]
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config.get("num_attention_heads", (config.get("text_config") or {}).get("num_attention_heads"))
    return heads if isinstance(heads, int) and heads > 0 else None


def launch_training(cfg: Config, model_path: str | Path):
    """Create (or find) the synchronizer and the trainer and ask the trainer to start its loop,
    without waiting: the caller can start the explorer replicas while the trainer loads the
    policy model, then wait on the returned reference.

    Returns:
        ``(the trainer actor handle, the ObjectRef of its start)``; ``ray.get`` of the reference
        raises ray.exceptions.RayTaskError (wrapping the trainer's RuntimeError) when setting up
        failed, or ray.exceptions.RayActorError when the actor died; the cause is in the message.
    Raises:
        ValueError: no Redis URL.
    """
    from serve_rft.synchronizer.actor import get_or_create_synchronizer
    from serve_rft.trainer.actor import get_or_create_trainer

    if not cfg.buffer.redis_url:
        raise ValueError("buffer.redis_url must be set to train")
    get_or_create_synchronizer(cfg.synchronizer, cfg.buffer)
    trainer = get_or_create_trainer(cfg, str(model_path))
    return trainer, trainer.start.remote()


def start_training(cfg: Config, model_path: str | Path):
    """`launch_training`, then wait until the training loop runs.

    Returns:
        The trainer actor handle.
    Raises:
        ValueError: no Redis URL.
        ray.exceptions.RayTaskError / RayActorError: the trainer failed to start or died (the
            cause is in the message).
    """
    import ray

    trainer, started = launch_training(cfg, model_path)
    ray.get(started)
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

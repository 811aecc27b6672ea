"""The vLLM engine arguments of one explorer replica: what serve_rft sets, what the run config
passes through (``explorer.engine_args``), and what it may not.

serve_rft owns the arguments its contracts rest on: the behaviour logprobs (``logprobs_mode``,
``max_logprobs``), the weight lifecycle (``worker_extension_cls``, ``weight_transfer_config``,
the LoRA settings of adapter-only sync), the model and its seed, and the arguments that have a
field of their own in ``explorer`` (`ENGINE_ARGS_OWNED` names it). Any other field of vLLM's
``AsyncEngineArgs`` (``vllm serve``'s flags, ``-`` written ``_``) passes through unchanged:
``enable_prefix_caching``, ``block_size``, ``max_num_batched_tokens``, ``kv_cache_dtype``,
``compilation_config``, ``swap_space`` ...
"""

from __future__ import annotations

from typing import Any

from serve_rft.config.explorer import check_passthrough

LOGPROBS_MODE = "processed_logprobs"
"""Behaviour logprobs are logged after temperature (and top-p/top-k) processing: the
distribution the token was actually sampled from."""

ADAPTERS_KEPT = 8
"""Adapter versions an engine keeps registered (requests in flight keep the version they
started on; vLLM's own LRU cache decides which of them stay loaded)."""


def engine_kwargs(cfg, model_path: str, *, seed: int, on_cpu: bool, weight_transfer: str | None = None,
                  lora_rank: int | None = None, max_logprobs: int = 20) -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments of a replica's engine: serve_rft's own, then
    ``cfg.engine_args`` (checked by `check_passthrough`; unknown names fail in ``AsyncEngineArgs``).

    Args:
        cfg: the `ExplorerConfig`.
        on_cpu: vLLM runs on CPU (``enforce_eager`` then defaults to true: vLLM-CPU captures no
            CUDA graphs; on GPU it defaults to false, as in vLLM).
        weight_transfer: a vLLM weight-transfer backend to enable (``"nccl"``), or None.
        lora_rank: serve policy versions as LoRA adapters of up to this rank, or None.
        max_logprobs: the most ``top_logprobs`` a request may ask.
    Raises:
        ValueError: ``cfg.engine_args`` sets an argument serve_rft owns.
    """
    from vllm.config import LoggingConfig

    check_passthrough(cfg.engine_args)
    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        enforce_eager=on_cpu if cfg.enforce_eager is None else cfg.enforce_eager,
        logprobs_mode=LOGPROBS_MODE,
        max_logprobs=max_logprobs,
        seed=seed,
        disable_log_stats=not cfg.log_stats,
        # vLLM's default applies a logging dictConfig here, which closes every handler of the
        # process: Ray Serve's buffered replica log handler then kept every later record (one
        # access-log line per request) in memory for good and wrote none (benchmarks/soak.py).
        # vLLM logs through the process's handlers instead, at VLLM_LOGGING_LEVEL (`engine_env`).
        logging_config=LoggingConfig(configure_logging=False),
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        worker_extension_cls="serve_rft.explorer.engine.worker_ext.PolicyWeightsExtension",
        tensor_parallel_size=cfg.tensor_parallel_size,
    )
    if cfg.tensor_parallel_size > 1:
        # the workers are this replica's child processes: on its node, seeing the GPUs Ray gave it
        # (vLLM would pick its Ray executor inside a Ray actor, with workers placed elsewhere)
        kwargs["distributed_executor_backend"] = "mp"
    if weight_transfer is not None:
        from vllm.config.weight_transfer import WeightTransferConfig

        kwargs["weight_transfer_config"] = WeightTransferConfig(backend=weight_transfer)
    if lora_rank is not None:
        kwargs.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=cfg.max_loras,
                      max_cpu_loras=max(ADAPTERS_KEPT, cfg.max_loras))
    return {**kwargs, **{k: _as_config(k, v) for k, v in cfg.engine_args.items()}}


def _as_config(name: str, value: Any) -> Any:
    """``value`` for the engine argument ``name``: a mapping becomes the argument's config class
    where vLLM's ``AsyncEngineArgs`` does not convert it itself (``structured_outputs_config``,
    ``speculative_config`` ...), as ``vllm serve`` parses ``--structured-outputs-config '{...}'``;
    anything else unchanged.

    Raises:
        pydantic.ValidationError / TypeError: vLLM's config class refuses the mapping.
    """
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    if not isinstance(value, dict):
        return value
    field = {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}.get(name)
    factory = getattr(field, "default_factory", dataclasses.MISSING)
    if isinstance(factory, type) and dataclasses.is_dataclass(factory):
        return factory(**value)
    return value


def stat_loggers() -> list | None:
    """vLLM's engine metrics through Ray's metrics API (``RayPrometheusStatLogger``, a
    ``ReplicaId`` label per Serve replica; Ray exports them as ``ray_vllm_*``), as Ray Serve LLM
    does, with its gauges held (`held_stat_logger`); None outside a Ray worker (vLLM's own
    Prometheus logger, in process)."""
    import ray

    if not ray.is_initialized():
        return None
    return [held_stat_logger()]


def held_stat_logger():
    """vLLM's ``RayPrometheusStatLogger`` whose gauges are `serve_rft.observability.held.Gauge`:
    vLLM records its engine gauges (requests running and waiting, KV-cache usage) at each engine
    step, and Ray exports a gauge only in the interval after it was set, so an idle engine's
    gauges left Prometheus about 20 s after its last step. Held, each keeps its last recorded
    value, as vLLM's own server exports it (``prometheus_client`` gauges keep their value)."""
    from vllm.v1.metrics.ray_wrappers import RayGaugeWrapper, RayPrometheusMetric, RayPrometheusStatLogger

    from serve_rft.observability.held import Gauge

    class HeldGaugeWrapper(RayGaugeWrapper):
        def __init__(self, name: str, documentation: str | None = "", labelnames: list[str] | None = None,
                     multiprocess_mode: str | None = ""):
            RayPrometheusMetric.__init__(self)  # RayGaugeWrapper's body, with a held gauge
            self.metric = Gauge(name=self._get_sanitized_opentelemetry_name(name), description=documentation,
                                tag_keys=self._get_tag_keys(labelnames))

    class HeldRayPrometheusStatLogger(RayPrometheusStatLogger):
        _gauge_cls = HeldGaugeWrapper

    return HeldRayPrometheusStatLogger

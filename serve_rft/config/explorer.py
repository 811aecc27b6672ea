"""Settings of the served model and the explorer replicas (vLLM engines in Ray Serve)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from serve_rft.config.base import StrictSection

ENGINE_ARGS_OWNED = {
    "model": "set model.path instead",
    "served_model_name": "set model.served_name instead",
    "tokenizer": "the tokenizer is model.path's",
    "dtype": "set explorer.dtype instead",
    "max_model_len": "set explorer.max_model_len instead",
    "max_num_seqs": "set explorer.max_num_seqs instead",
    "gpu_memory_utilization": "set explorer.gpu_memory_utilization instead",
    "enforce_eager": "set explorer.enforce_eager instead",
    "disable_log_stats": "set explorer.log_stats instead",
    "seed": "each replica gets its own seed",
    "logprobs_mode": "the behaviour logprobs must be of the distribution the tokens were sampled from",
    "max_logprobs": "serve_rft asks for the sampled token's logprob on every request",
    "worker_extension_cls": "weight sync runs through serve_rft's worker extension",
    "weight_transfer_config": "set synchronizer.sync_method instead",
    "enable_lora": "set trainer.lora instead (merge_and_sync: false serves adapters)",
    "max_lora_rank": "set trainer.lora.rank instead",
    "max_loras": "set explorer.max_loras instead",
    "max_cpu_loras": "set explorer.max_loras instead",
    "logging_config": "vLLM logs through the replica's handlers (set VLLM_LOGGING_LEVEL)",
    "tensor_parallel_size": "set explorer.tensor_parallel_size instead",
    "pipeline_parallel_size": "a replica's workers split each layer (explorer.tensor_parallel_size), never "
                              "the layers between them",
    "distributed_executor_backend": "a replica's tensor-parallel workers are its child processes (mp)",
    "data_parallel_size": "set explorer.num_replicas instead (each replica is one engine)",
    "logits_processors": "custom logits processors change the sampling distribution; the trainer does not "
                         "reproduce them",
}
"""Engine arguments ``explorer.engine_args`` may not set -> why, or what to set instead."""


def check_passthrough(engine_args: dict[str, Any]) -> None:
    """Refuse pass-through keys serve_rft owns (`ENGINE_ARGS_OWNED`) without importing vLLM.

    Raises:
        ValueError: the first owned key, with why or what to set instead.
    """
    for key in engine_args:
        if key in ENGINE_ARGS_OWNED:
            raise ValueError(f"explorer.engine_args.{key} is serve_rft's to set: {ENGINE_ARGS_OWNED[key]}")


def check_known(engine_args: dict[str, Any]) -> None:
    """Refuse pass-through keys that are not fields of vLLM's ``AsyncEngineArgs`` (imports vLLM).

    Raises:
        ValueError: the unknown keys, with a hint.
    """
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    unknown = sorted(set(engine_args) - known)
    if unknown:
        raise ValueError(f"explorer.engine_args: {', '.join(unknown)} not an argument of vLLM's "
                         "AsyncEngineArgs (write `vllm serve` flags with _ for -)")


class ModelConfig(StrictSection):
    path: str | None = Field(
        None,
        description="A Hugging Face model directory, or a hub id (owner/name) resolved through the "
        "Hugging Face cache, downloaded only when not cached and HF_HUB_OFFLINE is not set. None: "
        "build (once) and use the embedded default model under `cache_dir`.",
    )
    cache_dir: str = Field(
        default_factory=lambda: os.environ.get(
            "SERVE_RFT_CACHE", str(Path.home() / ".cache" / "serve_rft")
        ),
        description="Where the embedded default model is built and cached.",
    )
    served_name: str = Field("serve-rft", description="Model name shown by /v1/models.")


class AutoscalingSettings(StrictSection):
    """Ray Serve's ``autoscaling_config`` for the explorer deployment: replicas are added and
    removed by load; the synchronizer counts the replicas that run (never a configured number)."""

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0, description="In-flight requests per replica "
                                           "Serve aims for.")
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingSettings":
        if self.max_replicas < self.min_replicas:
            raise ValueError("explorer.autoscaling.max_replicas must be >= min_replicas")
        return self


class RequestLimits(StrictSection):
    """Size bounds on request fields that are kept with every choice's experience or handed to
    vLLM's grammar compiler, checked before anything is generated (a request over one: 400 naming
    the field). OpenAI's documented limits where it has them; generous bounds elsewhere. The
    request body as a whole is bounded by serve_rft.explorer.http.body (8 MiB), ``metadata`` by
    OpenAI's 16 pairs, 64-character keys and 512-character values, ``stop`` by OpenAI's and vLLM's
    4 sequences."""

    max_stop_chars: int = Field(
        1024, ge=1, description="Characters of one stop sequence (kept with every choice's experience).")
    max_user_chars: int = Field(
        512, ge=1, description="Characters of `user` (kept with every choice's experience; OpenAI "
        "documents no bound, a stable end-user id is short).")
    max_schema_bytes: int = Field(
        65536, ge=1, description="UTF-8 bytes of `response_format` and of `structured_outputs` as JSON "
        "(the constraint is kept with every choice's experience), bytes.")
    max_tools: int = Field(
        128, ge=1, description="Tools per request (OpenAI's chat `tools`: a max of 128 functions).")
    max_tools_bytes: int = Field(
        262144, ge=1, description="UTF-8 bytes of `tools` as JSON (their schemas), bytes.")


class ExplorerConfig(StrictSection):
    num_replicas: int = Field(2, ge=1, description="vLLM explorer replicas behind Ray Serve (the "
                              "initial count when `autoscaling` is set).")
    autoscaling: AutoscalingSettings | None = Field(
        None, description="Let Ray Serve add and remove replicas by load (null: a fixed num_replicas).")
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="vLLM workers per replica, each holding a slice of every layer (vLLM's "
        "tensor_parallel_size, Megatron-LM's tensor parallelism): for a model larger than one GPU. The "
        "workers are the replica's child processes on its node (vLLM's multiprocessing executor); every "
        "sync method loads each version into all of them. Must divide the model's attention heads.")
    num_cpus_per_replica: float = Field(
        1.0, gt=0, description="Ray logical CPUs per tensor-parallel worker: a replica reserves "
        "tensor_parallel_size times this.")
    num_gpus_per_replica: float = Field(
        0.0, ge=0, description="Ray GPUs per tensor-parallel worker (GPU machines with the `vllm` package; "
        "NCCL needs > 0): a replica reserves tensor_parallel_size times this, all visible to its workers.")
    max_model_len: int = Field(1024, ge=16, description="Context length (prompt + response), tokens.")
    kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE per replica, GiB.")
    max_num_seqs: int = Field(64, ge=1, description="vLLM scheduler: concurrent sequences per replica.")
    max_ongoing_requests: int = Field(64, ge=1, description="Ray Serve: in-flight requests per replica.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="GPU machines: share of the GPU's memory one vLLM replica may use "
        "(weights + KV cache); lower it when replicas and the trainer share a GPU.")
    max_n: int = Field(16, ge=1, description="Largest accepted `n` (choices per request).")
    limits: RequestLimits = Field(
        default_factory=RequestLimits, description="Size bounds on request fields (RequestLimits).")
    tool_call_parser: str | None = Field(
        "hermes", description="vLLM's tool-call parser (its --tool-call-parser: hermes for Qwen2.5 / "
        "Hermes <tool_call> blocks, as the embedded model's chat template writes them; llama3_json, "
        "mistral, ...): turns the model's text into message.tool_calls. null: requests with tools "
        "get 400.")
    tool_strict_level: Literal["auto", "function", "parameter"] = Field(
        "auto", description="vLLM's --tool-strict-level: how much of a tool call its grammar pins. auto: "
        "forced calls (tool_choice required / named) get the call envelope, arguments follow their "
        "schema only for tools marked strict (OpenAI's rule); function: the envelope for every "
        "request with tools; parameter: also every tool's arguments, as if all were strict.")
    chat_template: str | None = Field(
        None, description="A Jinja chat template file used instead of the model's own.")
    routing_stats_period_s: float = Field(
        0.25, gt=0, description="How often Ray Serve polls replica routing stats (drain flag), s "
        "(service.ingress=proxy only: HAProxy needs no drain notice)."
    )
    max_loras: int = Field(
        4, ge=1, description="With adapter-only LoRA sync (trainer.lora.merge_and_sync=false): adapters "
        "(policy versions) one vLLM batch may mix; requests in flight keep the version they started on.")
    enforce_eager: bool | None = Field(
        None, description="vLLM's enforce_eager (no CUDA graphs, no torch.compile). null: true on CPU "
        "(vLLM-CPU), false on GPU, as vLLM's own default there.")
    direct_weight_load: bool = Field(
        True, description="On CPU, load a policy version (CHECKPOINT, MEMORY) straight into vLLM's packed "
        "linear layers, each weight read once by the pack; false: vLLM's layer-wise reload (allocate, "
        "copy, pack, copy back). Models it cannot handle (quantized, tensor-parallel, not eager) always "
        "use vLLM's. docs/performance.md, Sync cost per method.")
    peer_wait_s: float = Field(
        10.0, gt=0, description="How long /v1/status and the operator routes (/v1/sync/*) wait for the "
        "synchronizer or the trainer, s. A stuck one (a frozen process, a long pause) never hangs them: "
        "past it the synchronizer's part is a 504 (code synchronizer_unavailable, retry) and the "
        "trainer's part of /v1/status says answered: false.")
    log_stats: bool = Field(
        True, description="vLLM's engine metrics (requests running and waiting, KV-cache usage, time "
        "to first token, ...) through Ray's metrics API, one ReplicaId label per replica, as Ray Serve "
        "LLM exports them: ray_vllm_* on service.metrics_port.")
    user_code_loop_thread: bool = Field(
        False, description="Ray Serve's RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD for the explorer "
        "replicas. false (serve_rft's default): the replica's routes run on the event loop of its own "
        "HTTP server, so no stream chunk is handed between two event loops; true (Ray's default): on a "
        "second loop in its own thread, which keeps Ray's control calls to the replica answered while "
        "user code blocks its loop. docs/performance.md, Side by side with plain vLLM.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="More vLLM engine arguments, passed through unchanged: any "
        "field of vLLM's AsyncEngineArgs (`vllm serve` flags, - written _), e.g. {enable_prefix_caching: "
        "false, max_num_batched_tokens: 4096}. Those serve_rft sets itself are refused with where "
        "their value comes from (ENGINE_ARGS_OWNED above).")

    @model_validator(mode="after")
    def _initial_within_bounds(self) -> "ExplorerConfig":
        check_passthrough(self.engine_args)
        a = self.autoscaling
        if a is not None and not a.min_replicas <= self.num_replicas <= a.max_replicas:
            raise ValueError(f"explorer.num_replicas={self.num_replicas} (the initial count) must lie within "
                             f"autoscaling [{a.min_replicas}, {a.max_replicas}]")
        return self

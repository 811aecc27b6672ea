"""Settings of the served model and the explorer replicas (vLLM engines in Ray Serve)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from serve_rft.config.base import StrictSection


class ModelConfig(StrictSection):
    path: str | None = Field(
        None,
        description="A Hugging Face model directory. None: build (once) and use the embedded "
        "default model under `cache_dir`.",
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


class ExplorerConfig(StrictSection):
    num_replicas: int = Field(2, ge=1, description="vLLM explorer replicas behind Ray Serve (the "
                              "initial count when `autoscaling` is set).")
    autoscaling: AutoscalingSettings | None = Field(
        None, description="Let Ray Serve add and remove replicas by load (null: a fixed num_replicas).")
    num_cpus_per_replica: float = Field(1.0, gt=0, description="Ray logical CPUs per replica.")
    num_gpus_per_replica: float = Field(
        0.0, ge=0, description="Ray GPUs per replica (GPU machines with the `vllm` package; NCCL needs > 0).")
    max_model_len: int = Field(1024, ge=16, description="Context length (prompt + response), tokens.")
    kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE per replica, GiB.")
    max_num_seqs: int = Field(64, ge=1, description="vLLM scheduler: concurrent sequences per replica.")
    max_ongoing_requests: int = Field(64, ge=1, description="Ray Serve: in-flight requests per replica.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="GPU machines: share of the GPU's memory one vLLM replica may use "
        "(weights + KV cache); lower it when replicas and the trainer share a GPU.")
    max_n: int = Field(16, ge=1, description="Largest accepted `n` (choices per request).")
    tool_call_parser: str | None = Field(
        "hermes", description="vLLM's tool-call parser (its --tool-call-parser: hermes for Qwen2.5 / "
        "Hermes <tool_call> blocks, as the embedded model's chat template writes them; llama3_json, "
        "mistral, ...): turns the model's text into message.tool_calls. null: requests with tools "
        "get 400.")
    chat_template: str | None = Field(
        None, description="A Jinja chat template file used instead of the model's own.")
    routing_stats_period_s: float = Field(
        0.25, gt=0, description="How often Ray Serve polls replica routing stats (drain flag), s "
        "(service.ingress=proxy only: HAProxy needs no drain notice)."
    )
    max_loras: int = Field(
        4, ge=1, description="With adapter-only LoRA sync (trainer.lora.merge_and_sync=false): adapters "
        "(policy versions) one vLLM batch may mix; requests in flight keep the version they started on.")


    @model_validator(mode="after")
    def _initial_within_bounds(self) -> "ExplorerConfig":
        a = self.autoscaling
        if a is not None and not a.min_replicas <= self.num_replicas <= a.max_replicas:
            raise ValueError(f"explorer.num_replicas={self.num_replicas} (the initial count) must lie within "
                             f"autoscaling [{a.min_replicas}, {a.max_replicas}]")
        return self

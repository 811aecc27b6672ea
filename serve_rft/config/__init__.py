"""Typed run configuration.

One pydantic model per runtime role (explorer, buffer, trainer, synchronizer, service; a module
each in this package), assembled by `Config` and loaded from YAML plus ``--set a.b=value``
overrides. This package imports neither torch nor vLLM so that ``serve-rft --help`` and config
validation are instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, model_validator

from serve_rft.config.base import StrictSection
from serve_rft.config.buffer import BufferConfig
from serve_rft.config.explorer import AutoscalingSettings, ExplorerConfig, ModelConfig
from serve_rft.config.service import ServiceConfig
from serve_rft.config.synchronizer import CanaryConfig, SyncMethod, SyncStyle, SynchronizerConfig
from serve_rft.config.trainer import VLLM_LORA_RANKS, LoraSettings, TrainerConfig

__all__ = ["AutoscalingSettings", "BufferConfig", "CanaryConfig", "Config", "ExplorerConfig", "LoraSettings",
           "ModelConfig", "ServiceConfig", "SyncMethod", "SyncStyle", "SynchronizerConfig", "TrainerConfig",
           "VLLM_LORA_RANKS", "apply_overrides", "load_config"]


class Config(StrictSection):
    """The whole run: one section per runtime role."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    explorer: ExplorerConfig = Field(default_factory=ExplorerConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    synchronizer: SynchronizerConfig = Field(default_factory=SynchronizerConfig)
    service: ServiceConfig = Field(default_factory=ServiceConfig)

    @model_validator(mode="after")
    def _nccl_needs_gpus(self) -> "Config":
        if self.synchronizer.sync_method is SyncMethod.NCCL and (
                self.trainer.device != "cuda" or self.explorer.num_gpus_per_replica <= 0):
            raise ValueError(
                "synchronizer.sync_method=nccl moves weights GPU to GPU: it needs trainer.device=cuda "
                "and explorer.num_gpus_per_replica > 0 (on a machine without GPUs use checkpoint or memory)")
        return self

    @model_validator(mode="after")
    def _adapter_sync_method(self) -> "Config":
        if self.adapter_sync and self.synchronizer.sync_method is SyncMethod.NCCL:
            raise ValueError("trainer.lora.merge_and_sync=false syncs adapters as files or buckets: use "
                             "synchronizer.sync_method=checkpoint or memory (NCCL broadcasts full weights)")
        return self

    @model_validator(mode="after")
    def _merged_lora_sync_method(self) -> "Config":
        if (self.trainer.lora is not None and self.trainer.lora.merge_and_sync
                and self.synchronizer.sync_method is SyncMethod.NCCL):
            raise ValueError("trainer.lora with merge_and_sync streams the merged weights from CPU a bucket "
                             "at a time: use synchronizer.sync_method=checkpoint or memory (NCCL broadcasts "
                             "from GPU tensors of one whole model)")
        return self

    @model_validator(mode="after")
    def _sharded_trainer_support(self) -> "Config":
        if self.trainer.num_workers > 1:
            if self.synchronizer.sync_method is SyncMethod.NCCL:
                raise ValueError("trainer.num_workers > 1 publishes through checkpoint or memory so far "
                                 "(NCCL broadcasts from one trainer process)")
        return self

    @property
    def adapter_sync(self) -> bool:
        """True when replicas serve LoRA adapters over the base (``trainer.lora.merge_and_sync``
        false) instead of loading full weights."""
        return self.trainer.lora is not None and not self.trainer.lora.merge_and_sync

    @model_validator(mode="after")
    def _always_one_serving(self) -> "Config":
        auto = self.explorer.autoscaling
        n = auto.min_replicas if auto is not None else self.explorer.num_replicas
        if n > 1 and self.synchronizer.max_unavailable >= n:
            raise ValueError(
                f"synchronizer.max_unavailable={self.synchronizer.max_unavailable} would let all "
                f"{n} replicas sync at once; it must be < explorer.num_replicas"
            )
        lora = self.trainer.lora
        if self.synchronizer.canary.on_reject == "reset" and lora is not None and lora.merge_and_sync:
            raise ValueError("synchronizer.canary.on_reject=reset takes the incumbent's adapter back; with "
                             "trainer.lora.merge_and_sync=true versions carry merged weights only: use "
                             "merge_and_sync=false or on_reject=continue")
        if self.synchronizer.rollout == "canary" and self.synchronizer.canary.replicas >= n:
            raise ValueError(
                f"synchronizer.canary.replicas={self.synchronizer.canary.replicas} leaves no replica "
                f"on the incumbent version with {n} replicas; it must be < explorer.num_replicas "
                "(or autoscaling.min_replicas)")
        return self


def _parse_value(raw: str) -> Any:
    """Parse an override value with YAML rules (``1`` -> int, ``true`` -> bool, ``a`` -> str)."""
    return yaml.safe_load(raw)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.field=value`` overrides to a raw config dict (in place, returned).

    Raises:
        ValueError: an override without ``=``.
    """
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form section.field=value")
        dotted, raw = item.split("=", 1)
        node = data
        parts = dotted.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _parse_value(raw)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config file (optional) and apply overrides.

    Raises:
        pydantic.ValidationError: a field of the wrong type or out of bounds.
        FileNotFoundError: ``path`` does not exist.
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
    apply_overrides(data, overrides or [])
    return Config.model_validate(data)

"""Typed run configuration.

One pydantic model per runtime role (explorer, buffer, trainer, synchronizer, service; a module
each in this package), assembled by `Config` and loaded in layers (`load_config`): defaults <
YAML file < environment (``SERVE_RFT_<SECTION>__<FIELD>``) < ``--set a.b=value`` overrides. This
package imports neither torch nor vLLM so that ``serve-rft --help`` and config validation are
instant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict, SettingsError

from serve_rft.config.buffer import BufferConfig
from serve_rft.config.explorer import AutoscalingSettings, ExplorerConfig, ModelConfig
from serve_rft.config.service import ServiceConfig
from serve_rft.config.synchronizer import CanaryConfig, SyncMethod, SyncStyle, SynchronizerConfig
from serve_rft.config.trainer import VLLM_LORA_RANKS, LoraSettings, TrainerConfig

__all__ = ["AutoscalingSettings", "BufferConfig", "CanaryConfig", "Config", "ConfigFileError", "ExplorerConfig",
           "LoraSettings", "ModelConfig", "ServiceConfig", "SyncMethod", "SyncStyle", "SynchronizerConfig",
           "TrainerConfig", "VLLM_LORA_RANKS", "apply_overrides", "env_layer", "explain", "load_config",
           "read_file", "schema_text"]


class Config(BaseSettings):
    """The whole run: one section per runtime role.

    ``Config()`` is the defaults with this process's environment over them
    (``SERVE_RFT_<SECTION>__<FIELD>``, `env_layer`); `load_config` adds a file and overrides.
    Validating a dump (``model_validate_json``, how Ray actors get it) reads no environment.
    """

    # inputs hidden in errors: a refused value may be a key (a section's own setting does not
    # apply to errors raised through this model)
    model_config = SettingsConfigDict(extra="forbid", validate_assignment=True, hide_input_in_errors=True,
                                      env_prefix="SERVE_RFT_", env_nested_delimiter="__")

    model: ModelConfig = Field(default_factory=ModelConfig)
    explorer: ExplorerConfig = Field(default_factory=ExplorerConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    synchronizer: SynchronizerConfig = Field(default_factory=SynchronizerConfig)
    service: ServiceConfig = Field(default_factory=ServiceConfig)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        """Arguments, then the environment: no ``.env`` file, no secrets folder."""
        return init_settings, env_settings

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


class ConfigFileError(ValueError):
    """A run-config file that is not YAML or not a mapping; the message names the file and the
    line, never the line's text (it may hold a key)."""


def read_file(path: str | Path) -> dict[str, Any]:
    """The mapping of the YAML run-config file ``path`` (an empty file: ``{}``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConfigFileError: not YAML (the message gives the file, line and column) or not a mapping.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigFileError(f"{path}{where}: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise ConfigFileError(f"{path}: not YAML ({type(e).__name__})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: a run config is a mapping of sections, not a {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.field=value`` overrides to a raw config dict (in place, returned). A value
    is read with YAML rules (``1`` -> int, ``true`` -> bool, ``[a, b]`` -> list, ``a`` -> str); a
    section that is missing or null (``lora: null``) becomes a mapping.

    Raises:
        ValueError: an override without ``=``, or one that goes below a field that is not a section.
    """
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form section.field=value")
        dotted, raw = item.split("=", 1)
        node = data
        parts = dotted.strip().split(".")
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ValueError(f"override {dotted}: {'.'.join(parts[:i + 1])} is a value, not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def env_layer() -> dict[str, Any]:
    """The settings of this process's environment: ``SERVE_RFT_<SECTION>__<FIELD>`` (nesting
    goes on with ``__``: ``SERVE_RFT_TRAINER__LORA__RANK=8``; a list or mapping is JSON), read by
    pydantic-settings with `Config`'s settings. The key variables (``SERVE_RFT_API_KEYS`` ...)
    are no part of it: they are the defaults of the key fields (`serve_rft.config.service`).

    Raises:
        ValueError: a list or mapping that is not JSON (the value is not shown).
    """
    try:
        return EnvSettingsSource(Config)()
    except SettingsError as e:
        raise ValueError(f"{e} (a list or mapping in SERVE_RFT_<SECTION>__<FIELD> is JSON, e.g. "
                         "SERVE_RFT_SERVICE__API_KEYS='[\"sk-1\", \"sk-2\"]')") from None


def _merged(low: dict[str, Any], high: dict[str, Any]) -> dict[str, Any]:
    """``low`` updated by ``high``, section by section (a mapping replaces a null)."""
    out = dict(low)
    for key, value in high.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """The run config: the defaults, then the YAML file ``path`` (optional), then the environment
    (`env_layer`), then ``overrides`` (``section.field=value``); each layer wins over the ones
    before it, field by field.

    Errors never show a value given (`Config` hides inputs): a key in a refused value stays out.

    Raises:
        pydantic.ValidationError: a field of the wrong type or out of bounds, or a rule across
            fields broken.
        FileNotFoundError: ``path`` does not exist.
        ConfigFileError: ``path`` is not YAML or not a mapping.
        ValueError: an override not of the form ``section.field=value``, or an environment list or
            mapping that is not JSON.
    """
    data = read_file(path) if path is not None else {}
    data = _merged(_merged(data, env_layer()), apply_overrides({}, overrides or []))
    return Config.model_validate(data)


def explain(error: Exception) -> str:
    """One line for a person: each problem of a `pydantic.ValidationError` as ``field: message``
    (never the value given), or ``str(error)``."""
    if not isinstance(error, ValidationError):
        return str(error)
    parts = []
    for item in error.errors(include_input=False, include_url=False):
        msg = item["msg"].removeprefix("Value error, ")
        loc = ".".join(str(x) for x in item["loc"])
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def schema_text() -> str:
    """The JSON Schema of a run-config file (`Config`), as committed in
    docs/reference/config.schema.json: two-space indent, sorted keys, a final newline. Defaults
    computed from the environment (keys, the cache folder) are not in it."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **Config.model_json_schema()}
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"

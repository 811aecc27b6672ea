"""Ray Serve application builder for `serve run` / `serve deploy` (see serve_config.yaml).

``args`` (the config file's ``args:``) may hold ``config`` (a run-config YAML path) and
``overrides`` (a list of ``section.field=value``). ``buffer.redis_url`` must point at a running
Redis: under `serve deploy` nothing else starts one (``serve-rft up`` does).
"""

from __future__ import annotations

from serve_rft.config import load_config
from serve_rft.model.embedded import resolve_model_path
from serve_rft.service.app import build_app


def app_builder(args: dict):
    cfg = load_config(args.get("config"), list(args.get("overrides", [])))
    model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    return build_app(cfg, model_path)

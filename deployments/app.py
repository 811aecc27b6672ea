"""Ray Serve entry points for `serve run` / `serve deploy` / `serve build` (see serve_config.yaml).

- `app_builder` (the config file's ``import_path``): ``args`` may hold ``config`` (a run-config
  YAML path) and ``overrides`` (a list of ``section.field=value``). ``buffer.redis_url`` must point
  at a running Redis: under `serve deploy` nothing else starts one (``serve-rft up`` does).
- `app`: the application of ``configs/default.yaml`` (Redis at 127.0.0.1:6379), importable with
  no side effects, for ``RAY_SERVE_ENABLE_HA_PROXY=1 serve build deployments.app:app``, which
  prints the deployment options (replicas, actor options, max_ongoing_requests) that
  serve_config.yaml repeats (without the variable the output also lists DrainAwareRouter's
  request_router_config, used only behind Ray Serve's Python proxy).

Either way the explorer replicas create the synchronizer and trainer actors when they start
(`serve_rft.control.ensure_control`).
"""

from __future__ import annotations

from pathlib import Path

from serve_rft.config import load_config
from serve_rft.control import preflight
from serve_rft.service.app import build_app

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def app_builder(args: dict):
    """The application of ``args["config"]`` + ``args["overrides"]``.

    Raises:
        ValueError: a config this machine cannot run (`preflight`), or no ``buffer.redis_url``.
    """
    cfg = load_config(args.get("config"), list(args.get("overrides", [])))
    preflight(cfg)
    return build_app(cfg)


def __getattr__(name: str):
    """``app``, built when asked for (`serve build`), never on import: `serve deploy` imports
    this module to call `app_builder`, and the default config's build would check that
    cluster's HTTP host against keys and settings the deployed config does not share."""
    if name == "app":
        return build_app(load_config(DEFAULT_CONFIG, [f"buffer.redis_url={DEFAULT_REDIS}"]))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

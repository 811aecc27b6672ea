"""Ray Serve entry points for `serve run` / `serve deploy` / `serve build`, importable from an
installed package (the wheel, with its ``cpu`` or ``cuda`` extra), and the shipped Serve configs.

- `app_builder` (the shipped configs' ``import_path: serve_rft.deploy:app_builder``): ``args``
  may hold ``config`` (a run-config YAML path; absent: the defaults, which are
  ``configs/default.yaml``) and ``overrides`` (a list of ``section.field=value``).
  ``buffer.redis_url`` must point at a running Redis: under `serve deploy` nothing else starts
  one (``serve-rft up`` does).
- `app`: the application of the default run config (Redis at 127.0.0.1:6379), importable with
  no side effects, for ``RAY_SERVE_ENABLE_HA_PROXY=1 serve build serve_rft.deploy:app``, which
  prints the deployment options (replicas, actor options, max_ongoing_requests) that
  ``serve_config.yaml`` repeats (without the variable the output also lists DrainAwareRouter's
  request_router_config, used only behind Ray Serve's Python proxy).
- `SERVE_CONFIGS`: the shipped Serve config files by name (package data;
  ``serve-rft config serve`` prints one; a checkout links them from ``deployments/``).

Either way the explorer replicas create the synchronizer and trainer actors when they start
(`serve_rft.control.ensure_control`). Ray Serve's config files: "Production Guide, Serve Config
Files" in Ray's documentation.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVE_CONFIGS = {"serve_config": HERE / "serve_config.yaml",
                 "serve_config_autoscaling": HERE / "serve_config_autoscaling.yaml"}
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def app_builder(args: dict):
    """The application of ``args["config"]`` (optional) + ``args["overrides"]`` (optional).

    Raises:
        ValueError: a config this machine cannot run (`serve_rft.control.preflight`: a model that
            does not load, no ``buffer.redis_url``, an open service without keys, ...).
    """
    from serve_rft.config import load_config
    from serve_rft.control import preflight
    from serve_rft.service.app import build_app

    cfg = load_config(args.get("config"), list(args.get("overrides", [])))
    preflight(cfg)
    return build_app(cfg)


def __getattr__(name: str):
    """``app``, built when asked for (`serve build`), never on import: `serve deploy` imports
    this module to call `app_builder`, and the default config's build would check that
    cluster's HTTP host against keys and settings the deployed config does not share."""
    if name == "app":
        from serve_rft.config import load_config
        from serve_rft.service.app import build_app

        return build_app(load_config(None, [f"buffer.redis_url={DEFAULT_REDIS}"]))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""deployments/: `serve build` accepts the importable application, and serve_config.yaml's
deployment options are exactly what `serve build` prints for configs/default.yaml; the builder
the config file names turns its args into the same application."""

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_serve_build_output_matches_serve_config(tmp_path):
    out = tmp_path / "built.yaml"
    serve = Path(sys.executable).parent / "serve"
    env = dict(os.environ, RAY_SERVE_ENABLE_HA_PROXY="1")  # no custom router: valid in both modes
    proc = subprocess.run([str(serve), "build", "deployments.app:app", "--app-dir", str(ROOT), "-o", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = yaml.safe_load(out.read_text())["applications"][0]
    shipped = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())["applications"][0]
    assert built["deployments"] == shipped["deployments"]
    assert shipped["import_path"] == "deployments.app:app_builder"


def test_the_builder_applies_its_args():
    from ray.serve.handle import DeploymentHandle  # noqa: F401  (Serve is importable)

    from deployments.app import app_builder

    shipped = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())["applications"][0]
    args = dict(shipped["args"], config=str(ROOT / shipped["args"]["config"]))
    args["overrides"] = args["overrides"] + ["explorer.num_replicas=3"]
    app = app_builder(args)
    deployment = app._bound_deployment
    assert deployment.num_replicas == 3
    assert '"redis_url":"redis://127.0.0.1:6379/0"' in deployment.init_args[0]


def test_drain_aware_router_only_without_haproxy(monkeypatch):
    """HAProxy balances by itself (Ray refuses a custom router there); the Python proxy needs ours."""
    from serve_rft.config import Config
    from serve_rft.service.app import explorer_deployment

    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    assert explorer_deployment(Config())._deployment_config.request_router_config.request_router_class != \
        "serve_rft.explorer.router.DrainAwareRouter"
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    assert explorer_deployment(Config())._deployment_config.request_router_config.request_router_class == \
        "serve_rft.explorer.router.DrainAwareRouter"


def test_refusals_only_when_haproxy_retries_them(monkeypatch):
    from serve_rft.explorer.ingress_mode import refusals_are_retried
    from serve_rft.service.ingress import RETRY_ON

    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_RETRY_ON", RETRY_ON)
    assert refusals_are_retried()
    monkeypatch.setenv("RAY_SERVE_HAPROXY_RETRY_ON", "conn-failure 503")  # body after headers: not re-sent
    assert not refusals_are_retried()
    monkeypatch.setenv("RAY_SERVE_HAPROXY_RETRY_ON", "conn-failure")  # Ray's default: a 503 would reach the client
    assert not refusals_are_retried()
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_RETRY_ON", "503")
    assert not refusals_are_retried()

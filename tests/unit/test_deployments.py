"""deployments/: `serve build` accepts the importable application, and serve_config.yaml's
deployment options are exactly what `serve build` prints for configs/default.yaml; the builder
the config file names turns its args into the same application."""

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_serve_build_output_matches_serve_config(tmp_path):
    out = tmp_path / "built.yaml"
    serve = Path(sys.executable).parent / "serve"
    proc = subprocess.run([str(serve), "build", "deployments.app:app", "--app-dir", str(ROOT), "-o", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
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

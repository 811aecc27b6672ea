"""The command line as a user meets it: version, help, ``config show / validate / schema / serve``, --host."""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from serve_rft.cli import cli

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "docs" / "reference" / "config.schema.json"


@pytest.fixture(autouse=True)
def no_config_env(monkeypatch):
    for name in list(os.environ):
        if name.upper().startswith("SERVE_RFT_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("COLUMNS", "200")


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def test_version_is_the_package_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    result = run("--version")
    assert result.exit_code == 0 and result.output.strip() == f"serve-rft {version}"


COMMANDS = [[], ["up"], ["demo"], ["agent"], ["report"], ["status"], ["init-model"], ["cluster-env"],
            ["config"], ["config", "show"], ["config", "validate"], ["config", "schema"], ["config", "serve"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "serve-rft")
def test_help_is_written_for_users(command):
    """No reST markup, no Markdown code spans, no module paths or source files in --help."""
    result = run(*command, "--help")
    assert result.exit_code == 0
    text = result.output
    for pattern in (r"``", r"`", r"serve_rft[./]\w", r"\.py\b", r"<list\[str\]>"):
        assert not re.search(pattern, text), f"{pattern!r} in the help of {command}:\n{text}"


def test_host_is_the_address_up_binds():
    """--host sets service.host: an exposed one without keys is refused before anything starts."""
    result = run("up", "--host", "0.0.0.0", "--set", "service.run_dir=/nonexistent/never-created")
    assert result.exit_code == 2 and "refusing to serve on 0.0.0.0 with no API keys" in result.output
    assert "--host" in run("up", "--help").output


def test_config_show_prints_the_resolved_config_with_secrets_redacted(tmp_path, monkeypatch):
    f = tmp_path / "run.yaml"
    f.write_text("trainer:\n  lr: 0.01\n  lora: null\nbuffer:\n  redis_url: redis://:pw-SECRET@10.0.0.5:6379/0\n")
    monkeypatch.setenv("SERVE_RFT_ADMIN_KEYS", "sk-admin-SECRET")
    monkeypatch.setenv("SERVE_RFT_EXPLORER__NUM_REPLICAS", "3")
    result = run("config", "show", "-c", str(f), "--set", "trainer.lora.rank=8", "--set",
                 "service.tenants={acme: {api_keys: [sk-acme-SECRET], reward_keys: [sk-r-SECRET]}}")
    assert result.exit_code == 0, result.output
    assert "SECRET" not in result.output
    shown = yaml.safe_load(result.output)
    assert shown["trainer"]["lr"] == 0.01 and shown["trainer"]["lora"]["rank"] == 8
    assert shown["explorer"]["num_replicas"] == 3
    assert shown["buffer"]["redis_url"] == "redis://10.0.0.5:6379/0"
    assert shown["service"]["admin_keys"] == ["<redacted>"]
    assert shown["service"]["tenants"]["acme"] == {"api_keys": ["<redacted>"], "reward_keys": ["<redacted>"],
                                                   "quota": None, "key_quota": None, "scope_quotas": {}}
    assert shown["service"]["api_keys"] == []


def test_config_validate_runs_the_checks_of_up_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "run"
    ok = run("config", "validate", "-c", str(ROOT / "configs" / "default.yaml"),
             "--set", f"service.run_dir={run_dir}")
    assert ok.exit_code == 0 and "config valid" in ok.output
    bad = run("config", "validate", "--set", "explorer.engine_args={no_such_argument: 1}")
    assert bad.exit_code == 2 and "no_such_argument" in bad.output
    assert run("config", "validate", "--set", "explorer.num_replicas=0").exit_code == 2
    assert run("config", "validate", "--set", "service.host=0.0.0.0").exit_code == 2  # exposure
    train = run("config", "validate", "--mode", "train", "--set", "service.ray_address=10.0.0.1:6379")
    assert train.exit_code == 2 and "redis_url" in train.output
    assert not run_dir.exists()


def test_the_committed_json_schema_is_what_the_cli_writes(tmp_path):
    out = tmp_path / "schema.json"
    assert run("config", "schema", "--output", str(out)).exit_code == 0
    assert out.read_text() == SCHEMA.read_text(), "stale: run serve-rft config schema -o " + str(SCHEMA.relative_to(ROOT))


@pytest.mark.parametrize("name", ["default.yaml", "single_gpu.yaml", "cluster.yaml"])
def test_the_shipped_configs_pass_the_schema_and_a_typo_does_not(name):
    """What an editor checks with the schema: the shipped configs pass, an unknown field fails."""
    import jsonschema

    schema = json.loads(SCHEMA.read_text())
    data = yaml.safe_load((ROOT / "configs" / name).read_text())
    jsonschema.validate(data, schema)
    data["trainer"]["lrr"] = 0.1
    with pytest.raises(jsonschema.ValidationError, match="lrr"):
        jsonschema.validate(data, schema)


def test_cluster_env_prints_what_the_kuberay_manifest_sets_and_bash_reads_it_back():
    """`serve-rft cluster-env` and deployments/kuberay/rayservice.yaml give every node the same Ray
    settings; bash's ``eval`` of the output yields each value exactly (HAProxy's directives after
    newlines included)."""
    import subprocess

    from serve_rft.service.cluster_env import cluster_env

    result = run("cluster-env")
    assert result.exit_code == 0
    docs = yaml.safe_load_all((ROOT / "deployments" / "kuberay" / "rayservice.yaml").read_text())
    (service,) = [d for d in docs if d and d["kind"] == "RayService"]
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ray_env = {e["name"]: e["value"] for e in head["env"] if e["name"].startswith("RAY_")}
    assert cluster_env() == ray_env
    lines = [line for line in result.stdout.splitlines() if line.startswith("export ")]
    script = "\n".join(lines) + "\n" + "".join(f'printf "%s\\0" "${name}"\n' for name in ray_env)
    values = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert values.split("\0")[:-1] == list(ray_env.values())
    proxy = run("cluster-env", "--ingress", "proxy").stdout
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in proxy and "RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S=30" in proxy
    assert "serve-rft cluster-env" in (ROOT / "docs" / "operations" / "deploy.md").read_text()


@pytest.mark.parametrize("flags, name", [([], "serve_config.yaml"), (["--autoscaling"], "serve_config_autoscaling.yaml")])
def test_config_serve_prints_the_shipped_serve_config(tmp_path, flags, name):
    """What a package install has of deployments/ (package data): the same file, importing the
    packaged builder."""
    shipped = (ROOT / "deployments" / name).read_text()
    result = run("config", "serve", *flags)
    assert result.exit_code == 0 and result.output == shipped
    assert yaml.safe_load(shipped)["applications"][0]["import_path"] == "serve_rft.deploy:app_builder"
    assert run("config", "serve", *flags, "-o", str(tmp_path / name)).exit_code == 0
    assert (tmp_path / name).read_text() == shipped

"""No key in any config error: a refused value is never echoed, whether it came from a YAML file,
``--set``, the environment or the overrides of a Serve config, through `load_config`, the CLI and
the Serve application builder."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from serve_rft.config import explain, load_config

SECRET = "sk-SECRET-4242"

CASES = {  # name -> (YAML file text or None, --set overrides, environment)
    "set: a key list as one string": (None, [f"service.api_keys={SECRET}"], {}),
    "set: a tenant's keys as one string": (None, [f"service.tenants={{acme: {{api_keys: {SECRET}}}}}"], {}),
    "set: admin keys as a mapping": (None, [f"service.admin_keys={{k: {SECRET}}}"], {}),
    "set: a Redis URL as a list": (None, [f"buffer.redis_url=[redis://:{SECRET}@127.0.0.1:6379/0]"], {}),
    "file: a key list as one string": (f"service:\n  reward_keys: {SECRET}\n", [], {}),
    "file: not YAML on the key's line": (f"service:\n  api_keys: [{SECRET}\n  port: 1\n", [], {}),
    "env: a key list not JSON": (None, [], {"SERVE_RFT_SERVICE__API_KEYS": SECRET}),
    "env: a key list as a JSON string": (None, [], {"SERVE_RFT_SERVICE__API_KEYS": f'"{SECRET}"'}),
    "env: a tenant's keys as one string": (None, [], {"SERVE_RFT_TENANTS": f'{{"acme": {{"api_keys": "{SECRET}"}}}}'}),
}


@pytest.fixture(params=sorted(CASES))
def case(request, monkeypatch, tmp_path):
    """One refused config: (file path or None, overrides), with its environment set."""
    for name in list(os.environ):
        if name.upper().startswith("SERVE_RFT_"):
            monkeypatch.delenv(name)
    text, overrides, env = CASES[request.param]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = None
    if text is not None:
        path = tmp_path / "run.yaml"
        path.write_text(text)
    return path, overrides


def test_load_config_never_echoes_a_key(case):
    path, overrides = case
    with pytest.raises(Exception) as e:
        load_config(path, overrides)
    assert SECRET not in str(e.value) and SECRET not in explain(e.value)


def test_the_cli_never_echoes_a_key(case):
    from serve_rft.cli import cli

    path, overrides = case
    args = ["up", *(["--config", str(path)] if path else []), *(a for o in overrides for a in ("--set", o))]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "config error" in result.output
    assert SECRET not in result.output
    assert len(result.output.strip().splitlines()) <= 3  # one line, wrapped by the console at most


def test_the_serve_application_builder_never_echoes_a_key(case):
    """``serve deploy`` / ``serve run`` of a Serve config: ``args.config`` and ``args.overrides``."""
    from serve_rft.deploy import app_builder

    path, overrides = case
    args = {"overrides": overrides, **({"config": str(path)} if path else {})}
    with pytest.raises(Exception) as e:
        app_builder(args)
    assert SECRET not in str(e.value)

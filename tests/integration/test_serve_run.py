"""The package as a pip user gets it: the wheel built from this repository, installed into a fresh
venv outside the checkout, brings up a working service with Ray Serve's own CLI (`serve run` of
the shipped config that `serve-rft config serve` writes, no serve-rft launcher): the replicas
(run by the fresh venv's Python) create the synchronizer and the trainer, chat requests are
answered and logged, rewards are accepted, the trainer publishes a version. Runs Ray Serve's
Python proxy (RAY_SERVE_ENABLE_HA_PROXY=0): the build path that adds DrainAwareRouter; the
`serve-rft up` stacks of the other integration tests run the HAProxy ingress. The shipped
config binds 0.0.0.0, so the service runs with keys from the environment of `serve run` (the
builder refuses to serve there without them), one of each scope, and each client sends its own.

The fresh venv's dependencies are this venv's (`tests.support.package.fresh_venv`): what it shows
is that the wheel holds everything serve_rft needs (the builder, the shipped configs), not that
pip resolves vLLM. It fails when the wheel lacks a module or the shipped configs (a wheel built without
pyproject's package-data line holds no Serve config, so ``config serve`` finds no file), or when
the fresh venv's Python imports serve_rft from the checkout."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.load import get_status
from tests.support.package import ROOT, build_wheel, clean_env, fresh_venv

pytestmark = pytest.mark.integration

KEYS = {"SERVE_RFT_API_KEYS": "inference-key", "SERVE_RFT_REWARD_KEYS": "reward-key",
        "SERVE_RFT_ADMIN_KEYS": "admin-key"}
INFERENCE, REWARD, ADMIN = ({"Authorization": f"Bearer {k}"} for k in KEYS.values())


def test_the_wheel_in_a_fresh_venv_serves_the_shipped_config_with_serve_run(redis_server, embedded_model, tmp_path):
    from benchmarks.plain_vllm import stop, wait_http
    from serve_rft.buffer.redis_server import free_port

    python = fresh_venv(tmp_path / "venv", build_wheel(tmp_path / "build"))
    bindir = python.parent
    where = tmp_path / "elsewhere"  # outside the checkout: nothing of it on the import path
    where.mkdir()
    env = clean_env(RAY_SERVE_ENABLE_HA_PROXY="0", **KEYS)
    installed = subprocess.run([str(python), "-c", "import serve_rft.deploy as d; print(d.__file__)"], cwd=where,
                               env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(installed).is_relative_to(tmp_path / "venv") and not Path(installed).is_relative_to(ROOT), installed
    subprocess.run([str(bindir / "serve-rft"), "config", "serve", "-o", "serve_config.yaml"], cwd=where, env=env,
                   check=True, capture_output=True, text=True)
    cfg = yaml.safe_load((where / "serve_config.yaml").read_text())
    assert cfg == yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    port = free_port()
    cfg["http_options"]["port"] = port
    app = cfg["applications"][0]
    app["args"]["overrides"] = [f"buffer.redis_url={redis_server.url}", f"service.run_dir={tmp_path / 'run'}",
                                "buffer.key_prefix=serve-run", "trainer.min_batch_size=4",
                                "trainer.batch_wait_s=0.5"]
    app["deployments"][0]["num_replicas"] = 1  # the file's count rules; the run config says 2
    (where / "serve_config.yaml").write_text(yaml.safe_dump(cfg))
    log = open(tmp_path / "serve-run.log", "w")
    # Ray Serve's CLI (its `serve` entry point) run by the fresh venv's Python
    proc = subprocess.Popen([str(python), "-c", "from ray.serve.scripts import cli; cli()", "run", "serve_config.yaml"],
                            cwd=where, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http(f"{url}/health", proc, timeout_s=400)
        except (RuntimeError, TimeoutError) as e:
            pytest.fail(f"serve run not healthy ({e!r}):\n" + (tmp_path / "serve-run.log").read_text()[-4000:])
        version = 0
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "n": 2}
        with httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
            r = c.post("/v1/chat/completions", json=chat, headers=REWARD)
            assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope", r.text
            assert c.post("/v1/sync/rollback", json={}, headers=REWARD).status_code == 403
            assert c.get("/openapi.json", headers=INFERENCE).status_code == 403
            assert c.get("/openapi.json", headers=ADMIN).status_code == 200
            deadline = time.monotonic() + 240
            while version < 1 and time.monotonic() < deadline:
                r = c.post("/v1/chat/completions", json=chat, headers=INFERENCE)
                assert r.status_code == 200, r.text
                body = r.json()
                rewards = {"completion_id": body["id"], "rewards": [1.0, 0.0]}
                assert c.post("/v1/rewards", json=rewards, headers=INFERENCE).status_code == 403
                assert c.post("/v1/rewards", json=rewards, headers=REWARD).status_code == 200
                st = c.get("/v1/status", headers=ADMIN).json()
                version = st["policy_version"]
        assert version >= 1, st
        assert st["experiences"]["logged"] > 0 and st["trainer"]["state"] in ("RUNNING", "REQUIRE_SYNC")
        # the synchronizer counts the one replica that runs (not the run config's 2): it syncs
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(r["policy_version"] >= 1 for r in st["replicas"]):
            time.sleep(0.5)
            st = get_status(url, headers=ADMIN)
        assert len(st["replicas"]) == 1 and st["replicas"][0]["policy_version"] >= 1, st
    finally:
        stop(proc)  # SIGINT to its process group (serve run ends Serve and its Ray), then SIGKILL
        log.close()

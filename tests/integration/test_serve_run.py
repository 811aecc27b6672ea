"""`serve run deployments/serve_config.yaml` (Ray Serve's own CLI, no serve-rft launcher) brings
up a working service: the replicas create the synchronizer and the trainer, chat requests are
answered and logged, rewards are accepted, the trainer publishes a version. Runs Ray Serve's
Python proxy (RAY_SERVE_ENABLE_HA_PROXY=0): the build path that adds DrainAwareRouter; the
`serve-rft up` stacks of the other integration tests run the HAProxy ingress. The shipped
config binds 0.0.0.0, so the service runs with keys from the environment of `serve run` (the
builder refuses to serve there without them), one of each scope, and each client sends its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.load import get_status

pytestmark = pytest.mark.integration

KEYS = {"SERVE_RFT_API_KEYS": "inference-key", "SERVE_RFT_REWARD_KEYS": "reward-key",
        "SERVE_RFT_ADMIN_KEYS": "admin-key"}
INFERENCE, REWARD, ADMIN = ({"Authorization": f"Bearer {k}"} for k in KEYS.values())

ROOT = Path(__file__).resolve().parents[2]


def test_serve_run_accepts_the_shipped_config(redis_server, embedded_model, tmp_path):
    from benchmarks.plain_vllm import stop, wait_http
    from serve_rft.buffer.redis_server import free_port

    cfg = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    port = free_port()
    cfg["http_options"]["port"] = port
    app = cfg["applications"][0]
    app["args"]["config"] = str(ROOT / app["args"]["config"])
    app["args"]["overrides"] = [f"buffer.redis_url={redis_server.url}", f"service.run_dir={tmp_path / 'run'}",
                                "buffer.key_prefix=serve-run", "trainer.min_batch_size=4",
                                "trainer.batch_wait_s=0.5"]
    app["deployments"][0]["num_replicas"] = 1  # the file's count rules; the run config says 2
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(cfg))
    serve = Path(sys.executable).parent / "serve"
    log = open(tmp_path / "serve-run.log", "w")
    proc = subprocess.Popen([str(serve), "run", str(config_path), "--app-dir", str(ROOT)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "RAY_SERVE_ENABLE_HA_PROXY": "0", **KEYS})
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

"""Start and stop the whole stack in the foreground: redis-server, Ray, Serve, the actors.

`ServiceStack` is a context manager used by ``serve-rft up`` and ``serve-rft demo``; it ends
everything it started (Serve, the local Ray cluster, redis-server by pid) on exit.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import httpx

from serve_rft.buffer.redis_server import RedisServer, free_port, start_redis
from serve_rft.config import Config
from serve_rft.model.embedded import resolve_model_path

log = logging.getLogger("serve_rft.service")


class ServiceStack:
    """The running service. Attributes after ``__enter__``: ``url``, ``model_path``, ``config``."""

    def __init__(self, cfg: Config):
        self.cfg = cfg.model_copy(deep=True)
        self.redis: RedisServer | None = None
        self.url = ""
        self.model_path: Path | None = None
        self.started_ray = False
        self.startup_seconds = 0.0
        self.ray_address = ""

    def __enter__(self) -> "ServiceStack":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self) -> None:
        from serve_rft.service.app import preflight

        t0 = time.monotonic()
        cfg = self.cfg
        preflight(cfg)  # before anything starts
        run_dir = Path(cfg.service.run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.service.run_dir = str(run_dir)
        self.model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        if not cfg.buffer.redis_url:
            self.redis = start_redis(run_dir / "redis")
            cfg.buffer.redis_url = self.redis.url
        if cfg.service.port == 0:
            cfg.service.port = free_port(cfg.service.host)

        import ray
        from ray import serve

        from serve_rft.service.app import APP_NAME, build_app

        if not ray.is_initialized():
            if cfg.service.ray_address:
                ray.init(address=cfg.service.ray_address, log_to_driver=False)
            else:
                # address="local": always a new cluster, never one another process started
                ray.init(address="local", num_cpus=cfg.service.ray_num_cpus, include_dashboard=False,
                         log_to_driver=False, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
                self.started_ray = True
        self.ray_address = ray.get_runtime_context().gcs_address
        serve.start(http_options={"host": cfg.service.host, "port": cfg.service.port})
        app = build_app(cfg, self.model_path)
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        self.url = f"http://{cfg.service.host}:{cfg.service.port}"
        self._wait_healthy(timeout_s=600)
        self.startup_seconds = time.monotonic() - t0

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        admin = self.cfg.service.admin_keys
        headers = {"Authorization": f"Bearer {admin[0]}"} if admin else {}
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.url}/v1/status", timeout=5, headers=headers)
                if r.status_code == 200:
                    st = r.json()
                    running = [x for x in st["replicas"] if x["state"] == "RUNNING"]
                    if len(running) >= self.cfg.explorer.num_replicas:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"service at {self.url} not healthy after {timeout_s} s")

    def stop(self) -> None:
        """Shut down Serve and the actors, the Ray cluster we started, and our redis-server."""
        try:
            import ray

            if ray.is_initialized():
                from ray import serve

                try:
                    serve.shutdown()
                finally:
                    for name in ("serve_rft_trainer", "serve_rft_synchronizer"):
                        try:
                            ray.kill(ray.get_actor(name, namespace="serve_rft"))
                        except ValueError:
                            pass
                    if self.started_ray:
                        ray.shutdown()
        finally:
            if self.redis is not None:
                self.redis.stop()
                self.redis = None


def wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM."""
    got = []

    def handler(signum, _frame):
        got.append(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    while not got:
        signal.pause() if hasattr(signal, "pause") else time.sleep(1)


def quiet_env() -> None:
    """Keep third-party progress bars and telemetry out of the terminal."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

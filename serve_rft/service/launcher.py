"""Start and stop the stack in the foreground: redis-server, Ray, Serve, the actors.

`ServiceStack` is a context manager used by ``serve-rft up`` and ``serve-rft demo``; it ends
everything it started (Serve, the local Ray cluster, redis-server by pid) on exit.

Modes (the Trinity-RFT technical report (Pan et al., 2025) §2.1: online / train-only, as roles of one service):

- ``both`` (default): explorers, store, synchronizer and trainer.
- ``serve``: explorers, store and synchronizer; experiences and rewards are collected, nothing
  is trained. A trainer can join later (``train`` with ``service.ray_address``).
- ``train``: trainer and synchronizer only, against an existing store: ``buffer.redis_url``, or
  the embedded redis-server restarted on ``run_dir/redis`` (its AOF holds what an earlier run
  collected). With ``service.ray_address`` of a running ``serve`` stack it joins that cluster,
  and the replicas there sync to the versions it publishes; without, it trains offline. The URL
  that stack printed has no password; the one of its embedded redis-server is read from
  ``run_dir/redis/password`` (`serve_rft.buffer.redis_auth.embedded_url`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Callable

import httpx

from serve_rft.buffer.redis_auth import embedded_url
from serve_rft.buffer.redis_server import RedisSupervisor, free_port
from serve_rft.config import Config
from serve_rft.config.service import check_exposure
from serve_rft.names import SYNCHRONIZER_NAME, TRAINER_NAME, find_actor, get_trainer
from serve_rft.service.haproxy_home import haproxy_folder, home_env
from serve_rft.service.ingress import (DRAIN_ENV, HAPROXY_FLAG, haproxy_env, haproxy_node_dirs,
                                      remove_dead_haproxy_dirs)
from serve_rft.service.ray_start import init_local_ray
from serve_rft.model.embedded import resolve_model_path

log = logging.getLogger("serve_rft.service")


MODES = ("both", "serve", "train")

# The GCS keeps kilobytes of task events per Ray task (every actor call, Ray Serve's own included)
# up to RAY_task_events_max_num_task_in_gcs tasks, 100,000 by default: hundreds of MiB that a
# long-running service reaches after hours. Task events feed only Ray's task list / dashboard,
# which `serve-rft up` does not start, so its Ray's workers record none (report interval 0;
# benchmarks/gcs_task_events.py measures both). An operator who sets the interval gets the 10,000 cap with it.
TASK_EVENTS_ENV = {"RAY_task_events_report_interval_ms": "0", "RAY_task_events_max_num_task_in_gcs": "10000"}


class ServiceStack:
    """The running service. Attributes after ``__enter__``: ``url`` (empty in ``train`` mode),
    ``model_path``, ``config``, ``ray_address``. ``cfg.buffer.redis_url`` carries the embedded
    redis-server's password: show it only through `serve_rft.buffer.redis_auth.redacted`.

    Raises:
        ValueError: an unknown ``mode``; on entry, a configuration that cannot run here
            (`serve_rft.control.preflight`) or that would serve with no keys on a non-loopback
            ``service.host`` (`serve_rft.config.service.check_exposure`).
    """

    def __init__(self, cfg: Config, mode: str = "both", progress: Callable[[str], None] | None = None):
        """``progress`` is told, in words, what start-up is doing or waiting for (the CLI shows it)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self.cfg = cfg.model_copy(deep=True)
        if mode == "serve":
            self.cfg.trainer.enabled = False
        self.redis: RedisSupervisor | None = None
        self.url = ""
        self.model_path: Path | None = None
        self.home_env_set: list[str] = []  # HAProxy folder settings this run put in os.environ
        self.started_ray = False
        self.haproxy_dirs: set[Path] = set()  # Ray's HAProxy folders of the node this process started
        self.haproxy_home: Path | None = None  # the private folder holding them (haproxy_home.py)
        self.metrics_url = ""  # Ray's Prometheus endpoint when this process started Ray
        self.startup_seconds = 0.0
        self.ray_address = ""
        self.progress = progress or (lambda _msg: None)

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
        from serve_rft.control import preflight

        t0 = time.monotonic()
        cfg = self.cfg
        preflight(cfg)  # before anything starts
        if self.mode != "train":  # never open on a non-loopback address by accident (build_app
            check_exposure(cfg.service, cfg.service.host)  # checks Serve's bound host again and warns)
        run_dir = Path(cfg.service.run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.service.run_dir = str(run_dir)
        self.model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        check_mode(cfg, self.mode)
        if not cfg.buffer.redis_url:
            b = cfg.buffer
            self.progress(f"starting redis-server (data in {run_dir / 'redis'})")
            self.redis = RedisSupervisor(run_dir / "redis", appendfsync=b.durability,
                                         maxmemory_bytes=b.maxmemory_mb * 2**20 if b.maxmemory_mb else None,
                                         key_prefix=b.key_prefix)
            cfg.buffer.redis_url = self.redis.url  # with its password: never print or log it
        elif self.mode == "train":  # the redacted URL a serve run printed: its run dir's password
            cfg.buffer.redis_url = embedded_url(cfg.buffer.redis_url, run_dir / "redis")
        if cfg.service.port == 0:
            cfg.service.port = free_port(cfg.service.host)

        import ray
        from ray import serve

        from serve_rft.control import ensure_control, launch_training, start_training
        from serve_rft.service.app import APP_NAME, build_app

        if not ray.is_initialized():
            self.progress(f"starting Ray{' (joining ' + cfg.service.ray_address + ')' if cfg.service.ray_address else ''}")
            if cfg.service.ray_address:
                ray.init(address=cfg.service.ray_address, log_to_driver=False)
            else:
                # address="local": always a new cluster, never one another process started
                if cfg.service.metrics_port == 0:
                    cfg.service.metrics_port = free_port()
                for key, value in {**DRAIN_ENV, **TASK_EVENTS_ENV}.items():  # Ray's processes inherit it
                    os.environ.setdefault(key, value)
                if cfg.service.ingress == "haproxy":
                    for key, value in haproxy_env().items():
                        os.environ.setdefault(key, value)
                    # its files in a folder only this user enters; stats and exporter on service.host
                    self.haproxy_home = haproxy_folder(run_dir)
                    for key, value in home_env(self.haproxy_home, cfg.service.host, os.environ).items():
                        if key not in os.environ:  # this run's folder and wrapper: gone with it (stop)
                            os.environ[key] = value
                            self.home_env_set.append(key)
                    if gone := remove_dead_haproxy_dirs():
                        log.info("removed %d folders of HAProxy instances that no longer run", len(gone))
                else:
                    os.environ.pop(HAPROXY_FLAG, None)
                init_local_ray(ray.init, num_cpus=cfg.service.ray_num_cpus, include_dashboard=False,
                               log_to_driver=False, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
                               _metrics_export_port=cfg.service.metrics_port)
                self.started_ray = True
                self.metrics_url = f"http://127.0.0.1:{cfg.service.metrics_port}/metrics"
                if cfg.service.ingress == "haproxy":
                    self.haproxy_dirs = haproxy_node_dirs(ray.get_runtime_context().get_node_id())
        self.ray_address = ray.get_runtime_context().gcs_address
        if self.mode == "train":
            self.progress("starting the trainer (loading the policy model)")
            start_training(cfg, self.model_path)
        else:
            # the trainer loads the policy model while the replicas start their engines
            trainer_started = None
            if cfg.trainer.enabled:
                self.progress("starting the trainer (loading the policy model)")
                _, trainer_started = launch_training(cfg, self.model_path)
            else:
                ensure_control(cfg, self.model_path)
            self.progress(f"deploying {cfg.explorer.num_replicas} explorer replicas (each starts a vLLM engine)")
            serve.start(http_options={"host": cfg.service.host, "port": cfg.service.port})
            app = build_app(cfg, self.model_path)
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
            self.url = f"http://{cfg.service.host}:{cfg.service.port}"
            if trainer_started is not None:  # a trainer that cannot start fails `up` here, with its error
                ray.get(trainer_started)
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
                    self.progress(f"waiting for the replicas to serve: {len(running)} of "
                                  f"{self.cfg.explorer.num_replicas} running")
                    if len(running) >= self.cfg.explorer.num_replicas:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"service at {self.url} not healthy after {timeout_s} s")

    def stop(self) -> None:
        """Shut down Serve and the actors, the Ray cluster we started (with the folders Ray's
        HAProxy manager leaves, `serve_rft.service.ingress.haproxy_node_dirs`, and the private
        folder holding them, `serve_rft.service.haproxy_home`), and our
        redis-server; logs each phase's seconds (INFO)."""
        try:
            import ray

            if ray.is_initialized():
                from ray import serve

                # train mode in a joined cluster leaves Serve and the synchronizer to their owner
                # serve mode leaves a trainer that joined (a train process) to its owner
                owned = [] if self.mode == "serve" else [TRAINER_NAME]
                if self.mode != "train" or self.started_ray:
                    owned.append(SYNCHRONIZER_NAME)
                try:
                    if self.mode != "train":
                        with _timed("Serve"):
                            serve.shutdown()
                finally:
                    with _timed("the trainer and synchronizer actors"):
                        for name in owned:
                            actor = find_actor(name)
                            if actor is None:
                                continue
                            if name == TRAINER_NAME and self.cfg.trainer.loggers:
                                _finish_trackers(actor)
                            ray.kill(actor)
                    if self.started_ray:
                        with _timed("Ray"):
                            ray.shutdown()
                        for d in self.haproxy_dirs:
                            shutil.rmtree(d, ignore_errors=True)
                        if self.haproxy_home is not None:  # with the wrapper; the next start makes it again
                            shutil.rmtree(self.haproxy_home, ignore_errors=True)
                            link = Path(self.cfg.service.run_dir) / "haproxy"
                            if link.is_symlink():
                                link.unlink()
                        for key in self.home_env_set:  # a next start in this process names its own
                            os.environ.pop(key, None)
                        self.home_env_set.clear()
        finally:
            if self.redis is not None:
                with _timed("redis-server"):
                    self.redis.stop()
                self.redis = None


def _finish_trackers(trainer) -> None:
    """Let the trainer finish its experiment trackers' runs before it is killed
    (`serve_rft.trainer.actor.Trainer.close_trackers`), waiting at most
    ``2 * TRACKERS_CLOSE_S``; a trainer that is dead or stuck is killed without it."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from serve_rft.observability.trackers import TRACKERS_CLOSE_S

    try:
        ray.get(trainer.close_trackers.remote(), timeout=2 * TRACKERS_CLOSE_S)
    except (GetTimeoutError, RayActorError) as e:
        log.warning("the trainer's experiment trackers were not finished before it was stopped: %r", e)


@contextlib.contextmanager
def _timed(what: str):
    """Log (INFO) how many seconds the block that stops ``what`` took."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        log.info("stopped %s in %.1f s", what, time.monotonic() - t0)


def check_mode(cfg: Config, mode: str) -> None:
    """Refuse a mode that cannot work with ``cfg``.

    Raises:
        ValueError: ``train`` joining a running service (``service.ray_address``) without that
            service's ``buffer.redis_url`` (a second embedded redis-server on the same data
            directory would corrupt it); ``train`` offline (no ``ray_address``, so no replica
            will ever ask) with ``sync_style=explorer_driven``, which would never publish.
    """
    if mode != "train":
        return
    if cfg.service.ray_address and not cfg.buffer.redis_url:
        raise ValueError("--mode train joining a service (service.ray_address) needs that service's "
                         "buffer.redis_url (printed by its `serve-rft up`; for its embedded redis-server also "
                         "its service.run_dir, which holds that server's password)")
    if not cfg.service.ray_address and cfg.synchronizer.sync_style.value == "explorer_driven":
        raise ValueError("offline --mode train has no explorer to drive syncs (sync_style=explorer_driven): use "
                         "synchronizer.sync_style=fixed or trainer_driven")


def _token_auth_for_existing_cluster() -> None:
    """A cluster started by ``ray.init()`` / ``serve-rft up`` uses Ray's token auth with the token
    in ``~/.ray/auth_token``, but a driver joining it by address does not turn token auth on by
    itself (it fails with InvalidAuthToken). Turn it on when a token is available and the user
    has not chosen a mode (``RAY_AUTH_MODE``); for a new local cluster that is Ray's own default.
    Must run before ``import ray`` (Ray reads the mode once)."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or (
            Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def wait_for_signal(done: Callable[[], bool] | None = None, poll_s: float = 1.0) -> None:
    """Block until SIGINT, SIGTERM or SIGHUP, or until ``done()`` is true (checked every ``poll_s``)."""
    got = []

    def handler(signum, _frame):
        got.append(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)
    while not got and not (done is not None and done()):
        time.sleep(poll_s)


def trainer_status() -> dict:
    """The trainer actor's `Trainer.status` (connects through the current Ray driver).

    Raises:
        ValueError: no trainer actor exists.
    """
    import ray

    return ray.get(get_trainer().status.remote(), timeout=60)


def quiet_env() -> None:
    """Keep third-party progress bars and telemetry out of the terminal."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    _token_auth_for_existing_cluster()

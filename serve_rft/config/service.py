"""Settings of the service: ports, ingress, run directory, Ray, API keys, shutdown."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field

from serve_rft.config.base import StrictSection


def _env_list(name: str) -> list[str]:
    return [k.strip() for k in os.environ.get(name, "").split(",") if k.strip()]


class ServiceConfig(StrictSection):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="HTTP port; 0 picks a free one.")
    ingress: Literal["haproxy", "proxy"] = Field(
        "haproxy", description="Front door of a locally started Ray: haproxy = Ray Serve's HAProxy "
        "mode (requests go straight to a replica's own HTTP server; a draining replica's refusals are "
        "retried elsewhere), proxy = Ray Serve's Python proxy with DrainAwareRouter. A joined "
        "cluster keeps the mode it was started with (serve_rft/service/ingress.py).")
    run_dir: str = Field("runs/default", description="Checkpoints, redis data and logs live here.")
    ray_address: str | None = Field(None, description="Existing Ray cluster. None: start one.")
    ray_num_cpus: int = Field(8, ge=1, description="Logical CPUs of a locally started Ray.")
    shutdown_grace_s: float = Field(
        25.0, gt=0, description="After SIGINT / SIGTERM / SIGHUP, how long the service gets to stop "
        "(Serve drains, redis-server flushes) before the keeper of `serve-rft up` / `demo` ends its "
        "processes with SIGKILL; a second signal ends them at once, s (serve_rft/service/keeper.py).")
    metrics_port: int = Field(
        8080, ge=0, le=65535, description="Prometheus endpoint (/metrics) of a locally started Ray "
        "(Ray's metrics export port; 0 picks a free one). A joined cluster keeps its own.")
    api_keys: list[str] = Field(
        default_factory=lambda: _env_list("SERVE_RFT_API_KEYS"),
        description="Inference keys (chat, models). Empty and no admin_keys: no auth.")
    admin_keys: list[str] = Field(
        default_factory=lambda: _env_list("SERVE_RFT_ADMIN_KEYS"),
        description="Admin keys: rewards, experiences, status, and inference too.")

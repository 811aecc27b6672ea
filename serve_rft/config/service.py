"""Settings of the service: ports, ingress, run directory, Ray, API keys, shutdown; and the rule
that an exposed service is never open by accident (`check_exposure`)."""

from __future__ import annotations

import ipaddress
import os
from typing import Literal

from pydantic import Field

from serve_rft.config.base import StrictSection


def _env_list(name: str) -> list[str]:
    return [k.strip() for k in os.environ.get(name, "").split(",") if k.strip()]


class ServiceConfig(StrictSection):
    host: str = Field("127.0.0.1", description="Address the HTTP front door binds (serve-rft up). A "
                      "non-loopback address needs keys (api_keys / reward_keys / admin_keys) or "
                      "allow_unauthenticated: true.")
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
        description="Inference keys (env SERVE_RFT_API_KEYS, comma-separated): chat, completions, "
        "models. No keys of any kind: no auth (loopback only, see allow_unauthenticated).")
    reward_keys: list[str] = Field(
        default_factory=lambda: _env_list("SERVE_RFT_REWARD_KEYS"),
        description="Reward keys (env SERVE_RFT_REWARD_KEYS): POST /v1/rewards and nothing else.")
    admin_keys: list[str] = Field(
        default_factory=lambda: _env_list("SERVE_RFT_ADMIN_KEYS"),
        description="Admin keys (env SERVE_RFT_ADMIN_KEYS): every route (rewards, experiences, "
        "status, sync operations, /docs and /openapi.json) and inference too.")
    allow_unauthenticated: bool = Field(
        False, description="Serve with no keys on a non-loopback address (anyone who reaches the port "
        "may chat, post rewards, pin, roll back and read every experience). Without it such a start "
        "is refused; with it every start logs a warning.")

    @property
    def has_keys(self) -> bool:
        """Whether any key of any scope is configured (auth is on)."""
        return any(k for k in (*self.api_keys, *self.reward_keys, *self.admin_keys))


def is_loopback(host: str | None) -> bool:
    """Whether an HTTP server bound to ``host`` is reachable from this machine only:
    127.0.0.0/8, ::1 or ``localhost``. ``0.0.0.0``, ``::``, an empty or None host (every
    interface) and any other name or address are not."""
    if not host:
        return False
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_exposure(service: ServiceConfig, host: str | None) -> str | None:
    """Fail closed: refuse to serve on ``host`` (the address the HTTP servers actually bind)
    when it is not loopback and no key is configured, unless ``service.allow_unauthenticated``.

    Returns:
        None, or the warning to log at this start (exposed and open by explicit choice).
    Raises:
        ValueError: exposed with no keys and no ``allow_unauthenticated`` (a one-line message).
    """
    if service.has_keys or is_loopback(host):
        return None
    if not service.allow_unauthenticated:
        raise ValueError(
            f"refusing to serve on {host or 'every interface'} with no API keys: set SERVE_RFT_API_KEYS / "
            "SERVE_RFT_REWARD_KEYS / SERVE_RFT_ADMIN_KEYS (or service.*_keys), bind 127.0.0.1, or set "
            "service.allow_unauthenticated=true to serve openly on purpose")
    return (f"SERVING WITHOUT AUTHENTICATION on {host or 'every interface'} "
            "(service.allow_unauthenticated=true): anyone who reaches this port may chat, post rewards, "
            "pin, roll back, drain and read every experience")

"""What a replica's process reads of its front door: Ray Serve's HAProxy mode or its Python proxy.

The mode is a property of the Ray cluster's processes' environment, set by the launcher
(`serve_rft.service.ingress`) or by ``ray start``'s environment. A draining replica refuses a new
chat request (503) only where HAProxy re-sends it to another replica; otherwise it holds it until
its weights are loaded (`serve_rft.explorer.weight_swap`).
"""

from __future__ import annotations

import os

HAPROXY_FLAG = "RAY_SERVE_ENABLE_HA_PROXY"


def haproxy_enabled() -> bool:
    """True when this process's Ray Serve runs in HAProxy mode (the same test Ray applies to
    ``RAY_SERVE_ENABLE_HA_PROXY`` in ray.serve._private.constants)."""
    return os.environ.get(HAPROXY_FLAG, "0") == "1"


def refusals_are_retried() -> bool:
    """True when this process runs behind HAProxy that re-sends a refused request to another
    replica: ``RAY_SERVE_HAPROXY_RETRY_ON`` holds ``503`` (or ``all-retryable-errors``) and
    ``option http-buffer-request`` (`serve_rft.service.ingress.RETRY_ON`). Only then may a draining replica refuse a
    request; otherwise it holds it until its weights are loaded."""
    words = os.environ.get("RAY_SERVE_HAPROXY_RETRY_ON", "conn-failure").split()
    retries_503 = "503" in words or "all-retryable-errors" in words
    return haproxy_enabled() and retries_503 and "http-buffer-request" in words

"""What a replica's process reads of its front door: Ray Serve's HAProxy mode or its Python proxy.

The mode is a property of the Ray cluster's processes' environment, set by the launcher
(`serve_rft.service.ingress`) or by ``ray start``'s environment. A draining replica refuses a new
chat request (503) only where HAProxy re-sends it to another replica; otherwise it holds it until
its weights are loaded (`serve_rft.explorer.weight_swap`). HAProxy re-sends only a request it
holds whole in one buffer (`fits_a_retry`): a larger one is held, or served during an operator's
drain, never refused.
"""

from __future__ import annotations

import os

HAPROXY_FLAG = "RAY_SERVE_ENABLE_HA_PROXY"
BUFSIZE_ENV, DEFAULT_BUFSIZE = "RAY_SERVE_HAPROXY_TUNE_BUFSIZE", 16384  # Ray's default tune.bufsize
REQUEST_ID_HEADER = "x-serve-rft-request-id"
"""HAProxy's ``unique-id-header`` (`serve_rft.service.ingress.RETRY_ON`): one id per client request,
the same on every re-send of it."""


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


def retry_capacity_bytes() -> int:
    """The largest request (bytes: request line, headers and body) this replica counts on HAProxy
    re-sending: half its ``tune.bufsize`` (``RAY_SERVE_HAPROXY_TUNE_BUFSIZE``, Ray's default
    16,384). HAProxy re-sends (L7 retry) only a request that was whole in its buffer, less the
    space it reserves for rewrites (``tune.maxrewrite``) and its HTX bookkeeping (HAProxy's
    configuration manual, ``retry-on``); half leaves room for both.

    Raises:
        ValueError: the variable is set but not an integer.
    """
    return int(os.environ.get(BUFSIZE_ENV, DEFAULT_BUFSIZE)) // 2


def head_bytes(method: str, target: str, headers) -> int:
    """About what HAProxy holds of a request besides its body: the request line (``method``, the
    path and query ``target``) and each ``(name, value)`` of ``headers`` with its separators."""
    return len(method) + len(target) + 16 + sum(len(k) + len(v) + 4 for k, v in headers)


def fits_a_retry(content_length: str | None, header_bytes: int) -> bool:
    """Whether HAProxy could re-send this request if a draining replica refused it.

    Args:
        content_length: the request's ``Content-Length`` header, None when it has none (a chunked
            body: its size is unknown until read, so it is not counted on).
        header_bytes: the request line and headers as received, bytes.
    Returns:
        True when the whole request fits `retry_capacity_bytes`; False for a malformed length.
    """
    if content_length is None or not content_length.isdigit():
        return False
    return int(content_length) + header_bytes <= retry_capacity_bytes()


def haproxy_request_id(values: list[str]) -> str | None:
    """The id HAProxy gave this request, from the `REQUEST_ID_HEADER` values in order. HAProxy
    appends its own after any a client sent, so the last one counts (a client that sends the
    header only makes its own request held rather than refused: nothing is lost)."""
    return values[-1] if values else None

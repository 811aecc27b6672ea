"""A real Prometheus for a test: Debian's ``prometheus`` binary with the shipped scrape config
(deployments/observability/prometheus.yml) pointed at one metrics URL and the shipped alert
rules, a temporary data dir, a free port; ended by its pid."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import yaml

from serve_rft.buffer.redis_server import free_port
from tests.support.promql import ALERTS, SCRAPE_CONFIG, alert_rules, dashboard_queries, resolve, selectors

NOT_INSTALLED = "prometheus not installed (scripts/bootstrap.sh installs Debian's prometheus package)"


class Prometheus:
    """A running Prometheus: its HTTP API at ``api``, its log at ``log_path``."""

    def __init__(self, proc: subprocess.Popen, api: str, log_path: Path):
        self.proc, self.api, self.log_path = proc, api, log_path

    def query(self, expr: str) -> list[dict]:
        """``/api/v1/query`` at now: the result vector (asserts the query was accepted)."""
        r = httpx.get(f"{self.api}/query", params={"query": expr}, timeout=30).json()
        assert r["status"] == "success", (expr, r)
        return r["data"]["result"]

    def rules(self) -> list[dict]:
        """Every rule of ``/api/v1/rules`` (name, health, lastError, lastEvaluation, ...)."""
        groups = httpx.get(f"{self.api}/rules", timeout=30).json()["data"]["groups"]
        return [r for g in groups for r in g["rules"]]

    def wait_for(self, what: str, check, timeout_s: float = 60.0):
        """``check()``'s first truthy answer, polled every second.

        Raises:
            AssertionError: Prometheus exited, or nothing truthy within ``timeout_s`` (its log's tail).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if got := check():
                    return got
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            time.sleep(1)
        raise AssertionError(f"{what} not within {timeout_s} s: {self.log_path.read_text()[-3000:]}")


@contextlib.contextmanager
def running_prometheus(metrics_url: str, tmp: Path, interval_s: int = 3):
    """Yield a `Prometheus` scraping ``metrics_url`` every ``interval_s`` and evaluating the
    shipped rules as often, after its first scrape of a ``ray_serve_rft_`` series."""
    binary = shutil.which("prometheus")
    assert binary, NOT_INSTALLED
    cfg = yaml.safe_load(SCRAPE_CONFIG.read_text())
    every = f"{interval_s}s"
    cfg["global"] = {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every}
    cfg["rule_files"] = [str(ALERTS)]
    (job,) = cfg["scrape_configs"]
    url = urlsplit(metrics_url)
    job["static_configs"] = [{"targets": [url.netloc]}]
    job["metrics_path"] = url.path or "/metrics"
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    log_path = tmp / "prometheus.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'prometheus-data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
        prom = Prometheus(proc, f"http://127.0.0.1:{port}/api/v1", log_path)
        try:
            prom.wait_for("Prometheus ready", lambda: httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=5).status_code == 200)
            prom.wait_for("the first scrape", lambda: prom.query('count({__name__=~"ray_serve_rft_.+"})'))
            yield prom
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


NEEDS_AN_EVENT = {
    "ray_serve_rft_trainer_skipped_steps_total": "a skipped step (a non-finite update or a gradient-norm spike)",
    "ray_serve_rft_sync_failures_total": "a failed weight load",
    "ray_serve_rft_throttled_total": "a quota refusal (the test stacks set no quotas)",
    "ray_serve_rft_quota_unchecked_total": "quotas set and Redis away",
    'ray_serve_rft_experiences_unlogged_total{reason="store_full"}': "Redis past its maxmemory",
    'ray_serve_rft_experiences_done_total{state="backlog_dropped"}': "the ready stream past buffer.max_ready",
}
"""Series a healthy stack does not export, and the event each needs: Ray exports a counter from
its first event, a labelled series from its first use. A dashboard query or alert that reads one
may find no data on a test stack (the alerts fire in their `promtool test rules` cases,
tests/unit/test_observability.py)."""
REQUEST_SERIES = ("ray_serve_rft_request", "time_to_first_token", "ray_serve_rft_tokens_total")
"""Dashboard queries over these read the traffic a test sent within the window: a number, not NaN."""


def _needs(expr: str) -> list[str]:
    return [why for name, braces in selectors(expr) for sel, why in NEEDS_AN_EVENT.items()
            if sel in (name, name + braces)]


def check_pack(prom: Prometheus) -> None:
    """Every dashboard query returns data carrying the labels it groups by (those over
    `REQUEST_SERIES` a number); every alert expression is accepted, every series it reads has
    data, every rule evaluates without error; only what reads `NEEDS_AN_EVENT` may be empty."""
    empty, unlabelled, nan = [], [], []
    for where, expr in dashboard_queries():
        result = prom.query(resolve(expr))
        if not result:
            if not _needs(expr):
                empty.append((where, expr))
            continue
        by = re.search(r"\bby\s*\(([^)]*)\)", expr)
        for label in ({x.strip() for x in by.group(1).split(",")} - {"le", ""}) if by else ():
            if not all(s["metric"].get(label) for s in result):
                unlabelled.append((where, label, result[:2]))
        if any(k in expr for k in REQUEST_SERIES) and all(s["value"][1] == "NaN" for s in result):
            nan.append((where, expr))
    assert not empty, f"dashboard queries without data: {empty}"
    assert not unlabelled, unlabelled
    assert not nan, f"request queries without the traffic sent: {nan}"

    missing = []
    for rule in alert_rules():
        prom.query(rule["expr"])  # accepted (a healthy stack fires none: empty)
        for name, braces in selectors(rule["expr"]):
            if not prom.query(name + braces) and not _needs(name + braces):
                missing.append((rule["alert"], name + braces))
    assert not missing, f"series the alerts read without data: {missing}"

    def evaluated():
        rules = prom.rules()
        return rules if rules and all(r["lastEvaluation"] > "2000" for r in rules) else None
    rules = prom.wait_for("a rule evaluation", evaluated, 30)
    assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}, rules
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]

"""The observability pack (deployments/observability/): the Grafana dashboard and the alert
rules name only metrics and labels the code defines; the rules and the scrape config pass
Prometheus' own checks (`promtool check`), and each alert fires on the series that mean trouble
and stays quiet on healthy ones (`promtool test rules`, tests/unit/prometheus/alerts_test.yml);
the metrics page lists every metric the code defines with its type and labels. That every
query and alert evaluates against a real stack scraped by a real Prometheus:
tests/integration/test_stack_canary.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from tests.support.promql import (
    ALERTS, DASHBOARD, RAY_LABELS, RAY_PREFIX, ROOT, SCRAPE_CONFIG, alert_rules, dashboard_queries,
    defined_metrics, grouping_labels, matchers, selectors, vllm_metric_defined)

PROMTOOL = shutil.which("promtool")
NO_PROMTOOL = "promtool not installed (scripts/bootstrap.sh installs Debian's prometheus package)"
# promtool is part of the install (scripts/bootstrap.sh): without it the checks below fail, never skip
METRICS_PAGE = ROOT / "docs" / "operations" / "metrics.md"
VLLM_LABELS = {"ReplicaId", "model_name", "engine", "le"}
NOT_METRICS = {"serve_rft_trainer", "serve_rft_synchronizer"}  # actor names the page may mention


def _all_queries() -> list[tuple[str, str]]:
    return [*dashboard_queries(), *((f"alert {r['alert']}", r["expr"]) for r in alert_rules())]


def test_the_code_defines_one_metric_per_quantity_with_prometheus_names():
    """Names follow Prometheus' guide: counters end in _total and only they do; every name is
    serve_rft_ snake case; no label is a catch-all ``stat`` over unrelated quantities."""
    defined = defined_metrics()
    assert len(defined) > 40, sorted(defined)
    for d in defined.values():
        assert re.fullmatch(r"serve_rft_[a-z0-9_]+", d.name), d.name
        assert d.name.endswith("_total") == (d.kind == "counter"), d
        assert "stat" not in d.tag_keys, d
        assert d.description, d
    assert {"serve_rft_trainer_loss", "serve_rft_trainer_learning_rate", "serve_rft_trainer_grad_norm",
            "serve_rft_trainer_approx_kl", "serve_rft_trainer_reward_mean", "serve_rft_trainer_skipped_steps_total",
            "serve_rft_store_experiences", "serve_rft_experiences_done_total"} <= set(defined)
    assert "serve_rft_trainer_stat" not in defined and "serve_rft_experiences" not in defined


def test_every_dashboard_and_alert_query_names_defined_metrics_and_labels():
    """Each series a query reads is exported by a metric the code defines (or by vLLM, whose
    source is read), each label it matches or groups by is one of that metric's tags or one Ray
    adds. Shown to fail with a dashboard query renamed to ray_serve_rft_trainer_stat."""
    defined = defined_metrics()
    exported = {series: d for d in defined.values() for series in d.exported()}
    problems = []
    for where, expr in _all_queries():
        names = selectors(expr)
        assert names, (where, expr)
        tags: set[str] = set()
        for name, braces in names:
            if name.startswith(RAY_PREFIX + "vllm_"):
                if not vllm_metric_defined(name):
                    problems.append((where, name, "not a vLLM metric"))
                tags |= VLLM_LABELS
                for label, _, _ in matchers(braces):
                    if label not in VLLM_LABELS | RAY_LABELS:
                        problems.append((where, name, f"label {label}"))
                continue
            d = exported.get(name)
            if d is None:
                problems.append((where, name, "not defined by serve_rft.observability"))
                continue
            tags |= set(d.tag_keys) | ({"le"} if d.kind == "histogram" else set())
            for label, _, _ in matchers(braces):
                if label not in set(d.tag_keys) | RAY_LABELS:
                    problems.append((where, name, f"label {label} is not a tag of {d.name}"))
        for label in grouping_labels(expr) - tags - RAY_LABELS:
            problems.append((where, expr, f"groups by {label}, a tag of none of its metrics"))
    assert not problems, problems


def test_the_dashboard_is_a_grafana_dashboard_over_a_prometheus_datasource():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), ids
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]
    titles = {p["title"] for p in dash["panels"]}
    for wanted in ("Requests", "Error ratio", "Time to first token (streaming)", "Replicas serving vs live",
                   "Policy version per replica", "Version lag", "Sync seconds by phase",
                   "Experiences in the store by state", "Loss and reward", "Canary verdicts"):
        assert wanted in titles, wanted
    for p in dash["panels"]:
        for t in p.get("targets", []):
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and t["refId"], (p["title"], t)


def test_promtool_checks_the_rules_and_the_scrape_config():
    assert PROMTOOL, NO_PROMTOOL
    for args in (["check", "rules", str(ALERTS)], ["check", "config", str(SCRAPE_CONFIG)]):
        r = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_fires_on_trouble_and_not_before():
    """`promtool test rules`: each alert quiet, then firing with its annotations rendered."""
    assert PROMTOOL, NO_PROMTOOL
    cases = ROOT / "tests" / "unit" / "prometheus" / "alerts_test.yml"
    tested = set(re.findall(r"alertname: (\w+)", cases.read_text()))
    assert tested == {r["alert"] for r in alert_rules()}, tested
    r = subprocess.run([PROMTOOL, "test", "rules", cases.name], cwd=cases.parent, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_metrics_page_lists_every_metric_with_its_type_and_labels():
    """docs/operations/metrics.md's tables: one row per metric the code defines (name, type,
    labels), and no serve_rft metric the code does not define."""
    rows = {}
    for line in METRICS_PAGE.read_text().splitlines():
        m = re.match(r"\|\s*`(serve_rft_[a-z0-9_]+)`\s*\|\s*(\w+)\s*\|([^|]*)\|", line)
        if m:
            rows[m.group(1)] = (m.group(2), tuple(re.findall(r"`([A-Za-z_]+)`", m.group(3))))
    defined = defined_metrics()
    want = {d.name: (d.kind, d.tag_keys) for d in defined.values()}
    assert rows == want, {"missing": sorted(set(want) - set(rows)), "extra": sorted(set(rows) - set(want)),
                          "differ": {k: (rows[k], want[k]) for k in set(rows) & set(want) if rows[k] != want[k]}}
    mentioned = set(re.findall(r"\bserve_rft_[a-z0-9_]+", METRICS_PAGE.read_text()))
    series = {s[len(RAY_PREFIX):] for d in defined.values() for s in d.exported()}
    unknown = mentioned - set(defined) - series - NOT_METRICS
    assert not unknown, sorted(unknown)


class _Recorded:
    """Stands in for Ray's metric types: keeps each series' value (counters add, gauges set)."""

    values: dict = {}

    def __init__(self, name, description="", tag_keys=None, boundaries=None):
        self.name = name

    def _key(self, tags):
        return (self.name, tuple(sorted((tags or {}).items())))

    def inc(self, value=1.0, tags=None):
        assert value > 0  # as Ray's Counter.inc requires
        _Recorded.values[self._key(tags)] = _Recorded.values.get(self._key(tags), 0) + value

    def set(self, value, tags=None):
        _Recorded.values[self._key(tags)] = value

    def observe(self, value, tags=None):
        pass


def test_the_store_counters_follow_the_stores_totals(monkeypatch):
    """The first read counts the store's totals since it was created (a restarted synchronizer
    continues the series); later reads count what they grew by; a total that falls (an entry
    put back) is not counted again until it passes its highest value."""
    from serve_rft.buffer.records import StoreCounts
    from serve_rft.observability import store_metrics

    monkeypatch.setattr(store_metrics, "Counter", _Recorded)
    monkeypatch.setattr(store_metrics, "Gauge", _Recorded)
    monkeypatch.setattr(_Recorded, "values", {})
    m = store_metrics.StoreMetrics()

    def counts(**kw):
        base = dict(pending=0, held=0, ready=0, logged=0, rewarded=0, trained=0, expired=0, stale_dropped=0,
                    groups_timed_out=0)
        return StoreCounts(**{**base, **kw})

    m.counts(counts(pending=5, held=1, ready=3, rewarded=10, trained=6, backlog_dropped=2))
    m.counts(counts(pending=2, held=0, ready=4, rewarded=14, trained=9, backlog_dropped=1))
    m.counts(counts(pending=2, held=0, ready=4, rewarded=14, trained=9, backlog_dropped=3))
    v = _Recorded.values
    assert v[("serve_rft_store_experiences", (("state", "pending"),))] == 2
    assert v[("serve_rft_store_experiences", (("state", "ready"),))] == 4
    assert v[("serve_rft_experiences_rewarded_total", ())] == 14
    assert v[("serve_rft_experiences_done_total", (("state", "trained"),))] == 9
    assert v[("serve_rft_experiences_done_total", (("state", "backlog_dropped"),))] == 3
    assert ("serve_rft_experiences_done_total", (("state", "expired"),)) not in v  # no zero counter
    assert ("serve_rft_redis_restarts_total", ()) not in v


def test_the_version_lag_is_the_age_of_the_oldest_promoted_version_not_everywhere(monkeypatch):
    from serve_rft.config import SynchronizerConfig
    from serve_rft.observability import sync_metrics
    from serve_rft.synchronizer.state import SyncState

    for kind in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(sync_metrics, kind, _Recorded)
    monkeypatch.setattr(_Recorded, "values", {})
    m = sync_metrics.SyncMetrics("checkpoint")
    state = SyncState(SynchronizerConfig(max_version_lag_s=12.0))
    m.refresh(state, now=100.0)
    assert _Recorded.values[("serve_rft_version_lag_seconds", ())] == 0.0
    assert _Recorded.values[("serve_rft_max_version_lag_seconds", ())] == 12.0
    state.rollout.lag_open.update({3: 90.0, 4: 97.0})  # promoted at 90 s and 97 s, not everywhere yet
    m.refresh(state, now=100.0)
    assert _Recorded.values[("serve_rft_version_lag_seconds", ())] == 10.0
    state.rollout.pinned = 0  # an operator's pin holds the replicas: no lag to report
    m.refresh(state, now=100.0)
    assert _Recorded.values[("serve_rft_version_lag_seconds", ())] == 0.0

"""The shipped Prometheus artefacts (deployments/observability/) and what the code defines, for
the observability tests (tests/unit/test_observability.py, the real-Prometheus test in
tests/integration/test_stack_canary.py).

`defined_metrics` builds every metrics class of `serve_rft.observability` with Ray's metric
types replaced by recorders, so the names are the code's own, not a list kept beside it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import yaml

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "deployments" / "observability"
DASHBOARD = OBSERVABILITY / "grafana_dashboard.json"
ALERTS = OBSERVABILITY / "alerts.yml"
SCRAPE_CONFIG = OBSERVABILITY / "prometheus.yml"
RAY_PREFIX = "ray_"
RAY_LABELS = frozenset({"Component", "NodeAddress", "SessionName", "Version", "WorkerId", "JobId", "instance", "job"})
"""Labels Ray's exporter (and Prometheus' scrape) add to every series."""
GRAFANA_RANGES = {"$__rate_interval": "2m", "$__interval": "15s", "$__range": "1h"}


@dataclass(frozen=True)
class Defined:
    """One metric as the code defines it: ``kind`` counter / gauge / histogram, its tag keys."""

    name: str
    kind: str
    tag_keys: tuple[str, ...]
    description: str

    def exported(self) -> set[str]:
        """Its series names as Ray's Prometheus endpoint exports them."""
        base = RAY_PREFIX + self.name
        if self.kind == "histogram":
            return {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
        return {base}


def defined_metrics() -> dict[str, Defined]:
    """Every metric the classes of `serve_rft.observability` define, by name."""
    from serve_rft.observability import explorer_metrics, store_metrics, sync_metrics, trainer_metrics

    found: dict[str, Defined] = {}

    def recorder(kind: str):
        class Recorder:
            def __init__(self, name, description="", tag_keys=None, boundaries=None):
                found[name] = Defined(name, kind, tuple(tag_keys or ()), description)

            def __getattr__(self, _name):
                return lambda *a, **k: None
        return Recorder

    modules = (explorer_metrics, store_metrics, sync_metrics, trainer_metrics)
    with mock.patch.multiple(explorer_metrics, Counter=recorder("counter"), Gauge=recorder("gauge"),
                             Histogram=recorder("histogram")), \
            mock.patch.multiple(sync_metrics, Counter=recorder("counter"), Gauge=recorder("gauge"),
                                Histogram=recorder("histogram")), \
            mock.patch.multiple(trainer_metrics, Counter=recorder("counter"), Gauge=recorder("gauge"),
                                Histogram=recorder("histogram")), \
            mock.patch.multiple(store_metrics, Counter=recorder("counter"), Gauge=recorder("gauge")):
        explorer_metrics.ExplorerMetrics("r0")
        sync_metrics.SyncMetrics("checkpoint")
        trainer_metrics.TrainerMetrics()
        store_metrics.StoreMetrics()
    assert all(m.__name__.startswith("serve_rft.observability.") for m in modules)
    return found


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title / refId, PromQL) of every target of the Grafana dashboard, Grafana's range
    variables as written."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for t in panel.get("targets", []):
            out.append((f"{panel['title']} / {t['refId']}", t["expr"]))
    return out


def alert_rules() -> list[dict]:
    """Every rule of the shipped alert rules file."""
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def resolve(expr: str) -> str:
    """``expr`` with Grafana's range variables replaced (as Grafana would, roughly)."""
    for var, value in GRAFANA_RANGES.items():
        expr = expr.replace(var, value)
    return expr


SELECTOR = re.compile(r"\b((?:ray_)[A-Za-z0-9_:]+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
BY = re.compile(r"\b(?:by|on|ignoring|without)\s*\(([^)]*)\)")


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, ``{matchers}`` or "") of every vector selector in ``expr``."""
    return [(m.group(1), m.group(2) or "") for m in SELECTOR.finditer(expr)]


def matchers(braces: str) -> list[tuple[str, str, str]]:
    """(label, operator, value) of a ``{...}`` selector body."""
    return MATCHER.findall(braces)


def grouping_labels(expr: str) -> set[str]:
    """Labels named in ``by`` / ``on`` / ``ignoring`` / ``without`` clauses."""
    return {x.strip() for m in BY.finditer(expr) for x in m.group(1).split(",") if x.strip()}


def vllm_metric_defined(series: str) -> bool:
    """Whether ``series`` (``ray_vllm_...``, a histogram's ``_bucket`` / ``_sum`` / ``_count``
    too) names a metric vLLM's installed source defines (``"vllm:..."``), read, not imported."""
    import importlib.util

    name = series[len(RAY_PREFIX + "vllm_"):]
    root = Path(importlib.util.find_spec("vllm").origin).parent / "v1" / "metrics"
    text = "".join(p.read_text() for p in root.rglob("*.py"))
    candidates = {name} | {name[: -len(s)] for s in ("_bucket", "_sum", "_count") if name.endswith(s)}
    return any(f'"vllm:{c}"' in text for c in candidates)

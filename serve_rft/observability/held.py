"""Gauges that stay exported for as long as their process lives.

Ray's metrics API exports a gauge's value only in the export interval after it was set: the
worker's recorder forgets a gauge's observations once the exporter has collected them
(``OpenTelemetryMetricRecorder::CollectGaugeMetricValues`` in Ray's
``src/ray/observability/open_telemetry_metric_recorder.cc``), and the dashboard agent drops a
series not refreshed within two export intervals (``_gauge_metric_ttl_s`` in
``ray/_private/telemetry/open_telemetry_metric_recorder.py``; the interval is
``max(metrics_report_interval_ms, 1 s)``, 10 s by default). So a gauge set once left Prometheus
about 20 s later: the last step's loss of a trainer with no traffic to train on, the arms of a
canary that closed, the replicas' versions on a quiet service.

`Gauge` is Ray's gauge that remembers each series' last value; one daemon thread per process sets
every held series again every `REFRESH_S`.
"""

from __future__ import annotations

import threading

from ray.util import metrics

REFRESH_S = 2.5
"""How often every held series is set again, s: a quarter of Ray's default export interval, so a
slower exporter (``metrics_report_interval_ms`` above 10 s) keeps the series too."""

_lock = threading.Lock()
_held: dict[tuple[int, tuple[tuple[str, str], ...]], tuple["Gauge", float, dict[str, str] | None]] = {}
_thread: threading.Thread | None = None


class Gauge(metrics.Gauge):
    """`ray.util.metrics.Gauge` whose series (one per tag set) are set again every `REFRESH_S` with
    their last value until the process ends. Same arguments and errors as Ray's."""

    def set(self, value: int | float | None, tags: dict[str, str] | None = None) -> None:
        """Set the series of ``tags`` to ``value`` and hold it there (None: Ray's no-op)."""
        super().set(value, tags)
        if value is None:
            return
        key = (id(self), tuple(sorted((tags or {}).items())))
        with _lock:
            _held[key] = (self, float(value), dict(tags) if tags else None)
        _start()

    def forget(self, tags: dict[str, str] | None = None) -> None:
        """Stop holding the series of ``tags`` (a replica that left): Prometheus drops it after
        Ray's two export intervals."""
        with _lock:
            _held.pop((id(self), tuple(sorted((tags or {}).items()))), None)


def refresh() -> int:
    """Set every held series again with its last value; the number of series set."""
    with _lock:
        series = list(_held.values())
    for gauge, value, tags in series:
        metrics.Gauge.set(gauge, value, tags)
    return len(series)


def _start() -> None:
    """Start the process's refresh thread once."""
    global _thread
    with _lock:
        if _thread is not None:
            return
        _thread = threading.Thread(target=_loop, name="serve-rft-held-gauges", daemon=True)
    _thread.start()


def _loop() -> None:
    stop = threading.Event()
    while not stop.wait(REFRESH_S):
        refresh()

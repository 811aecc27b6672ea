"""The `serve-rft status` view: tables built from ``GET /v1/status`` (pure functions, so they are
unit-testable), rates from the difference of two snapshots."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table

RATE_COUNTS = ("logged", "rewarded", "trained", "expired")


def rates(prev: dict[str, Any] | None, cur: dict[str, Any], seconds: float) -> dict[str, float | None]:
    """Per-second rates of the store counters and trainer steps between two ``/v1/status``
    snapshots ``seconds`` apart; None without a previous snapshot (or a counter reset)."""
    out: dict[str, float | None] = {}
    now_counts = cur.get("experiences") or {}  # None while the store is unavailable
    before = (prev.get("experiences") or {}) if prev is not None else {}
    for k in RATE_COUNTS:
        if not before or not now_counts or seconds <= 0:
            out[k] = None
            continue
        d = now_counts.get(k, 0) - before.get(k, 0)
        out[k] = d / seconds if d >= 0 else None
    if prev is None or seconds <= 0:
        out["steps"] = None
    else:
        d = cur["trainer"].get("step", 0) - prev["trainer"].get("step", 0)
        out["steps"] = d / seconds if d >= 0 else None
    return out


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(status: dict[str, Any], r: dict[str, float | None]) -> Group:
    """Three tables: replicas (state, version, explorer step, last sync, failures), the store
    (counts and rates /s), the trainer (state, step, steps/s, phase, staleness)."""
    rep = Table(title=f"policy version {status['policy_version']} · sync style {status['sync_style']}")
    for col in ("replica", "state", "version", "explorer step", "last sync s", "failures"):
        rep.add_column(col, justify="left" if col in ("replica", "state") else "right")
    latest = status["policy_version"]
    for x in status["replicas"]:
        state = x["state"]
        color = {"RUNNING": "green", "REQUIRE_SYNC": "yellow", "STOPPED": "red"}.get(state, "white")
        last = (x.get("last_sync") or {}).get("total_s")
        lag = latest - x["policy_version"]
        rep.add_row(x["id"][-12:], f"[{color}]{state}[/{color}]",
                    f"{x['policy_version']}" + (f" (-{lag})" if lag > 0 else ""),
                    str(x.get("explorer_step", "-")), _fmt(last, 2), str(x.get("failures", 0)))
    exp = status.get("experiences") or {}  # None while the store is unavailable
    store = Table(title="experiences" + (" (store unavailable)" if status.get("store") == "unavailable" else ""))
    for col in ("pending", "ready", "logged", "rewarded", "trained", "expired", "stale dropped", "dead letters"):
        store.add_column(col, justify="right")
    store.add_row(*[str(exp.get(k, 0)) for k in ("pending", "ready", "logged", "rewarded", "trained",
                                                  "expired", "stale_dropped", "dead_lettered")])
    store.add_row("", "", *[f"{_fmt(r.get(k))}/s" for k in RATE_COUNTS], "", "")
    t = status["trainer"]
    tr = Table(title="trainer" + (f" (not answering: {t.get('error')})" if t.get("answered") is False else ""))
    for col in ("state", "phase", "step", "steps/s", "staleness of trained (versions: count)"):
        tr.add_column(col)
    stale = t.get("staleness_trained") or {}
    tr.add_row(t.get("state", "-"), str(t.get("phase", "-")), str(t.get("step", "-")), _fmt(r.get("steps"), 2),
               ", ".join(f"{k}: {v}" for k, v in sorted(stale.items(), key=lambda kv: int(kv[0]))[:6]) or "-")
    return Group(rep, store, tr)

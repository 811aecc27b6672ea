"""`serve-rft status`: rates between snapshots and the rendered tables."""

from rich.console import Console

from serve_rft.service.status_view import rates, render


def _snap(logged, trained, step, version=3):
    return {"policy_version": version, "sync_style": "fixed",
            "trainer": {"state": "RUNNING", "step": step, "phase": "collecting", "staleness_trained": {"0": 5, "1": 2}},
            "replicas": [{"id": "replica-aaaaaaaaaaaa", "state": "RUNNING", "policy_version": version,
                          "explorer_step": 4, "last_sync": {"total_s": 0.61}, "failures": 0},
                         {"id": "replica-bbbbbbbbbbbb", "state": "REQUIRE_SYNC", "policy_version": version - 1,
                          "explorer_step": 4, "last_sync": None, "failures": 1}],
            "experiences": {"pending": 2, "ready": 1, "logged": logged, "rewarded": logged - 2,
                            "trained": trained, "expired": 0, "stale_dropped": 0}}


def test_rates_are_differences_per_second_and_none_without_history():
    a, b = _snap(100, 50, 10), _snap(140, 70, 14)
    assert rates(None, b, 2.0)["logged"] is None
    r = rates(a, b, 2.0)
    assert r["logged"] == 20.0 and r["trained"] == 10.0 and r["steps"] == 2.0
    assert rates(b, a, 2.0)["logged"] is None  # a counter going back (a new store) is no rate


def test_render_shows_replicas_versions_lag_and_counts():
    console = Console(record=True, width=140)
    console.print(render(_snap(140, 70, 14), rates(_snap(100, 50, 10), _snap(140, 70, 14), 2.0)))
    text = console.export_text()
    assert "policy version 3" in text and "REQUIRE_SYNC" in text and "2 (-1)" in text
    assert "20.0/s" in text and "0: 5, 1: 2" in text and "0.61" in text


def test_render_says_when_the_store_or_the_trainer_does_not_answer():
    """/v1/status while Redis is away (``experiences`` None) and the trainer is stuck
    (``answered`` false): rates and tables render, and say so."""
    prev = _snap(100, 50, 10)
    cur = {**_snap(140, 70, 14), "experiences": None, "store": "unavailable"}
    cur["trainer"] = {"state": "RUNNING", "step": 14, "answered": False, "error": "no answer within 5 s"}
    r = rates(prev, cur, 2.0)
    assert r["logged"] is None and r["steps"] == 2.0
    console = Console(record=True, width=160)
    console.print(render(cur, r))
    text = console.export_text()
    assert "store unavailable" in text and "not answering: no answer within 5 s" in text

"""Experiment trackers (``trainer.loggers``, `serve_rft.observability.trackers`): a step's
statistics read back from the run a tracker wrote, and a named tracker whose package is missing
refused before anything starts."""

from __future__ import annotations

import importlib.util

import pytest

from serve_rft.observability.trackers import PACKAGES, StepTrackers, check_available, scalars

STEPS = [{"loss": 0.5, "kl": 0.01, "skipped": False, "policy_version": 1, "note": "x"},
         {"loss": 0.25, "kl": float("nan"), "policy_version": 1},
         {"loss": 0.125, "kl": 0.02, "policy_version": 2}]


def test_a_steps_numbers_are_logged_and_nothing_else():
    assert scalars(STEPS[0]) == {"trainer/loss": 0.5, "trainer/kl": 0.01, "trainer/policy_version": 1.0}
    assert "trainer/kl" not in scalars(STEPS[1])  # not finite


def test_tensorboard_run_reads_back_every_steps_statistics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = StepTrackers(["tensorboard"], tmp_path, "run-a", {"trainer": {"lr": 1e-5}})
    for step, stats in enumerate(STEPS, start=1):
        trackers.log(stats, step)
    trackers.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard" / "run-a"))
    acc.Reload()
    loss = [(e.step, e.value) for e in acc.Scalars("trainer/loss")]
    assert loss == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert [e.step for e in acc.Scalars("trainer/kl")] == [1, 3]
    assert set(acc.Tags()["scalars"]) == {"trainer/loss", "trainer/kl", "trainer/policy_version"}


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is an optional extra, not installed")
def test_mlflow_run_reads_back_every_steps_statistics(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    trackers = StepTrackers(["mlflow"], tmp_path, "run-a", {"trainer": {"lr": 1e-5}})
    run_id = trackers._mlflow.info.run_id
    for step, stats in enumerate(STEPS, start=1):
        trackers.log(stats, step)
    trackers.close()
    client = mlflow.tracking.MlflowClient((tmp_path / "mlflow").resolve().as_uri())
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "trainer.loss")] == \
        [(1, 0.5), (2, 0.25), (3, 0.125)]


def test_a_tracker_whose_package_is_missing_is_refused_before_anything_starts():
    missing = [n for n, pkg in PACKAGES.items() if importlib.util.find_spec(pkg) is None]
    if not missing:
        pytest.skip("every tracker is installed here")
    with pytest.raises(ValueError) as e:
        check_available(missing[:1])
    assert f"serve-rft[{missing[0]}]" in str(e.value)
    check_available(["tensorboard"])  # the test extra installs it

    from serve_rft.config import load_config
    from serve_rft.control import preflight

    with pytest.raises(ValueError, match="trainer.loggers"):
        preflight(load_config(None, [f"trainer.loggers=[{missing[0]}]"]))

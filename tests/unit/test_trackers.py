"""Experiment trackers (``trainer.loggers``, `serve_rft.observability.trackers`): a step's
statistics read back from the run a tracker wrote, and a named tracker whose package is missing
refused before anything starts."""

from __future__ import annotations

import importlib.util
import os

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


def test_wandb_offline_run_reads_back_every_steps_statistics(tmp_path, monkeypatch):
    """W&B offline by default: the run file under the run dir holds each step's numbers at its
    step (read back from the file itself: tests/support/wandb_run.py)."""
    from tests.support.wandb_run import history, record_types

    for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = StepTrackers(["wandb"], tmp_path, "run-a", {"trainer": {"lr": 1e-5}})
    for step, stats in enumerate(STEPS, start=1):
        trackers.log(stats, step)
    trackers.close()
    (run_file,) = (tmp_path / "wandb").rglob("run-*.wandb")
    assert "offline-run-" in str(run_file)  # nothing left the machine
    rows = history(run_file)
    assert [(r["_step"], r["trainer/loss"]) for r in rows] == [(1, 0.5), (2, 0.25), (3, 0.125)], \
        (run_file.stat().st_size, record_types(run_file))
    assert [r["_step"] for r in rows if "trainer/kl" in r] == [1, 3]
    assert {k for r in rows for k in r if not k.startswith("_")} == {
        "trainer/loss", "trainer/kl", "trainer/policy_version"}


def test_wandb_run_is_complete_on_disk_when_close_returns_even_with_a_slow_service(tmp_path, monkeypatch):
    """``close()`` returns only once W&B's service process has closed the run file. ``finish()``
    alone returns before it (the service is told to finish by a one-way message), so the test
    pauses the service (SIGSTOP) just before that message and wakes it 2 s later.

    Shown failing with ``wandb.teardown()`` taken out of ``StepTrackers.close``: the file then
    holds only its 7-byte header when read."""
    import signal
    import threading

    import psutil
    from wandb.sdk.lib.service.service_connection import ServiceConnection

    from tests.support.wandb_run import history

    for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = StepTrackers(["wandb"], tmp_path, "run-a", {})
    def command_line(process) -> str:
        try:
            return " ".join(process.cmdline())
        except psutil.Error:  # gone, or a zombie an earlier test left
            return ""

    (service,) = [p for p in psutil.Process().children(recursive=True) if "wandb-core" in command_line(p)]
    inform_finish = ServiceConnection.inform_finish

    def paused_service_then_inform_finish(self, run_id):
        os.kill(service.pid, signal.SIGSTOP)
        threading.Timer(2.0, os.kill, (service.pid, signal.SIGCONT)).start()
        inform_finish(self, run_id)

    monkeypatch.setattr(ServiceConnection, "inform_finish", paused_service_then_inform_finish)
    for step, stats in enumerate(STEPS, start=1):
        trackers.log(stats, step)
    trackers.close()
    (run_file,) = (tmp_path / "wandb").rglob("run-*.wandb")
    assert [r["_step"] for r in history(run_file)] == [1, 2, 3], run_file.stat().st_size
    assert not service.is_running()


def test_mlflow_run_reads_back_every_steps_statistics(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")  # restored (to unset) after the test
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")  # the tracker opts in to MLflow 3's file store itself
    trackers = StepTrackers(["mlflow"], tmp_path, "run-a", {"trainer": {"lr": 1e-5}})
    run_id = trackers._mlflow.info.run_id
    for step, stats in enumerate(STEPS, start=1):
        trackers.log(stats, step)
    trackers.close()
    client = mlflow.tracking.MlflowClient((tmp_path / "mlflow").resolve().as_uri())
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "trainer.loss")] == \
        [(1, 0.5), (2, 0.25), (3, 0.125)]


def test_a_tracker_whose_package_is_missing_is_refused_before_anything_starts(monkeypatch):
    """The test extra installs every tracker; a machine without one is made by hiding its package."""
    from serve_rft.observability import trackers

    check_available(["tensorboard", "wandb", "mlflow"])  # the test extra installs them
    real = importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError) as e:
        check_available(["tensorboard", "wandb"])
    assert "serve-rft[wandb]" in str(e.value)
    check_available(["tensorboard", "mlflow"])

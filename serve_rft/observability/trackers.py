"""Experiment trackers: each training step's statistics, written where TRL and verl users read
their curves (``trainer.loggers``: TensorBoard, Weights & Biases, MLflow; each optional).

What is logged is what the trainer's step log holds (`serve_rft.trainer.actor.steps_log`: loss,
KL, entropy, clip fractions, advantages, staleness, publish seconds, ...): every number of a step's
statistics, under ``trainer/<name>``, at its step number. Runs are written under the run dir
(``<service.run_dir>/tracking/<tracker>``) unless the tracker's own environment says otherwise
(``WANDB_MODE`` / ``WANDB_DIR``, ``MLFLOW_TRACKING_URI``): W&B offline and MLflow to a local
file store by default, so nothing leaves the machine unless asked. MLflow 3 keeps its file store in
maintenance mode and refuses it unless ``MLFLOW_ALLOW_FILE_STORE=true``, which the default sets for
the trainer's process; a database or server URI in ``MLFLOW_TRACKING_URI`` needs no opt-in.

A tracker's package is installed with its extra (``pip install 'serve-rft[tensorboard]'``,
``[wandb]``, ``[mlflow]``); `check_available` refuses a named tracker whose package is missing
before anything starts (`serve_rft.control.preflight`).
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""The package each tracker needs (and the extra that installs it)."""

TRACKERS_CLOSE_S = 30.0
"""How long the trainer waits for its trackers to finish their runs (`StepTrackers.close`) at a
stop or before exiting for a restart (seconds)."""


def check_available(names: list[str]) -> None:
    """Raises:
        ValueError: a tracker in ``names`` whose package is not installed (the message names the
            extra that installs it).
    """
    for name in names:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ValueError(f"trainer.loggers names {name}, but the {PACKAGES[name]} package is not "
                             f"installed: pip install 'serve-rft[{name}]'")


def scalars(stats: dict) -> dict[str, float]:
    """The finite numbers of a step's statistics (bools and strings left out), keyed
    ``trainer/<name>``."""
    return {f"trainer/{k}": float(v) for k, v in stats.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class StepTrackers:
    """The trackers of one trainer process.

    Args:
        names: ``trainer.loggers``.
        root: where runs are written (``<run_dir>/tracking``).
        run_name: the run's name in every tracker.
        config: the run's config (a JSON-able dict), recorded with the run.
    """

    def __init__(self, names: list[str], root: str | Path, run_name: str, config: dict):
        self.names, self.root = list(names), Path(root)
        self._tb = self._wandb = self._mlflow = None
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.root / "tensorboard" / run_name))
        if "wandb" in self.names:
            import wandb

            self._wandb = wandb.init(project="serve-rft", name=run_name, config=config,
                                     mode=os.environ.get("WANDB_MODE", "offline"),
                                     dir=os.environ.get("WANDB_DIR", str(self.root / "wandb")))
        if "mlflow" in self.names:
            import mlflow

            uri = os.environ.get("MLFLOW_TRACKING_URI")
            if not uri:  # a local file store: MLflow 3 keeps it in maintenance mode, allowed by opting in
                uri = (self.root / "mlflow").resolve().as_uri()
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri(uri)
            mlflow.set_experiment("serve-rft")
            self._mlflow = mlflow.start_run(run_name=run_name)
            mlflow.log_dict(config, "config.json")

    def log(self, stats: dict, step: int) -> None:
        """Write ``stats``' numbers at ``step`` to every tracker. TensorBoard's are flushed and
        MLflow's written at once; W&B's service process holds a run's last records in memory until
        the run ends (`close`), so a ``kill -9`` of this process loses those."""
        values = scalars(stats)
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        if self._mlflow is not None:
            import mlflow

            mlflow.log_metrics({k.replace("/", "."): v for k, v in values.items()}, step=step)

    def close(self) -> None:
        """Finish every tracker's run; on return each run is complete on disk.

        W&B's ``finish()`` returns before its service process has closed the run's ``.wandb`` log
        (``ServiceConnection.inform_finish`` only publishes; wandb-core's stream writer closes the
        log, flushing its last block, when the stream ends: ``core/internal/stream/writer.go``), so
        ``wandb.teardown()`` follows it: it waits for the service process to exit.
        """
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            wandb.teardown()
        if self._mlflow is not None:
            import mlflow

            mlflow.end_run()

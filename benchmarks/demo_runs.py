"""Shared by benchmarks/learning.py and benchmarks/modes.py: one `serve-rft demo` run on the
real stack, in a fresh run directory, as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def demo_report(sets: list[str], duration: float, users: int, max_steps: int | None = None,
                task: str = "vowels", seed: int = 0) -> dict:
    """Run `serve-rft demo --no-live` with ``--set`` overrides for ``duration`` seconds (or until
    the trainer's step ``max_steps``) on ``task`` with the users' ``seed``, and return its JSON
    summary.

    Raises:
        RuntimeError: the demo wrote no report (its stderr tail is in the message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "serve_rft.cli", "demo", "--duration", str(duration), "--users", str(users),
               "--no-live", "--report", str(report), "--set", f"service.run_dir={tmp}/run", "--task", task,
               "--seed", str(seed)]
        if max_steps is not None:
            cmd += ["--max-steps", str(max_steps)]
        for s in sets:
            cmd += ["--set", s]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=duration + 900)
        if not report.exists():
            raise RuntimeError(f"demo {sets} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(report.read_text())

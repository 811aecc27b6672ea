"""Another git revision's ``serve_rft`` for side-by-side benchmarks (`log_ab.py`,
`store_memory.py`): exported with ``git archive REV serve_rft`` into a folder, which a child
process puts first on ``PYTHONPATH`` so it imports that version instead of the working tree's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def export(rev: str, into: Path) -> Path:
    """Write ``rev``'s ``serve_rft`` package under ``into`` (created); returns ``into``.

    Raises:
        subprocess.CalledProcessError: ``rev`` is not a revision of this repository.
    """
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev, "serve_rft"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def env_importing(source: Path | None) -> dict[str, str]:
    """This process's environment with ``source`` (a folder holding ``serve_rft``) first on
    ``PYTHONPATH``; None: unchanged (the working tree's ``serve_rft``)."""
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = f"{source}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env

"""The fault tests' own measurements, kept as a result: how long each fault took to be noticed,
to clear, or to be served around, on the real stack under load, next to the bound its test holds.

Runs ``pytest -n 0 tests/integration/test_stack_faults.py`` (one stack: the sync faults, then kill
-9 of a replica, the trainer and redis-server in turn, of the front door and of Serve's controller,
then each part stuck in turn) with ``SERVE_RFT_FAULT_TIMINGS`` set, so each test appends what it
measured (`tests.support.faults.record_timing`); writes them with the run's provenance and
pytest's exit status (a test that failed keeps what it recorded before its failure, and the exit
status says so). The Faults page (docs/operations/faults.md) quotes this file.

    .venv/bin/python benchmarks/fault_timings.py --out benchmarks/results/fault_timings.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import ROOT, record

sys.path.insert(0, str(ROOT))
from tests.support.faults import TIMINGS_ENV  # noqa: E402

MODULE = "tests/integration/test_stack_faults.py"
PYTEST_ARGS = ("-q", "-n", "0", "-p", "no:cacheprovider")


def main(argv: list[str] | None = None) -> int:
    """Run the fault module once and write its figures to ``--out``; returns pytest's exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    provenance = record()
    with tempfile.TemporaryDirectory(prefix="fault_timings.") as tmp:
        lines = Path(tmp) / "timings.jsonl"
        t0 = time.monotonic()
        status = subprocess.run([sys.executable, "-m", "pytest", *PYTEST_ARGS, MODULE],
                                cwd=ROOT, env={**os.environ, TIMINGS_ENV: str(lines)}).returncode
        took = time.monotonic() - t0
        faults = [json.loads(x) for x in lines.read_text().splitlines()] if lines.exists() else []
    out = {**provenance, "runs": " ".join(["pytest", *PYTEST_ARGS, MODULE]), "pytest_exit_status": status,
           "wall_s": round(took, 1), "faults": faults}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(faults, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())

"""The test suite's time as an artifact of the run that measured it.

Runs ``bash .ci/run`` (the README's second command: the install, then ``pytest -q tests``) from
the repository root, shows its output as it comes, and writes the wall time, pytest's own time and
counts (its last summary line) and its slowest items (``--durations``, as ``pyproject.toml`` asks
for) with the run's provenance (`benchmarks/provenance.py`):

    CI=true python3 scripts/suite_time.py --out benchmarks/results/suite_time.json

The docs' suite-time figure (docs/testing.md, "Suite time"; the README's row) is this JSON's.
Run it on a clean clone with nothing else on the machine, as the figure says.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import record  # noqa: E402

SUMMARY = re.compile(r"^=*\s*(?P<counts>\d+ \w+(?:, \d+ \w+)*) in (?P<s>[\d.]+)s\b")
DURATION = re.compile(r"^(?P<s>[\d.]+)s (?P<phase>setup|call|teardown)\s+(?P<item>\S+)")


def parse(lines: list[str]) -> dict:
    """pytest's last summary line (counts, seconds) and its ``--durations`` rows, from its output."""
    summary = next((m for m in map(SUMMARY.match, reversed(lines)) if m), None)
    counts = ({word: int(n) for n, word in (c.split(" ", 1) for c in summary["counts"].split(", "))}
              if summary else {})
    slowest = [{"s": float(m["s"]), "phase": m["phase"], "item": m["item"]}
               for m in map(DURATION.match, lines) if m]
    return {"pytest_s": float(summary["s"]) if summary else None, "counts": counts, "slowest": slowest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/suite_time.json")
    a = ap.parse_args()
    provenance = record()  # before the run: the machine's load as it starts
    if not Path(sys.executable).resolve().is_relative_to(ROOT):  # a clean clone has no venv yet
        provenance["command"] = shlex.join(["python3", "scripts/suite_time.py", *sys.argv[1:]])
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", ".ci/run"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line.rstrip("\n"))
    rc = proc.wait()
    venv = ROOT / ".venv" / "bin" / "python"  # the packages the suite ran with (the install made them)
    if venv.exists():
        shown = subprocess.run([str(venv), "-c", "import json, sys; sys.path.insert(0, 'benchmarks'); "
                                "from provenance import machine; print(json.dumps(machine()))"],
                               cwd=ROOT, capture_output=True, text=True)
        if shown.returncode == 0:
            load = provenance["machine"]["load_average_1min"]
            provenance["machine"] = {**json.loads(shown.stdout), "load_average_1min": load}
    result = {**provenance, "runs": "bash .ci/run", "exit_status": rc,
              "wall_s": round(time.monotonic() - t0, 1), **parse(lines)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("exit_status", "wall_s", "pytest_s", "counts")}))
    sys.exit(rc)


if __name__ == "__main__":
    main()

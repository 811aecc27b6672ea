"""The demo's report with its provenance (docs/performance.md, "The demo"): runs ``serve-rft demo``
(the embedded model, two replicas, the trainer, simulated users who like vowels) without its live
view and writes its JSON report with the command, machine, code version and date
(`benchmarks/provenance.py`).

    .venv/bin/python benchmarks/demo_report.py [--duration 240] [--out benchmarks/results/demo_report.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import record  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=240.0, help="Seconds of simulated traffic.")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "demo_report.json")
    args = ap.parse_args(argv)
    provenance = record(None if argv is None else [__file__, *argv])
    with tempfile.TemporaryDirectory() as tmp:
        report, run_dir = Path(tmp) / "report.json", Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "serve_rft.cli", "demo", "--duration", str(args.duration),
                        "--no-live", "--report", str(report), "--set", f"service.run_dir={run_dir}"],
                       cwd=ROOT, check=True)
        result = json.loads(report.read_text())
    args.out.write_text(json.dumps({**provenance, **result}, indent=2))
    print(json.dumps({k: result[k] for k in ("duration_s", "requests", "policy_version") if k in result}, indent=2))


if __name__ == "__main__":
    main()

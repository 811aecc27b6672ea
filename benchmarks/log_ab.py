"""Experience logging, two versions of the store side by side: `log_throughput.py` run on the
working tree's ``serve_rft`` and on another git revision's, alternating, pooled per version.

Each run is one `log_throughput.py` (its own fresh redis-server, its rounds alternating XADD and
the store), so every ratio is against ``redis-benchmark``'s XADD rate measured in the same run;
runs alternate between the versions (``--pairs`` pairs per durability, the order flipping each
pair) so the machine's drift falls on both. The other revision's ``serve_rft`` is exported with
``git archive REV serve_rft`` and put first on ``PYTHONPATH`` (the benchmark records which source
it imported, by its ``code_version``). Pooled per version and durability: the median / min / max
over all rounds of the experiences/s, the XADD rate, their ratio, and Redis's CPU per 1,000
experiences.

    .venv/bin/python benchmarks/log_ab.py --before REV [--pairs 2] [--rounds 3]
        [--durability always everysec] [--out runs/log_ab.json]

Its result names the earlier code by REV, so it is a record of a change, not a figure of today's
code: it stays out of ``benchmarks/results/`` (tests/unit/test_results.py); the changelog says
what such a comparison showed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from log_throughput import _summary  # noqa: E402
from other_revision import ROOT, env_importing, export  # noqa: E402
from provenance import command, machine  # noqa: E402


def run_once(source: Path | None, durability: str, rounds: int, out: Path) -> dict:
    """One `log_throughput.py` run on ``source`` (a directory holding ``serve_rft``; None: the
    working tree's). Returns its JSON."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "log_throughput.py"), "--rounds", str(rounds),
                    "--durability", durability, "--out", str(out)], cwd=ROOT, env=env_importing(source), check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def pooled(runs: list[dict]) -> dict:
    """Median / min / max over every round of ``runs``."""
    rounds = [r for run in runs for r in run["rounds"]]
    return {"rounds": len(rounds),
            "store_experiences_per_s": _summary([r["store"]["experiences_per_s"] for r in rounds]),
            "xadd_per_s": _summary([r["xadd_per_s"] for r in rounds]),
            "ratio": _summary([r["ratio"] for r in rounds]),
            "redis_cpu_ms_per_1000": _summary([r["store"]["redis_cpu_ms_per_1000"] for r in rounds]),
            "python_cpu_ms_per_1000": _summary([r["store"]["python_cpu_ms_per_1000"] for r in rounds]),
            "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="git revision of the other version")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--durability", nargs="+", choices=["always", "everysec"], default=["always", "everysec"])
    ap.add_argument("--out", default="runs/log_ab.json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = export(a.before, Path(tmp) / "before")
        result: dict = {"command": command(), "args": vars(a), "machine": machine(),
                        "load_average_1min_at_start": os.getloadavg()[0]}
        for d in a.durability:
            runs: dict[str, list[dict]] = {"before": [], "after": []}
            for p in range(a.pairs):
                for side in (("before", "after") if p % 2 == 0 else ("after", "before")):
                    runs[side].append(run_once(before if side == "before" else None, d, a.rounds,
                                               Path(tmp) / f"{d}_{side}_{p}.json"))
                    print(d, side, p, json.dumps(runs[side][-1]["ratio"]), flush=True)
            result[d] = {side: pooled(rs) for side, rs in runs.items()}
        result["load_average_1min_at_end"] = os.getloadavg()[0]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    for d in a.durability:
        for side in ("before", "after"):
            r = result[d][side]
            print(d, side, {k: round(r[k]["median"], 3) for k in ("ratio", "store_experiences_per_s", "xadd_per_s",
                                                                   "redis_cpu_ms_per_1000", "python_cpu_ms_per_1000")})


if __name__ == "__main__":
    main()

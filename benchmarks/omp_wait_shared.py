"""Two processes that each use torch and a vLLM engine sharing two cores, with libgomp's default
wait policy (``unset``: its threads spin a while before they sleep) against
``OMP_WAIT_POLICY=PASSIVE`` (they sleep at once; GNU libgomp manual, "OMP_WAIT_POLICY" and
"GOMP_SPINCOUNT"), side by side in one run.

The workload is what the test suite runs on each of its two workers: ``--copies`` copies at once
of one integration test module (default tests/integration/test_logprob_agreement.py: a vLLM
engine samples, then the trainer's model recomputes the logprobs), each ``pytest -n 0``. Each
round runs the two variants in turn, their order alternating; recorded per run: the wall
seconds until every copy exited and their exit codes. One stack alone:
``benchmarks/executor_ab.py --ab omp_wait``.

    .venv/bin/python benchmarks/omp_wait_shared.py --rounds 2 --out benchmarks/results/omp_wait_shared.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provenance import record  # noqa: E402

VARIANTS = {"unset": None, "passive": "PASSIVE"}
"""Variant -> ``OMP_WAIT_POLICY`` (None: the variable removed)."""


def run_one(value: str | None, module: str, copies: int) -> dict:
    """``copies`` copies of ``pytest -n 0 module`` at once with ``OMP_WAIT_POLICY`` = ``value``;
    the wall seconds until the last exited and each copy's exit code."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if value is not None:
        env["OMP_WAIT_POLICY"] = value
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", module]
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(copies)]
    codes = [p.wait() for p in procs]
    return {"wall_s": round(time.monotonic() - t0, 1), "exit_codes": codes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--copies", type=int, default=2)
    ap.add_argument("--module", default="tests/integration/test_logprob_agreement.py")
    ap.add_argument("--out", default="benchmarks/results/omp_wait_shared.json")
    a = ap.parse_args()
    runs = []
    for r in range(a.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            runs.append({"round": r, "variant": variant, **run_one(VARIANTS[variant], a.module, a.copies)})
            print(json.dumps(runs[-1]), flush=True)
    median = {v: statistics.median(x["wall_s"] for x in runs if x["variant"] == v) for v in VARIANTS}
    result = {**record(), "module": a.module, "copies": a.copies, "median_wall_s": median,
              "ratio_unset_to_passive": round(median["unset"] / median["passive"], 2), "runs": runs}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(median))


if __name__ == "__main__":
    main()

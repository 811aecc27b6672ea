"""The experience store under both ``buffer.durability`` settings: alternating rounds, medians.

Runs `store_throughput.py` ``--rounds`` times for each setting, alternating (``everysec`` then
``always`` in each round, each run on its own fresh embedded redis-server), and writes every
round in full and the median over the rounds of the figures the Performance page gives, with this
run's provenance (`provenance.record`):

    .venv/bin/python benchmarks/store_durability.py --rounds 3 \\
        --out benchmarks/results/store_throughput_durability.json

The machine's 1-minute load average at the start and end of each run is in its round (fsync and
CPU timings move with other work on the machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import record  # noqa: E402  (benchmarks/, the script's folder)

SETTINGS = ("everysec", "always")


def figures(run: dict) -> dict:
    """The figures of one `store_throughput.py` result that the medians are taken of."""
    n1 = next(s for s in run["store"] if s["n"] == 1)
    lat = {r["concurrent_callers"]: r for r in run["reward_latency"]}
    log = {r["concurrent_callers"]: r for r in run["log_latency"]}
    many = max(lat)
    return {"rewards_per_s_32_callers": n1["rewards_per_s"], "experiences_per_s_32_callers": n1["experiences_per_s"],
            "reward_p50_ms_1_caller": lat[1]["p50_ms"], "reward_p99_ms_1_caller": lat[1]["p99_ms"],
            "reward_p50_ms_32_callers": lat[many]["p50_ms"], "reward_p99_ms_32_callers": lat[many]["p99_ms"],
            "log_p50_ms_1_caller": log[1]["p50_ms"],
            "redis_benchmark_set_per_s": run["redis_benchmark_requests_per_s"]["SET"],
            "redis_benchmark_xadd_per_s": run["redis_benchmark_requests_per_s"]["XADD"],
            "reward_script_usec_per_call": n1["redis_reward"]["script_usec_per_call"],
            "load_average_1min_at_start_and_end": run["load_average_1min_at_start_and_end"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/store_throughput_durability.json")
    a = ap.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(1, a.rounds + 1):
            row: dict = {"round": k}
            for setting in SETTINGS:
                out = Path(tmp) / f"{setting}_{k}.json"
                subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "store_throughput.py"),
                                "--durability", setting, "--out", str(out)], check=True)
                run = json.loads(out.read_text())
                row[setting] = {"figures": figures(run), "run": run}
                print(json.dumps({"round": k, setting: row[setting]["figures"]}), flush=True)
            rounds.append(row)
    median = {s: {f: statistics.median(r[s]["figures"][f] for r in rounds)
                  for f in rounds[0][s]["figures"] if f != "load_average_1min_at_start_and_end"}
              for s in SETTINGS}
    loads = [x for r in rounds for s in SETTINGS for x in r[s]["figures"]["load_average_1min_at_start_and_end"]]
    result = {**record(), "rounds_per_setting": a.rounds, "median": median,
              "load_average_1min_range": [min(loads), max(loads)], "rounds": rounds}
    for r in rounds:  # each run's own out path is a temporary file: not part of the result
        for s in SETTINGS:
            r[s]["run"]["args"].pop("out", None)
            r[s]["run"]["command"] = r[s]["run"]["command"].rsplit(" --out ", 1)[0]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"median": median, "load_average_1min_range": result["load_average_1min_range"]}, indent=1))


if __name__ == "__main__":
    main()

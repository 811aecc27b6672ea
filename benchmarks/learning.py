"""It learns, through the live service: one `serve-rft demo` run per algorithm.

Each run starts the real stack on the embedded model (two vLLM-CPU replicas, Redis, the
trainer, the synchronizer rolling every version) and drives it with the demo's users: `n`=4
answers per request, the rule reward "share of lowercase vowels" posted 0.2-2 s later. The
trainer's algorithm is the only difference between runs. Reported per run: mean reward in the
first 30 s of traffic, the plateau (answer-weighted mean of the last two 30 s buckets), policy
versions published, requests failed. `serve-rft report` renders the figure.

    .venv/bin/python benchmarks/learning.py --duration 180 --algorithms grpo opmd \\
        --out benchmarks/results/learning.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from demo_runs import demo_report
from provenance import record  # benchmarks/ (the script's folder)


def run(algorithm: str, duration: float, users: int, extra: list[str]) -> dict:
    """One demo run with ``trainer.algorithm=algorithm``; returns its figures and JSON summary."""
    from serve_rft.demo.report import plateau

    rep = demo_report([f"trainer.algorithm={algorithm}", *extra], duration, users)
    curve = rep["reward_curve"]
    return {"label": algorithm, "algorithm": algorithm, "settings": extra,
            "start_reward": curve[0]["mean_reward"], "plateau_reward": plateau(rep),
            "policy_versions": rep["policy_version"], "requests_ok": rep["requests"]["ok"],
            "requests_failed": rep["requests"]["failed"], "report": rep}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--algorithms", nargs="+", default=["grpo", "opmd"])
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra config override (all runs)")
    ap.add_argument("--out", default="benchmarks/results/learning.json")
    a = ap.parse_args()
    runs = []
    for alg in a.algorithms:
        r = run(alg, a.duration, a.users, a.sets)
        print(json.dumps({k: v for k, v in r.items() if k != "report"}), flush=True)
        runs.append(r)
    out = {**record(), "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    from serve_rft.demo.report import load_runs, render_png

    print("figure:", render_png(load_runs(a.out), Path(a.out).with_suffix(".png")))
    bad = [r for r in runs if r["requests_failed"] or r["plateau_reward"] <= r["start_reward"] + 0.1]
    if bad:
        sys.exit(f"no clear learning (or failed requests) in: {[r['label'] for r in bad]}")


if __name__ == "__main__":
    main()

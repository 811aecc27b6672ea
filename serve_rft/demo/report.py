"""``serve-rft report``: the reward and policy-version timeline of a run, as a PNG and a table.

Input: the JSON summary ``serve-rft demo --report`` writes (`serve_rft.demo.driver`), or a file
holding a list of them under ``"runs"`` (benchmarks/learning.py) to compare runs on one figure.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_runs(path: str | Path) -> dict[str, dict]:
    """``{label: demo summary}`` from a demo report or a benchmark file with ``runs``.

    Raises:
        ValueError: the file holds neither.
    """
    data = json.loads(Path(path).read_text())
    if "runs" in data:
        return {r.get("label", str(i)): r["report"] for i, r in enumerate(data["runs"])}
    if "reward_curve" in data:
        return {Path(path).stem: data}
    raise ValueError(f"{path}: not a demo report (no reward_curve) nor a list of runs")


def version_series(report: dict) -> tuple[list[int], list[float], list[int]]:
    """(policy versions, mean reward of the answers each produced, answers) in version order."""
    items = sorted(((int(v), d["mean"], d["n"]) for v, d in report["reward_by_version"].items()))
    return [v for v, _, _ in items], [m for _, m, _ in items], [n for _, _, n in items]


def smoothed(xs: list[int], ys: list[float], ns: list[int], window: int) -> tuple[list[int], list[float]]:
    """Answer-weighted mean reward over consecutive windows of ``window`` versions."""
    out_x, out_y = [], []
    for i in range(0, len(xs), window):
        n = sum(ns[i:i + window])
        if n:
            out_x.append(xs[min(i + window, len(xs)) - 1])
            out_y.append(sum(y * k for y, k in zip(ys[i:i + window], ns[i:i + window])) / n)
    return out_x, out_y


def render_png(runs: dict[str, dict], out: str | Path, window: int = 10) -> Path:
    """Two panels: mean reward per policy version (smoothed over ``window`` versions) and mean
    reward over wall-clock time with the newest version any replica serves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_v, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, rep in runs.items():
        xs, ys, ns = version_series(rep)
        sx, sy = smoothed(xs, ys, ns, window)
        ax_v.plot(sx, sy, marker=".", label=label)
        curve = rep["reward_curve"]
        ax_t.plot([c["t_s"] for c in curve], [c["mean_reward"] for c in curve], marker="o", label=f"{label} reward")
    ax_v.set_xlabel("policy version")
    ax_v.set_ylabel(f"mean reward (answers of {window} versions)")
    ax_v.set_title("reward per policy version")
    ax_t.set_xlabel("time since start of traffic (s)")
    ax_t.set_ylabel("mean reward")
    ax_t.set_title("reward and served version over time")
    tw = ax_t.twinx()
    for label, rep in runs.items():
        points = sorted((p["t_s"], p["policy_version"]) for tl in rep["replica_timeline"].values() for p in tl)
        best, xs, ys = 0, [], []
        for t, v in points:
            best = max(best, v)
            xs.append(t)
            ys.append(best)
        tw.step(xs, ys, where="post", linestyle="--", alpha=0.5, label=f"{label} version")
    tw.set_ylabel("newest version served (dashed)")
    for ax in (ax_v, ax_t):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def table_rows(report: dict) -> list[tuple[str, str, str]]:
    """(time bucket, mean reward, answers) per row of the reward curve, then a summary row of
    the first and last 10% of versions."""
    rows = [(f"{c['t_s']}-{c['t_s'] + 30} s", f"{c['mean_reward']:.3f}", str(c["n"])) for c in report["reward_curve"]]
    xs, ys, ns = version_series(report)
    if xs:
        k = max(1, len(xs) // 10)
        first = sum(y * n for y, n in zip(ys[:k], ns[:k])) / max(1, sum(ns[:k]))
        last = sum(y * n for y, n in zip(ys[-k:], ns[-k:])) / max(1, sum(ns[-k:]))
        rows.append((f"versions {xs[0]}-{xs[k - 1]} / {xs[-k]}-{xs[-1]}", f"{first:.3f} -> {last:.3f}",
                     str(sum(ns))))
    return rows


def plateau(report: dict, last_buckets: int = 2) -> float:
    """Answer-weighted mean reward of the last ``last_buckets`` buckets of the reward curve."""
    tail = report["reward_curve"][-last_buckets:]
    return sum(c["mean_reward"] * c["n"] for c in tail) / max(1, sum(c["n"] for c in tail))

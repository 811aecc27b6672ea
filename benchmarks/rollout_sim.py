"""Rollout at scale, by simulation: version lag and the capacity syncs cost, 8 to 4,096 replicas.

Drives `serve_rft.synchronizer.simulation.Fleet` (every replica and the trainer played against the
synchronizer's own state machine, `SyncState`, on a simulated clock) and measures, for fleets of
8 to 4,096 replicas, the version lag (publish -> last replica) and the serving capacity lost to
syncs:

    .venv/bin/python benchmarks/rollout_sim.py --out benchmarks/results/rollout_sim.json

Per-replica load times are drawn around those measured by benchmarks/sync_cost.py (results in
benchmarks/results/sync_cost.json, Qwen2 0.47 B CHECKPOINT: 1.7-3.4 s per replica).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import record  # noqa: E402  (benchmarks/, the script's folder)

from serve_rft.config import SynchronizerConfig  # noqa: E402
from serve_rft.synchronizer.simulation import Fleet  # noqa: E402


def _scenario(n: int, max_unavailable: int, load_mean_s: float, versions: int, publish_every_s: float,
              seed: int) -> dict:
    """``versions`` versions published ``publish_every_s`` apart (or once the previous one is
    everywhere, if later) into ``n`` replicas whose syncs take ``load_mean_s`` (normal, sd /4).
    TRAINER_DRIVEN: every replica wants each version at once, so the lag is the roll itself."""
    cfg = SynchronizerConfig(sync_style="trainer_driven", max_unavailable=max_unavailable,
                             max_version_lag_s=None, lease_s=max(10.0, 4 * load_mean_s))
    fleet = Fleet(cfg, lambda rng: max(0.05, rng.gauss(load_mean_s, load_mean_s / 4)), seed=seed, check=False)
    for _ in range(n):
        fleet.add_replica()
    fleet.advance(2.0)
    fleet.live_s = fleet.out_s = 0.0
    for _ in range(versions):
        v = fleet.publish()
        published = fleet.now
        while v not in fleet.state.rollout.version_lags:
            fleet.advance(1.0)
            if fleet.now - published > 1e6:
                raise RuntimeError("did not converge")
        rest = publish_every_s - (fleet.now - published)
        if rest > 0:
            fleet.advance(rest)
    lags = sorted(fleet.state.rollout.version_lags.values())
    return {"replicas": n, "max_unavailable": max_unavailable, "load_mean_s": load_mean_s,
            "versions": versions, "publish_every_s": publish_every_s,
            "lag_s_median": round(lags[len(lags) // 2], 2), "lag_s_max": round(lags[-1], 2),
            "capacity_lost": round(fleet.out_s / fleet.live_s, 5) if fleet.live_s else 0.0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[8, 64, 512, 4096])
    ap.add_argument("--load-s", type=float, nargs="+", default=[0.1, 2.5],
                    help="mean per-replica sync time: embedded model / 0.47 B CHECKPOINT (sync_cost.json)")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--max-roll-s", type=float, default=2000.0,
                    help="skip settings whose roll (replicas x load / max_unavailable) is longer")
    ap.add_argument("--publish-every-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    for load in args.load_s:
        for n in args.replicas:
            for mu in sorted({1, max(1, math.floor(0.05 * n)), max(1, math.floor(0.10 * n))}):
                if n * load / mu > args.max_roll_s:  # every replica polls every second: too long to simulate
                    row = {"replicas": n, "max_unavailable": mu, "load_mean_s": load, "skipped": True,
                           "roll_s_estimate": round(n * load / mu, 1)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                t0 = time.perf_counter()
                row = _scenario(n, mu, load, args.versions, args.publish_every_s, args.seed)
                row["wall_s"] = round(time.perf_counter() - t0, 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({**record(None if argv is None else [__file__, *argv]), "rows": rows},
                                       indent=1))


if __name__ == "__main__":
    main()

"""What Ray's task events cost the GCS: its resident memory after N traced and N untraced actor calls.

Every Ray task (each actor call, a replica's once-a-second heartbeat to the synchronizer included)
leaves task events in the GCS, kept up to ``RAY_task_events_max_num_task_in_gcs`` tasks (100,000 by
default). This starts a local Ray (one CPU, no dashboard) with the given cap, makes ``--calls``
calls of a traced actor method and then as many of one declared with
``@ray.method(enable_task_events=False)`` (how the synchronizer's ``poll`` and ``renew`` are
declared), and records the GCS process's RSS before and after each. The cap ``off`` runs with
``RAY_task_events_report_interval_ms=0``: workers record and report no task events at all (what
``serve-rft up`` sets for a Ray it starts).

    .venv/bin/python benchmarks/gcs_task_events.py --calls 20000 --out benchmarks/results/gcs_task_events.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from provenance import record  # benchmarks/ (the script's folder)

ROOT = Path(__file__).resolve().parents[1]


def measure(calls: int, cap: int | str | None) -> dict:
    """One local Ray with task-event cap ``cap`` (None: Ray's default; "off": no task events
    reported). Returns RSS figures, MiB."""
    import psutil
    import ray

    if cap == "off":
        os.environ["RAY_task_events_report_interval_ms"] = "0"
    elif cap is not None:
        os.environ["RAY_task_events_max_num_task_in_gcs"] = str(cap)
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        gcs = next(p for p in psutil.Process().children(recursive=True) if "gcs_server" in p.name())

        @ray.remote
        class Peer:
            def traced(self, x):
                return x

            @ray.method(enable_task_events=False)
            def untraced(self, x):
                return x

        peer = Peer.remote()
        ray.get(peer.traced.remote(0))
        time.sleep(3)

        def rss() -> float:
            return gcs.memory_info().rss / 2**20

        r0 = rss()
        for i in range(calls):
            ray.get(peer.traced.remote(i))
        time.sleep(3)  # task events reach the GCS about once a second
        r1 = rss()
        for i in range(calls):
            ray.get(peer.untraced.remote(i))
        time.sleep(3)
        r2 = rss()
    finally:
        ray.shutdown()
    return {"cap": cap, "calls": calls, "gcs_rss_start_mib": round(r0, 1), "after_traced_mib": round(r1, 1),
            "after_untraced_mib": round(r2, 1), "traced_kib_per_call": round((r1 - r0) * 1024 / calls, 2),
            "untraced_kib_per_call": round((r2 - r1) * 1024 / calls, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--caps", default="default,10000,5000,off",
                    help="comma-separated caps; 'default' = Ray's, 'off' = no task events reported")
    ap.add_argument("--out", default="benchmarks/results/gcs_task_events.json")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one cap in this process
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(measure(a.calls, a.one if a.one == "off" else None if a.one == "default" else int(a.one))))
        return
    runs = []
    for cap in a.caps.split(","):  # a fresh process per cap: Ray reads the variable at start
        out = subprocess.run([sys.executable, __file__, "--calls", str(a.calls), "--one", cap],
                             capture_output=True, text=True, check=True, cwd=ROOT)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(runs[-1])
    result = {**record(), "runs": runs}
    Path(ROOT / a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

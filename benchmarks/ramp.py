"""A locust ramp (`loadtests/ramp.py`) through the live service, written with its provenance.

Starts the real stack (`ServiceStack`: two vLLM-CPU replicas, trainer, synchronizer, embedded
Redis; ``--set`` adds settings), runs ``locust -f loadtests/ramp.py`` against it, and writes the
ramp's per-step figures (users, successful chat requests/s, failures, p50/p99 latency; with
``--down`` the live replicas and the versions they served) with the run's command, machine, code
version and date (`provenance.record`) and the stack's settings::

    .venv/bin/python benchmarks/ramp.py --step-users 8 --step-s 25 --max-users 112 \\
        --out benchmarks/results/ramp.json
    .venv/bin/python benchmarks/ramp.py --set service.ingress=proxy --step-users 8 --step-s 25 \\
        --max-users 64 --out benchmarks/results/ramp_proxy.json
    .venv/bin/python benchmarks/ramp.py --set 'explorer.autoscaling={min_replicas: 1, max_replicas: 3,
        target_ongoing_requests: 4, upscale_delay_s: 2, downscale_delay_s: 30}' --step-users 4 \\
        --step-s 60 --max-users 16 --down --out benchmarks/results/autoscaling_ramp.json

Exits 1 when a request failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import record  # noqa: E402


def run(settings: list[str], step_users: int, step_s: float, max_users: int, down: bool, status_s: float,
        run_dir: Path) -> dict:
    """One ramp on a fresh stack with ``settings``; locust's ramp summary (``loadtests/ramp.py``)."""
    from serve_rft.config import load_config
    from serve_rft.service.launcher import ServiceStack, quiet_env

    quiet_env()
    cfg = load_config(None, ["service.port=0", f"service.run_dir={run_dir}", *settings])
    with tempfile.TemporaryDirectory() as tmp, ServiceStack(cfg) as stack:
        out = Path(tmp) / "ramp.json"
        cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "ramp.py"), "--headless",
               "--host", stack.url, "--ramp-step-users", str(step_users), "--ramp-step-s", str(step_s),
               "--ramp-max-users", str(max_users), "--ramp-status-s", str(status_s), "--ramp-out", str(out),
               "--only-summary", *(["--ramp-down"] if down else [])]
        steps = max_users // step_users * (2 if down else 1)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=steps * step_s + 300)
        if not out.exists():
            raise RuntimeError(f"locust wrote no ramp (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        ramp = json.loads(out.read_text())
    ramp.pop("command", None)  # locust's, with the stack's port: this script's command replaces it
    return {"locust_exit_code": proc.returncode, **ramp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of the stack (serve-rft's --set); repeatable")
    ap.add_argument("--step-users", type=int, default=8, help="chat users added per step")
    ap.add_argument("--step-s", type=float, default=25.0, help="seconds per step")
    ap.add_argument("--max-users", type=int, default=112, help="the top step's chat users")
    ap.add_argument("--down", action="store_true", help="come back down in the same steps (autoscaling)")
    ap.add_argument("--status-s", type=float, default=2.0, help="with --down: seconds between /v1/status reads")
    ap.add_argument("--run-dir", default="runs/bench-ramp", help="deleted and recreated (a fresh store)")
    ap.add_argument("--out", default="benchmarks/results/ramp.json")
    a = ap.parse_args()
    run_dir = Path(a.run_dir).resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    ramp = run(a.settings, a.step_users, a.step_s, a.max_users, a.down, a.status_s, run_dir)
    out = {**record(), "stack": {"settings": a.settings or ["(defaults)"]}, **ramp}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k not in ("steps", "versions_rolled", "machine")}, indent=1))
    sys.exit(1 if ramp["failures"] else 0)


if __name__ == "__main__":
    main()

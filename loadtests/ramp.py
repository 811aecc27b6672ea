"""Saturation ramp: the users of `loadtests/locustfile.py`, added in steps until throughput stops
growing. Per step: users, successful chat requests/s, failures, p50/p99 latency of the successful
ones; the saturation point is the smallest user count whose requests/s reaches 95 % of the best
step's (more users past it only add latency).

    .venv/bin/locust -f loadtests/ramp.py --headless --host http://127.0.0.1:8000 \
        --ramp-step-users 4 --ramp-step-s 30 --ramp-max-users 32 --ramp-out runs/ramp.json

(``-u``/``-t`` are ignored: the shape decides users and duration; one extra user posts rewards.)
"""

from __future__ import annotations

import json
import sys
import time

from locust import LoadTestShape, events
from locustfile import ChatUser, RewardUser, StreamUser  # noqa: F401  (the users of this run)

_steps: list[dict] = []


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    g = parser.add_argument_group("serve_rft ramp")
    g.add_argument("--ramp-step-users", type=int, default=4, help="Chat users added per step.")
    g.add_argument("--ramp-step-s", type=float, default=30.0, help="Seconds per step.")
    g.add_argument("--ramp-max-users", type=int, default=32, help="Last step's chat users.")
    g.add_argument("--ramp-out", default="", help="JSON file for the per-step results.")


def _step_of(users: int) -> dict:
    if not _steps or _steps[-1]["users"] != users:
        _steps.append({"users": users, "start": time.monotonic(), "latencies": [], "failures": 0})
    return _steps[-1]


@events.request.add_listener
def _record(request_type, name, response_time, response_length, exception=None, **_kw):
    if name == "rewards" or not _steps:
        return
    step = _steps[-1]
    if exception is None:
        step["latencies"].append(response_time / 1000.0)
    else:
        step["failures"] += 1


def summarize(steps: list[dict], ends: list[float]) -> dict:
    """Per-step figures and the saturation point (see the module docstring)."""
    rows = []
    for s, end in zip(steps, ends):
        lat = sorted(s["latencies"])
        secs = max(end - s["start"], 1e-9)

        def pct(q):
            return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None

        rows.append({"users": s["users"], "seconds": round(secs, 2), "requests": len(lat),
                     "requests_per_s": len(lat) / secs, "failures": s["failures"],
                     "p50_s": pct(0.50), "p99_s": pct(0.99)})
    best = max((r["requests_per_s"] for r in rows), default=0.0)
    sat = next((r["users"] for r in rows if r["requests_per_s"] >= 0.95 * best), None)
    return {"steps": rows, "best_requests_per_s": best, "saturation_users": sat}


@events.quitting.add_listener
def _write(environment, **_kw) -> None:
    opts = environment.parsed_options
    if not _steps:
        return
    ends = [s["start"] for s in _steps[1:]] + [time.monotonic()]
    out = {"command": " ".join(["locust", *sys.argv[1:]]), **summarize(_steps, ends)}
    print(json.dumps(out, indent=1))
    if opts is not None and opts.ramp_out:
        with open(opts.ramp_out, "w") as f:
            json.dump(out, f, indent=2)


class StepRamp(LoadTestShape):
    """Chat users ``step, 2*step, ...`` up to ``--ramp-max-users``, each for ``--ramp-step-s``."""

    def tick(self):
        opts = self.runner.environment.parsed_options
        step = int(self.get_run_time() // opts.ramp_step_s)
        users = (step + 1) * opts.ramp_step_users
        if users > opts.ramp_max_users:
            return None
        _step_of(users)
        return users + 1, float(max(users, 1))  # + the one RewardUser

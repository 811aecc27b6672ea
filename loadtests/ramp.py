"""Saturation ramp: the users of `loadtests/locustfile.py`, added in steps until throughput stops
growing. Per step: users, successful chat requests/s, failures, p50/p99 latency of the successful
ones; the saturation point is the smallest user count whose requests/s reaches 95 % of the best
step's (more users past it only add latency).

    .venv/bin/locust -f loadtests/ramp.py --headless --host http://127.0.0.1:8000 \
        --ramp-step-users 4 --ramp-step-s 30 --ramp-max-users 32 --ramp-out runs/ramp.json

(``-u``/``-t`` are ignored: the shape decides users and duration; one extra user posts rewards.)

Autoscaling (``--ramp-down``): after the top step the users come back down in the same steps, and
every ``--ramp-status-s`` the service's ``/v1/status`` is read, so each step also records the live
replicas (fewest, most) and the policy versions they served: replicas added and removed by Ray
Serve's autoscaler while versions keep rolling, and the failures meanwhile::

    .venv/bin/serve-rft up --set 'explorer.autoscaling={min_replicas: 1, max_replicas: 3, target_ongoing_requests: 4}'
    .venv/bin/locust -f loadtests/ramp.py --headless --host URL --ramp-step-users 4 \
        --ramp-step-s 40 --ramp-max-users 16 --ramp-down --ramp-out runs/autoscaling_ramp.json
"""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx
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
    g.add_argument("--ramp-down", action="store_true", default=False,
                   help="After the top step, come back down in the same steps (autoscaling).")
    g.add_argument("--ramp-status-s", type=float, default=2.0,
                   help="Seconds between reads of /v1/status (replicas, versions) per step.")


def _step_of(users: int, index: int) -> dict:
    if not _steps or _steps[-1]["index"] != index:
        _steps.append({"index": index, "users": users, "start": time.monotonic(), "latencies": [],
                       "failures": 0, "fleet": []})
    return _steps[-1]


def _watch_fleet(host: str, headers: dict, period_s: float, stop: threading.Event) -> None:
    """Every ``period_s``: live replicas and their policy versions, into the current step."""
    with httpx.Client(base_url=host, headers=headers, timeout=10) as client:
        while not stop.wait(period_s):
            try:
                st = client.get("/v1/status").json()
            except (httpx.HTTPError, ValueError):
                continue
            live = [r for r in st.get("replicas", []) if r.get("alive") and r.get("state") != "STOPPED"]
            if _steps:
                _steps[-1]["fleet"].append({"replicas": len(live), "policy_version": st.get("policy_version"),
                                            "versions": sorted(r["policy_version"] for r in live)})


_stop_watch = threading.Event()


@events.test_start.add_listener
def _start_watch(environment, **_kw) -> None:
    opts = environment.parsed_options
    if opts is None or not opts.ramp_down or not environment.host:
        return
    headers = {"Authorization": f"Bearer {opts.api_key}"} if getattr(opts, "api_key", "") else {}
    threading.Thread(target=_watch_fleet, args=(environment.host, headers, opts.ramp_status_s, _stop_watch),
                     daemon=True).start()


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

        row = {"users": s["users"], "seconds": round(secs, 2), "requests": len(lat),
               "requests_per_s": len(lat) / secs, "failures": s["failures"],
               "p50_s": pct(0.50), "p99_s": pct(0.99)}
        fleet = s.get("fleet") or []
        if fleet:
            row.update(replicas_min=min(f["replicas"] for f in fleet), replicas_max=max(f["replicas"] for f in fleet),
                       policy_versions=sorted({v for f in fleet for v in f["versions"]}))
        rows.append(row)
    best = max((r["requests_per_s"] for r in rows), default=0.0)
    sat = next((r["users"] for r in rows if r["requests_per_s"] >= 0.95 * best), None)
    out = {"steps": rows, "best_requests_per_s": best, "saturation_users": sat,
           "failures": sum(r["failures"] for r in rows)}
    if any("replicas_min" in r for r in rows):
        out["replicas_range"] = [min(r["replicas_min"] for r in rows if "replicas_min" in r),
                                 max(r["replicas_max"] for r in rows if "replicas_max" in r)]
        out["versions_rolled"] = sorted({v for r in rows for v in r.get("policy_versions", [])})
    return out


@events.quitting.add_listener
def _write(environment, **_kw) -> None:
    opts = environment.parsed_options
    _stop_watch.set()
    if not _steps:
        return
    ends = [s["start"] for s in _steps[1:]] + [time.monotonic()]
    out = {"command": " ".join(["locust", *sys.argv[1:]]), **summarize(_steps, ends)}
    print(json.dumps(out, indent=1))
    if opts is not None and opts.ramp_out:
        with open(opts.ramp_out, "w") as f:
            json.dump(out, f, indent=2)


def users_at(step: int, step_users: int, max_users: int, down: bool) -> int | None:
    """Chat users of step ``step`` (0-based): ``step_users * (step + 1)`` up to ``max_users``, then
    (``down``) back down to ``step_users``; None once the ramp is over."""
    top = max_users // step_users
    if step < top:
        return (step + 1) * step_users
    if down and step < 2 * top - 1:
        return (2 * top - 1 - step) * step_users
    return None


class StepRamp(LoadTestShape):
    """Chat users ``step, 2*step, ...`` up to ``--ramp-max-users`` (and back down with
    ``--ramp-down``), each for ``--ramp-step-s``."""

    def tick(self):
        opts = self.runner.environment.parsed_options
        step = int(self.get_run_time() // opts.ramp_step_s)
        users = users_at(step, opts.ramp_step_users, opts.ramp_max_users, opts.ramp_down)
        if users is None:
            return None
        _step_of(users, step)
        return users + 1, float(max(users, 1))  # + the one RewardUser

"""Sample which kinds of process use the CPU beside a run: every ``period`` seconds, append one
JSON line ``{"t": UNIX_TIME, "total": S, "kinds": {KIND: S, ...}}`` to FILE, until killed (S:
CPU-seconds, user + system, used in the period: by every process still running at its end
(``/proc/PID/stat``), and in all (``/proc/stat``); a process that started and ended within one
period is only in ``total``). With ``--summary`` read FILE instead and print each kind's
CPU-seconds from ``--since`` to ``--until`` (UNIX times; default: all), largest first, and the
share of the cores' time that was busy.

    python3 scripts/cpu_by_kind.py /tmp/kinds.jsonl &         # beside `bash .ci/run`
    python3 scripts/cpu_by_kind.py /tmp/kinds.jsonl --summary --since 1795706078

A process's kind (`kind_of`) comes from its name and command line: vLLM's engine processes,
Ray Serve's replicas, controller and proxies, the trainer's and the synchronizer's actors, Ray's
own daemons, HAProxy, redis-server, pytest workers (and the load their threads drive), the
`serve-rft` service processes. Linux only; needs psutil."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import psutil

KINDS = (  # (kind, substrings of "name cmdline", the first match wins)
    ("vllm-engine", ("EngineCore", "VLLM::", "vllm.v1", "multiprocessing.spawn")),
    ("serve-replica", ("ServeReplica",)),
    ("serve-controller", ("ServeController",)),
    ("serve-proxy", ("ProxyActor", "haproxy", "HAProxyManager")),
    ("trainer", ("Trainer", "TrainRank")),
    ("synchronizer", ("Synchronizer",)),
    ("ray-daemons", ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "monitor.py",
                     "ray::IDLE", "default_worker", "DashboardAgent", "RuntimeEnvAgent",
                     "ray.util.client")),
    ("redis-server", ("redis-server",)),
    ("pytest", ("pytest", "xdist")),
    ("serve-rft-cli", ("serve_rft.cli", "serve-rft")),
    ("kernel", ("kdamond", "rcu_", "ksoftirqd", "kswapd", "kworker", "kcompactd", "migration/")),
    ("sandbox", ("process_api", "binary_backend")),
)
CLK = os.sysconf("SC_CLK_TCK")


def kind_of(p: psutil.Process) -> str:
    """The kind of ``p`` (`KINDS`), ``"other"`` when none matches."""
    text = f"{p.name()} {' '.join(p.cmdline())}"
    return next((k for k, subs in KINDS if any(s in text for s in subs)), "other")


def _total_jiffies() -> int:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4]  # busy: all but idle and iowait


def _processes() -> dict[tuple[int, float], tuple[str, float]]:
    """(pid, create time) -> (kind, CPU-seconds so far) of every running process (its kind as
    of now: Ray's workers retitle themselves once they hold an actor)."""
    out = {}
    for p in psutil.process_iter():
        try:
            with p.oneshot():
                key = (p.pid, p.create_time())
                t = p.cpu_times()
                out[key] = (kind_of(p), t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def sample(path: str, period_s: float) -> None:
    """Append a line to ``path`` every ``period_s`` seconds, forever."""
    seen = _processes()  # the processes running before the first period: their CPU so far is not counted
    last_total = _total_jiffies()
    with open(path, "a") as out:
        while True:
            time.sleep(period_s)
            kinds: dict[str, float] = defaultdict(float)
            now = _processes()
            for key, (kind, cpu) in now.items():
                kinds[kind] += cpu - seen.get(key, (kind, 0.0))[1]
            seen = now
            total = _total_jiffies()
            out.write(json.dumps({"t": round(time.time()), "cpus": os.cpu_count(),
                                  "total": round((total - last_total) / CLK, 2),
                                  "kinds": {k: round(v, 2) for k, v in kinds.items()}}) + "\n")
            out.flush()
            last_total = total


def summary(path: str, since: float = 0.0, until: float = float("inf")) -> str:
    """Each kind's CPU-seconds (and share of the total) in the samples from ``since`` to
    ``until``, and how busy the cores were: the total over the samples' periods (from each
    sample's time to the one before it) times the cores (``os.cpu_count()`` where a line has no
    ``cpus``)."""
    kinds: dict[str, float] = defaultdict(float)
    total = capacity = 0.0
    last_t = None
    for line in open(path):
        s = json.loads(line)
        if since <= s["t"] <= until:
            total += s["total"]
            if last_t is not None:
                capacity += (s["t"] - last_t) * s.get("cpus", os.cpu_count())
            for k, v in s["kinds"].items():
                kinds[k] += v
        last_t = s["t"]
    rows = [f"{k:18} {v:8.0f} s  {v / max(total, 1e-9):5.1%}" for k, v in sorted(kinds.items(), key=lambda x: -x[1])]
    rows.append(f"{'unattributed':18} {total - sum(kinds.values()):8.0f} s")
    busy = f"cores busy {total / capacity:.0%} of the period" if capacity else "cores busy: one sample only"
    return "\n".join([f"{'all processes':18} {total:8.0f} s  ({busy})", *rows])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--period", type=float, default=5.0)
    ap.add_argument("--summary", action="store_true")
    ap.add_argument("--since", type=float, default=0.0)
    ap.add_argument("--until", type=float, default=float("inf"))
    a = ap.parse_args()
    print(summary(a.file, a.since, a.until)) if a.summary else sample(a.file, a.period)

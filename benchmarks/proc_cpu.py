"""CPU seconds per process tree during a measured window, by class of process (psutil).

`Sampler` takes a `snapshot` of every process on the machine (pid, parent, command line, user +
system CPU seconds) when the window opens, every ``interval_s`` while it is open and when it
closes; `window_usage` turns the snapshots into CPU seconds per named tree (a root pid and all its
descendants), per class and per role, plus the load generator's own CPU, the machine's busy CPU
and the busiest processes outside the trees ("what else ran").

A process is counted by what it used inside the window: last value seen minus its value when the
window opened; a process that started inside the window counts from 0, one that ended inside it
counts up to its last snapshot (so at most ``interval_s`` of its CPU is missed). Processes are
keyed by (pid, create time), so a reused pid is a new process.

Classes (`CLASSES`): ``front_end`` (HAProxy, the Ray Serve replica actor process = our HTTP server
and vLLM's serving classes, or vLLM's API server process), ``engine`` (vLLM's EngineCore and its
Worker process), ``logging`` (redis-server), ``ray_system`` (raylet, gcs_server, the dashboard and
runtime-env agents, log monitor, the Serve controller, proxy and HAProxy-manager actors, idle Ray
workers), ``other`` (the ``serve-rft up`` driver, the synchronizer actor, anything unmatched).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Self

import psutil

CLASSES = ("front_end", "engine", "logging", "ray_system", "other")

# (substring of the command line or process name, role, class); the first match wins
RULES: tuple[tuple[str, str, str], ...] = (
    ("VLLM::Worker", "vllm worker", "engine"),
    ("VLLM::EngineCor", "vllm engine core", "engine"),
    ("ServeReplica", "serve replica (HTTP + vLLM serving classes)", "front_end"),
    ("HAProxyManager", "serve haproxy manager actor", "ray_system"),
    ("ProxyActor", "serve proxy actor", "ray_system"),
    ("ServeController", "serve controller actor", "ray_system"),
    ("haproxy", "haproxy", "front_end"),
    ("redis-server", "redis-server", "logging"),
    ("api_server", "vllm api server", "front_end"),
    ("APIServer", "vllm api server", "front_end"),
    ("Synchronizer", "synchronizer actor", "other"),
    ("serve_rft.cli", "serve-rft up driver", "other"),
    ("raylet", "raylet", "ray_system"),
    ("gcs_server", "gcs_server", "ray_system"),
    ("dashboard", "ray dashboard/agent", "ray_system"),
    ("DashboardAgent", "ray dashboard/agent", "ray_system"),  # Ray 2.60's title: ray::DashboardAgent
    ("runtime_env", "ray runtime-env agent", "ray_system"),
    ("RuntimeEnvAgent", "ray runtime-env agent", "ray_system"),
    ("log_monitor", "ray log monitor", "ray_system"),
    ("ray::IDLE", "ray idle worker", "ray_system"),
    ("ray::", "ray other actor", "ray_system"),
    ("/ray/", "ray other", "ray_system"),
)


def short_command(cmd: str) -> str:
    """A process's program and first arguments, without any ``KEY=value`` or JSON argument (a
    machine's agents carry their environment on their command lines) and with a path argument's
    folders left out (a result keeps no machine paths: tests/unit/test_results.py): what
    `window_usage` lists of the processes outside the trees."""
    return " ".join(t.rsplit("/", 1)[-1] if t.startswith("/") else t
                    for t in cmd.split()[:4] if "=" not in t and "{" not in t)[:80]


def classify(cmdline: str, name: str = "") -> tuple[str, str]:
    """``(role, class)`` of a process from its command line (as set by setproctitle: Ray's
    ``ray::ServeReplica:...``, vLLM's ``VLLM::EngineCore``) or its name; ``("other", "other")``
    when no rule of `RULES` matches."""
    text = f"{cmdline} {name}"
    for key, role, cls in RULES:
        if key in text:
            return role, cls
    return "other", "other"


@dataclass(frozen=True)
class Proc:
    """One process in one snapshot: parent pid, role and class (`classify`), user + system CPU
    seconds so far, and its command line (first 160 characters)."""
    ppid: int
    role: str
    cls: str
    cpu_s: float
    cmd: str


@dataclass
class Snapshot:
    """Every process on the machine at one instant: ``procs`` keyed by (pid, create time in
    seconds since the epoch); ``t`` = ``time.time()``; ``busy_cpu_s`` = the machine's non-idle
    CPU seconds so far (all cores)."""
    t: float
    busy_cpu_s: float
    procs: dict[tuple[int, float], Proc] = field(default_factory=dict)


def machine_busy_cpu_s() -> float:
    """CPU seconds the machine has spent not idle (and not waiting on I/O), all cores summed."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def snapshot() -> Snapshot:
    """One pass over ``/proc``: a `Snapshot` of every process readable now (about 10 ms of CPU
    for 170 processes); processes that vanish mid-pass are left out."""
    snap = Snapshot(t=time.time(), busy_cpu_s=machine_busy_cpu_s())
    for p in psutil.process_iter(["pid", "ppid", "name", "cmdline", "cpu_times", "create_time"]):
        info = p.info
        if info["cpu_times"] is None or info["create_time"] is None:
            continue
        cmd = " ".join(info["cmdline"] or ())
        role, cls = classify(cmd[:400], info["name"] or "")
        snap.procs[(info["pid"], info["create_time"])] = Proc(
            info["ppid"] or 0, role, cls, info["cpu_times"].user + info["cpu_times"].system,
            (cmd.strip() or info["name"] or "")[:160])
    return snap


def tree(snap: Snapshot, root_pid: int) -> set[tuple[int, float]]:
    """The keys of ``root_pid`` and all its descendants in ``snap`` (by parent pid)."""
    children: dict[int, list[tuple[int, float]]] = {}
    for key, p in snap.procs.items():
        children.setdefault(p.ppid, []).append(key)
    out = {k for k in snap.procs if k[0] == root_pid}
    todo = [root_pid] if out else []
    while todo:
        for key in children.get(todo.pop(), ()):
            if key not in out and key[0] != root_pid:
                out.add(key)
                todo.append(key[0])
    return out


def _used(snaps: list[Snapshot]) -> dict[tuple[int, float], tuple[float, Proc]]:
    """CPU seconds each process used between the first and the last snapshot, with its last
    `Proc` (module docstring: what a process that starts or ends inside the window counts)."""
    first, t0 = snaps[0].procs, snaps[0].t
    base: dict[tuple[int, float], float] = {}
    last: dict[tuple[int, float], Proc] = {}
    for s in snaps:
        for key, p in s.procs.items():
            if key not in base:
                base[key] = first[key].cpu_s if key in first else (0.0 if key[1] >= t0 - 1.0 else p.cpu_s)
            last[key] = p
    return {k: (max(0.0, p.cpu_s - base[k]), p) for k, p in last.items()}


def window_usage(snaps: list[Snapshot], roots: dict[str, int], own_pid: int, top: int = 6) -> dict:
    """CPU seconds used between the first and the last of ``snaps`` (at least 2).

    Args:
        snaps: snapshots in time order.
        roots: tree name -> root pid; a process belongs to a tree if it was under the root in
            any snapshot.
        own_pid: the load generator's pid (counted apart, with its sampler thread).
        top: how many of the busiest processes outside the trees to list.

    Returns:
        ``seconds`` (wall), ``trees`` (name -> ``by_class`` over `CLASSES`, ``by_role``,
        ``processes``), ``load_generator_cpu_s``, ``machine_busy_cpu_s``, ``other_cpu_s`` (every
        process outside the trees and the load generator), ``top_other`` (pid, `short_command`, cpu_s),
        ``loadavg_1m`` (at the end).

    Raises:
        ValueError: fewer than 2 snapshots.
    """
    if len(snaps) < 2:
        raise ValueError("window_usage needs the opening and the closing snapshot")
    used = _used(snaps)
    members = {name: set().union(*(tree(s, pid) for s in snaps)) for name, pid in roots.items()}
    out: dict = {"seconds": snaps[-1].t - snaps[0].t, "trees": {}}
    in_trees: set[tuple[int, float]] = set().union(*members.values()) if members else set()
    for name, keys in members.items():
        by_class = dict.fromkeys(CLASSES, 0.0)
        by_role: dict[str, float] = {}
        for k in keys:
            cpu, p = used[k]
            by_class[p.cls] += cpu
            by_role[p.role] = by_role.get(p.role, 0.0) + cpu
        out["trees"][name] = {"by_class": {c: round(v, 4) for c, v in by_class.items()}, "processes": len(keys),
                              "by_role": {r: round(v, 4) for r, v in sorted(by_role.items(), key=lambda kv: -kv[1])}}
    own = [k for k in used if k[0] == own_pid]
    others = sorted(((cpu, k, p) for k, (cpu, p) in used.items() if k not in in_trees and k[0] != own_pid),
                    key=lambda x: -x[0])
    out["load_generator_cpu_s"] = round(sum(used[k][0] for k in own), 4)
    out["machine_busy_cpu_s"] = round(snaps[-1].busy_cpu_s - snaps[0].busy_cpu_s, 4)
    out["other_cpu_s"] = round(sum(c for c, _, _ in others), 4)
    out["top_other"] = [{"pid": k[0], "cmd": short_command(p.cmd), "cpu_s": round(c, 3)}
                        for c, k, p in others[:top] if c > 0]
    out["loadavg_1m"] = os.getloadavg()[0]
    return out


class Sampler:
    """Snapshots the machine every ``interval_s`` seconds in a thread while open::

        with Sampler({"ours": pid_a, "vllm": pid_b}) as s:
            ...  # the measured work
        s.usage  # window_usage(...)
    """

    def __init__(self, roots: dict[str, int], interval_s: float = 1.0) -> None:
        self.roots, self.interval_s = roots, interval_s
        self.snaps: list[Snapshot] = []
        self.usage: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.snaps.append(snapshot())

    def __enter__(self) -> Self:
        self.snaps.append(snapshot())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.snaps.append(snapshot())
        self.usage = window_usage(self.snaps, self.roots, os.getpid())
        self.snaps = [self.snaps[0], self.snaps[-1]]

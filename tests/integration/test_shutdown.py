"""Clean shutdown of `serve-rft up` (issue 14) on the real stack: a stop signal under load, and
kill -9 of the leader.

Every process of the run carries a marker in its environment (inherited from the command the
test starts: Ray's GCS, raylet and workers, the vLLM engines, HAProxy), and every one is a
descendant of the command while it runs (redis-server too, whose process title overwrites its
environment). After the stop: the command exited with 0 within ``service.shutdown_grace_s``
(`GRACE_S`) + the keeper's SIGTERM-then-SIGKILL of leftovers (3 s); no marked process is left; the
service, redis and metrics ports no longer accept connections; the folder Ray's HAProxy manager
kept the node's HAProxy config in is gone (Ray leaves it; the stop removes it).

Where each case is covered. The keeper (serve_rft.service.keeper) turns every stop signal into
one SIGINT to the service process, which runs in a session of its own, so the signal's kind and
whether it reached the leader or its whole group change nothing past the keeper:

- SIGINT / SIGTERM / SIGHUP x leader / group, with stand-in services (a child that ignores
  SIGTERM, an orphan adopted by the keeper): tests/unit/test_keeper.py
  (``test_a_stop_signal_to_the_keeper_or_its_group_ends_every_process``); each signal to the
  group after a descendant was killed -9: ``test_a_group_stop_after_a_descendant_was_killed_9_...``.
- Here, with real Ray, vLLM, HAProxy and redis-server processes, three runs of one run dir in
  turn, each under load with rewards: kill -9 of the keeper alone; the run dir starts again
  (the rewards kept), kill -9 of the keeper with its service process (the reaper ends the run);
  it starts again, and SIGTERM goes to the group after a replica was killed -9 (a Ray worker and
  its engine die before the stop: the hardest case; SIGTERM to the group is systemd's
  ``KillMode=control-group``, ``timeout``, ``kill -- -PGID``), with the promises above
  (`_stop_under_load`).
- SIGINT to the leader (Ctrl-C's signal, one process) ends every stack module's run
  (tests/support/stack.py asserts its exit 0).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import httpx
import psutil
import pytest

from serve_rft.config import ServiceConfig
from tests.support.load import get_status
from tests.support.stack import kill_all, launch, stack_command

pytestmark = pytest.mark.integration
GRACE_S = ServiceConfig().shutdown_grace_s  # the default the test stacks run with
STOP_BOUND_S = GRACE_S + 3 + 2  # grace, the keeper's SIGTERM wait, slack for reaping


def _marked(mark: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("SERVE_RFT_TEST_RUN") == mark and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _replica_pids(mark: str) -> set[int]:
    """The run's Serve replica processes (Ray workers titled ``ray::ServeReplica:...``)."""
    pids = set()
    for p in _marked(mark):
        try:
            if "ServeReplica" in " ".join(p.cmdline()):
                pids.add(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return pids


def _replica_files(pids: set[int]) -> list[str]:
    """What the replica processes ``pids`` keep in shared memory (staged buckets, adapters,
    vLLM's IPC sockets: `serve_rft.explorer.engine.vllm_engine.SHM_PREFIX`) that is still there."""
    from serve_rft.explorer.engine.vllm_engine import SHM_PREFIX, _pid_namespace, _shm_root

    ns = _pid_namespace()
    return [n for n in os.listdir(_shm_root()) if n.startswith(SHM_PREFIX)
            and any(f"-{ns}-{pid}-" in n for pid in pids)]


def _haproxy_dirs(tree: dict[int, psutil.Process]) -> set[str]:
    """The folders of the HAProxy configs (``haproxy -f DIR/haproxy.cfg``) that ``tree`` runs."""
    dirs = set()
    for p in tree.values():
        try:
            args = p.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if args and os.path.basename(args[0]) == "haproxy" and "-f" in args[:-1]:
            dirs.add(os.path.dirname(args[args.index("-f") + 1]))
    return dirs


def _alive(p: psutil.Process) -> bool:
    """The same process (pid and start time) still running."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _names(tree: dict[int, psutil.Process]) -> dict[int, str]:
    """Pid -> name of the processes of ``tree`` still running; a short-lived one may have exited
    since it was listed (CI once failed here on a process that ended in between)."""
    out = {}
    for pid, p in tree.items():
        try:
            out[pid] = p.name()
        except psutil.NoSuchProcess:
            pass
    return out


def _listening(url: str) -> bool:
    u = urlparse(url)
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((u.hostname, u.port)) == 0


class Load:
    """Two users chatting (n=2) and rewarding until stopped; counts answers and errors, keeps the
    completion ids whose reward was accepted (``rewarded``)."""

    def __init__(self, url: str):
        self.url, self.ok, self.errors = url, 0, 0
        self.rewarded: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self._stop.is_set():
                try:
                    r = c.post("/v1/chat/completions", json={
                        "model": "serve-rft", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 6, "n": 2})
                    if r.status_code == 200:
                        self.ok += 1
                        cid = r.json()["id"]
                        if c.post("/v1/rewards", json={"completion_id": cid, "rewards": [1.0, 0.0]}
                                  ).status_code == 200:
                            self.rewarded.append(cid)
                except httpx.HTTPError:
                    self.errors += 1
                    time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=40)


def _stop_under_load(proc: subprocess.Popen, lines: list[str], info: dict, mark: str, sig: signal.Signals,
                     to_group: bool, kill_replica: bool = False) -> int | None:
    """With two users chatting and rewarding on the `serve-rft up` ``proc`` (started with
    ``SERVE_RFT_TEST_RUN=mark``), optionally kill -9 a replica, send ``sig`` to the leader or its
    group and assert the module docstring's promises. Ends whatever is left should one fail.
    Returns the pid of the replica killed, if any."""
    tree: dict[int, psutil.Process] = {}
    pid = None
    try:
        url, redis_url = info["url"], info["redis_url"]
        # redis-server rewrites its environment block (its process title): found as a descendant
        tree.update((p.pid, p) for p in [*_marked(mark), *psutil.Process(proc.pid).children(recursive=True)])
        before = _names(tree)
        names = " ".join(before.values()).lower()
        assert "redis-server" in names and "raylet" in names and "gcs_server" in names, before
        assert any("haproxy" in n.lower() for n in before.values()), before
        haproxy_dirs = _haproxy_dirs(tree)
        assert haproxy_dirs and all(os.path.isdir(d) for d in haproxy_dirs), haproxy_dirs
        load = Load(url)
        try:
            deadline = time.monotonic() + 60
            while load.ok < 5 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert load.ok >= 5, "no traffic before the stop"
            if kill_replica:
                st = get_status(url)
                pid = next(r["pid"] for r in st["replicas"] if r["alive"] and r.get("pid"))
                os.kill(pid, signal.SIGKILL)
                time.sleep(1)
            t0 = time.monotonic()
            (os.killpg if to_group else os.kill)(proc.pid, sig)
            proc.wait(timeout=STOP_BOUND_S + 30)
            took = time.monotonic() - t0
        finally:
            load.stop()
        print(f"stop ({signal.Signals(sig).name} to the {'group' if to_group else 'leader'}): {took:.1f} s, "
              f"exit {proc.returncode}, {len(before)} processes before")
        assert proc.returncode == 0, "".join(lines[-60:])
        assert took < STOP_BOUND_S, took
        left = {p.pid: p for p in _marked(mark)} | {pid: p for pid, p in tree.items() if _alive(p)}
        assert not left, [(p.pid, p.name(), p.cmdline()[:3]) for p in left.values()]
        for u in (url, redis_url, info["metrics_url"]):
            assert not _listening(u), f"{u} still accepts connections"
        # Ray leaves its HAProxy folder behind; serve-rft up's stop removes it
        assert not [d for d in haproxy_dirs if os.path.exists(d)], haproxy_dirs
        return pid
    finally:
        if proc.poll() is None:
            kill_all(proc)
        for p in [*_marked(mark), *tree.values()]:  # never leave a failed case's processes behind
            if _alive(p):
                p.kill()


def _wait_load(load: Load, n: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while load.ok < n and time.monotonic() < deadline:
        time.sleep(0.2)
    assert load.ok >= n, "no traffic before the kill"


def _kill_leader(cmd: list[str], proc: subprocess.Popen, info: dict, mark: str, victims: str) -> Load:
    """Under load on the run ``proc`` (started from ``cmd`` with ``SERVE_RFT_TEST_RUN=mark``),
    SIGKILL its keeper (``victims="keeper"``) or the keeper and its service process
    (``"keeper-and-service"``); assert nothing of the run is left within the bound and its ports
    are closed. Returns the load (its accepted rewards). With ``"keeper"``, a second run on the
    run dir in use is refused first."""
    tree: dict[int, psutil.Process] = {}
    try:
        url = info["url"]
        tree.update((p.pid, p) for p in [*_marked(mark), *psutil.Process(proc.pid).children(recursive=True)])
        service = next(p for p in psutil.Process(proc.pid).children()
                       if "serve_rft.cli" in " ".join(p.cmdline()))
        if victims == "keeper":  # a second run on a run dir in use is refused before it starts anything
            second = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
            said = " ".join((second.stdout + second.stderr).split())  # rich wraps lines
            assert second.returncode == 2 and "in use by another serve-rft process" in said, second
        load = Load(url)
        try:
            _wait_load(load, 8)
            os.kill(proc.pid, signal.SIGKILL)
            if victims == "keeper-and-service":
                os.kill(service.pid, signal.SIGKILL)
            t0 = time.monotonic()
            proc.wait(timeout=10)
            bound = (GRACE_S + 3 + 5) if victims == "keeper" else (3 + 7)  # grace (service alive), TERM wait, slack
            while time.monotonic() - t0 < bound + 30:
                left = {p.pid: p for p in _marked(mark)} | {pid: p for pid, p in tree.items() if _alive(p)}
                if not left:
                    break
                time.sleep(0.2)
            took = time.monotonic() - t0
        finally:
            load.stop()
        print(f"kill -9 of the {victims}: nothing left after {took:.1f} s; {len(tree)} processes before, "
              f"{load.ok} chats, {len(load.rewarded)} rewards accepted")
        assert not left, [(p.pid, p.name(), p.cmdline()[:3]) for p in left.values()]
        assert took < bound, took
        for u in (url, info["redis_url"], info["metrics_url"]):
            assert not _listening(u), f"{u} still accepts connections"
        return load
    finally:
        for p in [*_marked(mark), *tree.values()]:  # never leave a failed case's processes behind
            if _alive(p):
                p.kill()


def _start_again(cmd: list[str], log: Path, kept: Load, gone: set[str] = frozenset()
                 ) -> tuple[subprocess.Popen, list[str], dict, str]:
    """`serve-rft up` on the same run dir again: it starts, every reward ``kept`` accepted before
    is in its store, the folders ``gone`` are no more, and it answers a chat. Returns (process,
    output lines, JSON line, mark)."""
    mark = uuid.uuid4().hex
    proc, lines, info = launch(cmd, log, env={"SERVE_RFT_TEST_RUN": mark})
    try:
        assert not [d for d in gone if os.path.exists(d)], gone
        with httpx.Client(base_url=info["url"], timeout=30) as c:
            for cid in kept.rewarded:
                r = c.get(f"/v1/experiences/{cid}")
                assert r.status_code == 200, (cid, r.text)
                assert [ch["reward"] for ch in r.json()["choices"]] == [1.0, 0.0], r.json()
            r = c.post("/v1/chat/completions", json={"model": "serve-rft", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
    except BaseException:
        kill_all(proc)
        for p in _marked(mark):
            p.kill()
        raise
    return proc, lines, info, mark


def test_kill_9_of_the_leader_leaves_nothing_the_run_dir_starts_again_and_a_group_stop_ends_it(
        embedded_model, tmp_path):
    """SIGKILL runs no handler: the keeper's reaper (serve_rft.service.reaper) ends the run. One
    run dir, three runs in turn (one replica, one, two), each under load with rewards:

    1. the keeper killed alone: its service process stops on the SIGTERM the kernel sends it
       (bounded by the grace);
    2. `serve-rft up` on the same run dir starts, every reward accepted before the kill is in its
       store; then the keeper killed with its service process: the reaper ends the rest at once
       (Ray Serve's HAProxy kept the service port and redis-server the run's data directory for
       good before);
    3. the run dir starts again, the rewards of run 2 are kept; a replica is killed -9, then
       SIGTERM goes to the whole group (systemd's KillMode=control-group, `timeout`,
       kill -- -PGID): the hardest stop, a Ray worker and its engine dead before it
       (`_stop_under_load`).

    The HAProxy folder run 2's kill leaves is gone once run 3 has started
    (`serve_rft.service.ingress.remove_dead_haproxy_dirs`). At the end no replica's files are
    left in shared memory (vLLM's IPC sockets among them) but the one killed in run 3: a stopped
    replica removes its own, and the replicas of the next run remove those of the replicas killed
    before (`remove_dead_replicas_files`).

    SIGINT to the leader (Ctrl-C's signal) ends every stack module's run (tests/support/stack.py
    asserts its exit 0); the rest of the signal x target matrix: tests/unit/test_keeper.py."""
    def up(replicas: int) -> list[str]:
        return stack_command("", tmp_path / "run", "leader",
                             ["trainer.min_batch_size=4", f"explorer.num_replicas={replicas}"])
    # runs 1 and 2 with one replica (their kills end the same kinds of process: Ray's, a vLLM
    # engine's, HAProxy, redis-server; two starts bring up one engine less each), run 3 with
    # two: one killed -9, the other serving the load while the group stops
    mark = uuid.uuid4().hex
    proc, _, info = launch(up(1), tmp_path / "up.log", env={"SERVE_RFT_TEST_RUN": mark})
    replicas = _replica_pids(mark)
    kept = _kill_leader(up(1), proc, info, mark, "keeper")
    proc, _, info, mark = _start_again(up(1), tmp_path / "up2.log", kept)
    replicas |= _replica_pids(mark)
    run2_haproxy = _haproxy_dirs({p.pid: p for p in [*_marked(mark), *psutil.Process(proc.pid).children(recursive=True)]})
    kept = _kill_leader(up(1), proc, info, mark, "keeper-and-service")
    assert run2_haproxy and all(os.path.isdir(d) for d in run2_haproxy), run2_haproxy  # no stop ran
    proc, lines, info, mark = _start_again(up(2), tmp_path / "up3.log", kept, gone=run2_haproxy)  # removed by the start
    run3 = _replica_pids(mark)
    replicas |= run3
    from serve_rft.explorer.engine.vllm_engine import _shm_root

    ipc = [n for n in _replica_files(run3) if "-ipc-" in n]  # each replica's vLLM sockets, in its own folder
    assert len(ipc) == 2 and all(os.listdir(os.path.join(_shm_root(), n)) for n in ipc), ipc
    killed = _stop_under_load(proc, lines, info, mark, signal.SIGTERM, to_group=True, kill_replica=True)
    assert len(replicas) == 4 and killed in replicas, (replicas, killed)
    assert not _replica_files(replicas - {killed}), _replica_files(replicas)

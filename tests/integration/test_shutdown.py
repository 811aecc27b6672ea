"""Clean shutdown of `serve-rft up` (issue 14): each stop signal, sent to the leader or to its
whole process group, under load; once with a replica killed -9 just before.

Every process of the run carries a marker in its environment (inherited from the command the
test starts: Ray's GCS, raylet and workers, the vLLM engines, HAProxy), and every one is a
descendant of the command while it runs (redis-server too, whose process title overwrites its
environment). After the
stop: the command exited with 0 within ``service.shutdown_grace_s`` (25 s) + the keeper's
SIGTERM-then-SIGKILL of leftovers (3 s); no marked process is left; the service, redis and
metrics ports no longer accept connections.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from urllib.parse import urlparse

import httpx
import psutil
import pytest

from tests.integration.conftest import kill_all, launch, stack_command
from tests.integration.load import get_status

pytestmark = pytest.mark.integration
STOP_BOUND_S = 25 + 3 + 2  # grace, the keeper's SIGTERM wait, slack for reaping


def _marked(mark: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("SERVE_RFT_TEST_RUN") == mark and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _alive(p: psutil.Process) -> bool:
    """The same process (pid and start time) still running."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _listening(url: str) -> bool:
    u = urlparse(url)
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((u.hostname, u.port)) == 0


class Load:
    """Two users chatting (n=2) and rewarding until stopped; counts answers and errors."""

    def __init__(self, url: str):
        self.url, self.ok, self.errors = url, 0, 0
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
                        c.post("/v1/rewards", json={"completion_id": r.json()["id"], "rewards": [1.0, 0.0]})
                except httpx.HTTPError:
                    self.errors += 1
                    time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=40)


@pytest.mark.parametrize("sig,to_group,kill_replica", [
    (signal.SIGTERM, True, True),  # systemd's KillMode=control-group, `timeout`, kill -- -PGID
    (signal.SIGINT, True, False),  # Ctrl-C in a terminal
    (signal.SIGTERM, False, False),  # kill PID
    (signal.SIGINT, False, False),
], ids=["sigterm-group-after-replica-kill-9", "sigint-group", "sigterm-leader", "sigint-leader"])
def test_a_stop_ends_every_process_of_the_run_in_bounded_time(embedded_model, tmp_path, sig, to_group,
                                                              kill_replica):
    mark = uuid.uuid4().hex
    cmd = stack_command("", tmp_path, "shutdown", ["trainer.min_batch_size=4"])
    proc, lines, info = launch(cmd, tmp_path / "up.log", env={"SERVE_RFT_TEST_RUN": mark})
    tree: dict[int, psutil.Process] = {}
    try:
        url, redis_url = info["url"], info["redis_url"]
        # redis-server rewrites its environment block (its process title): found as a descendant
        tree.update((p.pid, p) for p in [*_marked(mark), *psutil.Process(proc.pid).children(recursive=True)])
        before = {pid: p.name() for pid, p in tree.items()}
        names = " ".join(before.values()).lower()
        assert "redis-server" in names and "raylet" in names and "gcs_server" in names, before
        assert any("haproxy" in n.lower() for n in before.values()), before
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
        print(f"stop: {took:.1f} s, exit {proc.returncode}, {len(before)} processes before")
        assert proc.returncode == 0, "".join(lines[-60:])
        assert took < STOP_BOUND_S, took
        left = {p.pid: p for p in _marked(mark)} | {pid: p for pid, p in tree.items() if _alive(p)}
        assert not left, [(p.pid, p.name(), p.cmdline()[:3]) for p in left.values()]
        for u in (url, redis_url, info["metrics_url"]):
            assert not _listening(u), f"{u} still accepts connections"
    finally:
        if proc.poll() is None:
            kill_all(proc)
        for p in [*_marked(mark), *tree.values()]:  # never leave a failed case's processes behind
            if _alive(p):
                p.kill()


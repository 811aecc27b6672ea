"""The embedded redis-server's supervisor against real redis-server processes."""

import os
import signal

import redis

from serve_rft.buffer.redis_server import RedisSupervisor
from tests.support.polling import until


def test_a_killed_redis_is_restarted_from_its_aof_on_the_same_port_and_counted(tmp_path):
    sup = RedisSupervisor(tmp_path / "r", appendfsync="always", key_prefix="p", poll_s=0.1)
    try:
        url, first = sup.url, sup.pid
        redis.Redis.from_url(url).set("kept", "yes")
        os.kill(first, signal.SIGKILL)
        assert until(lambda: sup.restarts == 1), "not restarted"
        assert sup.url == url and sup.pid != first
        r = redis.Redis.from_url(url)
        assert r.get("kept") == b"yes"  # reloaded from the AOF
        assert r.hget("p:stat", "redis_restarts") == b"1"
    finally:
        sup.stop()
    assert sup.server.proc.poll() is not None  # stopped: nothing left running


def test_restarts_are_bounded_and_a_crash_loop_is_reported(tmp_path):
    sup = RedisSupervisor(tmp_path / "r", max_restarts=1, window_s=60, poll_s=0.1)
    try:
        os.kill(sup.pid, signal.SIGKILL)
        assert until(lambda: sup.restarts == 1)
        os.kill(sup.pid, signal.SIGKILL)
        assert until(lambda: sup.failed is not None)
        assert "died 2 times" in sup.failed and sup.restarts == 1
    finally:
        sup.stop()


def test_free_ports_come_from_outside_the_ephemeral_range_and_skip_taken_ones(monkeypatch):
    """An outgoing connection takes its source port from the ephemeral range, and a Serve replica
    in HAProxy mode its own from the direct-ingress range; a port chosen there could be taken
    before the server binds it."""
    import random
    import socket

    from serve_rft.buffer import redis_server

    monkeypatch.setattr(redis_server, "_HANDED_OUT", set())
    low, high = redis_server.PORT_BAND
    ports = {redis_server.free_port() for _ in range(20)}
    assert all(low <= p <= high for p in ports)
    with socket.socket() as taken:  # a candidate that is taken is skipped
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        serve_lo, serve_hi = redis_server.reserved_ranges()[0]
        picks = iter([busy, serve_lo, busy, serve_hi, low + 7])
        monkeypatch.setattr(random, "randint", lambda a, b: next(picks))
        assert redis_server.free_port() == low + 7
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", str(low + 100))
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", str(low + 200))
    assert redis_server.reserved_ranges()[0] == (low + 100, low + 200)


def test_free_port_never_hands_out_the_same_port_twice(monkeypatch):
    """The service port and HAProxy's stats port are chosen one after the other and bound tens of
    seconds later by other processes; the second choice must not repeat the first even though the
    first still binds."""
    import random

    from serve_rft.buffer import redis_server

    monkeypatch.setattr(redis_server, "_HANDED_OUT", set())
    low = redis_server.PORT_BAND[0]
    picks = iter([low + 3, low + 3, low + 3, low + 4])
    monkeypatch.setattr(random, "randint", lambda a, b: next(picks))
    assert [redis_server.free_port(), redis_server.free_port()] == [low + 3, low + 4]


def test_a_second_supervisor_on_the_same_data_dir_is_refused_until_the_first_stops(tmp_path):
    """Two redis-servers on one data directory would append to one AOF."""
    import pytest

    from serve_rft.buffer.redis_server import DataDirInUse

    first = RedisSupervisor(tmp_path / "r", poll_s=0.1)
    try:
        with pytest.raises(DataDirInUse, match=f"pid {os.getpid()}"):
            RedisSupervisor(tmp_path / "r", poll_s=0.1)
    finally:
        first.stop()
    second = RedisSupervisor(tmp_path / "r", poll_s=0.1)  # the lock went with the first's stop
    second.stop()


def test_redis_ends_with_the_process_that_started_it_even_by_kill_9(tmp_path):
    """PR_SET_PDEATHSIG: SIGTERM when its starter dies, so it flushes and leaves the directory to
    the next run (an orphan kept it, and the port, for good), and that run finds what was written."""
    import subprocess
    import sys
    from pathlib import Path

    import psutil

    code = ("import sys, time; from serve_rft.buffer.redis_server import RedisSupervisor; "
            "s = RedisSupervisor(sys.argv[1], appendfsync='always'); print(s.pid, s.url, flush=True); "
            "time.sleep(600)")
    owner = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "r")], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    server = None
    try:
        pid, url = owner.stdout.readline().split()
        server = psutil.Process(int(pid))
        redis.Redis.from_url(url).set("kept", "yes")
        owner.kill()
        owner.wait()
        server.wait(timeout=10)  # raises TimeoutExpired if it outlives its owner
    finally:
        if owner.poll() is None:
            owner.kill()
        if server is not None and server.is_running():
            server.kill()  # a failed case leaves nothing behind
    sup = RedisSupervisor(tmp_path / "r", poll_s=0.1)  # the lock died with the owner
    try:
        assert redis.Redis.from_url(sup.url).get("kept") == b"yes"
    finally:
        sup.stop()

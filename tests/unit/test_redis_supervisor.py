"""The embedded redis-server's supervisor against real redis-server processes."""

import os
import signal
import time

import redis

from serve_rft.buffer.redis_server import RedisSupervisor


def _until(pred, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_a_killed_redis_is_restarted_from_its_aof_on_the_same_port_and_counted(tmp_path):
    sup = RedisSupervisor(tmp_path / "r", appendfsync="always", key_prefix="p", poll_s=0.1)
    try:
        url, first = sup.url, sup.pid
        redis.Redis.from_url(url).set("kept", "yes")
        os.kill(first, signal.SIGKILL)
        assert _until(lambda: sup.restarts == 1), "not restarted"
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
        assert _until(lambda: sup.restarts == 1)
        os.kill(sup.pid, signal.SIGKILL)
        assert _until(lambda: sup.failed is not None)
        assert "died 2 times" in sup.failed and sup.restarts == 1
    finally:
        sup.stop()

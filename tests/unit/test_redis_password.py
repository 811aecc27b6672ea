"""The embedded redis-server's password against real redis-server processes: kept 0600 in the
data directory, handed over in a 0600 config file (never the command line), required of every
client, kept across restarts; printed URLs never carry it."""

import json
import os
import signal
import socket
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from serve_rft.buffer.redis_auth import (CONFIG_FILE, PASSWORD_FILE, embedded_url, redacted,
                                         run_password, with_password)
from serve_rft.buffer.redis_server import RedisSupervisor, start_redis
from tests.support.polling import until


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _once(**kwargs) -> redis.Redis:
    """A client that does not retry (redis-py retries a refused handshake with backoff)."""
    return redis.Redis(socket_timeout=2.0, retry=Retry(NoBackoff(), 0), **kwargs)


def _refused(port: int) -> None:
    """A client without the password is refused: NOAUTH to a plain command, and redis-py's
    handshake (HELLO) fails with AuthenticationError."""
    with socket.create_connection(("127.0.0.1", port), timeout=2.0) as s:
        s.sendall(b"*2\r\n$3\r\nGET\r\n$4\r\nkept\r\n")
        assert s.makefile("rb").readline().startswith(b"-NOAUTH")
    with _once(port=port) as anonymous, pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.set("k", "v")


def test_the_supervised_server_requires_the_run_dir_s_password_kept_0600_and_reused(tmp_path):
    sup = RedisSupervisor(tmp_path / "r", poll_s=0.1)
    try:
        pw_file, conf = tmp_path / "r" / PASSWORD_FILE, tmp_path / "r" / CONFIG_FILE
        password = pw_file.read_text().strip()
        assert len(password) >= 40 and _mode(pw_file) == 0o600 and _mode(conf) == 0o600
        assert f"requirepass {password}" in conf.read_text().splitlines()
        assert password in sup.url
        assert password not in Path(f"/proc/{sup.pid}/cmdline").read_bytes().decode()  # ps shows it
        argv = " ".join(sup.server.proc.args)  # what it was started with (redis retitles itself)
        assert password not in argv and str(conf.resolve()) in argv
        _refused(sup.port)
        with redis.Redis.from_url(sup.url) as client:
            client.set("kept", "yes")
        with _once(port=sup.port, password="wrong") as guess, \
                pytest.raises(redis.exceptions.AuthenticationError):
            guess.ping()
    finally:
        sup.stop()
    again = RedisSupervisor(tmp_path / "r", poll_s=0.1)  # the same run dir starts again
    try:
        assert run_password(tmp_path / "r") == password and password in again.url
        assert _mode(pw_file) == 0o600
        with redis.Redis.from_url(again.url) as client:
            assert client.get("kept") == b"yes"  # its AOF, under the same password
        _refused(again.port)
    finally:
        again.stop()


def test_a_restart_after_kill_9_keeps_the_password(tmp_path):
    sup = RedisSupervisor(tmp_path / "r", key_prefix="p", poll_s=0.1)
    try:
        url, first = sup.url, sup.pid
        redis.Redis.from_url(url).set("kept", "yes")
        os.kill(first, signal.SIGKILL)
        assert until(lambda: sup.restarts == 1), "not restarted"
        assert sup.url == url and sup.pid != first
        assert run_password(tmp_path / "r") not in Path(f"/proc/{sup.pid}/cmdline").read_text()
        _refused(sup.port)
        with redis.Redis.from_url(url) as client:
            assert client.get("kept") == b"yes"
            assert client.hget("p:stat", "redis_restarts") == b"1"  # the supervisor authenticates too
    finally:
        sup.stop()


def test_a_password_file_open_to_others_is_refused(tmp_path):
    data = tmp_path / "r"
    data.mkdir()
    (data / PASSWORD_FILE).write_text("guessable\n")
    os.chmod(data / PASSWORD_FILE, 0o644)
    with pytest.raises(PermissionError, match="0600"):
        run_password(data)
    with pytest.raises(PermissionError):
        RedisSupervisor(data, poll_s=0.1)
    assert not (data / CONFIG_FILE).exists()  # nothing started


def test_start_redis_without_a_password_stays_open_and_writes_no_config(tmp_path):
    """The tests' own servers and an operator's workflow with `start_redis` are unchanged."""
    server = start_redis(tmp_path / "r")
    try:
        assert "@" not in server.url and not (tmp_path / "r" / CONFIG_FILE).exists()
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
    finally:
        server.stop()


@pytest.mark.parametrize("url, shown", [
    ("redis://:s3cret@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("redis://alice:s3cret@db.example:6380/2", "redis://alice@db.example:6380/2"),
    ("rediss://:s3cret@db.example:6380", "rediss://db.example:6380"),
    ("redis://db.example:6379/0?password=s3cret&socket_timeout=2", "redis://db.example:6379/0?socket_timeout=2"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("", ""), (None, None),
])
def test_redacted_urls_carry_no_password(url, shown):
    assert redacted(url) == shown
    assert "s3cret" not in (redacted(url) or "")


def test_with_password_round_trips_through_redis_py():
    url = with_password("redis://127.0.0.1:6379/3", "a-b_c")
    assert url == "redis://:a-b_c@127.0.0.1:6379/3"
    kwargs = redis.connection.parse_url(url)
    assert kwargs["password"] == "a-b_c" and kwargs["port"] == 6379 and kwargs["db"] == 3
    assert redacted(url) == "redis://127.0.0.1:6379/3"
    assert with_password("redis://alice:old@db.example:6379/0", "new") == "redis://alice:new@db.example:6379/0"


def test_train_mode_finds_the_password_of_the_printed_embedded_url_only(tmp_path):
    """`--mode train` joining a serve run gets the redacted URL; the password comes from the run
    dir when the URL names that run's embedded server, and nothing is added to any other URL."""
    data = tmp_path / "redis"
    sup = RedisSupervisor(data, poll_s=0.1)
    try:
        printed = redacted(sup.url)
        assert "@" not in printed
        joined = embedded_url(printed, data)
        assert joined == sup.url
        with redis.Redis.from_url(joined) as client:
            assert client.ping()
        other_port = f"redis://127.0.0.1:{sup.port + 1}/0"
        for url in (other_port, "redis://db.example:6379/0", "redis://:theirs@127.0.0.1:6379/0",
                    sup.url):
            assert embedded_url(url, data) == url
        assert embedded_url(printed, tmp_path / "elsewhere") == printed  # no embedded server there
    finally:
        sup.stop()


def test_the_ready_line_shows_the_redis_url_without_its_password():
    from serve_rft.cli import ready_line

    secret = "Zm9vYmFyLXNlY3JldC1wYXNzd29yZC0xMjM0NTY3ODkw"
    stack = SimpleNamespace(url="http://127.0.0.1:8000", startup_seconds=1.5, ray_address="127.0.0.1:6380",
                            metrics_url="", redis=SimpleNamespace(pid=4321),
                            cfg=SimpleNamespace(buffer=SimpleNamespace(redis_url=f"redis://:{secret}@127.0.0.1:23456/0")))
    line = ready_line(stack, "both")
    assert secret not in line
    info = json.loads(line)
    assert info["redis_url"] == "redis://127.0.0.1:23456/0" and info["redis_pid"] == 4321
    assert info["url"] == "http://127.0.0.1:8000" and info["mode"] == "both"
    stack.cfg.buffer.redis_url, stack.redis = "redis://db.example:6379/0", None  # an operator's Redis
    info = json.loads(ready_line(stack, "serve"))
    assert info["redis_url"] == "redis://db.example:6379/0" and info["redis_pid"] is None


def test_the_server_repr_carries_no_password(tmp_path):
    server = start_redis(tmp_path / "data", password="hunter2-embedded")
    try:
        assert "hunter2-embedded" in server.url
        assert "hunter2-embedded" not in repr(server) and "hunter2-embedded" not in str(server)
    finally:
        server.stop()


def test_the_data_directory_is_closed_to_other_users(tmp_path):
    """The AOF holds every tenant's prompts and rewards: the data directory is 0700, made so when
    created (whatever the umask) and when it already exists open to others."""
    old = os.umask(0o022)
    try:
        fresh = tmp_path / "fresh" / "data"
        run_password(fresh)
        assert _mode(fresh) == 0o700
        existing = tmp_path / "existing"
        existing.mkdir(mode=0o755)
        os.chmod(existing, 0o755)
        server = start_redis(existing)
        try:
            assert _mode(existing) == 0o700
        finally:
            server.stop()
        also = tmp_path / "new-plain"
        start_redis(also).stop()
        assert _mode(also) == 0o700
    finally:
        os.umask(old)

"""Start and stop an embedded `redis-server` (own port, own data directory, AOF persistence).

The process is tracked by its pid and ended by it, never by name. It ends with the process that
started it (SIGTERM from the kernel, ``PR_SET_PDEATHSIG``: it flushes its AOF and exits), however
that one died: an orphaned redis-server kept its data directory, and one started on that directory
next would append to the same AOF. A `RedisSupervisor` holds a lock on its data directory, so a
second run on it fails at once with `DataDirInUse`.

The supervised server requires a password: `serve_rft.buffer.redis_auth`.
"""

from __future__ import annotations

import fcntl
import os
import signal
import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from serve_rft.buffer.redis_auth import CONFIG_FILE, private_dir, run_password, with_password, write_private
from serve_rft.proc import die_with_parent

MISSING = ("redis-server not found on PATH: install it (Debian/Ubuntu: `apt-get install redis-server`; "
           "a checkout: `bash scripts/bootstrap.sh`) or set buffer.redis_url to a running Redis")
"""What a start without ``redis-server`` says (`start_redis`, `serve_rft.control.preflight`)."""


PORT_BAND = (20000, 32767)
"""Where `free_port` looks: above Ray's worker ports (10002-19999 by default) and below Linux's
ephemeral range (``net.ipv4.ip_local_port_range``, 32768-60999 by default). A port the kernel
hands out for ``bind(0)`` comes from the ephemeral range, where any outgoing connection made
before the server binds it may take it as its source port (a stack once failed to start with
Ray Serve's "Failed to bind to address 127.0.0.1:37351")."""

SERVE_INGRESS_PORTS = (("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", 30000,
                        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", 31000),
                       ("RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT", 40000,
                        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT", 41000))
"""The ranges Ray Serve's replicas take their own HTTP and gRPC ports from in HAProxy mode
("direct ingress"; env variable and default of each end). `free_port` never returns a port in
them: a replica that starts between the choice and the bind takes it first (a stack in CI once
failed to start with HAProxy unable to bind its port)."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return PORT_BAND[1] + 1


def reserved_ranges() -> list[tuple[int, int]]:
    """Ray Serve's direct-ingress port ranges as this process's environment sets them, inclusive
    (`SERVE_INGRESS_PORTS`); an unparsable value counts as its default."""
    def value(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default
    return [(value(lo, lo_default), value(hi, hi_default))
            for lo, lo_default, hi, hi_default in SERVE_INGRESS_PORTS]


_HANDED_OUT: set[int] = set()
"""Every port `free_port` returned in this process. A port chosen here is often bound much later
by another process (the service port by Serve's proxy, the HAProxy stats port by HAProxy, tens of
seconds after `serve-rft up` chose them), so a second choice that only checks whether the port
binds *now* can return the same number. A stack in CI once failed to start with HAProxy's stats
listener refused ("Address already in use") while the other listeners of the same HAProxy bound."""


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A TCP port that was free a moment ago, outside the ephemeral range (`PORT_BAND`), outside
    Ray Serve's replica port ranges (`reserved_ranges`) and never one this process returned before
    (`_HANDED_OUT`): a random candidate that binds is returned (closed again). Falls back to
    ``bind(0)`` if ``tries`` candidates were all taken."""
    low, high = PORT_BAND[0], min(PORT_BAND[1], _ephemeral_low() - 1)
    reserved = reserved_ranges()
    for _ in range(tries if high > low else 0):
        port = random.randint(low, high)
        if port in _HANDED_OUT or any(lo <= port <= hi for lo, hi in reserved):
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    for _ in range(tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free port on {host} after {tries} tries")


class DataDirInUse(RuntimeError):
    """Another process (a running `serve-rft up`) holds the redis data directory."""


@dataclass
class RedisServer:
    """A running embedded redis-server: ``url`` (with the password, if any), ``pid``, ``stop()``."""

    proc: subprocess.Popen
    port: int
    data_dir: Path
    password: str | None = field(default=None, repr=False)  # a traceback's locals never show it

    @property
    def url(self) -> str:
        base = f"redis://127.0.0.1:{self.port}/0"
        return with_password(base, self.password) if self.password else base

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (redis flushes the AOF and exits), then SIGKILL after ``timeout_s``."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_redis(data_dir: str | Path, port: int | None = None, timeout_s: float = 20.0,
                appendfsync: str = "always", maxmemory_bytes: int | None = None,
                password: str | None = None) -> RedisServer:
    """Start ``redis-server`` with append-only persistence in ``data_dir`` (created or made mode
    0700: its AOF holds every tenant's prompts and rewards; `private_dir`).

    Args:
        password: the ``requirepass`` clients must AUTH with (None: none). It reaches redis-server
            in ``data_dir/redis.conf``, written anew with mode 0600 at each start (the file is
            removed when there is no password), never on the command line.
        appendfsync: ``always`` (the AOF is written and fsynced before every reply: an
            acknowledged write survives a kill -9 of redis-server and a crash of the machine) or
            ``everysec`` (fsync once a second; while a background fsync is slow, Redis postpones
            even the write of the AOF up to 2 s and answers meanwhile, so an acknowledged write
            can be lost to a kill -9 of redis-server too: Redis docs, "Redis persistence", and
            ``flushAppendOnlyFile`` in Redis's src/aof.c).
        maxmemory_bytes: Redis ``maxmemory`` with ``noeviction``: past it writes are refused
            (the store counts and reports them), nothing is evicted. None: no bound.

    Raises:
        FileNotFoundError: no ``redis-server`` on PATH (`MISSING` says how to install it).
        RuntimeError: the server did not answer PING within ``timeout_s``.
    """
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError(MISSING)
    data = private_dir(Path(data_dir).resolve())
    port = port or free_port()
    conf = data / CONFIG_FILE
    conf.unlink(missing_ok=True)
    args = [exe]
    if password is not None:
        write_private(conf, f"port {port}\nrequirepass {password}\n")
        args.append(str(conf))
    args += [
        "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
        "--appendonly", "yes", "--appendfsync", appendfsync, "--save", "",
        "--daemonize", "no", "--protected-mode", "yes",
        "--logfile", str(data / "redis.log"),
    ]
    if maxmemory_bytes is not None:
        args += ["--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", "noeviction"]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM))
    server = RedisServer(proc=proc, port=port, data_dir=data, password=password)
    probe = b"*1\r\n$4\r\nPING\r\n"
    if password is not None:  # RESP array: AUTH's reply (+OK) comes first
        secret = password.encode()
        probe = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(secret), secret) + probe
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}; see {data}/redis.log")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s, s.makefile("rb") as replies:
                s.sendall(probe)
                if password is not None:
                    replies.readline()
                if replies.readline().startswith(b"+PONG"):
                    return server
        except OSError:
            pass
        time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"redis-server on port {port} did not answer within {timeout_s} s")


class RedisSupervisor:
    """Keeps the embedded redis-server running: when its process dies (kill -9, OOM killer), it
    is started again on the same port and data directory, so it reloads its AOF and every
    client's retrying connection (`serve_rft.buffer.store`, ``buffer.reconnect_s``) finds it.

    Restarts are bounded: at most ``max_restarts`` within ``window_s`` seconds, each after an
    exponential backoff (0.5 s doubling, at most 8 s); past the bound it gives up, logs the
    reason and keeps it in ``failed`` (a crash loop is not hidden behind restarts). Each restart
    is logged and counted (``restarts``; and ``redis_restarts`` in the store's ``P:stat`` when
    ``key_prefix`` is given). Same interface as `RedisServer` for its owner (``url``, ``pid``,
    ``stop``). With ``auth`` (the default) the server requires the data directory's password
    (`run_password`), the same one on every restart, and ``url`` carries it.

    The supervisor holds an exclusive lock (``flock``) on ``data_dir/serve-rft.lock`` from its
    start to `stop` (the kernel drops it when the process dies).

    Raises (constructor):
        DataDirInUse: another process holds ``data_dir`` (its pid in the message).
        PermissionError / ValueError: the password file is open to others or empty (`run_password`).
        Whatever `start_redis` raises for the first start.
    """

    def __init__(self, data_dir: str | Path, appendfsync: str = "always",
                 maxmemory_bytes: int | None = None, key_prefix: str | None = None,
                 max_restarts: int = 5, window_s: float = 300.0, poll_s: float = 0.5, auth: bool = True):
        import threading

        self.data_dir = Path(data_dir)
        self._lock = _lock_dir(self.data_dir)
        try:
            self._args = dict(appendfsync=appendfsync, maxmemory_bytes=maxmemory_bytes,
                              password=run_password(self.data_dir) if auth else None)
            self.server = start_redis(self.data_dir, **self._args)
        except BaseException:
            os.close(self._lock)
            raise
        self.port = self.server.port
        self.key_prefix = key_prefix
        self.max_restarts, self.window_s, self.poll_s = max_restarts, window_s, poll_s
        self.restarts = 0
        self.failed: str | None = None
        self._recent: list[float] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="redis-supervisor", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def pid(self) -> int:
        return self.server.pid

    def _watch(self) -> None:
        import logging

        log = logging.getLogger("serve_rft.buffer")
        while not self._stopping.wait(self.poll_s):
            if self.server.proc.poll() is None:
                continue
            code = self.server.proc.returncode
            now = time.monotonic()
            self._recent = [t for t in self._recent if now - t < self.window_s]
            if len(self._recent) >= self.max_restarts:
                self.failed = (f"redis-server died {len(self._recent) + 1} times in {self.window_s:.0f} s "
                               f"(last exit {code}); not restarted again: see {self.data_dir}/redis.log")
                log.error(self.failed)
                return
            time.sleep(min(8.0, 0.5 * 2 ** len(self._recent)))
            if self._stopping.is_set():
                return
            self._recent.append(time.monotonic())
            try:
                self.server = start_redis(self.data_dir, port=self.port, **self._args)
            except (RuntimeError, OSError) as e:  # e.g. the port not yet free: the next poll retries
                log.warning("restarting redis-server failed (%s); retrying", e)
                continue
            log.warning("redis-server (exit %s) restarted from its AOF on port %d, pid %d (restart %d)",
                        code, self.port, self.server.pid, self.restarts + 1)
            self._record(log)
            self.restarts += 1  # after the store's count, so a reader of both never sees them apart

    def _record(self, log) -> None:
        """Count the restart in the store's ``P:stat`` (a few tries: a just-started server may still
        be loading its AOF); a count that cannot be written is logged, the watch goes on."""
        if self.key_prefix is None:
            return
        import redis

        for attempt in range(5):
            try:
                with redis.Redis.from_url(self.url, socket_timeout=2.0) as client:
                    client.hincrby(f"{self.key_prefix}:stat", "redis_restarts", 1)
                return
            except redis.RedisError as e:
                if attempt == 4 or self._stopping.wait(0.2 * 2 ** attempt):
                    log.warning("redis restart %d not counted in %s:stat: %s",
                                self.restarts + 1, self.key_prefix, e)
                    return

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop watching, then stop the server (SIGTERM, SIGKILL after ``timeout_s``)."""
        self._stopping.set()
        self._thread.join(timeout=5.0)
        self.server.stop(timeout_s)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def _lock_dir(data_dir: Path) -> int:
    """Take ``data_dir/serve-rft.lock`` (``flock``, exclusive, not waiting) and write this pid in
    it. Returns the open descriptor (closing it releases the lock).

    Raises:
        DataDirInUse: another process holds it.
    """
    private_dir(data_dir)
    fd = os.open(data_dir / "serve-rft.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DataDirInUse(f"{data_dir} is in use by another serve-rft process (pid {holder}); give "
                           "this run its own service.run_dir, or stop that one first") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd

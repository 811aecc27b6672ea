"""Start and stop an embedded `redis-server` (own port, own data directory, AOF persistence).

The process is tracked by its pid and ended by it, never by name.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """A running embedded redis-server: ``url``, ``pid``, ``stop()``."""

    proc: subprocess.Popen
    port: int
    data_dir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

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
                appendfsync: str = "everysec", maxmemory_bytes: int | None = None) -> RedisServer:
    """Start ``redis-server`` with append-only persistence in ``data_dir``.

    Args:
        appendfsync: ``everysec`` (an acknowledged write survives a crash unless it was in the
            last second) or ``always`` (fsync before every reply: none is lost).
        maxmemory_bytes: Redis ``maxmemory`` with ``noeviction``: past it writes are refused
            (the store counts and reports them), nothing is evicted. None: no bound.

    Raises:
        FileNotFoundError: no ``redis-server`` on PATH (run scripts/bootstrap.sh).
        RuntimeError: the server did not answer PING within ``timeout_s``.
    """
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server not found on PATH; run scripts/bootstrap.sh")
    data = Path(data_dir).resolve()
    data.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    args = [
        exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
        "--appendonly", "yes", "--appendfsync", appendfsync, "--save", "",
        "--daemonize", "no", "--protected-mode", "yes",
        "--logfile", str(data / "redis.log"),
    ]
    if maxmemory_bytes is not None:
        args += ["--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", "noeviction"]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    server = RedisServer(proc=proc, port=port, data_dir=data)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}; see {data}/redis.log")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return server
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise RuntimeError(f"redis-server on port {port} did not answer within {timeout_s} s")

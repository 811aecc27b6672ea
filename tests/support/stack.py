"""A real stack for tests and benchmarks: `serve-rft up` as a subprocess.

Real redis-server (the caller's, on a free port, so tests can read the store directly; or the
embedded one when ``redis_url`` is empty), Ray Serve with two vLLM-CPU explorer replicas on the
embedded model, the trainer and the synchronizer. Ended by the pid we started: SIGINT (clean
shutdown), then SIGKILL of every process under it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from serve_rft.buffer.redis_auth import embedded_url

STARTUP_TIMEOUT_S = 600


@dataclass
class Stack:
    """A running `serve-rft up`: its service ``url``, store (``redis_url``, key ``prefix``),
    ``model_path``, ``run_dir``, keeper process, Ray address, ``startup_seconds`` (s) and the
    Prometheus ``metrics_url``."""

    url: str
    redis_url: str
    prefix: str
    model_path: Path
    run_dir: Path
    proc: subprocess.Popen
    ray_address: str
    startup_seconds: float
    metrics_url: str = ""
    redis_pid: int | None = None  # the embedded redis-server (started with buffer.redis_url empty)


def _pump(stream, sink: list[str], log_path: Path) -> None:
    with open(log_path, "a") as f:
        for line in iter(stream.readline, ""):
            sink.append(line)
            f.write(line)
            f.flush()


def stack_command(redis_url: str, run_dir: Path, prefix: str, overrides: list[str],
                  args: tuple[str, ...] = ()) -> list[str]:
    """The `serve-rft up` command line of a test stack (free ports, small batches)."""
    cmd = [sys.executable, "-m", "serve_rft.cli", "up", "--port", "0", *args,
           "--set", f"buffer.redis_url={redis_url}",
           "--set", f"buffer.key_prefix={prefix}",
           "--set", f"service.run_dir={run_dir}", "--set", "service.metrics_port=0",
           "--set", "trainer.min_batch_size=8", "--set", "trainer.batch_size=32",
           "--set", "trainer.batch_wait_s=1.0", "--set", "trainer.max_batch_wait_s=10"]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def launch(cmd: list[str], log_path: Path, env: dict[str, str] | None = None
           ) -> tuple[subprocess.Popen, list[str], dict]:
    """Start ``cmd`` (a `serve-rft up`) in a session of its own and wait for its JSON line.

    Returns:
        (the process, its output lines so far and to come, the JSON line).
    Raises:
        RuntimeError: it exited first; TimeoutError: no JSON line in STARTUP_TIMEOUT_S.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    lines: list[str] = []
    threading.Thread(target=_pump, args=(proc.stdout, lines, log_path), daemon=True).start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"serve-rft up exited with {proc.returncode}:\n{''.join(lines[-80:])}")
        if time.monotonic() > deadline:
            kill_all(proc)
            raise TimeoutError(f"serve-rft up not ready after {STARTUP_TIMEOUT_S} s:\n{''.join(lines[-80:])}")
        for line in list(lines):
            if line.startswith('{"url"'):
                return proc, lines, json.loads(line)
        time.sleep(0.5)


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the keeper ``proc`` and every process under it (by pid, never by name)."""
    try:
        procs = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def stop(proc: subprocess.Popen, timeout_s: float = 120) -> int:
    """End the `serve-rft up` keeper ``proc`` as Ctrl-C does: SIGINT, then wait up to
    ``timeout_s`` seconds; past that, `kill_all`. Returns its exit code."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_all(proc)
    return proc.returncode


def store_url(info: dict, redis_url: str, run_dir: Path) -> str:
    """The URL tests open the stack's store with: the caller's ``redis_url``, or the embedded
    redis-server's from the JSON line (``info``, printed without its password) with the password
    of ``run_dir/redis`` (tests run as the user that owns it)."""
    return embedded_url(info.get("redis_url") or redis_url, run_dir / "redis")


def start_stack(redis_url: str, model_path: Path, run_dir: Path, overrides: list[str],
                args: tuple[str, ...] = (), prefix: str | None = None):
    """Run `serve-rft up` with ``overrides`` and more CLI ``args``; a generator yielding a
    `Stack`, then ending it. ``prefix``: the store's key prefix (default: the run dir's name).

    Raises:
        RuntimeError / TimeoutError: from `launch`; AssertionError: the clean shutdown (SIGINT,
        120 s) did not exit 0.
    """
    prefix = prefix or run_dir.name
    log_path = run_dir / f"serve-rft-up{'-'.join(args)}.log"
    proc, lines, info = launch(stack_command(redis_url, run_dir, prefix, overrides, args), log_path)
    yield Stack(url=info["url"], redis_url=store_url(info, redis_url, run_dir), prefix=prefix,
                model_path=model_path, run_dir=run_dir, proc=proc, startup_seconds=info["startup_seconds"],
                ray_address=info["ray_address"], metrics_url=info.get("metrics_url", ""),
                redis_pid=info.get("redis_pid"))
    assert stop(proc) == 0, "".join(lines[-80:])


def stack_fixture(run_name: str, overrides: list[str], args: tuple[str, ...] = (), doc: str = ""):
    """A module-scoped pytest fixture named ``stack``: one `start_stack` on the session's
    redis-server (fixture ``redis_server``) and the embedded model, in a fresh run directory
    named after ``run_name``, with ``overrides`` (``key=value`` settings) and CLI ``args``;
    ``doc``: the fixture's docstring (``pytest --fixtures``).

    Use as ``stack = stack_fixture("run-keep", [...])`` at a test module's top level."""

    def stack(redis_server, embedded_model, tmp_path_factory):
        yield from start_stack(redis_server.url, embedded_model, tmp_path_factory.mktemp(run_name),
                               list(overrides), args)

    stack.__doc__ = doc or f"The stack of run {run_name!r}: {', '.join(overrides) or 'default settings'}."
    return pytest.fixture(scope="module")(stack)

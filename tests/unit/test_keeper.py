"""The keeper of `serve-rft up` (serve_rft.service.keeper) with small stand-in service processes:
the stop is forwarded, the grace is bounded, and no descendant outlives it, orphans included; its
reaper (serve_rft.service.reaper) does the same when the keeper is killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from serve_rft.service import keeper, reaper

ROOT = str(Path(__file__).resolve().parents[2])
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")

# A stand-in service: starts a child that ignores SIGTERM and a double-forked orphan (as a
# daemonizing proxy would), writes "up", then waits for SIGINT (or ignores it: IGNORE=1).
SERVICE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    def sleeper(name):  # writes its pid to `name`, ignores SIGTERM, sleeps
        code = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)")
        return [sys.executable, "-c", code, name]
    subprocess.Popen(sleeper("child.pid"))
    first = os.fork()
    if first == 0:  # the orphan: its parent exits at once, it is adopted by the keeper
        if os.fork() == 0:
            os.execv(sys.executable, sleeper("orphan.pid"))
        os._exit(0)
    os.waitpid(first, 0)
    while not (os.path.exists("child.pid") and os.path.exists("orphan.pid")):
        time.sleep(0.01)
    time.sleep(0.05)
    # the SIGINT handler is in place before "up": a SIGINT that comes at once exits with EXIT too
    stop = lambda signum, frame: sys.exit(int(os.environ.get("EXIT", "0")))
    signal.signal(signal.SIGINT, signal.SIG_IGN if os.environ.get("IGNORE") else stop)
    if os.environ.get("IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("up", flush=True)
    time.sleep(600)
""")


def _marked(mark: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("KEEPER_TEST") == mark and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _run_keeper(tmp_path, grace_s: float, **env) -> tuple[subprocess.Popen, str]:
    """A keeper process (``keep`` in a fresh interpreter, as `serve-rft up` runs it) over SERVICE,
    once the service has started its child and its orphan."""
    mark = uuid.uuid4().hex
    script = tmp_path / "service.py"
    script.write_text(SERVICE)
    code = (f"import sys; from serve_rft.service.keeper import keep; "
            f"sys.exit(keep([sys.executable, {str(script)!r}], {grace_s}))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True, env={**os.environ, **env, "KEEPER_TEST": mark, "PYTHONPATH": ROOT})
    assert proc.stdout.readline().strip() == "up"
    orphan = psutil.Process(int((tmp_path / "orphan.pid").read_text()))
    assert orphan.ppid() == proc.pid  # adopted by the keeper (a child subreaper), not by init
    assert len(_marked(mark)) == 5  # keeper, reaper, service, its child, the orphan
    return proc, mark


def _service(proc: subprocess.Popen, mark: str) -> psutil.Process:
    return next(p for p in _marked(mark) if p.ppid() == proc.pid and "service.py" in " ".join(p.cmdline()))


def _none_left(mark: str, within_s: float) -> float:
    """Seconds until no marked process is left; fails after ``within_s``."""
    t0 = time.monotonic()
    while _marked(mark):
        assert time.monotonic() - t0 < within_s, [(p.pid, p.cmdline()[-2:]) for p in _marked(mark)]
        time.sleep(0.1)
    return time.monotonic() - t0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
@pytest.mark.parametrize("to_group", [False, True])
def test_a_stop_signal_to_the_keeper_or_its_group_ends_every_process(tmp_path, sig, to_group):
    proc, mark = _run_keeper(tmp_path, grace_s=10)
    t0 = time.monotonic()
    (os.killpg if to_group else os.kill)(proc.pid, sig)
    assert proc.wait(timeout=30) == 0  # the service exited 0 on the forwarded SIGINT
    assert time.monotonic() - t0 < 10  # no grace needed: the leftovers get SIGTERM, then SIGKILL at 3 s
    assert _marked(mark) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_group_stop_after_a_descendant_was_killed_9_ends_every_process(tmp_path, sig):
    """The keeper's part of tests/integration/test_shutdown.py's real-stack case (a replica killed
    -9, then a stop signal to the group), for each stop signal: the dead child changes nothing."""
    proc, mark = _run_keeper(tmp_path, grace_s=10)
    child = psutil.Process(int((tmp_path / "child.pid").read_text()))
    child.kill()
    deadline = time.monotonic() + 5
    while child.status() != psutil.STATUS_ZOMBIE:  # dead, not reaped: the service never waits for it
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    os.killpg(proc.pid, sig)
    assert proc.wait(timeout=30) == 0  # the service exited 0 on the forwarded SIGINT
    assert time.monotonic() - t0 < 10
    assert _marked(mark) == []


def test_a_service_that_ignores_the_stop_is_killed_when_the_grace_runs_out(tmp_path):
    proc, mark = _run_keeper(tmp_path, grace_s=2, IGNORE="1")
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 1  # forced
    assert 2 <= time.monotonic() - t0 < 2 + 2 * keeper.TERM_WAIT_S + 2
    assert _marked(mark) == []


def test_a_second_signal_ends_it_at_once(tmp_path):
    proc, mark = _run_keeper(tmp_path, grace_s=60, IGNORE="1")
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=30) == 1
    assert time.monotonic() - t0 < 2 * keeper.TERM_WAIT_S + 3
    assert _marked(mark) == []


def test_the_service_s_own_exit_status_is_passed_on_and_its_leftovers_ended(tmp_path):
    proc, mark = _run_keeper(tmp_path, grace_s=10, EXIT="3")
    service = next(p for p in _marked(mark) if p.ppid() == proc.pid and "service.py" in " ".join(p.cmdline()))
    service.send_signal(signal.SIGINT)  # the service ends by itself (not asked by the keeper)
    assert proc.wait(timeout=30) == 3
    assert _marked(mark) == []


def test_when_the_keeper_is_killed_the_service_stops_and_the_reaper_ends_the_rest(tmp_path):
    proc, mark = _run_keeper(tmp_path, grace_s=10)
    service = _service(proc, mark)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    service.wait(timeout=10)  # PR_SET_PDEATHSIG: SIGTERM when the keeper dies
    # its child ignores SIGTERM (SIGKILL after TERM_WAIT_S); the orphan is init's now
    _none_left(mark, within_s=reaper.POLL_S + keeper.TERM_WAIT_S + 5)


def test_kill_9_of_the_keeper_and_the_service_at_once_leaves_nothing(tmp_path):
    proc, mark = _run_keeper(tmp_path, grace_s=10)
    service = _service(proc, mark)
    os.kill(proc.pid, signal.SIGKILL)
    os.kill(service.pid, signal.SIGKILL)
    proc.wait()
    _none_left(mark, within_s=reaper.POLL_S + keeper.TERM_WAIT_S + 5)


def test_a_service_that_ignores_its_keeper_s_death_is_killed_after_the_grace(tmp_path):
    proc, mark = _run_keeper(tmp_path, grace_s=3, IGNORE_TERM="1")
    service = _service(proc, mark)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1.5)
    assert service.is_running()  # within its grace
    took = 1.5 + _none_left(mark, within_s=3 + 2 * reaper.POLL_S + keeper.TERM_WAIT_S + 5)
    assert took >= 3 - reaper.POLL_S, took


def test_the_reaper_leaves_a_run_alone_while_the_keeper_lives(tmp_path):
    proc, mark = _run_keeper(tmp_path, grace_s=10)
    time.sleep(4 * reaper.POLL_S)
    assert len(_marked(mark)) == 5
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    assert _marked(mark) == []  # the keeper ended its reaper too

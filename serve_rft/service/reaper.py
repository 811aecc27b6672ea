"""The reaper: ends a run's processes when its keeper was killed (kill -9, the OOM killer).

`serve_rft.service.keeper` ends every process of a run when the service stops, but only while the
keeper lives. Killed with SIGKILL, it can do nothing: the service process gets SIGTERM from the
kernel (``PR_SET_PDEATHSIG``) and stops itself, but nothing bounds that stop, and killed too (a
``kill -9`` of both, ``pkill -9 -f serve_rft``), it leaves the processes that do not end with their
parent: Ray Serve's HAProxy kept the service port and redis-server its data directory for good
(seen on the stack), Ray's agents and the vLLM engines for 25-60 s.

So the keeper starts this small process in a session of its own (``python -m
serve_rft.service.reaper KEEPER_PID SERVICE_PID RUN_ID GRACE_S``). Every `POLL_S` it notes the
keeper's descendants; while the keeper lives it does nothing else. Once the keeper is gone:

1. while the service process lives it gets ``GRACE_S`` seconds to stop (the SIGTERM above asked it
   to), then SIGKILL to its process group;
2. then every process it noted and every process whose environment carries ``RUN_ENV=RUN_ID``
   (set by the keeper, inherited by Ray's GCS, raylet and workers, the vLLM engines and HAProxy;
   not by redis-server, whose process title overwrites its environment, but it is a noted
   descendant and also ends with the service process, `serve_rft.buffer.redis_server`) gets
   SIGTERM, and SIGKILL `keeper.TERM_WAIT_S` later; then it exits.

The keeper ends the reaper itself when it stops normally (it is one of its descendants).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil

RUN_ENV = "SERVE_RFT_RUN_ID"  # set by the keeper in the service's environment: one value per run
POLL_S = 0.5  # how often the keeper's descendants are noted and its life checked


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _alive(p: psutil.Process | None) -> bool:
    """``p`` (the same process: pid and start time) still runs and is not a zombie."""
    try:
        return p is not None and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def marked(run_id: str) -> list[psutil.Process]:
    """Every running process whose environment has ``RUN_ENV=run_id`` (this one excepted)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(RUN_ENV) == run_id and _alive(p):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def end(procs: list[psutil.Process], term_wait_s: float) -> list[int]:
    """SIGTERM each live process of ``procs``, SIGKILL those alive ``term_wait_s`` seconds later.

    Returns:
        The pids that needed SIGKILL.
    """
    procs = [p for p in procs if _alive(p)]
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=term_wait_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=term_wait_s)
    return [p.pid for p in alive]


def watch(keeper_pid: int, service_pid: int, run_id: str, grace_s: float, term_wait_s: float,
          poll_s: float = POLL_S) -> list[int]:
    """The reaper's loop (module docstring). Returns when the run's processes are ended, or at
    once when the keeper is already gone at the start and nothing of the run is left.

    Args:
        keeper_pid, service_pid: the keeper and the service process it started.
        run_id: the value of ``RUN_ENV`` in the run's processes.
        grace_s: seconds the service process gets to stop once the keeper is gone.
        term_wait_s: seconds between SIGTERM and SIGKILL for the leftovers.

    Returns:
        The pids that needed SIGKILL (the service process included when the grace ran out).
    """
    keeper, service = _process(keeper_pid), _process(service_pid)
    noted: dict[int, psutil.Process] = {}
    me = os.getpid()
    while _alive(keeper):
        try:
            for p in keeper.children(recursive=True):
                if p.pid != me:
                    noted.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            break
        noted = {pid: p for pid, p in noted.items() if _alive(p)}
        time.sleep(poll_s)
    killed: list[int] = []
    deadline = time.monotonic() + grace_s
    while _alive(service) and time.monotonic() < deadline:
        time.sleep(poll_s)
    if _alive(service):
        try:
            os.killpg(service_pid, signal.SIGKILL)  # its group: the service is a session leader
        except ProcessLookupError:
            pass
        killed.append(service_pid)
    return killed + end([*noted.values(), *marked(run_id)], term_wait_s)


def main(argv: list[str]) -> int:
    """``python -m serve_rft.service.reaper KEEPER_PID SERVICE_PID RUN_ID GRACE_S [TERM_WAIT_S]``."""
    keeper_pid, service_pid, run_id, grace_s = int(argv[0]), int(argv[1]), argv[2], float(argv[3])
    term_wait_s = float(argv[4]) if len(argv) > 4 else 3.0
    for s in (signal.SIGINT, signal.SIGHUP):  # only the keeper (SIGTERM) or SIGKILL end the reaper
        signal.signal(s, signal.SIG_IGN)
    killed = watch(keeper_pid, service_pid, run_id, grace_s, term_wait_s)
    if killed:
        print(f"serve-rft reaper: the keeper (pid {keeper_pid}) was gone; ended the run's leftovers "
              f"with SIGKILL: {killed}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

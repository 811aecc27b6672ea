"""The keeper: ``serve-rft up`` and ``serve-rft demo`` run the service in a process of their own
and end every process the service started, however the stop is asked for.

Why: a local Ray cluster's processes (GCS, raylet, workers, the vLLM engines they spawn) run in
the caller's process group. A signal to that group (systemd's default ``KillMode``, ``timeout``,
``kill -- -PGID``, Ctrl-C in a terminal) reaches Ray's GCS and raylet at the same moment as the
service, which then cannot shut Serve down ("Failed to connect to GCS", 60 s) and leaves
redis-server, Ray's HAProxy and vLLM engines running. So the command the user started becomes
the keeper, a small process that:

1. marks itself a child subreaper (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``), so every process
   the service starts stays its descendant even when its parent dies (an engine whose replica
   was killed, a daemonized proxy);
2. starts the same command as the **service process** in a new session (its own process group),
   out of reach of signals sent to the caller's group; the service process gets ``SIGTERM``
   should the keeper die (``PR_SET_PDEATHSIG``);
3. on the first SIGINT / SIGTERM / SIGHUP asks the service process to stop (SIGINT: Serve drains,
   the trainer's acknowledged work is saved, redis-server flushes) and waits ``grace_s``; a
   second signal, or the grace running out, ends it at once;
4. once the service process has exited (asked, or on its own) sends SIGTERM to every descendant
   still alive, SIGKILL to those alive 3 s later, and reaps them all. Nothing it started
   outlives it;
5. starts a reaper (`serve_rft.service.reaper`) in a session of its own, which does steps 3-4
   should the keeper itself be killed (SIGKILL: no handler runs), the service process with it or
   not. Every process of the run carries the run's id in its environment (``RUN_ENV``) for it.

Exit status: the service process's (0 after an asked-for stop), 1 when the grace ran out and
the stop was forced.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid

import psutil

from serve_rft.proc import die_with_parent, set_child_subreaper
from serve_rft.service.reaper import RUN_ENV, end

log = logging.getLogger("serve_rft.service")

INNER_ENV = "SERVE_RFT_KEEPER_PID"  # set in the service process: the keeper's pid
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
TERM_WAIT_S = 3.0  # after SIGTERM to the leftovers, before SIGKILL


def inside() -> bool:
    """True in the service process a keeper started (run the service itself, not a keeper)."""
    return bool(os.environ.get(INNER_ENV))


def end_descendants(term_wait_s: float = TERM_WAIT_S) -> list[int]:
    """SIGTERM every live descendant of this process, SIGKILL those still alive after
    ``term_wait_s`` seconds, reap them.

    Returns:
        The pids that needed SIGKILL.
    """
    killed = end(psutil.Process().children(recursive=True), term_wait_s)
    _reap()
    return killed


def _reap() -> None:
    """Collect the exit status of every exited child (orphans adopted as subreaper included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def keep(argv: list[str], grace_s: float, poll_s: float = 0.2) -> int:
    """Run ``argv`` as the service process and keep it (module docstring); returns the exit
    status for this process.

    Args:
        argv: the command (the same CLI invocation; the service process sees `inside`).
        grace_s: seconds the service process gets to stop after the first stop signal.
    """
    set_child_subreaper()
    asked: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _f: asked.append(signum)) for s in STOP_SIGNALS}
    run_id = uuid.uuid4().hex
    try:
        child = subprocess.Popen(argv, env={**os.environ, INNER_ENV: str(os.getpid()), RUN_ENV: run_id},
                                 start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM))
        reaper = subprocess.Popen([sys.executable, "-m", "serve_rft.service.reaper", str(os.getpid()),
                                   str(child.pid), run_id, str(grace_s), str(TERM_WAIT_S)],
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        forced = False
        deadline = None
        while child.poll() is None:
            if asked and deadline is None:
                os.kill(child.pid, signal.SIGINT)
                deadline = time.monotonic() + grace_s
            if deadline is not None and (len(asked) > 1 or time.monotonic() > deadline):
                forced = True
                log.warning("the service did not stop within %.0f s: ending its processes", grace_s)
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                break
            time.sleep(poll_s)
        killed = end_descendants()  # the reaper included: the keeper did its work
        reaper.poll()
        if killed:
            log.info("ended %d leftover processes with SIGKILL: %s", len(killed), killed)
        code = child.returncode
        return 1 if forced else (0 if asked and code in (0, -signal.SIGINT) else (code if code >= 0 else 1))
    finally:
        for s, h in previous.items():
            signal.signal(s, h)

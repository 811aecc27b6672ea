"""The shipped Serve configs (serve_rft/deploy/, linked from deployments/): `serve build` accepts
the importable application, and serve_config.yaml's deployment options are exactly what `serve
build` prints for configs/default.yaml; the builder the config file names turns its args into the
same application. The KubeRay RayService
(deployments/kuberay/rayservice.yaml) runs that application on configs/cluster.yaml, with Ray on
every pod started as `serve-rft up` starts it, and its control plane and store closed to anyone
without their secrets."""

import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_serve_build_output_matches_serve_config(tmp_path):
    out = tmp_path / "built.yaml"
    serve = Path(sys.executable).parent / "serve"
    env = dict(os.environ, RAY_SERVE_ENABLE_HA_PROXY="1")  # no custom router: valid in both modes
    proc = subprocess.run([str(serve), "build", "serve_rft.deploy:app", "--app-dir", str(ROOT), "-o", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = yaml.safe_load(out.read_text())["applications"][0]
    shipped = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())["applications"][0]
    assert built["deployments"] == shipped["deployments"]
    assert shipped["import_path"] == "serve_rft.deploy:app_builder"


def test_the_builder_applies_its_args():
    from ray.serve.handle import DeploymentHandle  # noqa: F401  (Serve is importable)

    from serve_rft.deploy import app_builder

    shipped = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())["applications"][0]
    assert "config" not in shipped["args"], "the defaults: no file a package install lacks"
    args = dict(shipped["args"])
    args["overrides"] = args["overrides"] + ["explorer.num_replicas=3"]
    app = app_builder(args)
    deployment = app._bound_deployment
    assert deployment.num_replicas == 3
    assert '"redis_url":"redis://127.0.0.1:6379/0"' in deployment.init_args[0]


def test_drain_aware_router_only_without_haproxy(monkeypatch):
    """HAProxy balances by itself (Ray refuses a custom router there); the Python proxy needs ours."""
    from serve_rft.config import Config
    from serve_rft.service.app import explorer_deployment

    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    assert explorer_deployment(Config())._deployment_config.request_router_config.request_router_class != \
        "serve_rft.explorer.router.DrainAwareRouter"
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    assert explorer_deployment(Config())._deployment_config.request_router_config.request_router_class == \
        "serve_rft.explorer.router.DrainAwareRouter"


def test_replicas_run_their_routes_on_the_http_loop_unless_configured():
    """`explorer.user_code_loop_thread` reaches the replica's process as Ray Serve's variable."""
    from serve_rft.config import Config
    from serve_rft.service.app import explorer_deployment

    key = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"
    assert explorer_deployment(Config()).ray_actor_options["runtime_env"]["env_vars"][key] == "0"
    cfg = Config.model_validate({"explorer": {"user_code_loop_thread": True}})
    assert explorer_deployment(cfg).ray_actor_options["runtime_env"]["env_vars"][key] == "1"


def test_refusals_only_when_haproxy_retries_them(monkeypatch):
    from serve_rft.explorer.http.ingress_mode import refusals_are_retried
    from serve_rft.service.ingress import RETRY_ON

    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_RETRY_ON", RETRY_ON)
    assert refusals_are_retried()
    monkeypatch.setenv("RAY_SERVE_HAPROXY_RETRY_ON", "conn-failure 503")  # body after headers: not re-sent
    assert not refusals_are_retried()
    monkeypatch.setenv("RAY_SERVE_HAPROXY_RETRY_ON", "conn-failure")  # Ray's default: a 503 would reach the client
    assert not refusals_are_retried()
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    monkeypatch.setenv("RAY_SERVE_HAPROXY_RETRY_ON", "503")
    assert not refusals_are_retried()


# --- deployments/kuberay/rayservice.yaml: the same application, Ray as the launcher starts it ---

RAYSERVICE = ROOT / "deployments" / "kuberay" / "rayservice.yaml"
IMAGE_ROOT = "/opt/serve_rft/"  # where the image holds this repository (docs/operations/deploy.md, "Image")
SHARED = "/shared"
# What haproxy_env() picks per machine so that stacks can share one (free ports, the core count);
# a pod has a network namespace and cores of its own, so Ray's defaults stand there.
PER_MACHINE = {"RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
               "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_HAPROXY_NBTHREAD"}


def _manifest() -> dict:
    docs = [d for d in yaml.safe_load_all(RAYSERVICE.read_text()) if d]
    return {d["kind"]: d for d in docs}


def _groups(service: dict) -> dict:
    cluster = service["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def _ray_container(group: dict) -> dict:
    (container,) = [c for c in group["template"]["spec"]["containers"] if c["name"].startswith("ray-")]
    return container


def _kuberay_app() -> dict:
    (app,) = yaml.safe_load(_manifest()["RayService"]["spec"]["serveConfigV2"])["applications"]
    return app


def _pod_env(container: dict) -> dict[str, str]:
    """A container's environment as Kubernetes gives it: a secretKeyRef as ``secret.NAME.KEY``
    (a stand-in for the Secret's value), ``$(VAR)`` of an entry above expanded."""
    env: dict[str, str] = {}
    for entry in container["env"]:
        if "valueFrom" in entry:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = f"secret.{ref['name']}.{ref['key']}"
        else:
            env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), entry["value"])
    return env


def _kuberay_config():
    """The run config the RayService's application builds: `serve_rft.deploy.app_builder`'s
    `load_config` call (its `preflight` needs CUDA), with the image path mapped to this checkout
    and the pods' run-config environment (the store URL; not the keys, which tests set)."""
    from serve_rft.config import load_config

    args = _kuberay_app()["args"]
    assert set(args) == {"config", "overrides"}
    assert args["config"].startswith(IMAGE_ROOT), "an absolute path: the builder's working directory is Ray's"
    local = ROOT / args["config"].removeprefix(IMAGE_ROOT)
    assert local == ROOT / "configs" / "cluster.yaml" and local.is_file()
    env = {k: v for k, v in _pod_env(_ray_container(_groups(_manifest()["RayService"])["head"])).items()
           if k.startswith("SERVE_RFT_") and k not in KEY_ENV}
    with mock.patch.dict(os.environ, env):
        return load_config(local, list(args["overrides"]))


def _secret_refs(node) -> list[tuple[str, dict]]:
    """(env name, secretKeyRef) of every env entry anywhere in a parsed manifest."""
    found, stack = [], [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            ref = n.get("valueFrom", {}).get("secretKeyRef") if isinstance(n.get("valueFrom"), dict) else None
            if ref is not None:
                found.append((n.get("name"), ref))
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return found


KEY_ENV = {"SERVE_RFT_API_KEYS", "SERVE_RFT_REWARD_KEYS", "SERVE_RFT_ADMIN_KEYS"}


def test_every_shipped_deployment_requires_its_key_secret():
    """A missing key Secret stops the pods (Kubernetes refuses a non-optional secretKeyRef) rather
    than starting an open service; every pod gets all three kinds of key."""
    files = sorted((ROOT / "deployments").rglob("*.yaml"))
    assert RAYSERVICE in files
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            for name, ref in _secret_refs(doc):
                assert ref.get("optional", False) is False, f"{path.name}: {name} is optional"
    groups = _groups(_manifest()["RayService"])
    for group_name, group in groups.items():
        refs = dict(_secret_refs(_ray_container(group)))
        assert KEY_ENV <= set(refs), group_name
        assert {refs[k]["key"] for k in KEY_ENV} == KEY_ENV


def test_rayservice_serves_the_shipped_application_on_the_cluster_config(monkeypatch):
    """serveConfigV2 is serve_config.yaml's application with configs/cluster.yaml: same builder,
    route and HTTP options; its deployment options are what the builder makes of the cluster config
    (as serve_config.yaml's are for the default one) plus the replicas' label_selector. Its pods
    have keys (the Secret): without them the builder refuses the cluster config's 0.0.0.0."""
    from ray.serve._private.build_app import build_app as serve_build
    from ray.serve.deployment import deployment_to_schema

    from serve_rft.service.app import build_app

    for name in KEY_ENV:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="refusing to serve on 0.0.0.0 with no API keys"):
        build_app(_kuberay_config())
    for name in KEY_ENV:  # as the Secret puts them on every pod
        monkeypatch.setenv(name, f"{name.lower()}-1")

    service = _manifest()["RayService"]
    assert service["apiVersion"] == "ray.io/v1"
    assert service["spec"]["upgradeStrategy"] == {"type": "None"}  # never a second trainer (docs/operations/deploy.md, Upgrades)
    serve_cfg = yaml.safe_load(service["spec"]["serveConfigV2"])
    shipped_cfg = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    assert {k: v for k, v in serve_cfg.items() if k != "applications"} == \
        {k: v for k, v in shipped_cfg.items() if k != "applications"}
    app, shipped = _kuberay_app(), shipped_cfg["applications"][0]
    for key in ("name", "route_prefix", "import_path"):
        assert app[key] == shipped[key]

    cfg = _kuberay_config()
    assert cfg.buffer.redis_url and "127.0.0.1" not in cfg.buffer.redis_url  # nothing starts one there
    assert cfg.model.path.startswith(SHARED + "/") and cfg.service.run_dir.startswith(SHARED + "/")

    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")  # as on every pod: no custom router
    built = [deployment_to_schema(d).model_dump(exclude_unset=True)
             for d in serve_build(build_app(cfg), name="serve_rft").deployments]
    (deployment,) = app["deployments"]
    assert set(deployment) == set(shipped["deployments"][0])
    options = dict(deployment, ray_actor_options=dict(deployment["ray_actor_options"]))
    selector = options["ray_actor_options"].pop("label_selector")
    assert [options] == built
    assert selector == _groups(service)["explorer-gpu"]["labels"]
    # the trainer goes to its own group (Ray's label_selector, as Ray validates actor options)
    from serve_rft.trainer.actor import trainer_options
    from ray._common.ray_option_utils import validate_actor_options

    assert cfg.trainer.label_selector == _groups(service)["trainer-gpu"]["labels"]
    opts = trainer_options(cfg)
    validate_actor_options(opts, in_options=True)
    assert opts["label_selector"] == cfg.trainer.label_selector and opts["num_gpus"] == 1.0


LOOPBACK = {"127.0.0.1", "localhost", "::1"}
SERVE_PORT = 8000
DASHBOARD_PORT = 8265


def test_ray_control_plane_needs_the_ray_token():
    """Whoever reaches Ray's dashboard, GCS or client server can run code on every pod (and read
    the keys, write the store): Ray token auth is on, for every pod, and a dashboard on the pod's
    interfaces (KubeRay's default when `dashboard-host` is not set) never goes without it; Ray's
    client server is not published."""
    service = _manifest()["RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    groups = _groups(service)
    host = groups["head"]["rayStartParams"].get("dashboard-host", "0.0.0.0")
    assert host in LOOPBACK or cluster.get("authOptions", {}).get("mode") == "token"
    assert cluster["authOptions"] == {"mode": "token"}  # the GCS listens on the pod's address anyway
    assert tuple(int(n) for n in cluster["rayVersion"].split(".")) >= (2, 52)  # Ray's token auth
    for name, group in groups.items():
        env = _pod_env(_ray_container(group))
        assert env.get("RAY_AUTH_MODE", "token") == "token", name  # nothing turns it off again
        assert "RAY_AUTH_TOKEN" not in env or env["RAY_AUTH_TOKEN"].startswith("secret."), name
        ports = {p["containerPort"] for p in _ray_container(group).get("ports", [])}
        assert 10001 not in ports, name  # Ray client: serve_rft never uses it


def test_network_policy_admits_only_the_serve_port_from_outside():
    """One NetworkPolicy over every Ray pod: from outside them only the serve port (from anyone)
    and the dashboard (from the KubeRay operator's pods); the Ray pods reach each other on any
    port (GCS, raylets, object managers, the NCCL rendezvous); no address block."""
    manifest = _manifest()
    policy, service = manifest["NetworkPolicy"], manifest["RayService"]
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert yaml.safe_load(service["spec"]["serveConfigV2"])["http_options"]["port"] == SERVE_PORT
    selected = policy["spec"]["podSelector"]["matchLabels"]
    assert selected
    for name, group in _groups(service).items():
        assert selected.items() <= group["template"]["metadata"]["labels"].items(), name
    assert "Ingress" in policy["spec"]["policyTypes"]
    rules = policy["spec"]["ingress"]
    anyone = [r for r in rules if not r.get("from")]
    assert [r["ports"] for r in anyone] == [[{"port": SERVE_PORT, "protocol": "TCP"}]]
    for rule in rules:
        for peer in rule.get("from", []):
            assert "ipBlock" not in peer
            if peer["podSelector"]["matchLabels"] == selected:  # one another, every port
                assert "namespaceSelector" not in peer
            else:  # the operator: the dashboard only
                assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kuberay-operator"}
                assert rule["ports"] == [{"port": DASHBOARD_PORT, "protocol": "TCP"}]


def test_the_store_password_comes_from_a_secret():
    """buffer.redis_url reaches the builder through the environment (SERVE_RFT_BUFFER__REDIS_URL)
    with its password from a Secret (a required secretKeyRef, expanded by Kubernetes): no password
    and no URL in serveConfigV2, which anyone who reads the RayService reads."""
    app = _kuberay_app()
    assert not [o for o in app["args"]["overrides"] if o.startswith("buffer.redis_url")]
    assert "redis://" not in _manifest()["RayService"]["spec"]["serveConfigV2"]
    groups = _groups(_manifest()["RayService"])
    for name, group in groups.items():
        env = _pod_env(_ray_container(group))
        url = urlsplit(env["SERVE_RFT_BUFFER__REDIS_URL"])
        assert url.scheme == "redis" and url.password and url.password.startswith("secret."), name
        raw = {e["name"]: e for e in _ray_container(group)["env"]}["SERVE_RFT_BUFFER__REDIS_URL"]["value"]
        assert re.fullmatch(r"redis://:\$\(\w+\)@[^:/@]+:\d+/\d+", raw), name  # no literal password
    cfg = _kuberay_config()
    assert urlsplit(cfg.buffer.redis_url).password == "secret.serve-rft-redis.password"


def test_haproxy_gets_one_thread_per_two_cores_between_one_and_four(monkeypatch):
    from serve_rft.service import ingress

    assert [ingress.haproxy_threads(c) for c in (1, 2, 3, 4, 8, 9, 64)] == [1, 1, 1, 2, 4, 4, 4]
    monkeypatch.setattr(ingress.os, "cpu_count", lambda: None)  # unknown: one thread
    assert ingress.haproxy_env()["RAY_SERVE_HAPROXY_NBTHREAD"] == "1"


def test_folders_of_haproxy_instances_that_no_longer_run_are_removed(tmp_path):
    """A node's HAProxy folders go when no HAProxy listens on its admin socket and the manager
    that started it is gone, or, without a manager's files, when the folder is also older than
    the grace period; a listening one, one whose manager runs (it may be starting HAProxy
    again), young ones and a folder not named by a node id stay."""
    import shutil
    import socket
    import subprocess
    import tempfile
    import time

    from serve_rft.service.ingress import remove_dead_haproxy_dirs

    # short: a Unix socket path has ~107 bytes, a node id 56 of them
    base, state = Path(tempfile.mkdtemp(prefix="h", dir="/tmp")), tmp_path / "s"
    now = time.time()
    gone_pid = subprocess.Popen(["true"])
    gone_pid.wait()
    names = ("live", "dead", "restarting", "manager gone", "starting", "young", "old")
    ids = {name: f"{k:x}" * 56 for k, name in enumerate(names, 1)}

    def node(name: str, sock: str | None, manager_pid: int | None) -> socket.socket | None:
        folder = base / ids[name]
        for b in (base, state):
            (b / ids[name]).mkdir(parents=True)
        (folder / "haproxy.cfg").write_text("global\n")
        if manager_pid is not None:  # as Ray's manager names each HAProxy's output
            (folder / f"admin.sock.{manager_pid}.1.stdout.log").touch()
        if sock is None:
            return None
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(folder / "admin.sock"))
        if sock == "listening":
            s.listen(1)
            return s
        s.close()  # the file stays, nothing listens: as a killed HAProxy leaves it
        return None

    live = node("live", "listening", gone_pid.pid)
    node("dead", "closed", gone_pid.pid)
    node("restarting", "closed", os.getpid())
    node("manager gone", None, gone_pid.pid)
    node("starting", "closed", None)  # a new manager swept its predecessor's files, not yet its own
    node("young", None, None)
    node("old", None, None)
    for f in [base / ids["old"], *(base / ids["old"]).iterdir()]:
        os.utime(f, (now - 3600, now - 3600))
    (base / "not-a-node").mkdir()
    os.utime(base / "not-a-node", (now - 3600, now - 3600))
    try:
        removed = remove_dead_haproxy_dirs(base / "admin.sock", {base, state}, grace_s=600, now=now)
        assert sorted(removed) == sorted(b / ids[n] for b in (base, state) for n in ("dead", "manager gone", "old"))
        kept = sorted(ids[n] for n in ("live", "restarting", "starting", "young"))
        assert sorted(p.name for p in base.iterdir()) == sorted([*kept, "not-a-node"])
        assert sorted(p.name for p in state.iterdir()) == kept
    finally:
        live.close()
        shutil.rmtree(base)
    assert remove_dead_haproxy_dirs(tmp_path / "missing" / "admin.sock", set()) == []


def test_every_pod_starts_ray_as_serve_rft_up_does():
    """HAProxy mode with the launcher's retry line, the task-events bound and the replicas'
    draining period on every pod (an HAProxy runs on each); the proxies' draining period is at
    least Ray's 30 s, since a Kubernetes Service is in front of them."""
    from serve_rft.service.ingress import DRAIN_ENV, HAPROXY_FLAG, RETRY_ON, haproxy_env
    from serve_rft.service.launcher import TASK_EVENTS_ENV

    expected = {k: v for k, v in haproxy_env().items() if k not in PER_MACHINE}
    assert expected[HAPROXY_FLAG] == "1" and expected["RAY_SERVE_HAPROXY_RETRY_ON"] == RETRY_ON
    expected |= TASK_EVENTS_ENV
    direct = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
    expected[direct] = DRAIN_ENV[direct]
    groups = _groups(_manifest()["RayService"])
    assert set(groups) == {"head", "explorer-gpu", "trainer-gpu"}
    images = set()
    for name, group in groups.items():
        container = _ray_container(group)
        images.add(container["image"])
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert {k: env.get(k) for k in expected} == expected, name
        assert float(env["RAY_SERVE_PROXY_MIN_DRAINING_PERIOD_S"]) >= 30, name
        assert not set(env) & PER_MACHINE, name
        assert IMAGE_ROOT.rstrip("/") in env["PYTHONPATH"].split(":"), name  # serve_rft.deploy
    assert len(images) == 1


def test_shared_volume_on_every_pod_and_gpus_for_replicas_and_trainer():
    manifest = _manifest()
    claim = manifest["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    groups = _groups(manifest["RayService"])
    for name, group in groups.items():
        volumes = {v["name"] for v in group["template"]["spec"]["volumes"]
                   if v.get("persistentVolumeClaim", {}).get("claimName") == claim["metadata"]["name"]}
        mounts = [m["mountPath"] for m in _ray_container(group)["volumeMounts"] if m["name"] in volumes]
        assert mounts == [SHARED], name

    cfg = _kuberay_config()
    head = groups.pop("head")
    assert head["rayStartParams"]["num-cpus"] == "0"  # no replica, trainer or build task there
    assert "nvidia.com/gpu" not in _ray_container(head)["resources"]["limits"]
    explorer, trainer = groups["explorer-gpu"], groups["trainer-gpu"]
    per_pod = int(_ray_container(explorer)["resources"]["limits"]["nvidia.com/gpu"])
    assert explorer["replicas"] == explorer["minReplicas"] == explorer["maxReplicas"]
    assert explorer["replicas"] * per_pod == cfg.explorer.num_replicas * cfg.explorer.num_gpus_per_replica
    # the trainer's own GPU, where trainer.label_selector places it (docs/operations/deploy.md, "Placement")
    assert trainer["replicas"] == 1 and cfg.trainer.device == "cuda"
    assert int(_ray_container(trainer)["resources"]["limits"]["nvidia.com/gpu"]) == cfg.trainer.num_gpus == 1


def test_operator_doc_gives_the_launchers_retry_line():
    """The `ray start` line in deployments/README.md carries RETRY_ON exactly (bash $'...')."""
    from serve_rft.service.ingress import RETRY_ON

    quoted = "$'" + RETRY_ON.replace("\n", "\\n") + "'"
    assert f"RAY_SERVE_HAPROXY_RETRY_ON={quoted}" in (ROOT / "deployments" / "README.md").read_text()


def test_the_autoscaling_config_is_serve_config_with_the_builders_autoscaling(monkeypatch):
    """deployments/serve_config_autoscaling.yaml: serve_config.yaml plus an ``explorer.autoscaling``
    override, and a deployments block equal to what the builder makes of it (autoscaling_config
    in place of num_replicas); min_replicas above max_unavailable, so a sync keeps one serving."""
    from ray.serve._private.build_app import build_app as serve_build
    from ray.serve.deployment import deployment_to_schema

    from serve_rft.config import load_config
    from serve_rft.service.app import build_app

    plain = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    scaled = yaml.safe_load((ROOT / "deployments" / "serve_config_autoscaling.yaml").read_text())
    assert {k: v for k, v in scaled.items() if k != "applications"} == \
        {k: v for k, v in plain.items() if k != "applications"}
    app, base = scaled["applications"][0], plain["applications"][0]
    assert {k: v for k, v in app.items() if k not in ("args", "deployments")} == \
        {k: v for k, v in base.items() if k not in ("args", "deployments")}
    extra = [o for o in app["args"]["overrides"] if o not in base["args"]["overrides"]]
    assert len(extra) == 1 and extra[0].startswith("explorer.autoscaling=")
    assert "config" not in app["args"], "the defaults: no file a package install lacks"
    cfg = load_config(None, list(app["args"]["overrides"]))
    assert cfg.explorer.autoscaling.min_replicas > cfg.synchronizer.max_unavailable
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    built = [deployment_to_schema(d).model_dump(exclude_unset=True)
             for d in serve_build(build_app(cfg), name="serve_rft").deployments]
    assert app["deployments"] == built

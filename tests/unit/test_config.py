import pytest
from pydantic import ValidationError

from serve_rft.config import Config, TrainerConfig, apply_overrides, load_config


def test_defaults_are_two_replicas_checkpoint_fixed():
    cfg = Config()
    assert cfg.explorer.num_replicas == 2
    assert cfg.synchronizer.sync_method.value == "checkpoint"
    assert cfg.synchronizer.sync_style.value == "fixed"
    assert cfg.synchronizer.max_unavailable == 1


def test_overrides_parse_yaml_scalars(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  lr: 0.01\n")
    cfg = load_config(f, ["explorer.num_replicas=3", "trainer.enabled=false", "model.path=/x"])
    assert cfg.explorer.num_replicas == 3
    assert cfg.trainer.enabled is False
    assert cfg.trainer.lr == 0.01
    assert cfg.model.path == "/x"


def test_rejects_config_that_lets_every_replica_sync_at_once():
    with pytest.raises(ValidationError, match="max_unavailable"):
        load_config(None, ["explorer.num_replicas=2", "synchronizer.max_unavailable=2"])


def test_rejects_unknown_fields_and_bad_bounds():
    with pytest.raises(ValidationError):
        load_config(None, ["trainer.nope=1"])
    with pytest.raises(ValidationError):
        load_config(None, ["explorer.num_replicas=0"])


def test_override_without_equals_is_an_error():
    with pytest.raises(ValueError):
        apply_overrides({}, ["trainer.lr"])


def test_nccl_without_gpus_in_the_config_is_a_config_error():
    with pytest.raises(ValidationError, match="trainer.device=cuda"):
        load_config(None, ["synchronizer.sync_method=nccl"])
    with pytest.raises(ValidationError, match="num_gpus_per_replica"):
        load_config(None, ["synchronizer.sync_method=nccl", "trainer.device=cuda"])
    cfg = load_config(None, ["synchronizer.sync_method=nccl", "trainer.device=cuda",
                             "explorer.num_gpus_per_replica=1"])
    assert cfg.synchronizer.sync_method.value == "nccl"


def test_shipped_default_config_equals_the_code_defaults():
    from pathlib import Path

    shipped = load_config(Path(__file__).parents[2] / "configs" / "default.yaml")
    skip = {"model": {"cache_dir"}}
    assert shipped.model_dump(exclude=skip) == Config().model_dump(exclude=skip)


@pytest.mark.parametrize("name", ["single_gpu.yaml", "cluster.yaml"])
def test_shipped_gpu_and_cluster_configs_are_valid(name):
    """configs/single_gpu.yaml and cluster.yaml load (no unknown field, every cross-field rule
    holds): replicas and trainer on GPUs, adapter-only LoRA on one GPU, NCCL on the cluster."""
    from pathlib import Path

    cfg = load_config(Path(__file__).parents[2] / "configs" / name)
    assert cfg.trainer.device == "cuda" and cfg.explorer.num_gpus_per_replica > 0
    if name == "single_gpu.yaml":  # everything on one GPU: the fractions fit in 1
        assert cfg.explorer.num_replicas * cfg.explorer.num_gpus_per_replica + cfg.trainer.num_gpus <= 1
        assert cfg.adapter_sync
    else:
        assert cfg.service.ray_address and cfg.buffer.redis_url


def test_a_group_timeout_past_the_reward_timeout_is_refused_with_the_reason():
    from serve_rft.config import BufferConfig

    with pytest.raises(ValueError, match="group_timeout_s=120.0 must not exceed buffer.reward_timeout_s"):
        BufferConfig(reward_timeout_s=60, group_timeout_s=120)


# --- fail closed: no keys on a non-loopback address is refused unless allowed explicitly ---

KEY_ENV = ("SERVE_RFT_API_KEYS", "SERVE_RFT_REWARD_KEYS", "SERVE_RFT_ADMIN_KEYS")


@pytest.fixture
def no_key_env(monkeypatch):
    for name in KEY_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LocalHost", True), ("0.0.0.0", False), ("::", False), ("", False), (None, False), ("10.0.0.5", False),
    ("example.internal", False), ("127.0.0.1.example.com", False),
])
def test_what_counts_as_loopback(host, loopback):
    from serve_rft.config.service import is_loopback

    assert is_loopback(host) is loopback


def test_an_open_service_on_an_exposed_address_is_refused_unless_allowed(no_key_env):
    from serve_rft.config.service import check_exposure

    cfg = load_config(None, [])
    assert check_exposure(cfg.service, "127.0.0.1") is None  # loopback: open is fine
    with pytest.raises(ValueError, match="refusing to serve on 0.0.0.0 with no API keys") as e:
        check_exposure(cfg.service, "0.0.0.0")
    assert "\n" not in str(e.value) and "allow_unauthenticated" in str(e.value)
    with pytest.raises(ValueError, match="every interface"):
        check_exposure(cfg.service, None)
    for kind in ("api_keys", "reward_keys", "admin_keys"):  # any key turns auth on for every route
        assert check_exposure(load_config(None, [f"service.{kind}=[k]"]).service, "0.0.0.0") is None
    with pytest.raises(ValueError):  # an empty key is no key
        check_exposure(load_config(None, ["service.admin_keys=['']"]).service, "0.0.0.0")
    warning = check_exposure(load_config(None, ["service.allow_unauthenticated=true"]).service, "0.0.0.0")
    assert warning and "WITHOUT AUTHENTICATION" in warning


def test_the_application_builder_checks_the_host_serve_binds(no_key_env, monkeypatch, caplog):
    """`build_app` (serve deploy / serve run / serve-rft up) checks Serve's own http_options.host,
    not service.host: a shipped serve config binds 0.0.0.0 while its run config says 127.0.0.1."""
    import logging

    from serve_rft.service import app as service_app

    overrides = ["buffer.redis_url=redis://127.0.0.1:6379/0"]
    assert service_app.serve_http_host(load_config(None, overrides)) == "127.0.0.1"  # no Ray here
    monkeypatch.setattr(service_app, "serve_http_host", lambda cfg: "0.0.0.0")
    with pytest.raises(ValueError, match="refusing to serve on 0.0.0.0"):
        service_app.build_app(load_config(None, overrides))
    service_app.build_app(load_config(None, [*overrides, "service.reward_keys=[r]"]))
    with caplog.at_level(logging.WARNING, logger="serve_rft.service"):
        service_app.build_app(load_config(None, [*overrides, "service.allow_unauthenticated=true"]))
    assert "WITHOUT AUTHENTICATION" in caplog.text


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config_autoscaling.yaml"])
def test_shipped_serve_configs_refuse_to_deploy_without_keys(no_key_env, monkeypatch, name):
    """deployments/serve_config*.yaml bind 0.0.0.0: their builder refuses with no key in the
    environment and builds with one."""
    from pathlib import Path

    import yaml

    from serve_rft.deploy import app_builder
    from serve_rft.service import app as service_app

    root = Path(__file__).parents[2]
    shipped = yaml.safe_load((root / "deployments" / name).read_text())
    host = shipped["http_options"]["host"]
    monkeypatch.setattr(service_app, "serve_http_host", lambda cfg: host)
    args = dict(shipped["applications"][0]["args"])  # no run-config file: the defaults
    with pytest.raises(ValueError, match="no API keys"):
        app_builder(args)
    monkeypatch.setenv("SERVE_RFT_ADMIN_KEYS", "adm")
    app_builder(args)


def test_repr_carries_no_password_or_key_but_the_dump_for_ray_actors_does():
    """A traceback that prints locals (an older typer's pretty exceptions) shows reprs: they
    carry no Redis password and no API key; ``model_dump_json`` (how actors get the config)
    carries both."""
    import typer

    from serve_rft.cli import cli

    url = "redis://:hunter2-redis@127.0.0.1:6390/0"
    cfg = load_config(None, [f"buffer.redis_url={url}", "service.api_keys=[sk-inference-1]",
                             "service.reward_keys=[sk-reward-1]", "service.admin_keys=[sk-admin-1]",
                             "service.tenants={acme: {api_keys: [sk-acme-1], reward_keys: [sk-acme-r]}}"])
    secrets = ("hunter2-redis", "sk-inference-1", "sk-reward-1", "sk-admin-1", "sk-acme-1", "sk-acme-r")
    for shown in (repr(cfg), str(cfg), repr(cfg.buffer), repr(cfg.service), repr(cfg.service.tenants)):
        assert not [s for s in secrets if s in shown], shown
    dumped = cfg.model_dump_json()
    assert all(s in dumped for s in secrets)
    assert Config.model_validate_json(dumped).buffer.redis_url == url
    assert isinstance(cli, typer.Typer) and cli.pretty_exceptions_show_locals is False


@pytest.mark.parametrize("name", ["alice\n", "", "a" * 65, "a b", "a:b", "alice\nbob"])
def test_a_tenant_name_must_match_whole(name):
    """A tenant name becomes part of Redis keys and group ids: the whole name must match (a
    trailing newline too is refused)."""
    from serve_rft.config import ServiceConfig

    with pytest.raises(ValidationError):
        ServiceConfig.model_validate({"tenants": {name: {"api_keys": ["sk-t"]}}})
    assert ServiceConfig.model_validate({"tenants": {"alice.b-c_1": {"api_keys": ["sk-t"]}}}).tenants


# --- layers: defaults < file < environment < --set ---

@pytest.fixture
def no_config_env(monkeypatch):
    """No SERVE_RFT_<SECTION>__<FIELD> or key variable of the machine running the tests."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("SERVE_RFT_"):
            monkeypatch.delenv(name)


def test_a_set_below_a_null_section_of_the_file_fills_it(no_config_env):
    """configs/default.yaml has ``trainer.lora: null``; ``--set trainer.lora.rank=8`` makes it a
    section with the other fields at their defaults."""
    from pathlib import Path

    cfg = load_config(Path(__file__).parents[2] / "configs" / "default.yaml", ["trainer.lora.rank=8"])
    assert cfg.trainer.lora is not None and cfg.trainer.lora.rank == 8 and cfg.trainer.lora.alpha == 16.0
    assert apply_overrides({"a": None}, ["a.b.c=1"]) == {"a": {"b": {"c": 1}}}
    with pytest.raises(ValueError, match="trainer.lr is a value, not a section"):
        apply_overrides({"trainer": {"lr": 0.1}}, ["trainer.lr.x=1"])


def test_each_layer_wins_over_the_one_before(no_config_env, monkeypatch, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  lr: 0.01\n  batch_size: 4\n  lora: null\nexplorer:\n  num_replicas: 3\n")
    assert load_config(f).trainer.lr == 0.01
    monkeypatch.setenv("SERVE_RFT_TRAINER__LR", "1e-4")  # what a Kubernetes manifest writes
    monkeypatch.setenv("serve_rft_explorer__num_replicas", "4")  # names are case-insensitive
    monkeypatch.setenv("SERVE_RFT_TRAINER__LORA__RANK", "16")  # nested, into the file's null section
    cfg = load_config(f)
    assert (cfg.trainer.lr, cfg.trainer.batch_size, cfg.explorer.num_replicas) == (1e-4, 4, 4)
    assert cfg.trainer.lora is not None and cfg.trainer.lora.rank == 16
    cfg = load_config(f, ["trainer.lr=5e-4", "trainer.lora.rank=32"])
    assert (cfg.trainer.lr, cfg.trainer.lora.rank) == (5e-4, 32)
    assert load_config(None).trainer.lr == 1e-4 and Config().trainer.lr == 1e-4  # no file: env over defaults


def test_the_environment_layer_is_read_by_loading_never_by_an_actors_copy(no_config_env, monkeypatch):
    """Ray actors rebuild the driver's config from its JSON: the environment of their process
    does not change it."""
    dumped = load_config(None).model_dump_json()
    monkeypatch.setenv("SERVE_RFT_TRAINER__LR", "0.5")
    assert Config.model_validate_json(dumped).trainer.lr == TrainerConfig().lr


def test_key_variables_keep_working_beside_the_section_variables(no_config_env, monkeypatch, tmp_path):
    monkeypatch.setenv("SERVE_RFT_API_KEYS", "sk-a, sk-b")
    monkeypatch.setenv("SERVE_RFT_TENANTS", '{"acme": {"api_keys": ["sk-acme"]}}')
    cfg = load_config(None)
    assert cfg.service.api_keys == ["sk-a", "sk-b"] and cfg.service.tenants["acme"].api_keys == ["sk-acme"]
    monkeypatch.setenv("SERVE_RFT_SERVICE__ADMIN_KEYS", '["sk-admin"]')  # a list is JSON
    assert load_config(None).service.admin_keys == ["sk-admin"]
    monkeypatch.setenv("SERVE_RFT_SERVICE__ADMIN_KEYS", "sk-admin")
    with pytest.raises(ValueError, match="is JSON"):
        load_config(None)


def test_a_yaml_error_names_the_file_and_the_line(tmp_path):
    from serve_rft.config import ConfigFileError

    f = tmp_path / "run.yaml"
    f.write_text("trainer:\n  lr: 0.01\n  target_modules: [q_proj\n  kl_coef: 0\n")
    with pytest.raises(ConfigFileError, match=rf"^{f}, line 4, column 10: expected ',' or ']'"):
        load_config(f)
    f.write_text("- trainer\n")
    with pytest.raises(ConfigFileError, match=rf"^{f}: a run config is a mapping of sections, not a list"):
        load_config(f)
    f.write_text("")
    assert load_config(f).trainer.lr == TrainerConfig().lr

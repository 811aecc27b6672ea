import pytest
from pydantic import ValidationError

from serve_rft.config import Config, apply_overrides, load_config


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

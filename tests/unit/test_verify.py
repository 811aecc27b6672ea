"""Version verification helpers and the trainer's reset (serve_rft.weights.verify)."""

from __future__ import annotations

import pytest
import torch

from serve_rft.trainer.policy.token_logprobs import trainer_probe
from serve_rft.weights.verify import (ProbeMismatch, VersionCorrupt, check_folder, check_probe, folder_checksums,
                                      probe_ids, tensors_checksum)


def test_folder_checksums_catch_a_flipped_byte_a_missing_and_an_extra_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"abc" * 1000)
    sums = folder_checksums(tmp_path)
    check_folder(tmp_path, sums)
    check_folder(tmp_path, None)  # nothing published: nothing to check
    raw = bytearray((tmp_path / "model.safetensors").read_bytes())
    raw[10] ^= 1
    (tmp_path / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(VersionCorrupt, match="model.safetensors"):
        check_folder(tmp_path, sums)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(VersionCorrupt):
        check_folder(tmp_path, sums)


def test_folder_checksums_are_xxh3_and_an_older_releases_crc32_is_still_checked(tmp_path):
    """A handle published before the switch to XXH3-64 (a synchronizer's state kept across an
    upgrade) carries CRC-32s; they are checked as such, so a good folder passes and a bad one
    is refused."""
    import zlib

    data = bytes(range(256)) * 4000
    (tmp_path / "model.safetensors").write_bytes(data)
    assert folder_checksums(tmp_path)["model.safetensors"].startswith("xxh3:")
    legacy = {"model.safetensors": f"{zlib.crc32(data):08x}"}
    check_folder(tmp_path, legacy)
    (tmp_path / "model.safetensors").write_bytes(data[:-1] + b"x")
    with pytest.raises(VersionCorrupt):
        check_folder(tmp_path, legacy)


def test_bucket_checksum_covers_names_and_bytes():
    a = [("w", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(2, dtype=torch.bfloat16))]
    same = [("w", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(2, dtype=torch.bfloat16))]
    assert tensors_checksum(a) == tensors_checksum(same)
    assert tensors_checksum(a) != tensors_checksum([("x", a[0][1]), a[1]])
    b = [("w", a[0][1].clone()), a[1]]
    b[0][1][3] += 1e-6
    assert tensors_checksum(a) != tensors_checksum(b)


def test_probe_is_fixed_per_version_and_checked_within_tolerance(embedded_model):
    from transformers import AutoModelForCausalLM

    assert probe_ids(1000, 3) == probe_ids(1000, 3) != probe_ids(1000, 4)
    model = AutoModelForCausalLM.from_pretrained(str(embedded_model), dtype=torch.float32)
    probe = trainer_probe(model, 3)
    assert len(probe["logprobs"]) == len(probe["token_ids"]) - 1
    assert all(lp < 0 for lp in probe["logprobs"])
    assert check_probe(probe, [x + 0.001 for x in probe["logprobs"]], 0.01) == pytest.approx(0.001)
    with pytest.raises(ProbeMismatch):
        check_probe(probe, [x + 0.5 for x in probe["logprobs"]], 0.01)
    with pytest.raises(ProbeMismatch):
        check_probe(probe, probe["logprobs"][:-1], 0.01)


def test_trainer_reset_takes_the_incumbents_weights_and_clears_adam(embedded_model, tmp_path):
    from serve_rft.config import load_config
    from serve_rft.weights import CheckpointMethod
    from serve_rft.trainer.policy.policy import PolicyTrainer
    from tests.support.batches import small_batch

    cfg = load_config(None, ["trainer.lr=0.01"])
    p = PolicyTrainer(cfg, str(embedded_model))
    before = {k: v.clone() for k, v in p.model.state_dict().items()}
    handle = CheckpointMethod(tmp_path / "ck").send(p.publish_model(), 1)
    handle["probe"] = trainer_probe(p.publish_model(), 1)
    p.step(small_batch(0))
    assert any(not torch.equal(before[k], v) for k, v in p.model.state_dict().items())
    assert p.optimizer.state
    assert p.reset_to(handle, 1) == 0.0  # the probe of the weights now held is the published one
    assert all(torch.equal(before[k], v) for k, v in p.model.state_dict().items())
    assert not p.optimizer.state
    assert p.reset_to({"method": "checkpoint", "path": str(embedded_model)}, 0) == 0.0  # the initial probe
    with pytest.raises(ValueError):
        p.reset_to({"method": "nccl"}, 2)


def test_trainer_reset_refuses_weights_that_are_not_the_versions(embedded_model, tmp_path):
    """A handle whose tensors do not give the version's probe (here: the probe of other weights)
    fails the reset loudly instead of training on from unknown weights."""
    from serve_rft.config import load_config
    from serve_rft.weights import CheckpointMethod
    from serve_rft.trainer.policy.policy import PolicyTrainer
    from tests.support.batches import small_batch

    cfg = load_config(None, ["trainer.lr=0.01"])
    p = PolicyTrainer(cfg, str(embedded_model))
    handle = CheckpointMethod(tmp_path / "ck").send(p.publish_model(), 1)
    p.step(small_batch(0))
    handle["probe"] = trainer_probe(p.publish_model(), 1)  # the trained weights', not the folder's
    with pytest.raises(ProbeMismatch):
        p.reset_to(handle, 1)


def test_config_refuses_rollouts_that_cannot_work():
    from pydantic import ValidationError

    from serve_rft.config import load_config

    with pytest.raises(ValidationError, match="canary"):
        load_config(None, ["synchronizer.rollout=canary", "synchronizer.sync_method=nccl"])
    with pytest.raises(ValidationError, match="canary.replicas"):
        load_config(None, ["synchronizer.rollout=canary", "synchronizer.canary={replicas: 2}"])
    with pytest.raises(ValidationError, match="on_reject"):
        load_config(None, ["synchronizer.canary={on_reject: reset}", "trainer.lora={rank: 4, merge_and_sync: true}"])
    with pytest.raises(ValidationError, match="max_replicas"):
        load_config(None, ["explorer.autoscaling={min_replicas: 3, max_replicas: 2}"])
    cfg = load_config(None, ["explorer.autoscaling={min_replicas: 2, max_replicas: 4}", "synchronizer.rollout=canary"])
    assert cfg.explorer.autoscaling.max_replicas == 4


@pytest.mark.parametrize("where", [0, 1, 7])
@pytest.mark.parametrize("side", ["replica", "trainer"])
def test_a_nan_anywhere_in_the_probe_is_a_mismatch(where, side):
    """``max(|a - b|)`` skips a NaN that is not the first difference (every comparison with NaN
    is false): NaN weights on a replica, or in the trainer, would pass the check."""
    want = [-1.0 - 0.1 * i for i in range(8)]
    got = list(want)
    (got if side == "replica" else want)[where] = float("nan")
    with pytest.raises(ProbeMismatch):
        check_probe({"logprobs": want}, got, 0.01)


def test_the_same_infinity_on_both_sides_agrees_and_a_different_one_does_not():
    inf = float("inf")
    assert check_probe({"logprobs": [-1.0, -inf]}, [-1.0, -inf], 0.01) == 0.0
    with pytest.raises(ProbeMismatch):
        check_probe({"logprobs": [-1.0, -inf]}, [-1.0, -2.0], 0.01)
    with pytest.raises(ProbeMismatch):
        check_probe({"logprobs": [-1.0, -2.0]}, [-1.0, -inf], 0.01)

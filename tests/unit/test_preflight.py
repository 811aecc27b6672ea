"""A configuration this machine cannot run is refused before anything starts."""

import pytest
import torch
from typer.testing import CliRunner

from serve_rft.cli import cli

NCCL = ["--set", "synchronizer.sync_method=nccl", "--set", "trainer.device=cuda",
        "--set", "explorer.num_gpus_per_replica=1"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
def test_nccl_on_a_machine_without_cuda_is_a_clear_config_error(tmp_path):
    result = CliRunner().invoke(cli, ["up", *NCCL, "--set", f"service.run_dir={tmp_path}"])
    assert result.exit_code == 2
    assert "needs CUDA GPUs" in result.output and "checkpoint or memory" in result.output
    assert not (tmp_path / "redis").exists()  # nothing was started


def test_nccl_without_gpus_in_the_config_is_refused_by_the_cli():
    result = CliRunner().invoke(cli, ["up", "--set", "synchronizer.sync_method=nccl"])
    assert result.exit_code == 2 and "trainer.device=cuda" in result.output


def test_train_mode_refuses_what_cannot_work():
    from serve_rft.config import load_config
    from serve_rft.service.launcher import check_mode

    with pytest.raises(ValueError, match="redis_url"):
        check_mode(load_config(None, ["service.ray_address=10.0.0.1:6379"]), "train")
    with pytest.raises(ValueError, match="explorer_driven"):
        check_mode(load_config(None, ["synchronizer.sync_style=explorer_driven"]), "train")
    check_mode(load_config(None, ["synchronizer.sync_style=explorer_driven"]), "both")
    check_mode(load_config(None, ["service.ray_address=10.0.0.1:6379",
                                  "buffer.redis_url=redis://10.0.0.1:6380/0"]), "train")

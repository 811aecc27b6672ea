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

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


def test_engine_arguments_serve_rft_owns_or_vllm_lacks_are_refused_before_anything_starts(tmp_path):
    """explorer.engine_args passes vLLM engine arguments through; one serve_rft sets itself is a
    config error that says what to set instead, and a name vLLM's AsyncEngineArgs lacks is refused
    by the CLI before Redis or Ray start."""
    from pydantic import ValidationError

    from serve_rft.config import load_config

    with pytest.raises(ValidationError, match="explorer.engine_args.dtype is serve_rft's to set: set explorer.dtype"):
        load_config(None, ["explorer.engine_args={dtype: bfloat16}"])
    with pytest.raises(ValidationError, match="logprobs_mode is serve_rft's to set"):
        load_config(None, ["explorer.engine_args={logprobs_mode: raw_logprobs}"])
    result = CliRunner().invoke(cli, ["up", "--set", "explorer.engine_args={enable_prefix_cachng: false}",
                                      "--set", f"service.run_dir={tmp_path}"])
    assert result.exit_code == 2, result.output
    assert "enable_prefix_cachng not an argument of vLLM's AsyncEngineArgs" in " ".join(result.output.split())
    assert not (tmp_path / "redis").exists()


def test_engine_kwargs_put_serve_rfts_arguments_first_and_pass_the_rest_through():
    from serve_rft.config.explorer import ExplorerConfig
    from serve_rft.explorer.engine.engine_args import LOGPROBS_MODE, engine_kwargs

    cfg = ExplorerConfig(engine_args={"enable_prefix_caching": False, "max_num_batched_tokens": 4096})
    kw = engine_kwargs(cfg, "/m", seed=7, on_cpu=True)
    assert kw["enable_prefix_caching"] is False and kw["max_num_batched_tokens"] == 4096
    assert kw["logprobs_mode"] == LOGPROBS_MODE and kw["seed"] == 7 and kw["model"] == "/m"
    assert kw["enforce_eager"] is True and kw["disable_log_stats"] is False
    assert engine_kwargs(ExplorerConfig(), "/m", seed=0, on_cpu=False)["enforce_eager"] is False  # GPU: graphs
    assert engine_kwargs(ExplorerConfig(enforce_eager=True), "/m", seed=0, on_cpu=False)["enforce_eager"] is True
    assert engine_kwargs(ExplorerConfig(log_stats=False), "/m", seed=0, on_cpu=True)["disable_log_stats"] is True
    so = engine_kwargs(ExplorerConfig(engine_args={"structured_outputs_config": {
        "backend": "xgrammar", "disable_any_whitespace": True}}), "/m", seed=0, on_cpu=True)["structured_outputs_config"]
    assert type(so).__name__ == "StructuredOutputsConfig" and so.disable_any_whitespace  # as `vllm serve` parses it
    lora = engine_kwargs(ExplorerConfig(max_loras=2), "/m", seed=0, on_cpu=True, lora_rank=8)
    assert lora["enable_lora"] and lora["max_lora_rank"] == 8 and lora["max_loras"] == 2


def test_tensor_parallel_replicas_get_a_worker_process_each_and_the_resources_of_all():
    """explorer.tensor_parallel_size: vLLM's argument, its workers this replica's child processes
    (vLLM's mp executor), the replica reserving every worker's CPUs and GPUs; vLLM's own argument
    and executor choice refused in engine_args; pipeline parallelism refused."""
    from pydantic import ValidationError

    from serve_rft.config import load_config
    from serve_rft.config.explorer import ExplorerConfig
    from serve_rft.explorer.engine.engine_args import engine_kwargs
    from serve_rft.service.app import explorer_deployment

    assert "distributed_executor_backend" not in engine_kwargs(ExplorerConfig(), "/m", seed=0, on_cpu=True)
    kw = engine_kwargs(ExplorerConfig(tensor_parallel_size=2), "/m", seed=0, on_cpu=True)
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "mp"
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend"):
        with pytest.raises(ValidationError, match=f"explorer.engine_args.{key} is serve_rft's to set"):
            load_config(None, [f"explorer.engine_args={{{key}: 2}}"])
    cfg = load_config(None, ["explorer.tensor_parallel_size=4", "explorer.num_cpus_per_replica=0.5",
                             "explorer.num_gpus_per_replica=1"])
    actor = explorer_deployment(cfg).ray_actor_options
    assert (actor["num_cpus"], actor["num_gpus"]) == (2.0, 4.0), actor


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused_before_anything_starts(tmp_path):
    """The embedded model has 4 attention heads: 2 and 4 workers hold 2 and 1 each, 3 cannot
    (vLLM refuses it only once a replica's engine starts)."""
    from serve_rft.config import load_config
    from serve_rft.control import attention_heads, preflight

    assert attention_heads(None) == 4
    for tp in (2, 4):
        preflight(load_config(None, [f"explorer.tensor_parallel_size={tp}", f"service.run_dir={tmp_path}"]))
    result = CliRunner().invoke(cli, ["up", "--set", "explorer.tensor_parallel_size=3",
                                      "--set", f"service.run_dir={tmp_path}"])
    assert result.exit_code == 2, result.output
    assert "tensor_parallel_size=3 does not divide the model's 4 attention heads" in " ".join(result.output.split())
    assert not (tmp_path / "redis").exists()


KEY_ENV = ("SERVE_RFT_API_KEYS", "SERVE_RFT_REWARD_KEYS", "SERVE_RFT_ADMIN_KEYS")


@pytest.mark.parametrize("args", [
    ["--config", "configs/cluster.yaml"],
    ["--config", "configs/single_gpu.yaml"],
    ["--set", "service.host=0.0.0.0"],
    ["--set", "service.host='::'"],
])
def test_up_on_an_exposed_address_without_keys_exits_non_zero_before_anything_starts(monkeypatch, tmp_path, args):
    from pathlib import Path

    for name in KEY_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(Path(__file__).parents[2])
    result = CliRunner().invoke(cli, ["up", *args, "--set", f"service.run_dir={tmp_path}"])
    assert result.exit_code == 2, result.output
    out = " ".join(result.output.split())
    assert "refusing to serve on" in out and "with no API keys" in out
    assert not (tmp_path / "redis").exists()  # nothing was started


@pytest.mark.skipif(torch.cuda.is_available(), reason="stops at the CUDA preflight on a machine without CUDA")
def test_up_allowed_to_serve_openly_says_so_loudly(monkeypatch, tmp_path):
    from pathlib import Path

    for name in KEY_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(Path(__file__).parents[2])
    result = CliRunner().invoke(cli, ["up", "--config", "configs/cluster.yaml", "--set",
                                      "service.allow_unauthenticated=true", "--set", f"service.run_dir={tmp_path}"])
    out = " ".join(result.output.split())
    assert "WITHOUT AUTHENTICATION on 0.0.0.0" in out
    assert result.exit_code == 2 and "CUDA" in out  # the next check refuses this machine


def test_train_mode_binds_no_http_so_needs_no_keys(monkeypatch):
    from serve_rft.cli import Mode, _runnable
    from serve_rft.config import load_config

    for name in KEY_ENV:
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(None, ["service.host=0.0.0.0"])
    assert _runnable(cfg, Mode.train) is cfg


def test_up_without_redis_server_on_path_says_how_to_install_it(monkeypatch, tmp_path):
    """The embedded store needs ``redis-server``: without it on PATH, one line naming the package and
    the bootstrap, exit 2, nothing started; with ``buffer.redis_url`` set it is not needed.
    (Fails with the preflight's check removed: validate then exits 0.)"""
    import shutil

    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    assert shutil.which("redis-server") is None
    result = CliRunner().invoke(cli, ["config", "validate", "--set", f"service.run_dir={tmp_path}"])
    out = " ".join(result.output.split())
    assert result.exit_code == 2 and "redis-server not found on PATH" in out and "apt-get install redis-server" in out
    result = CliRunner().invoke(cli, ["config", "validate", "--set", "buffer.redis_url=redis://127.0.0.1:1/0"])
    assert result.exit_code == 0, result.output

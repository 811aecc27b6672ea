"""The repository as something shipped: its files as a tree, its wheel, that wheel in a fresh venv.

Shared by tests that run the code the way it leaves this repository (test_multinode's
``working_dir`` zip, test_serve_run's package install).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def repo_files() -> list[str]:
    """The repository's files, tracked and untracked but not ignored (what a commit of the work
    tree would hold), as paths relative to its root; symlinks are listed as themselves."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
    return [f for f in out if (ROOT / f).is_file()]


def code_zip(dest: Path, top: str = "serve_rft_src") -> Path:
    """`repo_files` in one top-level folder ``top``, the layout Ray's ``working_dir`` zip URIs need."""
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as z:
        for f in repo_files():
            z.write(ROOT / f, f"{top}/{f}")
    return dest


def build_wheel(work: Path) -> Path:
    """The project's wheel, built by pip from a copy of `repo_files` (nothing is written into the
    checkout), offline and with this venv's setuptools (``--no-build-isolation --no-index``).

    Returns:
        The ``.whl`` file under ``work/dist``.
    Raises:
        subprocess.CalledProcessError: pip could not build it.
    """
    src = work / "src"
    for f in repo_files():
        target = src / f
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((ROOT / f).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(work / "dist"), str(src)], check=True, capture_output=True, text=True)
    (wheel,) = (work / "dist").glob("serve_rft-*.whl")
    return wheel


def fresh_venv(path: Path, wheel: Path) -> Path:
    """A new venv at ``path`` (the base interpreter's ``venv``, no packages) with ``wheel``
    installed by its own pip, ``--no-deps`` and offline. Its dependencies (vLLM, Ray, torch: GBs a
    2-core CI machine cannot install twice in its time) are this venv's: a ``.pth`` file adds this
    venv's site-packages after the fresh one's own, as a plain path, so none of its ``.pth`` files
    run and the checkout's editable install of serve_rft stays out.

    Returns:
        The fresh venv's ``python``.
    Raises:
        subprocess.CalledProcessError: venv or pip failed.
    """
    subprocess.run([sys._base_executable, "-m", "venv", str(path)], check=True, capture_output=True)
    python = path / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, text=True, env=clean_env())
    return python


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would put the checkout on a child's import path
    (``PYTHONPATH``, a venv's ``VIRTUAL_ENV``), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **extra}

"""The CHECKPOINT method's version folders (written by the trainer, read by replicas and by a
restarted trainer's state): each policy version is a committed folder.

Layout under ``root``: ``v000007/`` holds ``config.json`` + ``model.safetensors`` and a
``COMMITTED`` marker written last. A version is written to a hidden temp folder, fsynced,
renamed into place, then marked, so a reader never sees a partial version; every version gets
a new folder (vLLM issue #32718: reloading from the same path can return stale weights).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

MARKER = "COMMITTED"


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def _fsync_dir(path: Path) -> None:
    """fsync every file under ``path`` (subfolders too: a trainer state's ``optimizer/`` and
    ``adapter/``), then each folder's entries."""
    for f in path.iterdir():
        if f.is_dir():
            _fsync_dir(f)
        elif f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_version(model, root: str | Path, version: int, keep: int = 3, in_use_floor: int | None = None,
                 extra: Callable[[Path], None] | None = None) -> Path:
    """Write ``model`` (a transformers model) as policy ``version`` and prune old versions.

    ``in_use_floor``: the oldest version a replica serves or may still load; versions at or
    above it are never pruned (a replica restores its current version if a load fails).
    ``extra(folder)`` writes more files into the folder before it is committed.

    Returns:
        The committed folder.
    Raises:
        FileExistsError: that version was already committed.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    if (final / MARKER).exists():
        raise FileExistsError(f"version {version} already committed at {final}")
    tmp = Path(tempfile.mkdtemp(prefix=f".v{version:06d}.", dir=str(root)))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        if extra is not None:
            extra(tmp)
        _fsync_dir(tmp)
        if final.exists():  # an uncommitted leftover of a crashed publish
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    (final / MARKER).write_text(str(version))
    prune(root, keep, in_use_floor)
    return final


def committed_versions(root: str | Path) -> list[int]:
    """Committed versions under ``root``, ascending."""
    root = Path(root)
    if not root.exists():
        return []
    out = []
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("v") and (d / MARKER).exists():
            out.append(int(d.name[1:]))
    return sorted(out)


PRUNED = ".pruned-"
"""Prefix of a version folder taken out of the committed set and not yet deleted (`prune`)."""


def prune(root: str | Path, keep: int, in_use_floor: int | None = None) -> None:
    """Delete committed versions older than the newest ``keep`` and below ``in_use_floor``.

    Each goes in two steps: one atomic rename out of the committed set (to a hidden folder), then
    the deletion. A kill during a deletion thus leaves a hidden folder, which the next prune
    removes, never a committed version with files missing (a trainer killed mid-prune once left
    one, and its restart failed to resume: CI, test_chaos.py)."""
    root = Path(root)
    for leftover in root.glob(f"{PRUNED}*"):  # what an earlier prune did not finish
        shutil.rmtree(leftover, ignore_errors=True)
    for v in committed_versions(root)[:-keep]:
        if in_use_floor is None or v < in_use_floor:
            gone = root / f"{PRUNED}{version_dir(root, v).name}"
            os.rename(version_dir(root, v), gone)
            shutil.rmtree(gone, ignore_errors=True)

"""The CHECKPOINT method's version folders (written by the trainer, read by replicas and by a
restarted trainer's state): each policy version is a committed folder.

Layout under ``root``: ``v000007/`` holds ``config.json`` + ``model.safetensors`` and a
``COMMITTED`` marker written last. A version is written to a hidden temp folder, fsynced,
renamed into place, then marked, so a reader never sees a partial version; every version gets
a new folder (vLLM issue #32718: reloading from the same path can return stale weights).
Pruning keeps the newest versions and every version in use, whatever its age (`kept_versions`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Collection

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
    fsync_folder(path)


def fsync_folder(path: str | Path) -> None:
    """fsync ``path``'s own entries (a rename into it, a file created in it), not its files."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` and fsync the file, then its folder (the new entry)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    fsync_folder(path.parent)


def save_version(model, root: str | Path, version: int, keep: int = 3, in_use: Collection[int] | None = (),
                 extra: Callable[[Path], None] | None = None) -> Path:
    """Write ``model`` (a transformers model) as policy ``version`` and prune old versions.

    Durable when it returns: the files and the temp folder are fsynced, then the rename into
    place and ``root`` (its entry), then the ``COMMITTED`` marker and the version folder (the
    marker's entry), so a version announced or a trainer state acknowledged after this call
    survives a power loss (rename(2) and creat(2) are durable only once the folder holding the
    new entry is fsynced: fsync(2), NOTES).

    ``in_use``: versions a replica serves or may still load (`prune`; None: not known yet, prune
    nothing). ``extra(folder)`` writes more files into the folder before it is committed.

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
    fsync_folder(root)
    write_durably(final / MARKER, str(version))
    prune(root, keep, in_use)
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


def kept_versions(committed: list[int], keep: int, in_use: Collection[int] | None = ()) -> set[int]:
    """Which of the ``committed`` versions (ascending) `prune` keeps: the newest ``keep`` and
    every version in ``in_use`` (those a replica serves, restores to on a failed load, is
    loading, or the synchronizer holds a handle of); all of them when ``in_use`` is None (not
    known yet: a restarted synchronizer waiting for its replicas)."""
    if in_use is None:
        return set(committed)
    return set(committed[-keep:] if keep > 0 else []) | (set(committed) & set(in_use))


def prune(root: str | Path, keep: int, in_use: Collection[int] | None = ()) -> None:
    """Delete the committed versions `kept_versions` does not keep.

    Each goes in two steps: one atomic rename out of the committed set (to a hidden folder), then
    the deletion. A kill during a deletion thus leaves a hidden folder, which the next prune
    removes, never a committed version with files missing (a trainer killed mid-prune once left
    one, and its restart failed to resume: CI, test_stack_faults.py)."""
    root = Path(root)
    for leftover in root.glob(f"{PRUNED}*"):  # what an earlier prune did not finish
        shutil.rmtree(leftover, ignore_errors=True)
    committed = committed_versions(root)
    kept = kept_versions(committed, keep, in_use)
    for v in committed:
        if v not in kept:
            gone = root / f"{PRUNED}{version_dir(root, v).name}"
            os.rename(version_dir(root, v), gone)
            shutil.rmtree(gone, ignore_errors=True)

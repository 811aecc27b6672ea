"""A trainer state is durable before the entries it covers are acknowledged, and a published
version before it is announced: the files, the rename into place and its parent folder, the
``COMMITTED`` marker and its folder are fsynced first (fsync(2), NOTES: a new directory entry
is durable only once its folder is fsynced). Order observed with a spy on ``os.fsync`` and
``os.rename`` through a real `Publishing._publish` (CHECKPOINT method, real folders)."""

import asyncio
import os

from serve_rft.trainer.publishing.state import PUBLISHED_FILE
from serve_rft.weights import CheckpointMethod
from serve_rft.weights.folders import MARKER, version_dir
from tests.support.trainers import PublishingTrainer, StandInPolicy, StandInSynchronizer


def test_marker_rename_and_parents_are_fsynced_before_announce_and_ack(tmp_path, monkeypatch):
    log: list[tuple] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst):
        log.append(("rename", str(dst)))
        return real_rename(src, dst)

    def replace(src, dst):
        log.append(("rename", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    trainer = PublishingTrainer(tmp_path, log)
    weights = CheckpointMethod(tmp_path / "weights")
    weights.prepare()
    asyncio.run(trainer._publish(StandInPolicy(), weights, StandInSynchronizer(log), trainer.feed.store))

    def at(event: tuple) -> int:
        assert event in log, f"{event} never happened: {log}"
        return log.index(event)

    state_root, weights_root = str(trainer.state_root), str(tmp_path / "weights")
    # PUBLISHED: replaced, then its folder fsynced, before the weights are even written
    assert at(("rename", f"{state_root}/{PUBLISHED_FILE}")) < at(("fsync", state_root)) < at(
        ("rename", str(version_dir(weights_root, 1))))
    for root, then in ((weights_root, ("announce",)), (state_root, ("ack",))):
        folder = str(version_dir(root, 1))
        renamed = at(("rename", folder))
        parent = log.index(("fsync", root), renamed)
        marker = at(("fsync", f"{folder}/{MARKER}"))
        folder_after_marker = log.index(("fsync", folder), marker)
        assert renamed < parent < marker < folder_after_marker < at(then), log
    assert at(("announce",)) < at(("ack",))

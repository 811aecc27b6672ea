import torch
from safetensors.torch import load_file

from serve_rft.weights.folders import MARKER, committed_versions, save_version, version_dir


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3))

    def save_pretrained(self, path, safe_serialization=True):
        from pathlib import Path

        from safetensors.torch import save_file

        save_file({"w": self.w.detach()}, str(Path(path) / "model.safetensors"))
        (Path(path) / "config.json").write_text("{}")


def test_versions_are_committed_in_new_folders_and_pruned(tmp_path):
    m = _Tiny()
    for v in range(1, 6):
        with torch.no_grad():
            m.w += 1
        p = save_version(m, tmp_path, v, keep=3)
        assert p == version_dir(tmp_path, v) and (p / MARKER).exists()
    assert committed_versions(tmp_path) == [3, 4, 5]
    assert torch.equal(load_file(str(version_dir(tmp_path, 5) / "model.safetensors"))["w"], m.w.detach())
    assert not [d for d in tmp_path.iterdir() if d.name.startswith(".")]


def test_uncommitted_folder_is_not_a_version(tmp_path):
    (tmp_path / "v000009").mkdir()
    assert committed_versions(tmp_path) == []
    save_version(_Tiny(), tmp_path, 9)
    assert committed_versions(tmp_path) == [9]


def test_versions_in_use_by_a_replica_are_never_pruned(tmp_path):
    m = _Tiny()
    for v in range(1, 7):
        save_version(m, tmp_path, v, keep=2, in_use={2})
    assert committed_versions(tmp_path) == [2, 5, 6]


def test_one_old_version_in_use_keeps_itself_not_everything_above_it(tmp_path):
    """A pinned (or lagging) version keeps its own folder and the newest ``keep``: 40 versions
    with version 2 in use leave 3 folders, not the 38 from 2 up (each tens of GB at real sizes)."""
    m = _Tiny()
    for v in range(1, 41):
        save_version(m, tmp_path, v, keep=2, in_use=[2, 17, 39])
    assert committed_versions(tmp_path) == [2, 17, 39, 40]


def test_the_kept_set_is_the_versions_in_use_and_the_newest_keep():
    from serve_rft.weights.folders import kept_versions

    committed = [1, 2, 3, 5, 8, 13]
    assert kept_versions(committed, 2) == {8, 13}
    assert kept_versions(committed, 2, {1, 5, 99}) == {1, 5, 8, 13}  # 99: not on disk, nothing to keep
    assert kept_versions(committed, 0, {3}) == {3}
    assert kept_versions(committed, 2, None) == set(committed)  # not known yet: prune nothing


def test_nothing_is_pruned_while_the_versions_in_use_are_not_known(tmp_path):
    m = _Tiny()
    for v in range(1, 6):
        save_version(m, tmp_path, v, keep=2, in_use=None)
    assert committed_versions(tmp_path) == [1, 2, 3, 4, 5]
    save_version(m, tmp_path, 6, keep=2, in_use=[])
    assert committed_versions(tmp_path) == [5, 6]


def test_a_crash_mid_write_leaves_no_loadable_version(tmp_path):
    import pytest

    class _Crashing(_Tiny):
        def save_pretrained(self, path, safe_serialization=True):
            from pathlib import Path

            (Path(path) / "model.safetensors").write_bytes(b"half a tensor")
            raise OSError("disk full")

    save_version(_Tiny(), tmp_path, 1)
    with pytest.raises(OSError):
        save_version(_Crashing(), tmp_path, 2)
    assert committed_versions(tmp_path) == [1]
    assert not version_dir(tmp_path, 2).exists()
    assert not [d for d in tmp_path.iterdir() if d.name.startswith(".")]


def test_replicas_refuse_an_uncommitted_folder(tmp_path):
    import asyncio

    import pytest

    from serve_rft.weights import CheckpointMethod

    (tmp_path / "v000003").mkdir()
    with pytest.raises(FileNotFoundError, match="not a committed version"):
        asyncio.run(CheckpointMethod(tmp_path).receive(None, {"method": "checkpoint",
                                                              "path": str(tmp_path / "v000003")}, 3))


def test_a_kill_during_a_prune_leaves_no_committed_version_with_files_missing(tmp_path, monkeypatch):
    """The prune renames a version out of the committed set before deleting it: a deletion cut
    short (a kill) leaves a hidden folder the next prune removes. Deleting in place once left a
    `COMMITTED` folder without its state, and a restarted trainer failed to resume from it."""
    import shutil
    from pathlib import Path

    import pytest

    from serve_rft.weights import folders

    m = _Tiny()
    for v in range(1, 4):
        save_version(m, tmp_path, v, keep=3)
    real_rmtree = shutil.rmtree

    def killed(path, *a, **kw):  # the first deletion of a version folder stops half way
        if (Path(path) / "model.safetensors").exists():
            (Path(path) / "model.safetensors").unlink()
            raise KeyboardInterrupt("killed")  # as a kill -9 looks from here: nothing more runs
        return real_rmtree(path, *a, **kw)

    monkeypatch.setattr(folders.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        save_version(m, tmp_path, 4, keep=3)
    monkeypatch.setattr(folders.shutil, "rmtree", real_rmtree)
    assert committed_versions(tmp_path) == [2, 3, 4]  # version 1 is out of the committed set
    for v in committed_versions(tmp_path):
        assert (version_dir(tmp_path, v) / "model.safetensors").exists()
    assert [d.name for d in tmp_path.iterdir() if d.name.startswith(".")] == [".pruned-v000001"]
    save_version(m, tmp_path, 5, keep=3)
    assert committed_versions(tmp_path) == [3, 4, 5]
    assert not [d for d in tmp_path.iterdir() if d.name.startswith(".")]

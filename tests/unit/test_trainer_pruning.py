"""Which checkpoint folders a publish keeps: the synchronizer's versions in use plus the newest
``keep`` (`serve_rft.synchronizer.state.SyncState.in_use_versions`,
`serve_rft.weights.folders.prune`), never the whole range above the oldest one in use."""

from serve_rft.config import SynchronizerConfig
from serve_rft.synchronizer.state import SyncState
from serve_rft.types import PublishedVersion
from serve_rft.weights.folders import committed_versions, kept_versions, save_version


class _Tiny:
    def save_pretrained(self, path, safe_serialization=True):
        from pathlib import Path

        (Path(path) / "config.json").write_text("{}")


def _state(n=2):
    s = SyncState(SynchronizerConfig(max_unavailable=1, replica_timeout_s=10, sync_style="trainer_driven",
                                     retain_versions=1))
    for i in range(n):
        s.register(f"r{i}", 0, now=100.0, base_handle={"method": "checkpoint", "path": "/base"})
    return s


def _pub(s, v, now=101.0):
    s.publish(PublishedVersion(version=v, handle={"method": "checkpoint", "path": f"/v{v}"}, published_at=now), now)


def test_a_replica_loading_an_old_version_keeps_that_version_and_its_own_not_the_range(tmp_path):
    s = _state(n=2)
    _pub(s, 1)
    assert s.grant("r0", 101).version == 1  # r0 loads v1 (and restores v0 if that fails)
    for v in range(2, 40):
        _pub(s, v, 101)  # the incumbent moves on meanwhile
    s.lost("r1", now=102)
    in_use = s.in_use_versions(now=102)
    assert 0 in in_use and 1 in in_use and 39 in in_use
    assert not set(range(2, 30)) & set(in_use)  # what nobody serves, loads or holds a handle of
    for v in range(1, 41):
        save_version(_Tiny(), tmp_path, v, keep=2, in_use=in_use)
    assert set(committed_versions(tmp_path)) == kept_versions(list(range(1, 41)), 2, in_use)
    assert len(committed_versions(tmp_path)) <= len(in_use) + 2


def test_a_restarted_synchronizer_prunes_nothing_until_its_replicas_are_back():
    s = SyncState(SynchronizerConfig(sync_style="trainer_driven"))
    s.hold_grants_until = 200.0
    assert s.in_use_versions(now=150.0) is None
    assert kept_versions([1, 2, 3], 1, s.in_use_versions(now=150.0)) == {1, 2, 3}

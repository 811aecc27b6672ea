"""The loop with the MEMORY sync method (versions travel through Ray's object store in
buckets) and the EXPLORER_DRIVEN style (replicas ask; the trainer answers)."""

from __future__ import annotations

import pytest

from tests.integration import test_stack as loop
from tests.integration.conftest import start_stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(redis_server, embedded_model, tmp_path_factory):
    yield from start_stack(redis_server.url, embedded_model, tmp_path_factory.mktemp("run-memory"),
                           ["synchronizer.sync_method=memory", "synchronizer.bucket_bytes=262144",
                            "synchronizer.sync_style=explorer_driven", "synchronizer.sync_interval=2"])


def test_memory_method_rolls_versions_without_failures(stack):
    loop.test_training_rolls_new_versions_across_replicas_without_failures(stack)
    import httpx

    st = httpx.get(f"{stack.url}/v1/status").json()
    assert st["sync_style"] == "explorer_driven"
    assert all(r["last_sync"] and r["last_sync"]["bytes"] > 0 for r in st["replicas"]), st
    assert all(r["explorer_step"] >= 2 for r in st["replicas"]), st
    assert not (stack.run_dir / "checkpoints").exists(), "MEMORY must not write checkpoints"

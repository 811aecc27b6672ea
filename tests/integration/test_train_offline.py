"""Train-only on a store collected earlier (the Trinity-RFT technical report's train-only
mode, §2.1): no explorer runs.

A run directory's embedded redis-server holds rewarded experiences (written through the store's
own code, then stopped); ``serve-rft up --mode train --max-steps 1`` restarts that redis-server
from its AOF, trains, publishes, saves its state and exits; a second run resumes from that state.
Both runs log their steps to TensorBoard and Weights & Biases (``trainer.loggers``), read back at
the end: the W&B runs are complete on disk only because the stop finishes them before it kills
the trainer (``Trainer.close_trackers``; shown failing with that call taken out of the launcher's
stop: the run files held no history).
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys

import pytest

from serve_rft.buffer.redis_server import start_redis
from serve_rft.buffer.store import ExperienceStore
from serve_rft.weights.folders import committed_versions
from serve_rft.types import Experience, SamplingInfo

pytestmark = pytest.mark.integration


def _collect(run_dir, tag: str, completions: int = 4, n: int = 4):
    server = start_redis(run_dir / "redis")

    async def go():
        s = ExperienceStore(server.url, prefix="srft")
        for k in range(completions):
            cid = f"chatcmpl-{tag}-{k}"
            await s.log_experiences([Experience(
                completion_id=cid, choice_index=i, group_id=cid, replica_id="earlier-run",
                prompt_token_ids=[1, 2, 3], response_token_ids=[10 + i, 20 + k, 30],
                behaviour_logprobs=[-5.0, -5.0, -5.0], token_versions=[(0, 0, 3)],
                sampling=SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=3), finish_reason="length")
                for i in range(n)])
            for i in range(n):
                await s.post_reward(cid, i, float(i))
        counts = await s.counts()
        await s.close()
        return counts

    try:
        return asyncio.run(go())
    finally:
        server.stop()


def _train(run_dir) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "serve_rft.cli", "up", "--mode", "train", "--max-steps", "1",
         "--set", f"service.run_dir={run_dir}", "--set", "trainer.min_batch_size=4",
         "--set", "trainer.batch_size=16", "--set", "trainer.batch_wait_s=0.5",
         "--set", "trainer.loggers=[tensorboard,wandb]"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "WANDB_SILENT": "true", "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _counts(run_dir):
    server = start_redis(run_dir / "redis")

    async def go():
        s = ExperienceStore(server.url, prefix="srft")
        try:
            return await s.counts(), [c.trained_version for c in await s.choices("chatcmpl-b-0")]
        finally:
            await s.close()

    try:
        return asyncio.run(go())
    finally:
        server.stop()


def test_train_only_on_a_store_collected_earlier_then_resume(tmp_path):
    assert _collect(tmp_path, "a").ready == 16
    out = _train(tmp_path)
    assert "trainer: 1 steps, policy version 1" in out
    assert committed_versions(tmp_path / "checkpoints") == [1]
    assert committed_versions(tmp_path / "trainer_state") == [1]

    _collect(tmp_path, "b")
    out = _train(tmp_path)  # resumes from state v1: republishes it as v2, trains v3
    assert "policy version 3" in out
    counts, versions = _counts(tmp_path)
    assert (counts.trained, counts.ready, counts.rewarded) == (32, 0, 32)
    assert versions == [3, 3, 3, 3]
    # trainer.loggers: each run's step statistics in TensorBoard, read back
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tracking" / "tensorboard" / tmp_path.name))
    acc.Reload()
    loss = acc.Scalars("trainer/loss")
    assert [e.step for e in loss] == [1, 3] and all(math.isfinite(e.value) for e in loss), loss
    assert [e.value for e in acc.Scalars("trainer/policy_version")] == [1.0, 3.0]
    # ... and in W&B's offline runs, one per trainer process
    from tests.support.wandb_run import history

    runs = sorted((tmp_path / "tracking" / "wandb").rglob("run-*.wandb"))
    assert [[r["_step"] for r in history(f)] for f in runs] == [[1], [3]], runs

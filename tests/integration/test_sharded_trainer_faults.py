"""A sharded trainer (``trainer.num_workers=2``: two FSDP2 rank actors behind the trainer actor)
survives ``kill -9`` of a rank in the middle of a run: the trainer process ends with it, Ray
restarts the trainer, which builds a new group from its newest saved state (weights and AdamW
shards) and trains on; every rewarded experience is trained exactly once (the store's trained
counter equals the number rewarded, none dead-lettered, none left ready).

``serve-rft up --mode train`` runs on the shared redis-server with a store seeded here; a
separate driver process joins its Ray cluster to read the trainer's status (rank pids, steps).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from serve_rft.buffer.store import ExperienceStore
from serve_rft.types import Experience, SamplingInfo
from tests.support.stack import start_stack

pytestmark = pytest.mark.integration

COMPLETIONS, N = 24, 4


def _seed(url: str, prefix: str) -> None:
    async def go():
        s = ExperienceStore(url, prefix=prefix)
        try:
            for k in range(COMPLETIONS):
                cid = f"chatcmpl-shk-{k}"
                await s.log_experiences([Experience(
                    completion_id=cid, choice_index=i, group_id=cid, replica_id="earlier-run",
                    prompt_token_ids=[1, 2, 3 + k % 7], response_token_ids=[10 + i, 20 + k, 30, 40 + i],
                    behaviour_logprobs=[-5.0] * 4, token_versions=[(0, 0, 4)],
                    sampling=SamplingInfo(temperature=1.0, top_p=1.0, max_tokens=4), finish_reason="length")
                    for i in range(N)])
                for i in range(N):
                    await s.post_reward(cid, i, float(i))
        finally:
            await s.close()
    asyncio.run(go())


def _counts(url: str, prefix: str):
    async def go():
        s = ExperienceStore(url, prefix=prefix)
        try:
            return await s.counts()
        finally:
            await s.close()
    return asyncio.run(go())


class _StatusReader:
    """A driver process in the stack's Ray cluster printing the trainer's status twice a second."""

    CODE = (
        "import json, time, ray\n"
        "ray.init(address={addr!r}, log_to_driver=False)\n"
        "from serve_rft.service.launcher import trainer_status\n"
        "while True:\n"
        "    try:\n"
        "        st = trainer_status()\n"
        "    except Exception as e:\n"
        "        st = {{'unreachable': repr(e)}}\n"
        "    print(json.dumps(st, default=str), flush=True)\n"
        "    time.sleep(0.5)\n")

    def __init__(self, ray_address: str):
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE.format(addr=ray_address)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "RAY_AUTH_MODE": "token"})
        self.last: dict = {}
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in iter(self.proc.stdout.readline, ""):
            try:
                self.last = json.loads(line)
                self.seen.append(self.last)
            except json.JSONDecodeError:
                pass

    def wait(self, predicate, timeout_s: float, what: str) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.last
            if st and "unreachable" not in st and predicate(st):
                return st
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; last status {self.last}")

    def stop(self):
        self.proc.send_signal(signal.SIGKILL)  # by the pid we started
        self.proc.wait()


def test_kill_9_of_a_rank_resumes_from_the_saved_state_and_trains_every_entry_once(
        redis_server, embedded_model, tmp_path):
    prefix = "shk"
    _seed(redis_server.url, prefix)
    settings = ["trainer.num_workers=2", "trainer.min_batch_size=8", "trainer.batch_size=8",
                "trainer.batch_wait_s=0.2", "synchronizer.sync_style=trainer_driven", "synchronizer.sync_interval=1",
                "trainer.save_interval=1", "trainer.max_staleness=1000", "trainer.num_threads=1"]
    gen = start_stack(redis_server.url, embedded_model, tmp_path, settings, args=("--mode", "train"), prefix=prefix)
    stack = next(gen)
    reader = _StatusReader(stack.ray_address)
    try:
        st = reader.wait(lambda s: s["steps_done"] >= 2 and len(s.get("rank_pids") or []) == 2, 300,
                         "two sharded steps")
        old_pid, old_ranks = st["pid"], st["rank_pids"]
        victim = old_ranks[1]
        os.kill(victim, signal.SIGKILL)
        st = reader.wait(lambda s: s["pid"] != old_pid and s["resumed_from"] is not None, 300,
                         "the trainer to restart with a new group from its state")
        assert victim not in st["rank_pids"] and len(st["rank_pids"]) == 2
        survivor = old_ranks[0]  # the old group's other rank ended with its trainer process
        reader.wait(lambda s: not psutil.pid_exists(survivor) or psutil.Process(survivor).status() == "zombie",
                    60, f"the old rank 0 (pid {survivor}) to end")
        print("after restart:", {k: st.get(k) for k in ("steps_done", "resumed_from", "redelivered", "resume_acked")})
        deadline = time.monotonic() + 300
        while True:
            c = _counts(redis_server.url, prefix)
            if c.ready == 0 and c.trained + c.dead_lettered >= COMPLETIONS * N:
                break
            assert time.monotonic() < deadline, c
            time.sleep(1.0)
        assert (c.rewarded, c.trained, c.dead_lettered, c.stale_dropped) == (COMPLETIONS * N, COMPLETIONS * N, 0, 0), c
        assert reader.last["error"] is None
    finally:
        reader.stop()
        next(gen, None)  # SIGINT, clean shutdown, exit code 0

"""The Trainer Ray actor: ready experiences in, committed policy versions out.

Loop (seed 000, "Inside the Trainer"): sample a batch of rewarded experiences from the store's
ready stream, compute advantages and the PPO-clip loss against the logged behaviour logprobs,
step AdamW, and publish a new policy version when the sync style says so
(`serve_rft.synchronizer.styles.trainer_publishes`) through the configured sync method.

Exactly-once: ready-stream entries are acknowledged only after the version that trained on them
is published *and* a saved trainer state (`serve_rft.trainer.state`) covers them. The actor is
restarted by Ray when its process dies; it resumes from its newest state, acknowledges what
that state covers, and trains again what was delivered after it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import ray

from serve_rft.buffer.store import ExperienceStore
from serve_rft.config import Config
from serve_rft.types import ComponentState, PublishedVersion, RewardedExperience

log = logging.getLogger("serve_rft.trainer")
TRAINER_NAME = "serve_rft_trainer"


class PolicyTrainer:
    """The torch side, synchronous: holds the policy model and its optimizer."""

    def __init__(self, cfg: Config, model_path: str, resume: Path | None = None):
        """Load the policy from ``model_path``, or from the trainer state folder ``resume``
        (weights, optimizer, RNG, running baseline; `serve_rft.trainer.state`)."""
        import torch
        from transformers import AutoModelForCausalLM

        from serve_rft.trainer.algorithm import RunningBaseline
        from serve_rft.trainer.state import load_state

        torch.set_num_threads(cfg.trainer.num_threads)
        torch.manual_seed(cfg.trainer.seed)
        self.cfg = cfg.trainer
        self.device = torch.device(cfg.trainer.device)
        source = resume if resume is not None else model_path
        self.model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).to(self.device)
        self.model.train()
        self.pad_id = self.model.config.pad_token_id or 0
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr,
                                           weight_decay=self.cfg.weight_decay)
        self.baseline = RunningBaseline(self.cfg.baseline_momentum)
        self.resumed = load_state(resume, self.optimizer) if resume is not None else None
        if self.resumed is not None:
            self.baseline.value = self.resumed.baseline

    def step(self, batch: list[RewardedExperience]) -> dict[str, float]:
        """One optimizer step on ``batch``; returns loss / reward / advantage / ratio stats."""
        import torch

        from serve_rft.trainer.algorithm import compute_advantages, ppo_clip_loss, response_logprobs

        t0 = time.perf_counter()
        exps = [b.experience for b in batch]
        rewards = [b.reward for b in batch]
        adv = compute_advantages(rewards, [e.group_id for e in exps], self.baseline).to(self.device)
        logp, mask = response_logprobs(self.model, [e.prompt_token_ids for e in exps],
                                       [e.response_token_ids for e in exps],
                                       [e.sampling.temperature for e in exps], self.pad_id)
        behaviour = torch.zeros_like(logp)
        for i, e in enumerate(exps):
            behaviour[i, : len(e.behaviour_logprobs)] = torch.tensor(e.behaviour_logprobs)
        loss, stats = ppo_clip_loss(logp, behaviour, adv, mask, self.cfg.clip_low, self.cfg.clip_high)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        with torch.no_grad():
            diff = ((logp - behaviour).abs() * mask).max()
        stats.update(loss=float(loss.detach()), grad_norm=float(grad_norm), reward_mean=sum(rewards) / len(rewards),
                     adv_abs_mean=float(adv.abs().mean()), batch_size=len(batch),
                     tokens=float(mask.sum()), max_abs_logprob_diff=float(diff),
                     step_seconds=time.perf_counter() - t0)
        return stats


@ray.remote(num_cpus=1, max_concurrency=256)  # NCCL: every replica may wait in nccl_reserve
class Trainer:
    """Named actor ``serve_rft_trainer``: runs `PolicyTrainer` in the background.

    The training loop starts in the constructor, so a trainer Ray restarts after its process
    died resumes on its own (`get_or_create_trainer` sets ``max_restarts=-1``).
    """

    def __init__(self, cfg_json: str, model_path: str):
        self.cfg = Config.model_validate_json(cfg_json)
        self.model_path = model_path
        self.state_root = Path(self.cfg.service.run_dir) / "trainer_state"
        self.step_num = 0
        self.version = 0
        self.last_stats: dict | None = None
        self.unpublished: list[RewardedExperience] = []  # trained, in no published version yet
        self.unsaved: list[tuple[str, str, int]] = []  # published, no saved state covers them
        self.publishes_since_save = 0
        self.steps_done = 0  # optimizer steps of this process (step_num also counts resumed ones)
        self.resumed_from: int | None = None
        self.phase = "starting"
        self.staleness_trained: dict[int, int] = {}  # staleness (versions) -> experiences trained
        self.stale_dropped = 0
        from serve_rft.observability.trainer_metrics import TrainerMetrics

        self.metrics = TrainerMetrics()
        self._task: asyncio.Task | None = None
        self.error: str | None = None
        self.published: PublishedVersion | None = None
        self.method = None  # the sync method, once the loop built it
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def start(self) -> None:
        """Wait until the loop has started (it starts in the constructor). Errors end the loop
        and show in `status`."""
        while self.phase == "starting" and not self._task.done():
            await asyncio.sleep(0.05)

    async def _run(self) -> None:
        from serve_rft.synchronizer.actor import get_synchronizer
        from serve_rft.synchronizer.methods import make_method
        from serve_rft.synchronizer.styles import trainer_publishes
        from serve_rft.trainer.state import latest_state

        cfg = self.cfg
        sync = get_synchronizer()
        store = ExperienceStore.from_config(cfg.buffer)
        resume = latest_state(self.state_root)
        policy = await asyncio.to_thread(PolicyTrainer, cfg, self.model_path, resume)
        method = make_method(cfg)
        method.prepare()
        self.method = method
        await store.ensure_group()
        await self._resume(policy, method, sync, store)
        await sync.set_trainer.remote(ComponentState.RUNNING.value, self.step_num)
        backlog = await store.delivered(TRAINER_NAME)  # delivered before a restart, not acked
        scfg = cfg.synchronizer
        try:
            while True:
                if backlog:
                    batch, backlog = backlog[:cfg.trainer.batch_size], backlog[cfg.trainer.batch_size:]
                else:
                    self.phase = "collecting"
                    batch = await self._collect(store, policy, method, sync)
                batch = await self._drop_stale(store, batch)
                if not batch:
                    continue
                self.phase = "training"
                stats = await asyncio.to_thread(policy.step, batch)
                self.step_num += 1
                self.steps_done += 1
                self.unpublished.extend(batch)
                ages = [self.version - b.experience.min_version for b in batch]
                for age in ages:
                    self.staleness_trained[age] = self.staleness_trained.get(age, 0) + 1
                self.metrics.observe(ages, 0)
                stats["step"] = self.step_num
                stats["t"] = time.time()
                requested = await sync.sync_requested.remote()
                if trainer_publishes(scfg.sync_style, self.step_num, scfg.sync_interval, requested):
                    stats["publish_seconds"] = await self._publish(policy, method, sync, store)
                    stats["window_seconds"] = await self._handshake(method, sync)
                stats["policy_version"] = self.version
                self.last_stats = stats
                await sync.set_trainer.remote(ComponentState.RUNNING.value, self.step_num)
        except Exception as e:
            self.error = repr(e)
            self.phase = "stopped"
            log.exception("trainer stopped")
            await sync.set_trainer.remote(ComponentState.STOPPED.value, self.step_num)
            raise

    async def _resume(self, policy: PolicyTrainer, method, sync, store: ExperienceStore) -> None:
        """Continue after a restart: acknowledge what the resumed state covers, number new
        versions after every version that may exist (the synchronizer's latest, committed
        checkpoint folders), and publish the resumed weights if nobody serves them yet."""
        st = policy.resumed
        if st is not None:
            await store.ack_entries(st.trained)
            self.version = self.step_num = st.version
            self.resumed_from = st.version
            log.info("resumed from %s (version %d, %d entries acknowledged)", st.path, st.version,
                     len(st.trained))
        latest = await sync.latest.remote()
        floor = max(latest.version if latest is not None else 0, method.latest_version())
        if floor > self.step_num:  # versions published after the resumed state: their weights
            self.version = self.step_num = floor  # are lost, their entries get trained again
        if st is not None and (latest is None or latest.version < st.version):
            await self._publish(policy, method, sync, store, self.step_num + 1)

    async def _publish(self, policy, method, sync, store: ExperienceStore,
                       version: int | None = None) -> float:
        """Publish the current weights as ``version`` (default: ``step_num``), then save the
        trainer state when ``save_interval`` publishes have passed and acknowledge what it covers.

        Returns:
            Seconds the method's ``send`` took.
        """
        from serve_rft.trainer.state import save_state

        version = self.step_num if version is None else version
        self.step_num = version
        self.phase = "publishing"
        floor = await sync.in_use_floor.remote()
        t0 = time.perf_counter()
        handle = await asyncio.to_thread(method.send, policy.model, version, floor)
        seconds = time.perf_counter() - t0
        await sync.publish.remote(version, handle)
        self.published = PublishedVersion(version=version, handle=handle)
        self.version = version
        self.unsaved.extend((b.stream_id, b.member, version) for b in self.unpublished)
        self.unpublished = []
        self.publishes_since_save += 1
        if self.publishes_since_save >= self.cfg.trainer.save_interval:
            self.phase = "saving"
            await asyncio.to_thread(
                save_state, self.state_root, policy.model, policy.optimizer, version, self.step_num,
                policy.baseline.value, self.unsaved, self.model_path, self.cfg.trainer.keep_states)
            await store.ack_entries(self.unsaved)
            self.unsaved = []
            self.publishes_since_save = 0
        return seconds

    async def _drop_stale(self, store: ExperienceStore, batch: list[RewardedExperience]
                          ) -> list[RewardedExperience]:
        """Acknowledge as ``stale-dropped`` (counted, never trained) the experiences whose oldest
        token is more than ``max_staleness`` versions behind the latest published version
        (XTuner's max_staleness, seed 003); return the rest."""
        limit = self.cfg.trainer.max_staleness
        if limit is None:
            return batch
        stale = [b for b in batch if self.version - b.experience.min_version > limit]
        if stale:
            _, dropped = await store.ack(stale, self.version, state="stale-dropped")
            self.stale_dropped += dropped
            self.metrics.observe([], dropped)
        return [b for b in batch if self.version - b.experience.min_version <= limit]

    async def _handshake(self, method, sync) -> float:
        """NCCL (seed 000's two-way handshake): REQUIRE_SYNC while replicas pull the version
        just published, then RUNNING. A no-op for pull-only methods.

        Returns:
            Seconds the trainer waited.
        """
        if not method.handshake:
            return 0.0
        version = self.version
        await sync.set_trainer.remote(ComponentState.REQUIRE_SYNC.value, self.step_num)
        waited = await method.serve_window(version, lambda: sync.lagging.remote(version),
                                           self.cfg.synchronizer.sync_timeout_s)
        await sync.set_trainer.remote(ComponentState.RUNNING.value, self.step_num)
        return waited

    async def _collect(self, store: ExperienceStore, policy, method, sync) -> list[RewardedExperience]:
        """Up to ``batch_size`` ready experiences: waits ``batch_wait_s`` for a full batch,
        trains on fewer only if at least ``min_batch_size`` arrived. While it waits it answers
        explorer sync requests (seed 000: the trainer syncs during sampling so the explorer can
        keep producing data)."""
        tcfg = self.cfg.trainer
        batch: list[RewardedExperience] = []
        deadline = time.monotonic() + tcfg.batch_wait_s
        while len(batch) < tcfg.batch_size:
            if method.handshake and method.sender.waiting and self.step_num == self.version:
                await self._handshake(method, sync)  # a replica waits for the published weights
            left = deadline - time.monotonic()
            if left <= 0:
                if len(batch) >= tcfg.min_batch_size:
                    break
                if self.step_num > self.version and await sync.sync_requested.remote():
                    await self._publish(policy, method, sync, store)
                deadline = time.monotonic() + tcfg.batch_wait_s
                continue
            got = await store.read_ready(TRAINER_NAME, tcfg.batch_size - len(batch),
                                         block_ms=int(left * 1000) + 1)
            batch.extend(got)
        return batch

    # -- NCCL (serve_rft.synchronizer.methods.nccl): the trainer's side of each group ---------
    def _nccl(self):
        if self.method is None or self.method.name != "nccl":
            raise RuntimeError("the trainer's sync method is not nccl (or it has not started yet)")
        return self.method.sender

    def nccl_endpoint(self, world_size: int) -> dict:
        """The worker init info of a new group: a rendezvous address and free port on this
        trainer's node (rank 0 hosts the store), ``world_size``, the bucket size."""
        return self._nccl().endpoint(world_size)

    async def nccl_connect(self, replica_id: str, init_info: dict) -> dict:
        """Join ``replica_id``'s group as rank 0; returns the update info its workers need."""
        return await self._nccl().connect(replica_id, init_info)

    async def nccl_reserve(self, replica_id: str) -> int:
        """Wait for a sync window and reserve the broadcast; returns the version it carries."""
        return await self._nccl().reserve(replica_id)

    async def nccl_broadcast(self, replica_id: str) -> dict:
        """Broadcast the reserved version to ``replica_id``'s group (seconds, bytes)."""
        return await self._nccl().broadcast(replica_id)

    def status(self) -> dict:
        """Step, published version, error, last step's stats, and the staleness (versions
        behind the latest published one) of every experience trained so far."""
        return {
            "step": self.step_num,
            "policy_version": self.version,
            "error": self.error,
            "last": self.last_stats,
            "staleness_trained": {str(k): v for k, v in sorted(self.staleness_trained.items())},
            "stale_dropped": self.stale_dropped,
            "phase": self.phase,
            "steps_done": self.steps_done,
            "pid": os.getpid(),
            "resumed_from": self.resumed_from,
            "unacked": len(self.unpublished) + len(self.unsaved),
        }

    def latest_published(self) -> PublishedVersion | None:
        """The last version this trainer published (a restarted synchronizer rebuilds from it)."""
        return self.published


def get_or_create_trainer(cfg: Config, model_path: str):
    """The named trainer actor (detached), created if it does not exist yet."""
    from serve_rft.synchronizer.actor import NAMESPACE

    gpus = 1 if cfg.trainer.device == "cuda" else 0
    # max_restarts=-1: Ray restarts a trainer whose process died; it resumes from its state.
    return Trainer.options(name=TRAINER_NAME, namespace=NAMESPACE, get_if_exists=True, num_gpus=gpus,
                           lifetime="detached", max_restarts=-1, max_task_retries=-1,
                           ).remote(cfg.model_dump_json(), model_path)

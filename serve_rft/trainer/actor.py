"""The Trainer Ray actor: ready experiences in, committed policy versions out.

Loop (the Trinity-RFT Synchronizer documentation, "Inside the Trainer"): sample a batch of rewarded experiences from the store's
ready stream, compute advantages and the PPO-clip loss against the logged behaviour logprobs,
step AdamW, and publish a new policy version when the sync style says so
(`serve_rft.synchronizer.styles.trainer_publishes`) through the configured sync method.

Exactly-once: ready-stream entries are acknowledged only after the version that trained on them
is published *and* a saved trainer state (`serve_rft.trainer.state`) covers them. The actor is
restarted by Ray when its process dies; it resumes from its newest state, acknowledges what
that state covers, and trains again what was delivered after it. An acknowledgement that Redis
lost is repaired, never trained twice (`serve_rft.trainer.intake.TrainedLedger`).

Never halts: an exception in the loop ends the process (Ray restarts the actor, which resumes
from its state); entries that cannot be trained, or that were in the steps of too many crashed
processes, go to the store's dead-letter stream, counted (`serve_rft.trainer.intake`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from functools import partial
from pathlib import Path

import ray

from serve_rft.buffer.store import ExperienceStore
from serve_rft.config import Config
from serve_rft.names import NAMESPACE, TRAINER_NAME, get_synchronizer
from serve_rft.trainer.feed import PUBLISHED_KEPT, ExperienceFeed
from serve_rft.trainer.policy import PolicyTrainer
from serve_rft.types import ComponentState, PublishedVersion, RewardedExperience

log = logging.getLogger("serve_rft.trainer")


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
        self.redelivered = 0  # entries delivered to an earlier process, trained again by this one
        self.resume_acked = 0  # entries an earlier process trained and saved, acknowledged by this one
        self.resumed_from: int | None = None
        self._resumed_version: int | None = None
        self.phase = "starting"
        self.staleness_trained: dict[int, int] = {}  # staleness (sync cycles) -> experiences trained
        from serve_rft.observability.trainer_metrics import TrainerMetrics

        self.metrics = TrainerMetrics()
        self._task: asyncio.Task | None = None
        self.error: str | None = None
        self.published: PublishedVersion | None = None
        self.resets: list[tuple[int, dict | None]] = []  # canary rejections to reset to (on_reject=reset)
        self.reset_count = 0
        self.last_reset: dict | None = None  # version, probe max |diff| (None: no probe), time
        self.method = None  # the sync method, once the loop built it
        self.feed = ExperienceFeed(self.cfg.trainer, ExperienceStore.from_config(self.cfg.buffer), self.metrics)
        self.started = False
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def start(self) -> None:
        """Wait until the loop has started (it starts in the constructor).

        Raises:
            RuntimeError: setting up failed (model, store, resume); the cause is in the message.
        """
        while self.phase == "starting" and not self._task.done():
            await asyncio.sleep(0.05)
        if self._task.done() and self._task.exception() is not None:
            raise RuntimeError(f"the trainer failed to start: {self.error}")

    async def _run(self) -> None:
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError


        sync = get_synchronizer()
        try:
            await self._loop(sync)
        except (RedisConnectionError, RedisTimeoutError) as e:
            # Redis gone for longer than buffer.reconnect_s: end the process so Ray restarts
            # the actor, which resumes from its saved state once Redis is back.
            log.exception("trainer lost Redis; exiting for Ray to restart it")
            self.error = repr(e)
            os._exit(1)
        except Exception as e:
            self.error = repr(e)
            if self.started:  # never halt: Ray restarts the process, which resumes from its state
                log.exception("trainer loop failed; exiting for Ray to restart it")
                os._exit(1)
            self.phase = "stopped"  # setting up failed (model, store, resume): stays visible
            log.exception("trainer stopped")
            await sync.set_trainer.remote(ComponentState.STOPPED.value, self.step_num)
            raise

    async def _loop(self, sync) -> None:
        from serve_rft.weights import make_method
        from serve_rft.synchronizer.styles import trainer_publishes
        from serve_rft.trainer.state import latest_state

        cfg = self.cfg
        store, feed = self.feed.store, self.feed
        resume = latest_state(self.state_root)
        policy = await asyncio.to_thread(PolicyTrainer, cfg, self.model_path, resume)
        method = make_method(cfg)
        method.prepare()
        self.method = method
        await store.ensure_group()
        await self._resume(policy, method, sync, store)
        await sync.set_trainer.remote(ComponentState.RUNNING.value, self.step_num)
        backlog = await store.delivered(TRAINER_NAME)  # delivered before a restart, not acked
        self.redelivered = len(backlog)
        self.resumed_from = self._resumed_version  # status now tells the whole resume at once
        self.started = True
        scfg = cfg.synchronizer
        while True:
            if backlog:
                batch, backlog = backlog[:cfg.trainer.batch_size], backlog[cfg.trainer.batch_size:]
            else:
                self.phase = "collecting"
                await feed.shed_stale(self.version)
                batch = await feed.collect(partial(self._between_reads, policy, method, sync, store), self._held)
            batch = await feed.admit(batch, policy.vocab_size)
            batch = await feed.drop_stale(batch, self.version)
            if self.resets:
                version, handle = self.resets.pop()
                self.resets.clear()
                if handle is not None:
                    diff = await asyncio.to_thread(policy.reset_to, handle, version)
                    self.reset_count += 1
                    self.last_reset = {"version": version, "probe_max_diff": diff, "at": time.time()}
                    log.warning("trainer reset to the weights of version %d (canary rollback; probe "
                                "max |diff| %s)", version, diff)
                else:  # the synchronizer holds no handle for it (an unknown version): train on
                    log.warning("cannot reset to version %d: no published handle; training continues "
                                "from the current weights", version)
            if not batch:
                continue
            batch = await feed.count_attempts(batch)
            if not batch:
                continue
            self.phase = "training"
            stats = await asyncio.to_thread(policy.step, batch)
            self.step_num += 1
            self.steps_done += 1
            self.unpublished.extend(batch)
            cycles = [feed.staleness(b.experience.min_version) for b in batch]
            for c in cycles:
                self.staleness_trained[c] = self.staleness_trained.get(c, 0) + 1
            now = time.time()
            ages_s = [max(0.0, now - b.experience.finished_at) for b in batch]
            self.metrics.observe(cycles, 0, ages_s)
            stats.update(sample_age_s_mean=sum(ages_s) / len(ages_s), sample_age_s_max=max(ages_s))
            stats["step"] = self.step_num
            stats["t"] = time.time()
            requested = await sync.sync_requested.remote()
            if trainer_publishes(scfg.sync_style, self.step_num, scfg.sync_interval, requested):
                stats["publish_seconds"] = await self._publish(policy, method, sync, store)
                stats["window_seconds"] = await self._handshake(method, sync)
            stats["policy_version"] = self.version
            self.metrics.step(stats)
            self.last_stats = stats
            await sync.set_trainer.remote(ComponentState.RUNNING.value, self.step_num)

    async def _resume(self, policy: PolicyTrainer, method, sync, store: ExperienceStore) -> None:
        """Continue after a restart: acknowledge what the kept states cover, number new versions
        after every version that may exist (the durable `published_floor`, the synchronizer's
        latest, committed checkpoint folders), and publish the resumed weights if nobody can
        load them: no version yet, or the latest one died with a non-durable method's process."""
        from serve_rft.trainer.state import published_floor, trained_lists

        st = policy.resumed
        if st is not None:
            covered = trained_lists(self.state_root)
            self.feed.ledger.add(covered)
            self.resume_acked, _ = await store.ack_entries(covered)
            self.version = self.step_num = st.version
            self.feed.published_versions = sorted(set(st.published) | {0, st.version})[-PUBLISHED_KEPT:]
            self._resumed_version = st.version  # reported as resumed_from once the backlog is read
            log.info("resumed from %s (version %d; %d entries acknowledged now)", st.path, st.version,
                     self.resume_acked)
        latest = await sync.latest.remote()
        floor = max(latest.version if latest is not None else 0, method.latest_version(),
                    published_floor(self.state_root))
        if floor > self.step_num:  # versions published after the resumed state: their weights
            self.version = self.step_num = floor  # are lost, their entries get trained again
            self.feed.published(floor)
        stale_handle = latest is not None and not method.durable
        if stale_handle or (st is not None and (latest is None or latest.version < st.version)):
            await self._publish(policy, method, sync, store, self.step_num + 1)

    async def _publish(self, policy, method, sync, store: ExperienceStore,
                       version: int | None = None) -> float:
        """Publish the current weights as ``version`` (default: ``step_num``), then save the
        trainer state when ``save_interval`` publishes have passed and acknowledge what it covers.

        Returns:
            Seconds the method's ``send`` took.
        """
        from serve_rft.weights.adapters import is_adapter_model
        from serve_rft.trainer.state import record_published, save_state

        version = self.step_num if version is None else version
        self.step_num = version
        self.phase = "publishing"
        await asyncio.to_thread(record_published, self.state_root, version)
        floor = await sync.in_use_floor.remote()
        t0 = time.perf_counter()
        model = await asyncio.to_thread(policy.publish_model)
        handle = await asyncio.to_thread(method.send, model, version, floor)
        if self.cfg.synchronizer.verify:  # replicas check the weights in effect against this
            from serve_rft.trainer.algorithm import trainer_probe

            handle["probe"] = await asyncio.to_thread(trainer_probe, model, version)
        seconds = time.perf_counter() - t0
        await sync.publish.remote(version, handle)
        self.published = PublishedVersion(version=version, handle=handle)
        self.version = version
        self.feed.published(version)
        self.unsaved.extend((b.stream_id, b.member, version) for b in self.unpublished)
        self.unpublished = []
        self.publishes_since_save += 1
        if self.publishes_since_save >= self.cfg.trainer.save_interval:
            self.phase = "saving"
            # adapter-only sync published the adapter; the state holds full (merged) weights
            full = await asyncio.to_thread(policy.full_model) if is_adapter_model(model) else model
            await asyncio.to_thread(
                save_state, self.state_root, full, policy.optimizer, version, self.step_num,
                policy.baseline.value, self.unsaved, self.model_path, self.cfg.trainer.keep_states,
                policy.scheduler, policy.model if policy.export is not None else None, self.feed.published_versions)
            self.feed.ledger.add(self.unsaved)
            await store.ack_entries(self.unsaved)
            self.unsaved = []
            self.publishes_since_save = 0
        return seconds

    async def _handshake(self, method, sync) -> float:
        """NCCL (the two-way handshake of the Trinity-RFT Synchronizer documentation): REQUIRE_SYNC while replicas pull the version
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

    def _held(self) -> set[str]:
        """Stream ids this trainer trained and has not acknowledged yet (never read again)."""
        return {b.stream_id for b in self.unpublished} | {sid for sid, _, _ in self.unsaved}

    async def _between_reads(self, policy, method, sync, store: ExperienceStore, idle: bool) -> None:
        """While the trainer waits for data it answers the explorer side (the Trinity-RFT
        Synchronizer documentation: the trainer syncs during sampling so the explorer can keep
        producing data): an NCCL replica waiting for the published weights gets its window; after
        an ``idle`` wait, trained but unpublished weights are published if a replica asked."""
        if method.peer_waiting() and self.step_num == self.version:
            await self._handshake(method, sync)
        if idle and self.step_num > self.version and await sync.sync_requested.remote():
            await self._publish(policy, method, sync, store)

    # -- NCCL (serve_rft.weights.nccl): the trainer's side of each group ---------
    def _nccl(self):
        """The sync method's trainer-side peer. Raises RuntimeError: not started, or not NCCL."""
        if self.method is None:
            raise RuntimeError("the trainer has not started its sync method yet")
        return self.method.trainer_peer()

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

    def reset_to(self, version: int, handle: dict | None) -> None:
        """A canary rolled back (``canary.on_reject=reset``): train on from ``version``'s
        weights, before the next step (`PolicyTrainer.reset_to`)."""
        self.resets.append((version, handle))

    def status(self) -> dict:
        """Step, published version, error, last step's stats, and the staleness (versions
        behind the latest published one) of every experience trained so far."""
        return {
            "step": self.step_num,
            "policy_version": self.version,
            "error": self.error,
            "last": self.last_stats,
            "staleness_trained": {str(k): v for k, v in sorted(self.staleness_trained.items())},
            "stale_dropped": self.feed.stale_dropped,
            "phase": self.phase,
            "steps_done": self.steps_done,
            "pid": os.getpid(),
            "resumed_from": self.resumed_from,
            "unacked": len(self.unpublished) + len(self.unsaved),
            "redelivered": self.redelivered,
            "resume_acked": self.resume_acked,
            "resets": self.reset_count,
            "last_reset": self.last_reset,
            "dead_lettered": self.feed.dead_lettered,
            "reacked": self.feed.reacked,
        }

    def service_status(self) -> dict:
        """What ``/v1/status`` shows of this trainer beside the synchronizer's view of it: the
        `status` fields without the last step's stats, plus the mean and max sample age (seconds
        from generation to training) of the last step."""
        st = self.status()
        last = st.pop("last") or {}
        for k in ("step", "policy_version", "steps_done", "unacked"):
            st.pop(k)
        return {**st, "sample_age_s": {k: last.get(f"sample_age_s_{k}") for k in ("mean", "max")}}

    def latest_published(self) -> PublishedVersion | None:
        """The last version this trainer published (a restarted synchronizer rebuilds from it)."""
        return self.published


def get_or_create_trainer(cfg: Config, model_path: str):
    """The named trainer actor (detached), created if it does not exist yet."""
    gpus = cfg.trainer.num_gpus if cfg.trainer.device == "cuda" else 0
    # max_restarts=-1: Ray restarts a trainer whose process died; it resumes from its state.
    return Trainer.options(name=TRAINER_NAME, namespace=NAMESPACE, get_if_exists=True, num_gpus=gpus,
                           lifetime="detached", max_restarts=-1, max_task_retries=-1,
                           ).remote(cfg.model_dump_json(), model_path)

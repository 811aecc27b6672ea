"""The Trainer Ray actor: ready experiences in, committed policy versions out.

Loop (the Trinity-RFT Synchronizer documentation, "Inside the Trainer"): sample a batch of rewarded experiences from the store's
ready stream, compute advantages and the PPO-clip loss against the logged behaviour logprobs,
step AdamW, and publish a new policy version when the sync style says so
(`serve_rft.config.SyncStyle.trainer_publishes`) through the configured sync method.

Exactly-once: ready-stream entries are acknowledged only after the version that trained on them
is published *and* a saved trainer state (`serve_rft.trainer.publishing.state`) covers them. The actor is
restarted by Ray when its process dies; it resumes from its newest state, acknowledges what
that state covers, and trains again what was delivered after it. An acknowledgement that Redis
lost is repaired, never trained twice (`serve_rft.trainer.intake.admission.TrainedLedger`).

Never halts: an exception in the loop ends the process (Ray restarts the actor, which resumes
from its state); entries that cannot be trained, or that were in the steps of too many crashed
processes, go to the store's dead-letter stream, counted (`serve_rft.trainer.intake.admission`). Never
poisoned: a step whose update is not finite (or, with ``trainer.grad_norm_spike``, a gradient-norm
spike) is skipped and its batch dead-lettered, counted (``skipped_steps``), and nothing non-finite
is published or saved (`serve_rft.trainer.policy.finite`).

This module is the loop; what goes into a step is `serve_rft.trainer.intake.feed`, publishing and
resuming `serve_rft.trainer.publishing.publishing` (a `Publishing` the actor owns, which also holds the step
count, the published version and the phase), the model and optimizer `serve_rft.trainer.policy.policy`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from functools import partial
from pathlib import Path

import ray

from serve_rft.buffer.ready import ReadyStream
from serve_rft.buffer.store import ExperienceStore
from serve_rft.config import Config
from serve_rft.names import NAMESPACE, TRAINER_NAME, get_synchronizer
from serve_rft.observability.trackers import TRACKERS_CLOSE_S
from serve_rft.observability.trainer_metrics import STEP_STATS
from serve_rft.trainer.intake.feed import ExperienceFeed
from serve_rft.trainer.policy.policy import PolicyTrainer
from serve_rft.trainer.publishing.publishing import Publishing
from serve_rft.types import ComponentState, PublishedVersion, RewardedExperience

log = logging.getLogger("serve_rft.trainer")
steps_log = logging.getLogger("serve_rft.trainer.steps")
"""The step log: one JSON line per step taken (its statistics, `PolicyTrainer.step`), at INFO."""


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
        self.last_stats: dict | None = None
        self.steps_done = 0  # optimizer steps of this process (step_num also counts resumed ones)
        self.redelivered = 0  # entries delivered to an earlier process, trained again by this one
        self.skipped_steps = 0  # steps skipped: a non-finite update or a gradient-norm spike (batch dead-lettered)
        self.last_skipped: dict | None = None  # why, batch size, time
        self.resumed_from: int | None = None
        self.staleness_trained: dict[int, int] = {}  # staleness (sync cycles) -> experiences trained
        from serve_rft.observability.trainer_metrics import TrainerMetrics

        self.metrics = TrainerMetrics()
        self._task: asyncio.Task | None = None
        self.error: str | None = None
        self.resets: list[tuple[int, dict | None]] = []  # canary rejections to reset to (on_reject=reset)
        self.reset_count = 0
        self.last_reset: dict | None = None  # version, probe max |diff| (None: no probe), time
        self.method = None  # the sync method, once the loop built it
        self.feed = ExperienceFeed(self.cfg.trainer, ExperienceStore.from_config(self.cfg.buffer).ready)
        self.publishing = Publishing(self.cfg, self.state_root, model_path, self.feed)
        self.started = False
        self.rank_pids: list[int] = []  # trainer.num_workers > 1: the rank actors' processes
        self.trackers = None
        if self.cfg.trainer.loggers:  # experiment trackers: the step statistics as training curves
            from serve_rft.observability.trackers import StepTrackers

            self.trackers = StepTrackers(self.cfg.trainer.loggers, Path(self.cfg.service.run_dir) / "tracking",
                                         Path(self.cfg.service.run_dir).name, self.cfg.model_dump(mode="json"))
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def start(self) -> None:
        """Wait until the loop has started (it starts in the constructor).

        Raises:
            RuntimeError: setting up failed (model, store, resume); the cause is in the message.
        """
        while self.publishing.phase == "starting" and not self._task.done():
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
            self._exit_for_restart()
        except Exception as e:
            self.error = repr(e)
            if self.started:  # never halt: Ray restarts the process, which resumes from its state
                log.exception("trainer loop failed; exiting for Ray to restart it")
                self._exit_for_restart()
            self.publishing.phase = "stopped"  # setting up failed (model, store, resume): stays visible
            log.exception("trainer stopped")
            await sync.set_trainer.remote(ComponentState.STOPPED.value, self.publishing.step_num)
            raise

    def _exit_for_restart(self) -> None:
        """End the process for Ray to restart it, the experiment trackers' runs finished first
        (waiting at most `TRACKERS_CLOSE_S`)."""
        trackers, self.trackers = self.trackers, None
        if trackers is not None:
            closing = threading.Thread(target=trackers.close, daemon=True)
            closing.start()
            closing.join(TRACKERS_CLOSE_S)
        os._exit(1)

    async def close_trackers(self) -> None:
        """Finish the experiment trackers' runs (`StepTrackers.close`); steps after this are not
        logged to them. The launcher calls it before ``ray.kill``, which runs no exit handler:
        W&B keeps a run's last records in its service process's memory until the run ends."""
        trackers, self.trackers = self.trackers, None
        if trackers is not None:
            await asyncio.to_thread(trackers.close)

    async def _loop(self, sync) -> None:
        from serve_rft.weights import make_method
        from serve_rft.trainer.publishing.state import latest_state

        cfg, pub = self.cfg, self.publishing
        store, feed = self.feed.store, self.feed
        resume = latest_state(self.state_root)
        policy = await asyncio.to_thread(make_policy, cfg, self.model_path, resume)
        self.rank_pids = list(getattr(policy, "pids", []))
        method = make_method(cfg)
        method.prepare()
        self.method = method
        await store.ensure_group()
        await pub._resume(policy, method, sync, store)
        await sync.set_trainer.remote(ComponentState.RUNNING.value, pub.step_num)
        backlog = await store.delivered(TRAINER_NAME)  # delivered before a restart, not acked
        self.redelivered = len(backlog)
        self.resumed_from = pub.resumed_version  # status now tells the whole resume at once
        self.started = True
        scfg = cfg.synchronizer
        while True:
            if backlog:
                batch, backlog = backlog[:cfg.trainer.batch_size], backlog[cfg.trainer.batch_size:]
            else:
                pub.phase = "collecting"
                await feed.shed_stale(pub.version, pub.held())
                batch = await feed.collect(partial(self._between_reads, policy, method, sync, store), pub.held)
            batch = await feed.admit(batch, policy.vocab_size, pub.version)
            batch = await feed.drop_stale(batch, pub.version)
            if self.resets:
                version, handle = self.resets.pop()
                self.resets.clear()
                if handle is not None:
                    diff = await asyncio.to_thread(policy.reset_to, handle, version)
                    pub.held_version = version
                    feed.reset_to(version)
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
            pub.phase = "training"
            # tokens of the version whose weights the trainer holds (it published, resumed or reset
            # after its last step) measure trainer-vs-inference mismatch, older ones drift; lags
            # in sync cycles, as staleness is counted
            lags = {v: feed.staleness(v) for b in batch for v, _, _ in b.experience.token_versions}
            stats = await asyncio.to_thread(policy.step, batch, pub.held_version, lags)
            if stats.get("skipped"):  # nothing applied (a non-finite update, a spike): dead-lettered
                await self._skipped(batch, stats)
                continue
            await feed.stepped(batch)
            pub.stepped(batch)
            self.steps_done += 1
            cycles = [feed.staleness(b.experience.min_version) for b in batch]
            for c in cycles:
                self.staleness_trained[c] = self.staleness_trained.get(c, 0) + 1
            now = time.time()
            ages_s = [max(0.0, now - b.experience.finished_at) for b in batch]
            self.metrics.observe(cycles, ages_s)
            stats.update(sample_age_s_mean=sum(ages_s) / len(ages_s), sample_age_s_max=max(ages_s))
            stats["step"] = pub.step_num
            stats["t"] = time.time()
            requested = await sync.sync_requested.remote()
            if scfg.sync_style.trainer_publishes(pub.step_num, scfg.sync_interval, requested):
                stats["publish_seconds"] = await pub._publish(policy, method, sync, store)
                stats["window_seconds"] = await pub._handshake(method, sync)
            stats["policy_version"] = pub.version
            self.metrics.step(stats)
            self.last_stats = stats
            steps_log.info("%s", json.dumps({k: v for k, v in stats.items() if isinstance(v, (int, float, str))}))
            if self.trackers is not None:
                self.trackers.log(stats, pub.step_num)
            await sync.set_trainer.remote(ComponentState.RUNNING.value, pub.step_num)

    async def _skipped(self, batch: list[RewardedExperience], stats: dict) -> None:
        """``batch``'s step was skipped, its update not finite or a gradient-norm spike
        (`serve_rft.trainer.policy.finite`): dead-letter the batch with why, count it (``skipped_steps``,
        metrics)."""
        reason = f"step skipped: {stats['skipped']}"
        await self.feed.dead_letter(batch, reason)
        self.skipped_steps += 1
        self.last_skipped = {"reason": stats["skipped"], "batch_size": len(batch), "at": time.time()}
        self.metrics.skipped()
        log.error("%s; %d ready entries dead-lettered, weights and optimizer unchanged", reason, len(batch))

    async def _between_reads(self, policy, method, sync, store: ReadyStream, idle: bool) -> None:
        """While the trainer waits for data it answers the explorer side (the Trinity-RFT
        Synchronizer documentation: the trainer syncs during sampling so the explorer can keep
        producing data): an NCCL replica waiting for the published weights gets its window; after
        an ``idle`` wait, trained but unpublished weights are published if a replica asked."""
        pub = self.publishing
        if method.peer_waiting() and pub.step_num == pub.version:
            await pub._handshake(method, sync)
        if idle and pub.step_num > pub.version and await sync.sync_requested.remote():
            await pub._publish(policy, method, sync, store)

    def reset_to(self, version: int, handle: dict | None) -> None:
        """A canary rolled back (``canary.on_reject=reset``): train on from ``version``'s
        weights, before the next step (`PolicyTrainer.reset_to`)."""
        self.resets.append((version, handle))

    def status(self) -> dict:
        """Step, published version, error, last step's stats, and the staleness (versions
        behind the latest published one) of every experience trained so far."""
        pub = self.publishing
        return {
            "step": pub.step_num,
            "policy_version": pub.version,
            "error": self.error,
            "last": self.last_stats,
            "staleness_trained": {str(k): v for k, v in sorted(self.staleness_trained.items())},
            "stale_dropped": self.feed.stale_dropped,
            "phase": pub.phase,
            "steps_done": self.steps_done,
            "pid": os.getpid(),
            "rank_pids": self.rank_pids,
            "resumed_from": self.resumed_from,
            "unacked": len(pub.unpublished) + len(pub.unsaved),
            "redelivered": self.redelivered,
            "resume_acked": pub.resume_acked,
            "resets": self.reset_count,
            "last_reset": self.last_reset,
            "dead_lettered": self.feed.dead_lettered,
            "skipped_steps": self.skipped_steps,
            "last_skipped": self.last_skipped,
            "reacked": self.feed.reacked,
            "constrained": self.feed.constrained,
            "greedy": self.feed.greedy,
        }

    def service_status(self) -> dict:
        """What ``/v1/status`` shows of this trainer beside the synchronizer's view of it: the
        `status` fields without the last step's stats, plus the mean and max sample age (seconds
        from generation to training) of the last step."""
        st = self.status()
        last = st.pop("last") or {}
        for k in ("step", "policy_version", "steps_done", "unacked"):
            st.pop(k)
        step = {k: last[k] for k in ("step", *STEP_STATS) if isinstance(last.get(k), (int, float))}
        return {**st, "sample_age_s": {k: last.get(f"sample_age_s_{k}") for k in ("mean", "max")},
                "last_step": step}

    def latest_published(self) -> PublishedVersion | None:
        """The last version this trainer published (a restarted synchronizer rebuilds from it)."""
        return self.publishing.published

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


def make_policy(cfg: Config, model_path: str, resume: Path | None):
    """The trainer's policy: `PolicyTrainer` in this process, or with ``trainer.num_workers > 1``
    a `serve_rft.trainer.sharding.sharded_policy.ShardedPolicy` over that many rank actors."""
    if cfg.trainer.num_workers > 1:
        from serve_rft.trainer.sharding.sharded_policy import ShardedPolicy

        return ShardedPolicy(cfg, model_path, resume)
    return PolicyTrainer(cfg, model_path, resume)


def trainer_options(cfg: Config) -> dict:
    """Ray actor options of the trainer: its name, one Ray GPU share with ``device=cuda`` (none
    with ``num_workers > 1``: its ranks take one GPU each, `serve_rft.trainer.sharding.worker_group`), the
    ``trainer.label_selector`` placement if set, detached, restarted without bound (a restarted
    trainer resumes from its saved state)."""
    # N ranks: the actor only coordinates (the ranks hold the weights, one GPU each)
    gpus = cfg.trainer.num_gpus if cfg.trainer.device == "cuda" and cfg.trainer.num_workers == 1 else 0
    opts = dict(name=TRAINER_NAME, namespace=NAMESPACE, get_if_exists=True, num_gpus=gpus,
                lifetime="detached", max_restarts=-1, max_task_retries=-1)
    if cfg.trainer.label_selector:
        opts["label_selector"] = dict(cfg.trainer.label_selector)
    return opts


def get_or_create_trainer(cfg: Config, model_path: str):
    """The named trainer actor (detached), created if it does not exist yet (`trainer_options`)."""
    return Trainer.options(**trainer_options(cfg)).remote(cfg.model_dump_json(), model_path)

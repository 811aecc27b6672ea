"""The trainer's side of a sync: publishing versions and resuming after a restart.

`Publishing` is a component the `serve_rft.trainer.actor.Trainer` owns: it holds where the
trainer stands (optimizer steps, the published version, the phase, the trained entries no
published version or no saved state covers yet) and is called with what each operation needs
(the policy, the sync method, the synchronizer, the store). A publish sends the current weights
through the configured method (`serve_rft.weights`, with the probe replicas verify against),
registers the version with the synchronizer, and every ``save_interval`` publishes saves a
trainer state and only then acknowledges what it covers (exactly-once: the actor module's
docstring). With a method that needs the trainer in each transfer (NCCL) it also holds the sync
windows (`Publishing._handshake`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from serve_rft.buffer.ready import ReadyStream
from serve_rft.trainer.intake.feed import PUBLISHED_KEPT
from serve_rft.types import ComponentState, PublishedVersion, RewardedExperience

log = logging.getLogger("serve_rft.trainer")


class Publishing:
    """The trainer's version ledger and its publish and resume steps (module docstring).

    Args:
        cfg: the service configuration (``trainer.save_interval``, ``trainer.keep_states``,
            ``synchronizer.verify``, ``synchronizer.sync_timeout_s``).
        state_root: the folder of the trainer states (`serve_rft.trainer.publishing.state`).
        model_path: the model folder (its tokenizer is saved with each state).
        feed: the trainer's `serve_rft.trainer.intake.feed.ExperienceFeed` (its ledger of trained
            entries and the published versions it measures staleness against).
    """

    def __init__(self, cfg, state_root, model_path: str, feed):
        self.cfg, self.state_root, self.model_path, self.feed = cfg, state_root, model_path, feed
        self.step_num = 0  # optimizer steps, resumed ones included
        self.version = 0  # the last version published
        self.held_version: int | None = 0  # the version whose weights the policy holds (None: stepped since)
        self.phase = "starting"
        self.published: PublishedVersion | None = None
        self.unpublished: list[RewardedExperience] = []  # trained, in no published version yet
        self.unsaved: list[tuple[str, str, int]] = []  # published, no saved state covers them
        self.publishes_since_save = 0
        self.resume_acked = 0  # entries an earlier process trained and saved, acknowledged by this one
        self._resumed_version: int | None = None

    def stepped(self, batch: list[RewardedExperience]) -> None:
        """An optimizer step trained ``batch``: count it; its entries wait for a publish."""
        self.held_version = None  # the weights moved past every published version
        self.step_num += 1
        self.unpublished.extend(batch)

    def held(self) -> set[str]:
        """Stream ids trained and not acknowledged yet (never read again)."""
        return {b.stream_id for b in self.unpublished} | {sid for sid, _, _ in self.unsaved}

    @property
    def resumed_version(self) -> int | None:
        """The version of the saved state this process resumed from (None: it started fresh)."""
        return self._resumed_version

    async def _resume(self, policy, method, sync, store: ReadyStream) -> None:
        """Continue after a restart: acknowledge what the kept states cover, number new versions
        after every version that may exist (the durable `published_floor`, the synchronizer's
        latest, committed checkpoint folders), and publish the resumed weights if nobody can
        load them: no version yet, or the latest one died with a non-durable method's process."""
        from serve_rft.trainer.publishing.state import published_floor, trained_lists

        st = policy.resumed
        if st is not None:
            covered = trained_lists(self.state_root)
            self.feed.ledger.add(covered)
            self.resume_acked, _ = await store.ack_entries(covered)
            self.version = self.step_num = st.version
            self.held_version = st.version
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

    async def _publish(self, policy, method, sync, store: ReadyStream,
                       version: int | None = None) -> float:
        """Publish the current weights as ``version`` (default: ``step_num``), then save the
        trainer state when ``save_interval`` publishes have passed and acknowledge what it covers.
        The weights and AdamW state are checked finite first (`PolicyTrainer.check_finite`:
        raises `serve_rft.trainer.policy.finite.NonFiniteState`, which ends the process).

        Returns:
            Seconds the method's ``send`` took.
        """
        from serve_rft.trainer.publishing.state import record_published

        version = self.step_num if version is None else version
        self.step_num = version
        self.phase = "publishing"
        await asyncio.to_thread(policy.check_finite)  # never publish (nor then save) NaN weights
        await asyncio.to_thread(record_published, self.state_root, version)
        in_use = await sync.in_use_versions.remote()
        t0 = time.perf_counter()
        model = await asyncio.to_thread(policy.publish_model)
        handle = await asyncio.to_thread(method.send, model, version, in_use)
        if self.cfg.synchronizer.verify:  # replicas check the weights in effect against this
            handle["probe"] = await asyncio.to_thread(policy.probe, model, version)
        seconds = time.perf_counter() - t0
        await sync.publish.remote(version, handle)
        self.published = PublishedVersion(version=version, handle=handle)
        self.version = version
        self.held_version = version
        self.feed.published(version)
        self.unsaved.extend((b.stream_id, b.member, version) for b in self.unpublished)
        self.unpublished = []
        self.publishes_since_save += 1
        if self.publishes_since_save >= self.cfg.trainer.save_interval:
            self.phase = "saving"
            await asyncio.to_thread(policy.save, self.state_root, model, version, self.step_num, self.unsaved,
                                    self.model_path, self.cfg.trainer.keep_states, self.feed.published_versions)
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

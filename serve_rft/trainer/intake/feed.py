"""The trainer's feed: ready experiences from the store into its steps.

`ExperienceFeed` reads batches from the store's ready stream (`collect`, closing a batch by
`serve_rft.trainer.intake.admission.batch_complete`), and lets into a step only what may be trained, once:
entries a saved state already covers are acknowledged again, those sampled under a structured-
output grammar (which the trainer does not apply) are left out of the loss, counted, the untrainable and those in the
steps of too many crashed processes are dead-lettered (`serve_rft.trainer.intake.admission`), and those
past ``trainer.max_staleness`` sync cycles are dropped, counted (XTuner v1's RL trainer
documentation, ``max_staleness``). It counts staleness over the versions the trainer published.
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

from serve_rft.buffer.records import DeadLetter
from serve_rft.buffer.ready import ReadyStream
from serve_rft.config import TrainerConfig
from serve_rft.names import TRAINER_NAME
from serve_rft.trainer.intake.admission import (TrainedLedger, batch_complete, is_greedy, stale_threshold,
                                               sync_cycles, untrainable)
from serve_rft.types import RewardedExperience

log = logging.getLogger("serve_rft.trainer")

PUBLISHED_KEPT = 4096
"""Published version numbers the feed remembers (and states save) for counting staleness in cycles."""


class ExperienceFeed:
    """Batches for the trainer's steps, each entry trained at most once.

    Args:
        cfg: the trainer's settings (batch sizes and waits, ``max_staleness``,
            ``max_entry_attempts``, ``read_order``).
        store: the experience store's ready stream (``ExperienceStore.ready``), all the trainer
            holds of the store.
    """

    def __init__(self, cfg: TrainerConfig, store: ReadyStream):
        self.cfg, self.store = cfg, store
        self.ledger = TrainedLedger()  # members saved states cover: a lost ack is never retrained
        self.published_versions: list[int] = [0]  # ascending, the newest PUBLISHED_KEPT
        self.stale_dropped = 0
        self.dead_lettered = 0
        self.reacked = 0  # entries trained before whose acknowledgement Redis lost, acked again
        self.constrained = 0  # entries sampled under a grammar (structured outputs), left out of the loss
        self.greedy = 0  # entries sampled below min_train_temperature, left out of the loss

    async def collect(self, between_reads: Callable[[bool], Awaitable[None]],
                      held: Callable[[], set[str]]) -> list[RewardedExperience]:
        """Up to ``batch_size`` ready experiences, when `batch_complete` says so: a full batch at
        once, at least ``min_batch_size`` after ``batch_wait_s``, any once the oldest has waited
        ``max_batch_wait_s`` (checked every ``batch_wait_s``).

        Args:
            between_reads: awaited before each read with ``idle`` (a whole ``batch_wait_s``
                passed without a batch): the trainer answers the explorer side meanwhile.
            held: stream ids the trainer holds (trained, not acknowledged): never read again.
        """
        c = self.cfg
        batch: list[RewardedExperience] = []
        start = first = time.monotonic()  # `first`: when the oldest held experience was read
        while True:
            now = time.monotonic()
            if batch_complete(len(batch), now - start, now - first if batch else 0.0, c.batch_size,
                              c.min_batch_size, c.batch_wait_s, c.max_batch_wait_s):
                return batch
            left = start + c.batch_wait_s - now
            await between_reads(left <= 0)
            if left <= 0:  # too few: wait another batch_wait_s
                start, left = time.monotonic(), c.batch_wait_s
            got = await self.store.read_ready(TRAINER_NAME, c.batch_size - len(batch),
                                              block_ms=int(left * 1000) + 1,
                                              exclude={b.stream_id for b in batch} | held(),
                                              newest_first=c.read_order == "freshest")
            if got and not batch:
                first = time.monotonic()
            batch.extend(got)

    async def admit(self, batch: list[RewardedExperience], vocab_size: int, version: int
                    ) -> list[RewardedExperience]:
        """Acknowledge again what saved states already cover (a lost ack), leave out of the loss
        what was sampled under a grammar (state ``constrained``, counted; ``version``: the
        trainer's published version) and, unless ``trainer.train_greedy``, what was sampled
        greedily or nearly (temperature below ``trainer.min_train_temperature``: state
        ``greedy``, counted), dead-letter what cannot be trained
        (`serve_rft.trainer.intake.admission.untrainable`); return the rest.

        A greedy answer's token was chosen with probability 1, but its logged logprob is that of
        ``softmax(logits)``: trained as a sample it reinforces the mode with a biased gradient;
        near-greedy temperatures amplify the trainer's numeric differences from vLLM by ``1/T``."""
        batch, again = self.ledger.split(batch)
        if again:
            await self.store.ack_entries(again)
            self.reacked += len(again)
            log.warning("%d ready entries were trained before (their acknowledgement was lost): "
                        "acknowledged again, not trained", len(again))
        constrained = [b for b in batch if b.experience.sampling.structured_outputs]
        if constrained:  # their behaviour logprobs are of the grammar-masked distribution
            _, acked = await self.store.ack(constrained, version, state="constrained")
            self.constrained += acked
            batch = [b for b in batch if not b.experience.sampling.structured_outputs]
        if not self.cfg.train_greedy:
            greedy = [b for b in batch if is_greedy(b, self.cfg.min_train_temperature)]
            if greedy:
                _, acked = await self.store.ack(greedy, version, state="greedy")
                self.greedy += acked
                batch = [b for b in batch if not is_greedy(b, self.cfg.min_train_temperature)]
        keep, letters = [], []
        for b in batch:
            why = untrainable(b, vocab_size, self.cfg.max_abs_reward)
            if why is None:
                keep.append(b)
            else:
                letters.append(DeadLetter.of(b, why))
        if letters:
            self.dead_lettered += await self.store.dead_letter(letters)
            log.warning("dead-lettered %d ready entries: %s", len(letters), letters[0].reason)
        return keep

    async def count_attempts(self, batch: list[RewardedExperience]) -> list[RewardedExperience]:
        """Count a step attempt per entry; dead-letter those past ``max_entry_attempts`` (each
        earlier attempt ended with the trainer process dying); return the rest."""
        limit = self.cfg.max_entry_attempts
        attempts = await self.store.begin_attempt([b.stream_id for b in batch])
        over = [DeadLetter.of(b, f"in the steps of {n - 1} trainer processes that died")
                for b, n in zip(batch, attempts) if n > limit]
        if over:
            self.dead_lettered += await self.store.dead_letter(over)
            log.error("dead-lettered %d ready entries after %d crashed attempts", len(over), limit)
        return [b for b, n in zip(batch, attempts) if n <= limit]

    async def dead_letter(self, batch: list[RewardedExperience], reason: str) -> None:
        """Move ``batch`` to the dead-letter stream with ``reason``, counted."""
        self.dead_lettered += await self.store.dead_letter([DeadLetter.of(b, reason) for b in batch])

    async def stepped(self, batch: list[RewardedExperience]) -> None:
        """``batch``'s step succeeded: forget its attempts, so that restarts of trainer processes
        that die later (before a saved state covers the entries) do not count as crashes in
        their step and dead-letter entries that never crashed anything."""
        await self.store.clear_attempts([b.stream_id for b in batch])

    async def drop_stale(self, batch: list[RewardedExperience], version: int) -> list[RewardedExperience]:
        """Acknowledge as ``stale-dropped`` (counted, never trained; ``version``: the trainer's
        published version) the experiences whose group release's oldest token (the entry's
        ``release_version``, else its own oldest token) is more than ``max_staleness`` sync cycles
        old (`staleness`), so a release is dropped whole, as the store's DROP_STALE drops it;
        return the rest."""
        limit = self.cfg.max_staleness
        if limit is None:
            return batch

        def oldest(b: RewardedExperience) -> int:
            return b.release_version if b.release_version is not None else b.experience.min_version
        stale = [b for b in batch if self.staleness(oldest(b)) > limit]
        if stale:
            _, dropped = await self.store.ack(stale, version, state="stale-dropped")
            self.stale_dropped += dropped
        return [b for b in batch if self.staleness(oldest(b)) <= limit]

    async def shed_stale(self, version: int, held: set[str] | None = None) -> None:
        """Drop from the store, before they are read, the waiting experiences already past
        ``max_staleness`` (counted as `drop_stale` does): read freshest first under more traffic
        than the trainer trains, they would otherwise wait until the ready bound sheds them.
        ``held``: stream ids the trainer holds (trained, not acknowledged), never dropped even
        when the consumer group's pending entries list lost them."""
        threshold = stale_threshold(self.published_versions, self.cfg.max_staleness)
        if threshold is not None:
            dropped = await self.store.drop_stale(threshold, version, exclude=held)
            self.stale_dropped += dropped

    def staleness(self, version: int) -> int:
        """Sync cycles since ``version`` over what the trainer (or the state it resumed from)
        published (`serve_rft.trainer.intake.admission.sync_cycles`)."""
        return sync_cycles(self.published_versions, version)

    def reset_to(self, version: int) -> None:
        """The trainer took ``version``'s weights back (a canary or operator rollback,
        ``canary.on_reject=reset``): staleness counts from that version again. The versions
        published after it leave the history, so an experience of ``version`` is 0 sync cycles
        behind the weights it is trained into, not as many as were published (and rejected)
        since: counted against the whole history, a rollback more than ``max_staleness`` cycles
        back would drop every new experience as stale, and the trainer would never publish
        again."""
        self.published_versions = [v for v in self.published_versions if v < version] + [version]

    def published(self, version: int) -> None:
        """The trainer published ``version`` (a new sync cycle begins)."""
        if version > self.published_versions[-1]:
            self.published_versions.append(version)
            del self.published_versions[:-PUBLISHED_KEPT]

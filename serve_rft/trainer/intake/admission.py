"""What the trainer lets into a step: entries it can train, each at most once.

Three filters run on every batch read from the ready stream, before the step:

- **already trained** (`TrainedLedger`): a member (``{completion_id}:{choice_index}``) that a
  saved trainer state covers was acknowledged once; if Redis lost that acknowledgement (the last
  second of an ``appendfsync everysec`` AOF, a crash) the entry comes back as delivered and
  unacknowledged. The ledger re-acknowledges it with the version that trained it instead of
  training it twice.
- **untrainable** (`untrainable`): a non-finite reward, one beyond ``trainer.max_abs_reward``
  (whatever range the API was configured with), a non-finite behaviour logprob, logprobs that do
  not match the response, a token id outside the model's vocabulary. Such an entry would poison
  the step (NaN weights) or crash it; it goes to the store's dead-letter stream, counted.
- **crashed the trainer before** (``trainer.max_entry_attempts``): every step counts an attempt
  per entry in Redis before it runs; a trainer process that died in the step is restarted by Ray
  and meets the same entries again. Past the bound they are dead-lettered, so one poison batch
  cannot keep the trainer in a restart loop.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict

from serve_rft.types import RewardedExperience


def is_greedy(entry: RewardedExperience, min_temperature: float) -> bool:
    """Whether ``entry`` was sampled greedily or nearly: temperature below ``min_temperature``
    (vLLM samples greedily below 1e-5)."""
    return entry.experience.sampling.temperature < min_temperature


def batch_complete(size: int, waited_s: float, oldest_s: float, batch_size: int, min_batch_size: int,
                   batch_wait_s: float, max_batch_wait_s: float | None) -> bool:
    """Whether the trainer stops collecting and trains on the ``size`` experiences it holds.

    A full batch (``batch_size``) trains at once; past ``batch_wait_s`` of collecting, a batch of
    at least ``min_batch_size`` trains; and once the oldest held experience has waited
    ``max_batch_wait_s`` in the trainer, any non-empty batch trains, so the last experiences
    before traffic stops are trained instead of waiting for more that may never come.

    Args:
        size: experiences held.
        waited_s: seconds since this collection round began (or last restarted), s.
        oldest_s: seconds since the oldest held experience was read, s (0 when none).
        max_batch_wait_s: None: wait for ``min_batch_size`` however long it takes.
    """
    if size >= batch_size:
        return True
    if size == 0 or waited_s < batch_wait_s:
        return False
    return size >= min_batch_size or (max_batch_wait_s is not None and oldest_s >= max_batch_wait_s)


def untrainable(b: RewardedExperience, vocab_size: int, max_abs_reward: float = math.inf) -> str | None:
    """Why ``b`` cannot be trained, or None.

    Args:
        vocab_size: rows of the policy's input embedding; token ids must be in ``[0, vocab_size)``.
        max_abs_reward: ``trainer.max_abs_reward``; a reward beyond it is refused.
    """
    e = b.experience
    if not math.isfinite(b.reward):
        return f"non-finite reward {b.reward!r}"
    if abs(b.reward) > max_abs_reward:
        return f"reward {b.reward!r} beyond trainer.max_abs_reward={max_abs_reward:g}"
    if len(e.behaviour_logprobs) != len(e.response_token_ids):
        return (f"{len(e.behaviour_logprobs)} behaviour logprobs for {len(e.response_token_ids)} "
                "response tokens")
    if not all(math.isfinite(x) for x in e.behaviour_logprobs):
        return "non-finite behaviour logprob"
    ids = e.prompt_token_ids + e.response_token_ids
    if not ids or min(ids) < 0 or max(ids) >= vocab_size:
        return f"token id outside the vocabulary [0, {vocab_size})"
    if not math.isfinite(e.sampling.temperature) or e.sampling.temperature < 0:
        return f"temperature {e.sampling.temperature!r}"
    return None


class TrainedLedger:
    """Members that saved trainer states cover, with the stream id and version that trained
    them; the newest ``cap`` kept (far more than one second of acknowledgements).

    Args:
        cap: members kept (oldest forgotten first).
    """

    def __init__(self, cap: int = 200_000):
        self.cap = cap
        self._seen: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def add(self, entries: list[tuple[str, str, int]]) -> None:
        """Record ``(stream id, member, version)`` triples, as a saved state lists them."""
        for sid, member, version in entries:
            self._seen[member] = (sid, version)
            self._seen.move_to_end(member)
        while len(self._seen) > self.cap:
            self._seen.popitem(last=False)

    def split(self, batch: list[RewardedExperience]
              ) -> tuple[list[RewardedExperience], list[tuple[str, str, int]]]:
        """(entries never trained, ``(stream id, member, version)`` of those already trained)."""
        fresh, again = [], []
        for b in batch:
            hit = self._seen.get(b.member)
            if hit is None:
                fresh.append(b)
            else:
                again.append((b.stream_id, b.member, hit[1]))
        return fresh, again

    def __len__(self) -> int:
        return len(self._seen)


def stale_threshold(published: list[int], max_staleness: int | None) -> int | None:
    """The lowest policy version still within ``max_staleness`` sync cycles: a version ``v`` is
    past the bound (``sync_cycles(published, v) > max_staleness``) exactly when ``v`` is below
    it. None when nothing can be past it yet (fewer than ``max_staleness + 1`` versions
    published, or no bound)."""
    if max_staleness is None or len(published) <= max_staleness:
        return None
    return published[len(published) - max_staleness - 1]


def sync_cycles(published: list[int], version: int) -> int:
    """Weight synchronization cycles an experience of policy ``version`` is behind: how many of
    the ``published`` versions (ascending) came after it. XTuner v1's RL trainer documentation
    counts ``max_staleness`` in these cycles (its step threshold ``(max_staleness + 1) *
    sync_weights_interval``); version numbers here are trainer steps, so ``latest - version``
    would count steps. A version older than the history kept counts the whole history.
    """
    return len(published) - bisect.bisect_right(published, version)

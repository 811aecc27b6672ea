"""Every wire type that crosses a process boundary, with who produces and who consumes it.

Serialized as JSON (pydantic), never pickle, across Redis and HTTP. Ray actor calls pass these
models, plain dicts, or the dataclasses below (which may hold Ray ObjectRefs).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field


class ComponentState(str, enum.Enum):
    """Trainer / explorer-replica states kept by the synchronizer (the Trinity-RFT Synchronizer documentation, "Three Key States")."""

    RUNNING = "RUNNING"
    REQUIRE_SYNC = "REQUIRE_SYNC"
    STOPPED = "STOPPED"


class SamplingInfo(BaseModel):
    """The sampling parameters a response was produced with (explorer -> store -> trainer)."""

    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    structured_outputs: dict[str, Any] | None = Field(None, description=(
        "vLLM's structured-output constraint (json schema, regex, choice, grammar, structural tag "
        "of a forced tool call), if any: the tokens were sampled under its grammar mask, which the "
        "trainer does not apply, so their behaviour logprobs are not the policy's."))


class Experience(BaseModel):
    """One choice of one chat completion.

    Produced by an explorer replica before the response finishes; stored in Redis; consumed by
    the trainer once a reward arrives.

    ``token_versions`` are run-length spans ``(policy_version, start, end)`` over response token
    positions ``[start, end)``, taken from vLLM's per-token weight-version spans: a request kept
    in flight across a sync has several. ``behaviour_logprobs[t]`` is vLLM's
    ``processed_logprobs`` of ``response_token_ids[t]`` (after temperature scaling), which is
    what the trainer recomputes as ``log_softmax(logits / temperature)``.
    """

    completion_id: str
    choice_index: int
    group_id: str
    replica_id: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    behaviour_logprobs: list[float]
    token_versions: list[tuple[int, int, int]]
    sampling: SamplingInfo
    finish_reason: str | None
    created_at: float = Field(default_factory=time.time, description="Request arrival, unix s.")
    finished_at: float = Field(default_factory=time.time, description="Generation end, unix s.")
    user: str | None = Field(None, description="OpenAI's ``user`` of the request, if given.")
    metadata: dict[str, str] | None = Field(None, description="OpenAI's ``metadata`` of the request, if given.")

    @property
    def min_version(self) -> int:
        """The oldest policy version among the response tokens (staleness counts from it)."""
        return min((v for v, _, _ in self.token_versions), default=0)


class GroupReward(BaseModel):
    """A group's reward statistics, fixed by the store when it first released the group and
    carried by every member's ready entry (members released late carry the same), so an
    advantage never depends on how the trainer batches."""

    size: int = Field(ge=1, description="Members rewarded in the group's first release.")
    mean: float
    std: float = Field(ge=0, description="Unbiased standard deviation (0 for one member).")


class RewardedExperience(BaseModel):
    """An experience with its reward: what the trainer reads from the ready stream."""

    experience: Experience
    reward: float
    group: GroupReward | None = Field(None, description="The group's reward statistics from the store "
                                      "(None: an entry without them; the trainer groups within the batch).")
    stream_id: str = Field(description="Redis stream entry id, acknowledged after publish.")
    release_version: int | None = Field(
        None, description="The oldest token version of the group's release this entry came in (what "
        "the staleness bound drops a release by, whole); None: an entry without it.")

    @property
    def member(self) -> str:
        """``{completion_id}:{choice_index}``: the choice's name in the store."""
        return f"{self.experience.completion_id}:{self.experience.choice_index}"


@dataclass
class PublishedVersion:
    """A policy version the trainer published (trainer -> synchronizer -> replicas).

    ``handle`` is what the sync method's ``receive`` needs to load it (a dataclass, not JSON:
    it travels only through Ray calls and may hold Ray ObjectRefs): CHECKPOINT
    ``{"method": "checkpoint", "path": ...}``, MEMORY ``{"method": "memory", "buckets": [...]}``.
    """

    version: int
    handle: dict[str, Any]
    published_at: float = field(default_factory=time.time)


@dataclass
class SyncOrder:
    """The synchronizer's answer to a replica's poll: load this version now (synchronizer -> replica).

    ``others_serving``: another replica was RUNNING when the sync was granted, so (behind HAProxy)
    this one may refuse new requests while it drains instead of holding them.
    """

    version: int
    handle: dict[str, Any]
    drain_mode: str
    others_serving: bool = False


class SyncEvent(BaseModel):
    """A state change of a replica or the trainer, or a rollout decision, logged by the
    synchronizer for audits."""

    t: float
    component: str = Field(description="A replica id, `trainer`, or `synchronizer` (rollout decisions).")
    state: ComponentState
    policy_version: int
    serving: int = Field(description="Live replicas in rotation right after this event.")
    kind: str = Field("state", description="state, joined, left, lost, timeout, granted, synced, failed, "
                      "drained, undrained, published, quarantined, candidate, canary_started, promoted, "
                      "rolled_back, rollback, pinned, unpinned, promotion_paused, promotion_resumed.")
    detail: str | None = None


@dataclass
class PollReply:
    """The synchronizer's answer to a replica's poll (synchronizer -> replica).

    ``order``: sync now (or None). ``known``: False after a synchronizer restart; the replica
    then registers again with the handles it holds. ``drained``: an operator took it out of
    rotation. ``role``: ``canary`` while it serves a candidate version, else ``incumbent``.
    """

    order: SyncOrder | None = None
    known: bool = True
    drained: bool = False
    role: str = "incumbent"

"""Settings of the synchronizer: sync method and style, rolling and canary rollout."""

from __future__ import annotations

import enum
from typing import Literal

from pydantic import Field, model_validator

from serve_rft.config.base import StrictSection


class SyncMethod(str, enum.Enum):
    """How weights travel from trainer to explorer (the Trinity-RFT Synchronizer documentation, "Synchronization Methods")."""

    CHECKPOINT = "checkpoint"
    MEMORY = "memory"
    NCCL = "nccl"


class SyncStyle(str, enum.Enum):
    """When a sync happens (the Trinity-RFT Synchronizer documentation, "Synchronization Styles")."""

    FIXED = "fixed"
    EXPLORER_DRIVEN = "explorer_driven"
    TRAINER_DRIVEN = "trainer_driven"

    def trainer_publishes(self, trainer_step: int, interval: int, requested: bool) -> bool:
        """Whether the trainer publishes after its step ``trainer_step`` (>= 1): EXPLORER_DRIVEN
        when a replica ``requested`` a version; FIXED and TRAINER_DRIVEN every ``interval`` steps
        (``synchronizer.sync_interval``)."""
        if self is SyncStyle.EXPLORER_DRIVEN:
            return requested
        return trainer_step % interval == 0


class CanaryConfig(StrictSection):
    """Canary promotion (``synchronizer.rollout=canary``; serve_rft/synchronizer/canary.py).

    A new version first goes to ``replicas`` replicas while the others keep the incumbent. The
    window opens when the first canary serves it; experiences *generated* in the window are
    compared by policy version, with their rewards counted whenever they arrive (rewards come
    late: the verdict waits up to ``reward_wait_s`` after the window for ``min_rewards`` on each
    side)."""

    replicas: int = Field(1, ge=1, description="Replicas that serve a candidate version first.")
    window_s: float = Field(60.0, gt=0, description="Seconds of traffic compared, from the first "
                            "canary serving the candidate.")
    min_rewards: int = Field(20, ge=1, description="Rewards needed on each side (candidate, incumbent) "
                             "for experiences generated in the window.")
    reward_wait_s: float = Field(120.0, ge=0, description="How long after the window to wait for "
                                 "late rewards before the verdict falls back to `undecided`.")
    undecided: Literal["promote", "rollback"] = Field(
        "rollback", description="Verdict when too few rewards arrived in time.")
    reward_tolerance: float = Field(0.0, ge=0, description="A candidate whose mean reward is below the "
                                    "incumbent's by more than this (and significantly) is rolled back.")
    z: float = Field(2.0, gt=0, description="Significance of a reward drop: (candidate - incumbent + "
                     "tolerance) / standard error below -z rolls back.")
    min_requests: int = Field(10, ge=0, description="Requests needed on each side before error rate "
                              "and latency are judged.")
    max_error_rate_increase: float = Field(0.05, ge=0, le=1, description="Rolled back if the candidate's "
                                           "failed-request share exceeds the incumbent's by more than this.")
    max_latency_ratio: float = Field(2.0, ge=1, description="Rolled back if the candidate's mean request "
                                     "latency exceeds the incumbent's by this factor.")
    on_reject: Literal["continue", "reset"] = Field(
        "continue", description="What the trainer does after a rollback: continue from its own weights, "
        "or reset them to the incumbent's.")


class SynchronizerConfig(StrictSection):
    sync_method: SyncMethod = SyncMethod.CHECKPOINT
    sync_style: SyncStyle = SyncStyle.FIXED
    sync_interval: int = Field(
        1, ge=1, description="FIXED/TRAINER_DRIVEN: trainer steps per published version; FIXED/"
        "EXPLORER_DRIVEN: explorer steps between a replica's syncs (serve_rft.synchronizer.styles).")
    sync_offset: int = Field(0, ge=0, description="FIXED: explorer steps before a replica's first sync.")
    explorer_step_experiences: int = Field(
        16, ge=1, description="One explorer step = this many experiences logged by a replica.")
    sync_timeout_s: float = Field(
        30.0, gt=0, description="EXPLORER_DRIVEN: a request unanswered this long lapses (retried next cycle).")
    max_version_lag_s: float | None = Field(
        10.0, gt=0, description="Every promoted version reaches every live replica within this many "
        "seconds whatever the style and traffic (a time-based fallback, serve_rft/synchronizer/styles.py); "
        "null: only the style decides.")
    max_unavailable: int = Field(1, ge=1, description="Replicas that may be out of rotation (syncing "
                                 "or drained by an operator) at the same time.")
    drain_mode: Literal["wait", "keep"] = Field(
        "wait",
        description="wait: finish in-flight requests on the old weights before loading; "
        "keep: pause them, load, and continue them on the new weights.",
    )
    replica_timeout_s: float = Field(
        5.0, gt=0, description="A replica not heard from for this long no longer counts as serving "
        "(STOPPED); replicas poll every second.")
    lease_s: float = Field(
        10.0, gt=0, description="A replica granted a sync holds its slot while it renews this lease "
        "(every lease_s / 4 while it drains, loads and verifies); unrenewed, it counts as dead.")
    load_timeout_s: float = Field(
        600.0, gt=0, description="A replica whose drain + load + verification takes longer is broken: "
        "it reports the failure and Ray Serve replaces it.")
    retry_backoff_s: float = Field(
        2.0, gt=0, description="After a failed load a replica retries the same version no sooner than "
        "this, doubling per consecutive failure (at most 64x).")
    max_load_attempts: int = Field(
        3, ge=1, description="Failed loads (over all replicas) after which a version is quarantined: "
        "never granted again; newer versions still roll.")
    retain_versions: int = Field(
        3, ge=1, description="Newest good CHECKPOINT versions the synchronizer keeps loadable for an "
        "operator rollback besides those served (their folders are never pruned); MEMORY keeps only "
        "versions served, incumbent, candidate, pinned and latest (each holds a model in Ray's object store).")
    verify: bool = Field(
        True, description="Verify each version before serving it: checksums of the transferred bytes "
        "before the drain, logprobs of a probe sequence against the trainer's after the load.")
    verify_tolerance: float = Field(
        0.01, gt=0, description="Largest |logprob difference| of the probe sequence accepted (fp32 "
        "on CPU agrees to ~1e-5; a bf16 engine against the fp32 trainer needs ~0.25, and so does "
        "LoRA under trainer.precision=bf16, whose probe is a forward of the bf16 base + fp32 adapter).")
    rollout: Literal["rolling", "canary"] = Field(
        "rolling", description="rolling: every new version rolls to every replica; canary: it goes to "
        "canary.replicas first and is promoted or rolled back by its rewards (serve_rft/synchronizer/canary.py).")
    canary: CanaryConfig = Field(default_factory=CanaryConfig)
    bucket_bytes: int = Field(
        32 << 20, ge=1 << 16, description="MEMORY: largest bucket of tensors sent at once, bytes (the "
        "tensors of one block, which vLLM may fuse into one layer, travel together; a larger block alone)."
    )

    @model_validator(mode="after")
    def _canary_needs_versioned_method(self) -> "SynchronizerConfig":
        if self.rollout == "canary" and self.sync_method is SyncMethod.NCCL:
            raise ValueError("synchronizer.rollout=canary needs replicas to load a chosen version; "
                             "nccl sends the trainer's current weights only: use checkpoint or memory")
        return self

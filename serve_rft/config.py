"""Typed run configuration.

One pydantic model per runtime role (explorer, buffer, trainer, synchronizer, service),
loaded from YAML plus ``--set a.b=value`` overrides. This module imports neither torch nor
vLLM so that ``serve-rft --help`` and config validation are instant.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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


class ModelConfig(_Strict):
    path: str | None = Field(
        None,
        description="A Hugging Face model directory. None: build (once) and use the embedded "
        "default model under `cache_dir`.",
    )
    cache_dir: str = Field(
        default_factory=lambda: os.environ.get(
            "SERVE_RFT_CACHE", str(Path.home() / ".cache" / "serve_rft")
        ),
        description="Where the embedded default model is built and cached.",
    )
    served_name: str = Field("serve-rft", description="Model name shown by /v1/models.")


class AutoscalingSettings(_Strict):
    """Ray Serve's ``autoscaling_config`` for the explorer deployment: replicas are added and
    removed by load; the synchronizer counts the replicas that run (never a configured number)."""

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0, description="In-flight requests per replica "
                                           "Serve aims for.")
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingSettings":
        if self.max_replicas < self.min_replicas:
            raise ValueError("explorer.autoscaling.max_replicas must be >= min_replicas")
        return self


class ExplorerConfig(_Strict):
    num_replicas: int = Field(2, ge=1, description="vLLM explorer replicas behind Ray Serve (the "
                              "initial count when `autoscaling` is set).")
    autoscaling: AutoscalingSettings | None = Field(
        None, description="Let Ray Serve add and remove replicas by load (null: a fixed num_replicas).")
    num_cpus_per_replica: float = Field(1.0, gt=0, description="Ray logical CPUs per replica.")
    num_gpus_per_replica: float = Field(
        0.0, ge=0, description="Ray GPUs per replica (GPU machines with the `vllm` package; NCCL needs > 0).")
    max_model_len: int = Field(1024, ge=16, description="Context length (prompt + response), tokens.")
    kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE per replica, GiB.")
    max_num_seqs: int = Field(64, ge=1, description="vLLM scheduler: concurrent sequences per replica.")
    max_ongoing_requests: int = Field(64, ge=1, description="Ray Serve: in-flight requests per replica.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="GPU machines: share of the GPU's memory one vLLM replica may use "
        "(weights + KV cache); lower it when replicas and the trainer share a GPU.")
    max_n: int = Field(16, ge=1, description="Largest accepted `n` (choices per request).")
    default_max_tokens: int = Field(64, ge=1, description="max_tokens when a request gives none.")
    routing_stats_period_s: float = Field(
        0.25, gt=0, description="How often Ray Serve polls replica routing stats (drain flag), s "
        "(service.ingress=proxy only: HAProxy needs no drain notice)."
    )
    max_loras: int = Field(
        4, ge=1, description="With adapter-only LoRA sync (trainer.lora.merge_and_sync=false): adapters "
        "(policy versions) one vLLM batch may mix; requests in flight keep the version they started on.")


    @model_validator(mode="after")
    def _initial_within_bounds(self) -> "ExplorerConfig":
        a = self.autoscaling
        if a is not None and not a.min_replicas <= self.num_replicas <= a.max_replicas:
            raise ValueError(f"explorer.num_replicas={self.num_replicas} (the initial count) must lie within "
                             f"autoscaling [{a.min_replicas}, {a.max_replicas}]")
        return self

class BufferConfig(_Strict):
    redis_url: str | None = Field(
        None, description="Existing Redis to use. None: start an embedded redis-server."
    )
    key_prefix: str = Field("srft", description="Prefix of every Redis key of this service.")
    reward_timeout_s: float = Field(
        3600.0, gt=0, description="An experience with no reward after this long expires, s."
    )
    trained_ttl_s: float = Field(
        86400.0, gt=0, description="How long a trained experience stays readable, s."
    )
    reconnect_s: float = Field(
        30.0, gt=0, description="How long a Redis command is retried across a lost connection (a "
        "Redis restart) before it fails, s.")
    group_timeout_s: float = Field(
        60.0, gt=0, description="A group with >= 2 rewarded answers is trained this long after its "
        "first reward even if other members have no reward yet, s.")
    store_wait_s: float = Field(
        5.0, gt=0, description="How long a request waits for the store (a Redis restart, an outage). "
        "Past it a chat completion is answered anyway, not logged (counted: unlogged, reason "
        "store_unavailable), a reward gets 504 + Retry-After (nothing lost: retrying is safe) and "
        "/v1/status answers with store: unavailable.")
    max_ready: int | None = Field(
        100_000, ge=1, description="Bound of the ready stream (rewarded experiences waiting for the "
        "trainer). Past it the oldest entries not yet delivered to the trainer are dropped (state "
        "backlog-dropped, counted): what nothing consumes (serve-only mode, a trainer slower than the "
        "traffic) cannot grow without bound. None: unbounded.")
    durability: Literal["everysec", "always"] = Field(
        "everysec", description="Embedded redis-server's AOF fsync (appendfsync): everysec = an "
        "acknowledged reward or experience is lost in a crash of the machine only if it was written in "
        "the last second (RPO 1 s); always = fsync before every answer (RPO 0, slower writes).")
    maxmemory_mb: int | None = Field(
        2048, ge=16, description="Embedded redis-server's maxmemory (MiB) with noeviction: when full, new "
        "experiences are served but not logged (counted: unlogged, reason store_full) and rewards get "
        "507 + Retry-After; nothing stored is evicted. None: unbounded.")

    @model_validator(mode="after")
    def _no_reward_outlived(self) -> "BufferConfig":
        # A rewarded member is kept reward_timeout_s + trained_ttl_s (the REWARD script); its
        # group is released at the latest reward_timeout_s after the first reward, or
        # group_timeout_s after it: past both, the member's experience could expire first.
        if self.group_timeout_s > self.reward_timeout_s:
            raise ValueError(
                f"buffer.group_timeout_s={self.group_timeout_s} must not exceed buffer.reward_timeout_s="
                f"{self.reward_timeout_s}: a group could be held past the time its members' experiences "
                "are kept, and their accepted rewards would never be trained")
        return self


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (vllm.config.lora.MaxLoRARanks)."""


class LoraSettings(_Strict):
    """Train LoRA adapters (peft) instead of every weight (Twinkle's CheckpointEngine documentation, "merge_and_sync")."""

    rank: int = Field(8, ge=1, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling alpha (update scaled by alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Linear layers that get adapters (Qwen2/Llama names).")
    merge_and_sync: bool = Field(
        True, description="true: publish base + adapter merged as full weights (replicas need no LoRA "
        "support). false: publish only the adapter (adapter_model.safetensors + adapter_config.json); "
        "replicas start vLLM with LoRA enabled and serve each policy version as the adapter "
        "`v{version}` over the unchanged base (checkpoint or memory sync; no pause, no reload).")

    @model_validator(mode="after")
    def _rank_vllm_serves(self) -> "LoraSettings":
        if not self.merge_and_sync and self.rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"trainer.lora.rank={self.rank}: vLLM serves adapters up to rank "
                             f"{VLLM_LORA_RANKS[-1]} (use merge_and_sync=true)")
        return self

    def vllm_max_lora_rank(self) -> int:
        """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank`` (vLLM allows only
        `VLLM_LORA_RANKS`)."""
        return next(r for r in VLLM_LORA_RANKS if r >= self.rank)


class TrainerConfig(_Strict):
    enabled: bool = Field(True, description="Run the background trainer.")
    algorithm: Literal["grpo", "opmd", "opmd_kimi", "reinforce"] = Field(
        "grpo",
        description="grpo: group-normalised advantages (singletons: reward - running baseline), "
        "PPO clipped ratio vs behaviour logprobs. opmd: Trinity-RFT technical report appendix A.3, "
        "-1/(1+tau) (r - group mean) log pi. opmd_kimi: the report's appendix A.1, squared loss vs the "
        "behaviour policy. reinforce: reward - running baseline for every experience, PPO clipped ratio (serve_rft/trainer/losses.py).",
    )
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] | None = Field(
        None, description="Token aggregation of the loss; None: token_mean for grpo/reinforce "
        "(every token weighs the same, DAPO), seq_mean_token_sum for opmd (log pi(y|x) of the answer).")
    opmd_tau: float = Field(1.0, ge=0, description="OPMD's tau (opmd: >= 0, opmd_kimi: > 0).")
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of a k3 KL penalty to the initial weights (a frozen copy is "
        "kept in memory when > 0); 0: none.")
    lora: LoraSettings | None = Field(
        None, description="LoRA adapters instead of full fine-tuning; None: train every weight.")
    micro_batch_size: int = Field(
        0, ge=0, description="Experiences per forward/backward (gradient accumulation bounds memory); "
        "0: the whole batch at once. The gradient equals the unsplit batch's.")
    batch_size: int = Field(32, ge=1, description="Experiences per training step (upper bound).")
    min_batch_size: int = Field(8, ge=1, description="Wait for at least this many ready experiences.")
    batch_wait_s: float = Field(
        2.0, ge=0, description="Wait this long for a full batch before training on >= min_batch_size."
    )
    read_order: Literal["freshest", "oldest"] = Field(
        "freshest", description="Which ready experiences a step takes first. freshest: the newest "
        "(with more traffic than the trainer can train, it trains the freshest data; what waits "
        "grows older until max_staleness drops it, counted); oldest: first in, first out.")
    max_batch_wait_s: float | None = Field(
        30.0, ge=0, description="Train on fewer than min_batch_size (at least one) once the oldest "
        "experience the trainer holds has waited this long, so the last rewarded experiences before "
        "traffic stops are trained, s. None: wait for min_batch_size however long it takes.")
    lr: float = Field(1e-3, ge=0, description="AdamW learning rate (peak). 0: dummy mode, all the work "
                      "with fixed weights, for profiling (Trinity-RFT technical report §3.3.1).")
    lr_warmup_steps: int = Field(0, ge=0, description="Linear warm-up from 0 over this many steps.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After warm-up: constant, or cosine decay to lr * lr_min_ratio at lr_decay_steps.")
    lr_decay_steps: int = Field(10000, ge=1, description="cosine: steps (after warm-up) to reach the minimum.")
    lr_min_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip: 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip: 1 + clip_high.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    baseline_momentum: float = Field(
        0.9, ge=0, lt=1, description="EMA momentum of the running reward baseline."
    )
    max_staleness: int | None = Field(
        16, ge=0, description="Drop (count, do not train on) an experience generated more than this many "
        "weight synchronization cycles ago: more than max_staleness versions were published after the "
        "version of its oldest token (XTuner v1's max_staleness, counted in sync cycles, not trainer "
        "steps: 0 = only the current version). Bounds what a trainer slower than the traffic trains "
        "on. None: no limit.")
    max_entry_attempts: int = Field(
        3, ge=1, description="Training steps begun with one ready entry before it is moved to the "
        "dead-letter stream: a trainer process that died in a step restarts and meets the same "
        "entries again; past this bound they stop being retried (serve_rft.trainer.intake).")
    num_threads: int = Field(1, ge=1, description="torch threads of the trainer process.")
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where the trainer's policy model lives (cuda: the actor takes one Ray GPU).")
    num_gpus: float = Field(
        1.0, gt=0, le=1, description="Ray GPUs the trainer actor takes with device=cuda (a fraction "
        "shares one GPU with replicas: configs/single_gpu.yaml).")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Forward passes of the trainer: bf16 autocast (weights, optimizer and "
        "log-softmax stay fp32) or fp32. auto: bf16 on cuda, fp32 on cpu (where the logprob agreement "
        "with vLLM's fp32 engine is 1e-6).")
    keep_checkpoints: int = Field(5, ge=1, description="Published versions kept on disk.")
    save_interval: int = Field(
        1, ge=1, description="Save the trainer state (weights, optimizer, RNG, version, the ready "
        "entries trained) every this many published versions. Ready entries are acknowledged only "
        "once a saved state covers them, so a killed trainer resumes from its last state and "
        "trains what came after it again (serve_rft.trainer.state).")
    keep_states: int = Field(2, ge=1, description="Trainer states kept on disk.")

    @model_validator(mode="after")
    def _kimi_needs_tau(self) -> "TrainerConfig":
        if self.algorithm == "opmd_kimi" and self.opmd_tau <= 0:
            raise ValueError("trainer.algorithm=opmd_kimi needs trainer.opmd_tau > 0 (it divides by tau)")
        return self

    @property
    def aggregation(self) -> str:
        """``loss_agg``, or the algorithm's default when it is None."""
        if self.loss_agg is not None:
            return self.loss_agg
        return "seq_mean_token_sum" if self.algorithm.startswith("opmd") else "token_mean"
    seed: int = 0


class CanaryConfig(_Strict):
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


class SynchronizerConfig(_Strict):
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
        "on CPU agrees to ~1e-5; a bf16 engine against the fp32 trainer needs ~0.25).")
    rollout: Literal["rolling", "canary"] = Field(
        "rolling", description="rolling: every new version rolls to every replica; canary: it goes to "
        "canary.replicas first and is promoted or rolled back by its rewards (serve_rft/synchronizer/canary.py).")
    canary: CanaryConfig = Field(default_factory=CanaryConfig)
    bucket_bytes: int = Field(
        32 << 20, ge=1 << 16, description="MEMORY: largest bucket of tensors sent at once, bytes."
    )

    @model_validator(mode="after")
    def _canary_needs_versioned_method(self) -> "SynchronizerConfig":
        if self.rollout == "canary" and self.sync_method is SyncMethod.NCCL:
            raise ValueError("synchronizer.rollout=canary needs replicas to load a chosen version; "
                             "nccl sends the trainer's current weights only: use checkpoint or memory")
        return self


def _env_list(name: str) -> list[str]:
    return [k.strip() for k in os.environ.get(name, "").split(",") if k.strip()]


class ServiceConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="HTTP port; 0 picks a free one.")
    ingress: Literal["haproxy", "proxy"] = Field(
        "haproxy", description="Front door of a locally started Ray: haproxy = Ray Serve's HAProxy "
        "mode (requests go straight to a replica's own HTTP server; a draining replica's refusals are "
        "retried elsewhere), proxy = Ray Serve's Python proxy with DrainAwareRouter. A joined "
        "cluster keeps the mode it was started with (serve_rft/service/ingress.py).")
    run_dir: str = Field("runs/default", description="Checkpoints, redis data and logs live here.")
    ray_address: str | None = Field(None, description="Existing Ray cluster. None: start one.")
    ray_num_cpus: int = Field(8, ge=1, description="Logical CPUs of a locally started Ray.")
    shutdown_grace_s: float = Field(
        25.0, gt=0, description="After SIGINT / SIGTERM / SIGHUP, how long the service gets to stop "
        "(Serve drains, redis-server flushes) before the keeper of `serve-rft up` / `demo` ends its "
        "processes with SIGKILL; a second signal ends them at once, s (serve_rft/service/keeper.py).")
    metrics_port: int = Field(
        8080, ge=0, le=65535, description="Prometheus endpoint (/metrics) of a locally started Ray "
        "(Ray's metrics export port; 0 picks a free one). A joined cluster keeps its own.")
    api_keys: list[str] = Field(
        default_factory=lambda: _env_list("SERVE_RFT_API_KEYS"),
        description="Inference keys (chat, models). Empty and no admin_keys: no auth.")
    admin_keys: list[str] = Field(
        default_factory=lambda: _env_list("SERVE_RFT_ADMIN_KEYS"),
        description="Admin keys: rewards, experiences, status, and inference too.")


class Config(_Strict):
    """The whole run: one section per runtime role."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    explorer: ExplorerConfig = Field(default_factory=ExplorerConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    synchronizer: SynchronizerConfig = Field(default_factory=SynchronizerConfig)
    service: ServiceConfig = Field(default_factory=ServiceConfig)

    @model_validator(mode="after")
    def _nccl_needs_gpus(self) -> "Config":
        if self.synchronizer.sync_method is SyncMethod.NCCL and (
                self.trainer.device != "cuda" or self.explorer.num_gpus_per_replica <= 0):
            raise ValueError(
                "synchronizer.sync_method=nccl moves weights GPU to GPU: it needs trainer.device=cuda "
                "and explorer.num_gpus_per_replica > 0 (on a machine without GPUs use checkpoint or memory)")
        return self

    @model_validator(mode="after")
    def _adapter_sync_method(self) -> "Config":
        if self.adapter_sync and self.synchronizer.sync_method is SyncMethod.NCCL:
            raise ValueError("trainer.lora.merge_and_sync=false syncs adapters as files or buckets: use "
                             "synchronizer.sync_method=checkpoint or memory (NCCL broadcasts full weights)")
        return self

    @property
    def adapter_sync(self) -> bool:
        """True when replicas serve LoRA adapters over the base (``trainer.lora.merge_and_sync``
        false) instead of loading full weights."""
        return self.trainer.lora is not None and not self.trainer.lora.merge_and_sync

    @model_validator(mode="after")
    def _always_one_serving(self) -> "Config":
        auto = self.explorer.autoscaling
        n = auto.min_replicas if auto is not None else self.explorer.num_replicas
        if n > 1 and self.synchronizer.max_unavailable >= n:
            raise ValueError(
                f"synchronizer.max_unavailable={self.synchronizer.max_unavailable} would let all "
                f"{n} replicas sync at once; it must be < explorer.num_replicas"
            )
        lora = self.trainer.lora
        if self.synchronizer.canary.on_reject == "reset" and lora is not None and lora.merge_and_sync:
            raise ValueError("synchronizer.canary.on_reject=reset takes the incumbent's adapter back; with "
                             "trainer.lora.merge_and_sync=true versions carry merged weights only: use "
                             "merge_and_sync=false or on_reject=continue")
        if self.synchronizer.rollout == "canary" and self.synchronizer.canary.replicas >= n:
            raise ValueError(
                f"synchronizer.canary.replicas={self.synchronizer.canary.replicas} leaves no replica "
                f"on the incumbent version with {n} replicas; it must be < explorer.num_replicas "
                "(or autoscaling.min_replicas)")
        return self


def _parse_value(raw: str) -> Any:
    """Parse an override value with YAML rules (``1`` -> int, ``true`` -> bool, ``a`` -> str)."""
    return yaml.safe_load(raw)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.field=value`` overrides to a raw config dict (in place, returned).

    Raises:
        ValueError: an override without ``=``.
    """
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form section.field=value")
        dotted, raw = item.split("=", 1)
        node = data
        parts = dotted.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _parse_value(raw)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config file (optional) and apply overrides.

    Raises:
        pydantic.ValidationError: a field of the wrong type or out of bounds.
        FileNotFoundError: ``path`` does not exist.
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
    apply_overrides(data, overrides or [])
    return Config.model_validate(data)

"""Settings of the trainer: algorithm, batches, optimizer, staleness, LoRA."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from serve_rft.config.base import StrictSection


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (vllm.config.lora.MaxLoRARanks)."""


class LoraSettings(StrictSection):
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


class TrainerConfig(StrictSection):
    enabled: bool = Field(True, description="Run the background trainer.")
    algorithm: str = Field(
        "grpo", pattern=r"^[a-z][a-z0-9_]*$",
        description="The RL algorithm, one module of serve_rft/trainer/algorithms/ each: grpo "
        "(group-normalised advantages, singletons reward - running baseline; PPO clipped ratio vs "
        "the behaviour logprobs), opmd (Trinity-RFT technical report appendix A.3: -1/(1+tau) "
        "(r - group mean) log pi), opmd_kimi (the report's appendix A.1: squared loss vs the "
        "behaviour policy), reinforce (reward - running baseline for every experience, PPO clipped "
        "ratio). Checked against the algorithms found before anything starts.")
    algorithm_args: dict[str, Any] = Field(
        default_factory=dict, description="The algorithm's own settings, validated by it: opmd and "
        "opmd_kimi take tau (default 1.0; opmd >= 0, opmd_kimi > 0); grpo and reinforce take none.")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] | None = Field(
        None, description="Token aggregation of the loss; None: the algorithm's default, token_mean "
        "for grpo/reinforce (every token weighs the same, DAPO), seq_mean_token_sum for opmd and "
        "opmd_kimi (log pi(y|x) of the answer).")
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of a k3 KL penalty to the initial weights (a frozen copy is "
        "kept in memory when > 0); 0: none.")
    entropy_coef: float = Field(
        0.0, ge=0, le=1, description="Weight of an entropy bonus: the loss less entropy_coef times the "
        "mean entropy (nats) of the tempered, nucleus-masked next-token distribution at each response "
        "token of the batch, aggregated as the loss is (Williams and Peng 1991; Mnih et al. 2016, arXiv 1602.01783, "
        "section 4). It keeps the policy spread over answers that are rewarded alike, which GRPO "
        "alone gives no advantage to tell apart. With entropy_target set: the largest coefficient the "
        "adaptive control may reach. 0: none.")
    entropy_target: float | None = Field(
        None, gt=0, le=20, description="Adaptive entropy control (Skywork-OR1 technical report, He et al. "
        "2025, arXiv 2505.22312, 'Adaptive Entropy Control'): the bonus's coefficient starts at 0 and moves "
        "by entropy_coef_delta after each step, up while the step's mean token entropy (nats) is below this "
        "target and down while it is not, within [0, entropy_coef]; a step applies it only while the last "
        "step's entropy was below the target, so a policy above the target learns as with no bonus "
        "(serve_rft/trainer/policy/entropy_control.py). Needs entropy_coef > 0. None: entropy_coef fixed.")
    entropy_coef_delta: float = Field(
        0.001, gt=0, le=1, description="entropy_target: how far the coefficient moves per step.")
    lora: LoraSettings | None = Field(
        None, description="LoRA adapters instead of full fine-tuning; None: train every weight.")
    micro_batch_size: int = Field(
        0, ge=0, description="Experiences per forward/backward (gradient accumulation bounds memory); "
        "0: the whole batch at once. The gradient equals the unsplit batch's.")
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="Padded tokens per forward/backward: a micro-batch runs as one "
        "[experiences, longest prompt + response] right-padded tensor, and this bounds its size "
        "(experiences x longest length, tokens). The batch's experiences are sorted longest first "
        "(less padding) and packed greedily; one longer than the budget is a micro-batch of its own "
        "(never dropped). With micro_batch_size > 0 both limits apply. None: off (micro_batch_size "
        "alone, in batch order). The gradient and the step's statistics equal the unsplit batch's "
        "(serve_rft/trainer/policy/micro_batches.py).")
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
    clip_ratio_c: float | None = Field(
        3.0, gt=1, description="Dual-clip PPO's c (Ye et al. 2020, arXiv 1912.09729): a token with a "
        "negative advantage adds at most -A c to the loss and, past it, no gradient, whatever its ratio "
        "to the behaviour logprobs (a stale sample). None: no dual clip.")
    off_policy: Literal["ppo", "tis", "mis_token", "mis_sequence"] = Field(
        "ppo", description="Off-policy correction of grpo / reinforce for stale and multi-version "
        "samples (serve_rft/trainer/algorithms/off_policy.py): ppo (dual-clip PPO against the "
        "behaviour logprobs), tis (AReaL's decoupled loss, -min(pi/mu, is_cap) A log pi), mis_token / "
        "mis_sequence (tokens, or whole answers by the geometric mean ratio, outside [1/is_cap, is_cap] "
        "left out of the loss).")
    is_cap: float = Field(2.0, gt=1, description="C of off_policy: tis truncates pi/mu at C; mis_* keep "
                          "ratios in [1/C, C].")
    off_policy_seq_mask_kl: float | None = Field(
        None, gt=0, description="Off-policy sequence masking (DeepSeek-V3.2 report, arXiv 2512.02556): "
        "answers with a negative advantage whose mean log(mu/pi) exceeds this are left out of the loss. "
        "None: off.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    grad_norm_spike: float | None = Field(
        None, gt=1, description="Skip (and dead-letter) a step whose gradient norm is more than this many "
        "times the median norm of the last grad_norm_window steps (serve_rft.trainer.policy.finite.GradNormGuard); "
        "None: off. Every finite norm joins the window, so a lasting shift is accepted after about half a window.")
    grad_norm_window: int = Field(32, ge=4, description="Steps whose gradient norms the spike guard's median "
                                  "is taken over; the guard acts once it holds this many.")
    train_greedy: bool = Field(
        False, description="Train experiences sampled below min_train_temperature too (greedy and "
        "near-greedy answers). false: they are served, logged and rewardable, and left out of the loss, "
        "counted (state greedy): a greedy token was chosen with probability 1 but logged with "
        "softmax(logits)'s logprob, a biased sample; low temperatures amplify numeric differences by 1/T.")
    min_train_temperature: float = Field(
        0.1, ge=0, description="Experiences sampled at a lower temperature are greedy (see train_greedy).")
    max_abs_reward: float = Field(
        1e6, gt=0, le=1e30, description="Rewards with a larger magnitude are dead-lettered by the trainer "
        "(serve_rft.trainer.intake.admission), whatever range the API accepts: in float32 advantages (max ~3.4e38) one "
        "such reward would overflow a step, and the running baseline would carry it for hundreds of rewards.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="What grpo divides a centred reward by (Dr. GRPO's scale_rewards, arXiv "
        "2503.20783): group (a group member by its group's reward std, as GRPO; a singleton by the running "
        "std of rewards around the baseline, so both are unit-free), batch (everyone by the batch's reward "
        "std), none (no division).")
    zero_variance_std: float = Field(
        1e-4, ge=0, description="A group whose reward std is below this (reward units) gives its members an "
        "advantage of exactly 0 and is counted (zero_variance_groups in the step statistics).")
    filter_zero_variance: bool = Field(
        False, description="Leave the members of groups without reward spread (std below zero_variance_std) out "
        "of the step (DAPO's dynamic sampling, Yu et al. 2025, arXiv 2503.14476, section 3.2, without "
        "re-sampling): their policy gradient is 0, but they count in the loss's normalisers (so a batch of mostly "
        "solved or mostly failed groups takes a smaller step) and in the entropy and KL terms. Left out, the "
        "answers kept weigh more: a batch with few kept takes a whole step on them (grad_clip bounds it). They end "
        "trained (the step consumed them), counted as zero_variance_filtered; a batch with nothing else trains "
        "as without the filter. grpo and opmd only (refused with opmd_kimi, whose consistency term has a "
        "gradient at advantage 0, and reinforce, which has no groups).")
    singleton_advantage_clip: float | None = Field(
        3.0, gt=0, description="grpo: a singleton's advantage (reward - running baseline, divided by the "
        "scale) is clipped to +-this, so one singleton never outweighs a step's group z-scores when the "
        "running reward spread is small. None: no clip.")
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
        "entries again; past this bound they stop being retried (serve_rft.trainer.intake.admission).")
    num_threads: int = Field(1, ge=1, description="torch threads of the trainer process.")
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="Where the trainer's policy model lives (cuda: the actor takes one Ray GPU).")
    num_gpus: float = Field(
        1.0, gt=0, le=1, description="Ray GPUs the trainer actor takes with device=cuda (a fraction "
        "shares one GPU with replicas: configs/single_gpu.yaml).")
    num_workers: int = Field(
        1, ge=1, description="Trainer ranks. 1: the trainer actor trains in its own process. N > 1: "
        "N rank actors (one CPU each; with device=cuda one whole GPU each, and the trainer actor none) "
        "train data-parallel with the "
        "parameters, gradients and AdamW state sharded by FSDP2 (gloo on cpu, NCCL on cuda), and the "
        "trainer actor coordinates them: published versions are gathered bucket by bucket, trainer "
        "states saved with torch.distributed.checkpoint (serve_rft/trainer/sharding/sharded_policy.py). "
        "Full fine-tuning or LoRA (the adapter sharded with its layers), CHECKPOINT or MEMORY sync, so far.")
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list, description="Experiment trackers each training step's statistics go to "
        "(serve_rft/observability/trackers.py): tensorboard, wandb (offline unless WANDB_MODE says "
        "otherwise), mlflow (a local file store unless MLFLOW_TRACKING_URI says otherwise); runs under "
        "<service.run_dir>/tracking. Each needs its extra: pip install 'serve-rft[tensorboard]'.")
    label_selector: dict[str, str] | None = Field(
        None, description="Ray node labels the trainer actor must run on (Ray's label_selector, "
        "e.g. {serve-rft.io/role: trainer}: the node group started with that label; "
        "deployments/kuberay/rayservice.yaml). None: any node with the resources.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Forward passes of the trainer: bf16 autocast (weights, optimizer and "
        "log-softmax stay fp32) or fp32. auto: bf16 on cuda, fp32 on cpu (where the logprob agreement "
        "with vLLM's fp32 engine is 1e-6).")
    logprob_impl: Literal["chunked", "full"] = Field(
        "chunked", description="How a step computes the logprobs of sampled tokens. chunked: the "
        "decoder, then the LM head on the response positions only, logprob_chunk_tokens at a time, "
        "with a backward that recomputes each chunk (serve_rft/trainer/policy/token_logprobs.py). full: "
        "[batch, length, vocab] fp32 logits of the whole model (the reference; more memory and time).")
    logprob_chunk_tokens: int = Field(
        1024, ge=1, description="chunked: response tokens per LM-head chunk; the largest buffer is "
        "[chunk, vocab] fp32 (1024 x 151,936 words: 0.6 GB).")
    keep_checkpoints: int = Field(5, ge=1, description="Published versions kept on disk.")
    save_interval: int = Field(
        1, ge=1, description="Save the trainer state (weights, optimizer, RNG, version, the ready "
        "entries trained) every this many published versions. Ready entries are acknowledged only "
        "once a saved state covers them, so a killed trainer resumes from its last state and "
        "trains what came after it again (serve_rft.trainer.publishing.state).")
    keep_states: int = Field(2, ge=1, description="Trainer states kept on disk.")

    seed: int = 0

    @model_validator(mode="after")
    def _entropy_target_has_a_bound(self) -> "TrainerConfig":
        if self.entropy_target is not None and self.entropy_coef <= 0:
            raise ValueError("trainer.entropy_target needs trainer.entropy_coef > 0: the largest coefficient "
                             "the adaptive control may reach")
        return self

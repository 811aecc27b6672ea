"""The trainer's torch side (`PolicyTrainer`), synchronous: the policy model, its optimizer and
LR schedule, a frozen reference copy for the KL penalty, one policy-gradient step per batch of
rewarded experiences, and the weights to publish. The `serve_rft.trainer.actor.Trainer` actor
runs it off its event loop.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from serve_rft.config import Config
from serve_rft.types import RewardedExperience


LORA_MERGE_BUCKET_BYTES = 256 * 2**20
"""Full-tensor bytes of merged LoRA weights computed at once for a publish or a saved state."""


class PolicyTrainer:
    """The torch side, synchronous: the policy model, its optimizer and LR schedule, and (with
    ``kl_coef > 0``) a frozen reference copy of the initial weights."""

    def __init__(self, cfg: Config, model_path: str, resume: Path | None = None, rank: int = 0, world: int = 1):
        """Load the policy from ``model_path``, or from the trainer state folder ``resume``
        (weights, optimizer, LR schedule, RNG, running baseline; `serve_rft.trainer.publishing.state`).

        ``world > 1``: this is rank ``rank`` of a data-parallel group already joined
        (`serve_rft.trainer.sharding.fsdp.init_process_group`); the policy (and the KL reference) are
        built sharded with FSDP2 (`serve_rft.trainer.sharding.fsdp.load_sharded`: only rank 0 reads the
        whole model, on the CPU) before the optimizer is built, so AdamW's state is sharded too.

        With LoRA the adapter is sharded with the layers it sits in (`serve_rft.trainer.sharding.fsdp.shard`).

        Raises:
            NonFiniteState: the weights or AdamW state resumed from hold NaN or infinity.
        """
        import torch

        from serve_rft.trainer.algorithms import get_algorithm
        from serve_rft.trainer.algorithms.advantages import RunningBaseline
        from serve_rft.trainer.policy.entropy_control import EntropyControl
        from serve_rft.trainer.policy.finite import GradNormGuard
        from serve_rft.trainer.publishing.state import load_state

        torch.set_num_threads(cfg.trainer.num_threads)
        torch.manual_seed(cfg.trainer.seed)
        self.cfg = cfg.trainer
        self.algorithm = get_algorithm(cfg.trainer)
        self.rank, self.world = rank, world
        # bf16 weight copies cast again in the backward (one process) or held from the forward
        # (plain autocast: FSDP2 ranks; benchmarks/trainer_throughput.py --autocast plain)
        self.recast_bf16 = world == 1
        self.device = torch.device(cfg.trainer.device)
        self.bf16 = cfg.trainer.precision == "bf16" or (cfg.trainer.precision == "auto" and self.device.type == "cuda")
        from serve_rft.trainer.sharding.fsdp import load_sharded, pretrained

        def load(build):
            """``build``'s model on this process's device, or its shard of it on N ranks (built
            sharded: no rank but 0 ever holds a whole copy)."""
            if world > 1:
                return load_sharded(build, self.device, rank)
            return build(True).to(self.device)

        self.merged = None  # LoRA: the effective weights (base + adapter), streamed when published
        self.ref_model = None
        if self.cfg.lora is not None:
            from serve_rft.trainer.policy import lora

            # the base never changes: held in the compute dtype (bf16 under bf16 precision); the
            # adapter is fp32 (peft casts adapter weights up), so is its AdamW state
            base = pretrained(model_path, torch.bfloat16 if self.bf16 else torch.float32)

            def with_adapter(real: bool):
                model = lora.wrap(base(real), self.cfg.lora)
                if real and resume is not None:
                    lora.load_adapter(model, resume)
                return model
            self.model = load(with_adapter)
            self.merged = lora.MergedWeights(self.model)
            self.model_path = model_path
        else:
            self.model = load(pretrained(str(resume if resume is not None else model_path)))
            if self.cfg.kl_coef > 0:  # LoRA's reference is the base: the adapter disabled
                self.ref_model = load(pretrained(str(model_path)))
                self.ref_model.eval().requires_grad_(False)
        self.model.train()
        self.pad_id = self.model.config.pad_token_id or 0
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                           lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.baseline = RunningBaseline(self.cfg.baseline_momentum)  # its spread (var) restarts with
        # the process: a trainer state saves the baseline's value only
        self.spikes = GradNormGuard(self.cfg.grad_norm_spike, self.cfg.grad_norm_window)
        self.entropy_control = EntropyControl(self.cfg.entropy_coef, self.cfg.entropy_target,
                                              self.cfg.entropy_coef_delta)
        self.resumed = None
        if resume is not None:
            self.resumed = load_state(resume, self.optimizer, self.scheduler, self.model, rank, world)
        if self.resumed is not None:
            self.baseline.value = self.resumed.baseline
            if self.baseline.value is not None and not math.isfinite(self.baseline.value):
                self.baseline.value = None  # a state saved before the guard: start the EMA again
            self.check_finite()  # a poisoned state stops the trainer at setup, visibly, instead of
            # a restart loop that dead-letters every batch
        # version 0's probe (the replicas register the initial weights without one): what a reset
        # to the initial weights is checked against; unknown to a trainer that resumed
        self.initial_probe = None
        if resume is None:
            self.initial_probe = self.probe(self.publish_model(), 0)

    def full_model(self):
        """The policy as the full model the sync methods and trainer states take: the model
        itself, or with LoRA a `serve_rft.trainer.policy.gathered.GatheredModel` streaming base +
        adapter (fp32, `serve_rft.trainer.policy.lora.MergedWeights`) a bucket at a time."""
        if self.merged is None:
            return self.model
        from serve_rft.trainer.policy.gathered import GatheredModel

        return GatheredModel(self.merged.gather, self.merged.specs(), self.export_config(), LORA_MERGE_BUCKET_BYTES,
                             self.model_path)

    def export_specs(self) -> list[tuple[str, list[int], str]]:
        """``(name, whole shape, dtype name)`` of every weight a full publish carries, in order:
        the model's parameters, or with LoRA the merged weights under the base model's names."""
        if self.merged is not None:
            return self.merged.specs()
        return [(n, list(p.shape), str(p.dtype)) for n, p in self.model.named_parameters()]

    def export_config(self):
        """The transformers config a full publish is saved with (LoRA: the base's, fp32, what the
        merged tensors are)."""
        if self.merged is None:
            return self.model.config
        import copy

        import torch

        config = copy.deepcopy(self.model.get_base_model().config)
        config.dtype = torch.float32
        return config

    def gather_weights(self, names: list[str]) -> dict:
        """The whole tensors of the weights ``names`` (`export_specs`' names; LoRA: merged), on the
        CPU. On N ranks a collective: every rank gathers the same names in the same order, and
        only rank 0 copies them to the CPU and returns them (the others return ``{}``)."""
        import torch

        from serve_rft.trainer.sharding.fsdp import reshard

        reshard(self.model)  # the registered parameters must be the sharded ones
        keep = self.rank == 0
        if self.merged is not None:
            return self.merged.gather(names, keep=keep)
        params = dict(self.model.named_parameters())
        out = {}
        with torch.no_grad():
            for name in names:
                p = params[name]
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                if keep:
                    out[name] = full.detach().to("cpu")  # gathered on CPU (gloo): a fresh tensor already
                del full
        return out

    def adapter_snapshot(self):
        """The LoRA adapter whole, as adapter-only sync publishes it
        (`serve_rft.weights.adapters.AdapterSnapshot`). On N ranks a collective; rank 0's is the
        snapshot, the others return None."""
        from peft import get_peft_model_state_dict

        from serve_rft.trainer.policy.lora import _whole
        from serve_rft.trainer.sharding.fsdp import reshard
        from serve_rft.weights.adapters import AdapterSnapshot, adapter_config_text

        reshard(self.model)
        tensors = {k: _whole(v).detach().to("cpu", copy=True).contiguous()
                   for k, v in get_peft_model_state_dict(self.model).items()}
        return AdapterSnapshot(tensors, adapter_config_text(self.model)) if self.rank == 0 else None

    def reset_to(self, handle: dict, version: int) -> float | None:
        """Take the weights behind version ``version``'s published ``handle``
        (``synchronizer.canary.on_reject=reset`` after a rolled-back candidate): full fine-tuning
        loads the version's tensors (CHECKPOINT folder, MEMORY buckets, or the initial model
        directory), adapter-only LoRA its adapter (the initial weights: a zero adapter). AdamW's
        moments are cleared; the LR schedule, the step count and the entropy control go on.

        Returns:
            The largest |difference| between the probe logprobs of the weights now held and the
            ones the handle carries (the same check a replica makes before serving,
            `serve_rft.weights.verify.check_probe`; version 0: the probe this trainer took of the
            initial weights at start), or None when there is no probe to compare with (version 0
            after a resume).

        Raises:
            ValueError: a handle this trainer cannot take (merged LoRA publishes full weights).
            ProbeMismatch: the weights now held are not the version's (beyond 1e-5).
        """
        from serve_rft.trainer.policy.reset import load_handle

        load_handle(self.model, handle, self.cfg.lora, self.rank, self.world)
        self.optimizer.state.clear()
        expected = handle.get("probe") or (self.initial_probe if version == 0 else None)
        if not expected:
            return None
        from serve_rft.weights.verify import check_probe

        got = self.probe(self.publish_model(), version)["logprobs"]
        return check_probe(expected, got, tolerance=1e-5)

    def publish_model(self):
        """What a publish carries: `full_model`, or with adapter-only LoRA sync
        (``lora.merge_and_sync=false``) the `peft.PeftModel`, whose adapter alone the sync
        methods move."""
        if self.cfg.lora is not None and not self.cfg.lora.merge_and_sync:
            return self.model
        return self.full_model()

    def probe(self, model, version: int) -> dict[str, list]:
        """The probe a published handle carries (`serve_rft.trainer.policy.token_logprobs.trainer_probe`) of
        ``model``, what `publish_model` returned for this publish."""
        from serve_rft.trainer.policy.token_logprobs import trainer_probe
        from serve_rft.trainer.policy.gathered import GatheredModel
        from serve_rft.trainer.sharding.fsdp import reshard

        if isinstance(model, GatheredModel):  # streamed LoRA merge: the adapted model computes the same policy
            model = self.model
        try:
            return trainer_probe(model, version)
        finally:
            reshard(self.model)

    def save(self, root: Path, model, version: int, step: int, trained: list[tuple[str, str, int]],
             tokenizer_dir: str, keep: int, published: list[int]) -> Path:
        """Save the trainer state of ``version`` under ``root`` (`serve_rft.trainer.publishing.state.save_state`):
        ``model`` is what was just published (adapter-only LoRA published the adapter: the state
        holds the merged weights and the adapter)."""
        from serve_rft.trainer.publishing.state import save_state
        from serve_rft.weights.adapters import is_adapter_model

        full = self.full_model() if is_adapter_model(model) else model
        return save_state(root, full, self.optimizer, version, step, self.baseline.value, trained, tokenizer_dir,
                          keep, self.scheduler, self.model if self.merged is not None else None, published)

    def save_shards(self, folder: Path) -> None:
        """A sharded rank's part of a trainer state (a collective): its AdamW shards and RNG;
        rank 0 also the LR schedule (the same on every rank) and, with LoRA, the adapter."""
        import torch

        from serve_rft.trainer.publishing.state import save_optimizer_shards

        save_optimizer_shards(folder, self.model, self.optimizer)
        if self.cfg.lora is not None:  # resume loads the adapter over the base
            from serve_rft.trainer.policy.lora import ADAPTER_DIR

            snapshot = self.adapter_snapshot()
            if snapshot is not None:
                snapshot.save_pretrained(Path(folder) / ADAPTER_DIR)
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), Path(folder) / "scheduler.pt")

    def _lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step``: linear warm-up, then constant or
        cosine decay to ``lr_min_ratio``."""
        c = self.cfg
        if step < c.lr_warmup_steps:
            return (step + 1) / c.lr_warmup_steps
        if c.lr_schedule == "constant":
            return 1.0
        t = min(1.0, (step - c.lr_warmup_steps) / c.lr_decay_steps)
        return c.lr_min_ratio + (1 - c.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    def step(self, batch: list[RewardedExperience], held_version: int | None = None,
             version_lags: dict[int, int] | None = None) -> dict[str, float]:
        """One optimizer step on ``batch`` (``trainer.algorithm``), in micro-batches whose summed
        gradient equals the whole batch's: at most ``micro_batch_size`` experiences and (when
        set) ``micro_batch_tokens`` padded tokens each (`serve_rft.trainer.policy.micro_batches.partition`;
        with a token budget the experiences are regrouped longest first). Advantages and OPMD's
        ``tau log Z`` are computed on the whole batch first, in batch order, and follow their
        experiences into the micro-batches.

        Args:
            batch: the rewarded experiences of the step.
            held_version: the policy version whose weights this trainer holds (it published,
                resumed or reset after its last step), or None: its tokens' logprob differences
                are reported as trainer-vs-inference mismatch, every other token's as drift
                (staleness).
            version_lags: ``{policy version: sync cycles behind the trainer}`` of the batch's
                token versions (the clip fraction per lag bucket), or None (no buckets).

        Returns:
            loss, reward / advantage / ratio / clip / entropy / KL statistics (the unsplit
            batch's, `serve_rft.trainer.policy.micro_batches.accumulate`), the learning rate,
            ``entropy_coef`` (the entropy bonus's coefficient the step applied,
            `serve_rft.trainer.policy.entropy_control.EntropyControl`),
            ``max_abs_logprob_diff`` (trainer vs behaviour logprobs), ``micro_batches`` (the
            number of parts), ``zero_variance_filtered`` (experiences left out of the loss by
            ``trainer.filter_zero_variance``; ``batch_size``, ``tokens`` and ``reward_mean``
            count them, the loss's statistics and ``adv_abs_mean`` do not), seconds. A step that
            would apply a non-finite update is skipped
            (`serve_rft.trainer.policy.finite.skip_reason`; with ``grad_norm_spike`` also a
            gradient-norm spike, `serve_rft.trainer.policy.finite.GradNormGuard`: weights, AdamW
            state, LR schedule, running baseline and entropy control unchanged): then only
            ``skipped`` (why), ``loss``, ``grad_norm``, ``batch_size`` and seconds.
        Raises:
            NonFiniteState: the update left a weight or AdamW state non-finite (the process
                must not go on from them).
        """
        import torch

        from serve_rft.trainer.policy.finite import skip_reason
        from serve_rft.trainer.policy.micro_batches import accumulate, finish, partition
        from serve_rft.trainer.sharding.fsdp import all_ranks_partials, merge_ranks, my_parts

        t0 = time.perf_counter()
        c = self.cfg
        exps = [b.experience for b in batch]
        rewards = all_rewards = [b.reward for b in batch]
        n_tokens = all_tokens = float(sum(len(e.response_token_ids) for e in exps))
        baseline_before = (self.baseline.value, self.baseline.var)  # a skipped step leaves it as it was
        made = self.algorithm.advantages(batch, self.baseline)
        adv = made.values.to(self.device)
        tlz = self.algorithm.batch_values(batch)
        tlz = tlz.to(self.device) if tlz is not None else None
        kept = [i for i, zero in enumerate(made.zero_variance) if not zero] if c.filter_zero_variance else []
        filtered = len(batch) - len(kept) if kept else 0  # a batch with nothing else trains whole
        if filtered:
            idx = torch.tensor(kept, dtype=torch.long)
            exps, rewards = [exps[i] for i in kept], [rewards[i] for i in kept]
            adv, tlz = adv[idx.to(adv.device)], tlz[idx.to(tlz.device)] if tlz is not None else None
            n_tokens = float(sum(len(e.response_token_ids) for e in exps))
        n_seqs = float(len(exps))
        parts = partition([len(e.prompt_token_ids) + len(e.response_token_ids) for e in exps],
                          c.micro_batch_size, c.micro_batch_tokens)
        self.optimizer.zero_grad(set_to_none=True)
        bonus = self.entropy_control.coef()  # one coefficient for every micro-batch and rank
        totals: dict[str, float] = {}
        for part, counts in my_parts(parts, self.rank, self.world):  # all parts when world == 1
            idx = torch.tensor(part, dtype=torch.long, device=self.device)
            loss, stats, tokens = self._micro_step([exps[i] for i in part], adv[idx], [rewards[i] for i in part],
                                                   tlz[idx] if tlz is not None else None, n_tokens, n_seqs,
                                                   held_version, version_lags, bonus)
            if not counts:  # a filler: the same collectives as the other ranks, no gradient
                (loss * 0.0).backward()
                continue
            (loss * self.world).backward()  # FSDP averages the ranks' gradients: x world gives their sum
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
            accumulate(totals, stats, tokens, len(part), n_tokens, n_seqs)
        totals = finish(merge_ranks(all_ranks_partials(totals, self.world)))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # sharded: the norm over every rank's shards
            grad_norm = grad_norm.full_tensor()
        lr = self.optimizer.param_groups[0]["lr"]
        why = skip_reason(adv, totals.get("loss", 0.0), float(grad_norm))  # the same on every rank
        why = why or self.spikes.reason(float(grad_norm))
        if why is not None:
            self.optimizer.zero_grad(set_to_none=True)
            self.baseline.value, self.baseline.var = baseline_before
            return {"skipped": why, "loss": totals.get("loss", 0.0), "grad_norm": float(grad_norm),
                    "batch_size": len(batch), "step_seconds": time.perf_counter() - t0}
        self.optimizer.step()
        self.scheduler.step()
        self.check_finite()
        self.entropy_control.update(totals.get("entropy", math.nan))
        totals.update(grad_norm=float(grad_norm), lr=lr, entropy_coef=bonus,
                      reward_mean=sum(all_rewards) / len(all_rewards),
                      adv_abs_mean=float(adv.abs().mean()), groups=made.groups,
                      zero_variance_groups=made.zero_variance_groups, zero_variance_filtered=filtered,
                      batch_size=len(batch), tokens=all_tokens,
                      micro_batches=len(parts), step_seconds=time.perf_counter() - t0)
        return totals

    def check_finite(self) -> None:
        """Raise unless every weight and AdamW state tensor is finite (on N ranks a collective);
        after each update and before a publish or a save (`serve_rft.trainer.policy.finite`).

        Raises:
            NonFiniteState: some are not.
        """
        from serve_rft.trainer.policy.finite import check_finite

        check_finite(self.model, self.optimizer, self.world)

    def _autocast(self):
        """bf16 autocast for forward passes (``trainer.precision``: bf16, or auto on CUDA); the
        weights, the optimizer and the logits' log-softmax stay fp32. In one process the bf16
        weight copies a backward needs are cast again then, not held from the forward
        (`serve_rft.trainer.policy.precision.bf16_autocast`); FSDP2 ranks use plain autocast."""
        from serve_rft.trainer.policy.precision import bf16_autocast

        return bf16_autocast(self.device.type, enabled=self.bf16, recast=self.recast_bf16)

    def _micro_step(self, exps, adv, rewards, tlz, n_tokens: float, n_seqs: float, held_version: int | None = None,
                    version_lags: dict[int, int] | None = None, entropy_coef: float | None = None):
        """Loss of one micro-batch of this policy (`serve_rft.trainer.policy.objective.micro_batch_loss`)."""
        from serve_rft.trainer.policy.objective import micro_batch_loss

        return micro_batch_loss(self.cfg, self.algorithm, self.model, self.ref_model, self.pad_id, self._autocast, exps, adv,
                                rewards, tlz, n_tokens, n_seqs, held_version,
                                version_lags, entropy_coef)

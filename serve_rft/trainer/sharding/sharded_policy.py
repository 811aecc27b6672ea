"""The trainer actor's policy when it trains on N ranks (``trainer.num_workers > 1``).

`ShardedPolicy` gives the trainer actor (`serve_rft.trainer.actor.Trainer`) what
`serve_rft.trainer.policy.policy.PolicyTrainer` gives it: ``step``, ``check_finite``, ``publish_model``,
``probe``, ``save``, ``resumed``, ``vocab_size``. Behind it a `serve_rft.trainer.sharding.worker_group.WorkerGroup`
of FSDP2 ranks trains (`serve_rft.trainer.sharding.fsdp`); the actor itself holds no weights:

- a publish is a `serve_rft.trainer.policy.gathered.GatheredModel`: the sync method (CHECKPOINT
  writes a folder, MEMORY puts buckets) pulls the full weights one bucket at a time;
- the probe replicas verify against is a collective forward of the sharded model;
- a canary reset (``canary.on_reject=reset``) loads the version's weights into the ranks;
- a trainer state is the gathered weights (a Hugging Face directory, as one process saves it),
  the AdamW shards of every rank (torch.distributed.checkpoint), the ranks' RNG and the LR
  schedule, committed atomically with the bookkeeping (`serve_rft.trainer.publishing.state`).

Faults: if a rank dies, the group's next call raises; the trainer process exits, its ranks
(actors it owns) end with it, and Ray restarts the trainer, which builds a new group from the
newest state: exactly-once acknowledgement is the single-process rule unchanged (entries are
acknowledged only once a saved state covers them).
"""

from __future__ import annotations

from pathlib import Path

from serve_rft.config import Config
from serve_rft.types import RewardedExperience


class ShardedPolicy:
    """N FSDP2 ranks behind `PolicyTrainer`'s interface (module docstring).

    Args:
        cfg: the run config (``trainer.num_workers`` ranks).
        model_path: the initial model directory.
        resume: the newest trainer state folder, or None.
    Raises:
        ray.exceptions.RayActorError: a rank died while starting.
    """

    def __init__(self, cfg: Config, model_path: str, resume: Path | None = None):
        from serve_rft.trainer.publishing.state import read_state
        from serve_rft.trainer.sharding.worker_group import WorkerGroup

        self.cfg = cfg
        self.model_path = model_path
        self.group = WorkerGroup(cfg, model_path, cfg.trainer.num_workers, str(resume) if resume else None)
        try:
            info = self.group.call("info")
        except BaseException:
            self.group.stop()
            raise
        self.specs, self.config, self.vocab_size = info["specs"], info["config"], info["vocab_size"]
        self.resumed = read_state(resume) if resume is not None else None

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, rank 0 first."""
        return list(self.group.pids)

    def step(self, batch: list[RewardedExperience], held_version: int | None = None,
             version_lags: dict[int, int] | None = None) -> dict[str, float]:
        """`PolicyTrainer.step` over the ranks (the same figures as one process's step)."""
        return self.group.step(batch, held_version, version_lags)

    def check_finite(self) -> None:
        """`PolicyTrainer.check_finite` on every rank's shards.

        Raises:
            ray.exceptions.RayTaskError: wrapping `serve_rft.trainer.policy.finite.NonFiniteState`.
        """
        self.group.call("check_finite")

    def full_model(self):
        """The full weights as a `GatheredModel` (gathered bucket by bucket when read; with LoRA
        the merged weights, `serve_rft.trainer.policy.lora.MergedWeights`)."""
        from serve_rft.trainer.policy.gathered import GatheredModel

        return GatheredModel(lambda names: self.group.call("gather", names), self.specs, self.config,
                             self.cfg.synchronizer.bucket_bytes, self.model_path)

    def publish_model(self):
        """What a publish carries: `full_model`, or with adapter-only LoRA sync
        (``lora.merge_and_sync=false``) the adapter gathered whole
        (`serve_rft.weights.adapters.AdapterSnapshot`)."""
        lora = self.cfg.trainer.lora
        if lora is not None and not lora.merge_and_sync:
            return self.group.call("adapter_snapshot")
        return self.full_model()

    def probe(self, model, version: int) -> dict[str, list]:
        """The probe of the weights just published (a forward on the ranks; ``model`` unused)."""
        return self.group.call("probe", version)

    def save(self, root: Path, model, version: int, step: int, trained: list[tuple[str, str, int]],
             tokenizer_dir: str, keep: int, published: list[int]) -> Path:
        """Save the trainer state of ``version`` (module docstring); ``model``: what was just
        published (a `GatheredModel` gathers again as it writes; after an adapter-only publish the
        state holds the merged weights, and the adapter the ranks write)."""
        from serve_rft.trainer.publishing.state import save_state
        from serve_rft.weights.adapters import is_adapter_model

        full = self.full_model() if is_adapter_model(model) else model
        return save_state(root, full, None, version, step, self.group.call("baseline"), trained, tokenizer_dir,
                          keep, published=published, shards=self._save_shards)

    def _save_shards(self, folder: Path) -> None:
        """Every rank writes its part into ``folder`` (an absolute path: the ranks' working
        directories are Ray's); then check here that all of it is visible before the folder is
        committed.

        Raises:
            RuntimeError: a rank's files are not in ``folder`` as this process sees it (ranks on
                another node need ``service.run_dir`` on a filesystem every trainer node mounts).
        """
        from serve_rft.trainer.publishing.state import OPTIMIZER_DCP

        folder = Path(folder).resolve()
        self.group.call("save_shards", str(folder))
        want = [f"{OPTIMIZER_DCP}/.metadata", "scheduler.pt",
                *(f"rng-rank{r}.pt" for r in range(self.cfg.trainer.num_workers))]
        if self.cfg.trainer.lora is not None:
            from serve_rft.trainer.policy.lora import ADAPTER_DIR

            want.append(f"{ADAPTER_DIR}/adapter_model.safetensors")
        missing = [f for f in want if not (folder / f).is_file()]
        if missing:
            raise RuntimeError(f"trainer state {folder}: {missing} written by the ranks are not visible to the "
                               "trainer; service.run_dir must be a filesystem every trainer node mounts")

    def reset_to(self, handle: dict, version: int) -> float | None:
        """`PolicyTrainer.reset_to` on the ranks: rank 0 reads the tensors behind version
        ``version``'s ``handle`` (CHECKPOINT folder, MEMORY buckets, the initial model directory),
        each rank keeps its shards, AdamW's moments are cleared; then the probe check.

        Returns:
            The probe's largest |difference| (None: nothing to compare with).
        Raises:
            ProbeMismatch: the weights now held are not the version's (beyond 1e-5).
            ValueError: a handle the ranks cannot take.
        """
        return self.group.call("reset_to", handle, version)

    def stop(self) -> None:
        """End the ranks."""
        self.group.stop()

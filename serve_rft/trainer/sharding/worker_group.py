"""A data-parallel group of trainer ranks on Ray: N `TrainRank` actors, each one `PolicyTrainer`
rank with its FSDP2 shard of the policy (`serve_rft.trainer.sharding.fsdp`).

This is what Ray Train's worker group does for a ``TorchTrainer`` (placement, a
``torch.distributed`` rendezvous, one process per rank), kept as long-lived actors that a caller
drives step by step: a serving system's trainer receives batches as rewards arrive rather than
running one training function to completion. Rank 0 chooses the rendezvous address (its node's
IP and a free port); the others join it; every call goes to all ranks at once (each is a
collective).
"""

from __future__ import annotations

import ray

from serve_rft.config import Config
from serve_rft.types import RewardedExperience


START_TIMEOUT_S = 900.0
"""Seconds a group may take to be placed and to load (then the trainer reports the failure)."""


@ray.remote(num_cpus=1, max_restarts=0)
class TrainRank:
    """One rank: joins the group, then builds its `PolicyTrainer` shard."""

    def __init__(self, cfg_json: str, model_path: str, rank: int, world: int):
        self.cfg = Config.model_validate_json(cfg_json)
        self.model_path, self.rank, self.world = model_path, rank, world
        self.policy = None

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's node IP and a port free there (the group's TCP rendezvous)."""
        from serve_rft.buffer.redis_server import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def start(self, address: str, port: int, resume: str | None = None) -> int:
        """Join the group (blocks until every rank joined) and load this rank's shard: from
        the model directory, or from the trainer state folder ``resume`` (weights, then this
        rank's AdamW shards, LR schedule and RNG; `serve_rft.trainer.publishing.state.load_state`).

        Returns:
            This process's id.
        """
        import os

        import torch

        from serve_rft.trainer.policy.policy import PolicyTrainer
        from serve_rft.trainer.sharding.fsdp import init_process_group

        backend = "nccl" if self.cfg.trainer.device == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray gives each rank its own GPU as device 0
        init_process_group(self.rank, self.world, address, port, backend)
        self.policy = PolicyTrainer(self.cfg, self.model_path, resume, rank=self.rank, world=self.world)
        return os.getpid()

    def info(self) -> dict:
        """``specs``: ``(name, whole shape, dtype name)`` per weight a full publish carries
        (`PolicyTrainer.export_specs`), ``config``: the transformers config it is saved with,
        ``vocab_size``."""
        return {"specs": self.policy.export_specs(), "config": self.policy.export_config(),
                "vocab_size": self.policy.vocab_size}

    def gather(self, names: list[str]) -> dict | None:
        """The whole tensors of the weights ``names`` (`PolicyTrainer.gather_weights`: a
        collective, every rank gathers the same names in the same order); rank 0 returns them on
        CPU, the others None."""
        out = self.policy.gather_weights(names)
        return out if self.rank == 0 else None

    def adapter_snapshot(self):
        """`PolicyTrainer.adapter_snapshot` (a collective): rank 0's, the others None."""
        return self.policy.adapter_snapshot()

    def probe(self, version: int) -> dict:
        """`PolicyTrainer.probe` of the sharded model (a collective forward)."""
        return self.policy.probe(self.policy.model, version)

    def reset_to(self, handle: dict, version: int) -> float | None:
        """`PolicyTrainer.reset_to` on this rank (a collective: rank 0 reads the handle's tensors,
        every rank keeps its shards and clears its AdamW moments)."""
        return self.policy.reset_to(handle, version)

    def optimizer_state_size(self) -> int:
        """How many parameters have AdamW moments on this rank (0 right after a reset)."""
        return len(self.policy.optimizer.state)

    def save_shards(self, folder: str) -> None:
        """`PolicyTrainer.save_shards` into ``folder`` (a collective)."""
        self.policy.save_shards(folder)

    def baseline(self) -> float | None:
        """The running reward baseline (the same on every rank: each sees the whole batch)."""
        return self.policy.baseline.value

    def step(self, batch: list[RewardedExperience], held_version: int | None = None,
             version_lags: dict[int, int] | None = None) -> dict[str, float]:
        """`PolicyTrainer.step` on this rank's micro-batches; every rank returns the merged figures
        (and every rank skips a non-finite update, or none does)."""
        return self.policy.step(batch, held_version, version_lags)

    def check_finite(self) -> None:
        """`PolicyTrainer.check_finite` over this rank's shards (a collective)."""
        self.policy.check_finite()

    def full_tensors(self, which: str) -> dict | None:
        """Every parameter (``which="params"``) or gradient (``"grads"``) gathered whole, by
        name; a collective. Returns the dict on rank 0, None elsewhere. For tests and checks:
        it holds a whole copy of the model on rank 0."""
        out = {}
        for name, p in self.policy.model.named_parameters():
            t = p if which == "params" else p.grad
            if t is None:
                continue
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            if self.rank == 0:
                out[name] = full.detach().clone()
        return out if self.rank == 0 else None


class WorkerGroup:
    """N `TrainRank` actors stepping together.

    Args:
        cfg: the run config (``trainer.device`` picks gloo or NCCL).
        model_path: the initial weights, read by every rank.
        world: the number of ranks (each takes one CPU; with ``device=cuda`` one GPU).
        resume: a trainer state folder to start from (`TrainRank.start`).
        start_timeout_s: for placing the ranks (CPUs / GPUs with the trainer's labels) and loading.
    Raises:
        ray.exceptions.RayActorError: a rank died while starting.
        ray.exceptions.GetTimeoutError: not started within ``start_timeout_s`` (no room for N ranks).
    """

    def __init__(self, cfg: Config, model_path: str, world: int, resume: str | None = None,
                 start_timeout_s: float = START_TIMEOUT_S):
        opts = {"num_gpus": 1 if cfg.trainer.device == "cuda" else 0}  # NCCL: one whole GPU per rank
        if cfg.trainer.label_selector:
            opts["label_selector"] = dict(cfg.trainer.label_selector)
        cfg_json = cfg.model_dump_json()
        self.ranks = [TrainRank.options(**opts).remote(cfg_json, model_path, r, world) for r in range(world)]
        try:
            address, port = ray.get(self.ranks[0].rendezvous_address.remote(), timeout=start_timeout_s)
            self.pids = ray.get([r.start.remote(address, port, resume) for r in self.ranks], timeout=start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def call(self, method: str, *args):
        """``method(*args)`` on every rank at once (a collective); rank 0's answer.

        Raises:
            ray.exceptions.RayActorError: a rank died (the caller's process ends; Ray restarts
                the trainer, which rebuilds the group from its last state).
        """
        return ray.get([getattr(r, method).remote(*args) for r in self.ranks])[0]

    def step(self, batch: list[RewardedExperience], held_version: int | None = None,
             version_lags: dict[int, int] | None = None) -> dict[str, float]:
        """One optimizer step over the group (`PolicyTrainer.step`'s figures, the same on every rank)."""
        batch_ref = ray.put(batch)  # once into the object store, not once per rank
        return ray.get([r.step.remote(batch_ref, held_version, version_lags) for r in self.ranks])[0]

    def full_tensors(self, which: str) -> dict:
        """Parameters or gradients gathered whole (`TrainRank.full_tensors`)."""
        return self.call("full_tensors", which)

    def stop(self) -> None:
        """End every rank (by its actor handle)."""
        for r in self.ranks:
            ray.kill(r)

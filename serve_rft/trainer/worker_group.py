"""A data-parallel group of trainer ranks on Ray: N `TrainRank` actors, each one `PolicyTrainer`
rank with its FSDP2 shard of the policy (`serve_rft.trainer.sharding`).

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

    def start(self, address: str, port: int) -> int:
        """Join the group (blocks until every rank joined) and load this rank's shard.

        Returns:
            This process's id.
        """
        import os

        import torch

        from serve_rft.trainer.policy import PolicyTrainer
        from serve_rft.trainer.sharding import init_process_group

        backend = "nccl" if self.cfg.trainer.device == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray gives each rank its own GPU as device 0
        init_process_group(self.rank, self.world, address, port, backend)
        self.policy = PolicyTrainer(self.cfg, self.model_path, rank=self.rank, world=self.world)
        return os.getpid()

    def step(self, batch: list[RewardedExperience]) -> dict[str, float]:
        """`PolicyTrainer.step` on this rank's micro-batches; every rank returns the merged figures."""
        return self.policy.step(batch)

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
    Raises:
        ray.exceptions.RayActorError: a rank died while starting.
    """

    def __init__(self, cfg: Config, model_path: str, world: int):
        gpus = cfg.trainer.num_gpus if cfg.trainer.device == "cuda" else 0
        opts = {"num_gpus": gpus}
        if cfg.trainer.label_selector:
            opts["label_selector"] = dict(cfg.trainer.label_selector)
        cfg_json = cfg.model_dump_json()
        self.ranks = [TrainRank.options(**opts).remote(cfg_json, model_path, r, world) for r in range(world)]
        address, port = ray.get(self.ranks[0].rendezvous_address.remote())
        self.pids = ray.get([r.start.remote(address, port) for r in self.ranks])

    def step(self, batch: list[RewardedExperience]) -> dict[str, float]:
        """One optimizer step over the group (`PolicyTrainer.step`'s figures, the same on every rank)."""
        return ray.get([r.step.remote(batch) for r in self.ranks])[0]

    def full_tensors(self, which: str) -> dict:
        """Parameters or gradients gathered whole (`TrainRank.full_tensors`)."""
        return ray.get([r.full_tensors.remote(which) for r in self.ranks])[0]

    def stop(self) -> None:
        """End every rank (by its actor handle)."""
        for r in self.ranks:
            ray.kill(r)

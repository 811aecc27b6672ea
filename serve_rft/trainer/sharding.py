"""Data-parallel, sharded training: one `PolicyTrainer` per rank, parameters, gradients and AdamW
state sharded with PyTorch FSDP2 (``fully_shard``; gloo on CPU, NCCL on GPU).

The step stays the single-process step (`PolicyTrainer.step`): the batch is partitioned into
micro-batches as before and the parts are dealt round-robin to the ranks. Every micro-batch's
loss is already normalised by the *whole* batch's response tokens / answers, so the batch
gradient is the **sum** of the ranks' gradients, while FSDP's reduce-scatter averages them:
each rank multiplies its loss by the world size before the backward (exact for powers of two;
gloo has no pre-multiplied sum to give FSDP a divide factor of 1). A rank with fewer parts runs
its last part again with its loss multiplied by 0, so every rank makes the same collective calls. The ranks' partial
statistics are exchanged and merged with the single-process rule (`merge_ranks`), so a step's
figures do not depend on the number of ranks; gradient clipping uses the norm over all shards.
"""

from __future__ import annotations

from datetime import timedelta

from serve_rft.trainer.micro_batches import is_max_stat


def init_process_group(rank: int, world: int, address: str, port: int, backend: str,
                       timeout_s: float = 600.0) -> None:
    """Join the training group (``torch.distributed``, TCP rendezvous at ``address:port``).

    Raises:
        RuntimeError / DistStoreError: the rendezvous did not complete within ``timeout_s``.
    """
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def shard(model) -> None:
    """``fully_shard`` each decoder layer, then the whole model (embeddings, final norm, LM head:
    a tied head stays with its embedding), and install the chunked logprob path on it
    (`serve_rft.trainer.token_logprobs.install_sharded_head`).

    Args:
        model: a transformers causal LM with ``model.model.layers`` (Qwen2 / Llama family).
    Raises:
        ValueError: no ``model.model.layers`` to shard by.
    """
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"cannot shard {type(model).__name__}: no model.layers")
    from serve_rft.trainer.token_logprobs import install_sharded_head

    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    install_sharded_head(model)  # the chunked logprob path, run as one of the root's forwards


def reshard(model) -> None:
    """Free the gathered parameters a no-grad forward left on a sharded model: FSDP2 keeps the
    root module's parameters unsharded after a forward (for the backward that usually follows),
    and while they are, the model's registered parameters are not the optimizer's sharded ones
    (torch.distributed.checkpoint then cannot name them). A no-op for an unsharded model."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()


def my_parts(parts: list[list[int]], rank: int, world: int) -> list[tuple[list[int], bool]]:
    """The micro-batches rank ``rank`` runs: ``parts[rank::world]``, padded to ``ceil(len(parts) /
    world)`` with a repeat of its last part (or of part 0) flagged ``False`` (run with a zero loss,
    so the collectives line up). Returns [(indices, counts)]."""
    mine = [(p, True) for p in parts[rank::world]]
    per_rank = -(-len(parts) // world)
    filler = (mine[-1][0] if mine else parts[0], False)
    return mine + [filler] * (per_rank - len(mine))


def merge_ranks(partials: list[dict[str, float]]) -> dict[str, float]:
    """One step's statistics from each rank's partial sums over its micro-batches
    (`serve_rft.trainer.micro_batches.accumulate`): maxima (``*_max``, ``max_*``) by max,
    everything else (weighted means, the loss) by sum, as `accumulate` merges parts."""
    out: dict[str, float] = {}
    for t in partials:
        for k, v in t.items():
            if is_max_stat(k):
                out[k] = max(out.get(k, v), v)
            else:
                out[k] = out.get(k, 0.0) + v
    return out


def all_ranks_partials(partial: dict[str, float], world: int) -> list[dict[str, float]]:
    """Every rank's ``partial`` over the default process group (a collective: every rank calls
    it); ``[partial]`` when ``world`` is 1, whatever process group this process may belong to."""
    import torch.distributed as dist

    if world == 1:
        return [partial]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, partial)
    return out

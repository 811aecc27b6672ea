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

from serve_rft.trainer.policy.micro_batches import is_max_stat


def init_process_group(rank: int, world: int, address: str, port: int, backend: str,
                       timeout_s: float = 600.0) -> None:
    """Join the training group (``torch.distributed``, TCP rendezvous at ``address:port``).

    Raises:
        RuntimeError / DistStoreError: the rendezvous did not complete within ``timeout_s``.
    """
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def fsdp_root(model):
    """The module `shard` makes the FSDP2 root: the transformers model itself, or the one a peft
    adapter (injected in place into its layers) wraps."""
    return model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model


def shard(model) -> None:
    """``fully_shard`` each decoder layer, then the whole model (embeddings, final norm, LM head:
    a tied head stays with its embedding), and install the chunked logprob path on it
    (`serve_rft.trainer.policy.token_logprobs.install_sharded_head`). A peft model is sharded through
    the transformers model it wraps (`fsdp_root`): its LoRA weights sit in the layers, sharded
    with them (FSDP2 needs one dtype among a layer's *trainable* parameters only, so a bf16 frozen
    base with fp32 adapters shards).

    Args:
        model: a transformers causal LM with ``model.model.layers`` (Qwen2 / Llama family), or a
            `peft.PeftModel` of one.
    Raises:
        ValueError: no ``model.model.layers`` to shard by.
    """
    from torch.distributed.fsdp import fully_shard

    root = fsdp_root(model)
    layers = getattr(getattr(root, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"cannot shard {type(root).__name__}: no model.layers")
    from serve_rft.trainer.policy.token_logprobs import install_sharded_head

    for layer in layers:
        fully_shard(layer)
    fully_shard(root)
    install_sharded_head(root)  # the chunked logprob path, run as one of the root's forwards


def reshard(model) -> None:
    """Free the gathered parameters a no-grad forward left on a sharded model: FSDP2 keeps the
    root module's parameters unsharded after a forward (for the backward that usually follows),
    and while they are, the model's registered parameters are not the optimizer's sharded ones
    (torch.distributed.checkpoint then cannot name them). A no-op for an unsharded model."""
    from torch.distributed.fsdp import FSDPModule

    root = fsdp_root(model)
    if isinstance(root, FSDPModule):
        root.reshard()


def pretrained(path: str, dtype=None):
    """A builder for `load_sharded`: ``build(real)`` is the causal LM at ``path`` (``real``:
    its weights, ``from_pretrained`` on the CPU; else its architecture alone, ``from_config``,
    for the meta device). ``dtype``: the parameters' (default fp32, the master weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = dtype or torch.float32

    def build(real: bool):
        if real:
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    return build


def load_sharded(build, device, rank: int):
    """The model ``build`` makes, sharded with FSDP2 (`shard`) without a whole copy on any rank
    but rank 0, and there only on the CPU while the shards are handed out.

    Every rank builds the model on the meta device (``build(False)``: no memory), shards it and
    allocates its own shards on ``device`` (``to_empty``). Rank 0 alone builds it for real
    (``build(True)``: the weights read, an adapter loaded) and the tensors are broadcast one at a
    time, each rank keeping its shard (`load_full`: a rank holds its shards plus one full
    tensor at most). Buffers FSDP does not shard, including the non-persistent ones a state
    dict leaves out (rotary ``inv_freq``), are copied from rank 0's model and broadcast. A
    collective: every rank of the group calls it.

    Args:
        build: ``build(real: bool) -> model`` (`pretrained`, or a peft model of one); both
            calls must make the same architecture (parameter names, shapes, dtypes).
        device: where the shards live (``torch.device``: CPU under gloo, the rank's GPU under NCCL).
        rank: this process's rank in the default process group.
    Raises:
        OSError / ValueError: what ``build`` raises (a path that is no loadable model).
    """
    import torch
    import torch.distributed as dist

    with torch.device("meta"):
        model = build(False)
    shard(model)
    root = fsdp_root(model)
    root.to_empty(device=device)
    full = on_rank0(lambda: fsdp_root(build(True)), rank)  # every rank raises if rank 0's build failed
    load_full(root, (lambda: unique_tensors(full.state_dict())) if full is not None else None, rank)
    with torch.no_grad():
        for name, buffer in root.named_buffers():
            if full is not None:
                buffer.copy_(full.get_buffer(name))
            dist.broadcast(buffer, src=0)
    del full
    return model


def on_rank0(work, rank: int):
    """``work()`` on rank 0, and its failure on every rank: rank 0's exception (its type and
    message) is broadcast, and every rank raises, so no rank goes on into a collective the others
    left. A collective.

    Returns:
        ``work()``'s value on rank 0, None on the others.
    Raises:
        What ``work`` raised (rank 0), or RuntimeError naming it (the other ranks).
    """
    import torch.distributed as dist

    value, error = None, None
    if rank == 0:
        try:
            value = work()
        except Exception as e:  # re-raised below, on every rank
            error = e
    box = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0] is not None:
        raise RuntimeError(f"rank 0 failed: {box[0]}")
    return value


def unique_tensors(state: dict) -> dict:
    """``state`` without the names of a tensor seen under an earlier name (a tied ``lm_head``
    is the embedding): each tensor broadcast once."""
    seen, out = set(), {}
    for name, t in state.items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    return out


def load_full(model, read, rank: int, partial: bool = False) -> None:
    """Load full tensors read on rank 0 into a sharded ``model``: broadcast one tensor at a time,
    each rank keeping its shard (``set_model_state_dict``, ``broadcast_from_rank0``). A collective.
    Rank 0 reads the tensors and checks their names against the model's before anything is
    loaded (`on_rank0`): a failed read or tensors that do not fit raise on every rank and change
    nothing.

    Args:
        model: the FSDP2-sharded model (`shard`; a peft model loads through `fsdp_root`, under
            its state dict's names).
        read: on rank 0, ``read() -> {name: full tensor}`` (a tied ``lm_head.weight`` may be
            left out); None on the other ranks.
        rank: this process's rank.
        partial: the tensors are some of the model's (an adapter's): only names the model
            lacks are an error.
    Raises:
        ValueError: the tensors do not fit the model; what ``read`` raised (every rank raises).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from serve_rft.trainer.policy.handles import check_fits

    root = fsdp_root(model)

    def checked() -> dict:
        tensors = read()
        names = set(root.state_dict())  # the sharded state dict: names only, nothing gathered
        check_fits([] if partial else sorted(names - tensors.keys()), sorted(tensors.keys() - names))
        return tensors
    tensors = on_rank0(checked, rank)
    set_model_state_dict(root, tensors if tensors is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False))


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
    (`serve_rft.trainer.policy.micro_batches.accumulate`): maxima (``*_max``, ``max_*``) by max,
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

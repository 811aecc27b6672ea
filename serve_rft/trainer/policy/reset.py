"""A published version's weights back into the trainer's model, for a trainer that takes a
version back (``synchronizer.canary.on_reject=reset``,
`serve_rft.trainer.policy.policy.PolicyTrainer.reset_to`); the tensors come from
`serve_rft.trainer.policy.handles`."""

from __future__ import annotations

from serve_rft.trainer.policy.handles import check_fits, handle_tensors


def load_handle(model, handle: dict, lora_cfg, rank: int = 0, world: int = 1) -> None:
    """Load the tensors behind ``handle`` into ``model`` (`handle_tensors`): full fine-tuning its
    whole state dict, adapter-only LoRA its adapter (a handle without one, the initial weights:
    every ``lora_B`` zeroed). On ``world > 1`` ranks a collective: rank 0 reads the tensors and
    each rank keeps its shards (`serve_rft.trainer.sharding.fsdp.load_full`).

    Args:
        model: the policy (transformers or peft, possibly FSDP2-sharded).
        handle: a published version's handle (CHECKPOINT or MEMORY).
        lora_cfg: ``trainer.lora`` (None: full fine-tuning).
        rank, world: this process's rank and the number of ranks.
    Raises:
        ValueError: merged LoRA sync (its publishes lose the adapter), a handle of a method that
            keeps no tensors, or tensors that do not fit the model (`check_fits`).
    """
    import torch

    lora = lora_cfg is not None
    if lora and lora_cfg.merge_and_sync:
        raise ValueError("reset needs adapter-only LoRA sync (merged publishes lose the adapter)")
    if lora and not handle.get("adapter"):  # the initial weights: the adapter's B = 0
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.zero_()
        return
    if world > 1:
        from serve_rft.trainer.policy.lora import root_adapter_names
        from serve_rft.trainer.sharding.fsdp import load_full

        def read() -> dict:  # rank 0; an adapter's peft checkpoint names -> the sharded root's
            tensors = handle_tensors(handle)
            return root_adapter_names(tensors) if lora else tensors
        load_full(model, read if rank == 0 else None, rank, partial=lora)
        return
    tensors = handle_tensors(handle)
    with torch.no_grad():
        if lora:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model, tensors)
        else:
            missing, unexpected = model.load_state_dict(tensors, strict=False)
            check_fits(missing, unexpected)

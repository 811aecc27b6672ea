"""LoRA adapters as the sync methods move them (adapter-only sync, Twinkle's CheckpointEngine
documentation ``merge_and_sync=False``): the tensors and config of a `peft.PeftModel`'s adapter,
and the folder vLLM's LoRA loader reads. Training adapters is `serve_rft.trainer.lora`.
"""

from __future__ import annotations

from pathlib import Path

import torch


def is_adapter_model(model) -> bool:
    """True for a `peft.PeftModel`: publishing it syncs only its adapter (``merge_and_sync=false``)."""
    return hasattr(model, "peft_config")


def adapter_tensors(peft_model) -> tuple[dict[str, torch.Tensor], str]:
    """The adapter as ``save_pretrained`` writes it: its tensors (peft's checkpoint names, CPU,
    contiguous) and the text of its ``adapter_config.json``."""
    import tempfile

    from peft import get_peft_model_state_dict

    tensors = {k: v.detach().to("cpu", copy=True).contiguous()
               for k, v in get_peft_model_state_dict(peft_model).items()}
    with tempfile.TemporaryDirectory() as d:  # peft's own serialisation of its config
        peft_model.peft_config["default"].save_pretrained(d)
        config = (Path(d) / "adapter_config.json").read_text()
    return tensors, config


def write_adapter(folder: str | Path, tensors: dict[str, torch.Tensor], config: str) -> Path:
    """Write an adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``) that
    vLLM's LoRA loader and `peft.PeftModel.from_pretrained` read."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(config)
    return folder

"""LoRA adapters as the sync methods move them (adapter-only sync, Twinkle's CheckpointEngine
documentation ``merge_and_sync=False``): the tensors and config of a `peft.PeftModel`'s adapter,
and the folder vLLM's LoRA loader reads. Training adapters is `serve_rft.trainer.policy.lora`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


def is_adapter_model(model) -> bool:
    """True for a `peft.PeftModel`: publishing it syncs only its adapter (``merge_and_sync=false``)."""
    return hasattr(model, "peft_config")


@dataclass
class AdapterSnapshot:
    """A LoRA adapter gathered whole from sharded trainer ranks: published like a
    `peft.PeftModel` with adapter-only sync (`is_adapter_model`, `adapter_tensors`,
    ``save_pretrained``), without the model.

    Attributes:
        tensors: peft's checkpoint names -> CPU tensors (what ``save_pretrained`` writes).
        config: the text of its ``adapter_config.json``.
    """

    tensors: dict[str, torch.Tensor]
    config: str

    @property
    def peft_config(self) -> dict[str, str]:
        return {"default": self.config}

    def save_pretrained(self, path: str | Path, safe_serialization: bool = True) -> None:
        """Write the adapter folder (`write_adapter`)."""
        write_adapter(path, self.tensors, self.config)


def adapter_config_text(peft_model) -> str:
    """The text of ``peft_model``'s ``adapter_config.json`` (peft's own serialisation)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        peft_model.peft_config["default"].save_pretrained(d)
        return (Path(d) / "adapter_config.json").read_text()


def adapter_tensors(peft_model) -> tuple[dict[str, torch.Tensor], str]:
    """The adapter as ``save_pretrained`` writes it: its tensors (peft's checkpoint names, CPU,
    contiguous) and the text of its ``adapter_config.json``. ``peft_model``: a `peft.PeftModel`
    or an `AdapterSnapshot`."""
    from peft import get_peft_model_state_dict

    if isinstance(peft_model, AdapterSnapshot):
        return dict(peft_model.tensors), peft_model.config
    tensors = {k: v.detach().to("cpu", copy=True).contiguous()
               for k, v in get_peft_model_state_dict(peft_model).items()}
    return tensors, adapter_config_text(peft_model)


def write_adapter(folder: str | Path, tensors: dict[str, torch.Tensor], config: str) -> Path:
    """Write an adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``) that
    vLLM's LoRA loader and `peft.PeftModel.from_pretrained` read."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(config)
    return folder

"""LoRA adapters for the trainer (peft), synced as merged full weights (Twinkle's CheckpointEngine documentation,
``merge_and_sync=True``: "the LoRA is merged into the base model and then synchronized") or as
the adapter alone (``merge_and_sync=False``: replicas serve it with vLLM's LoRA support).

The trainer trains a `peft.PeftModel` whose frozen base is held in the compute dtype (bf16
with ``trainer.precision`` bf16, fp32 otherwise) and whose adapter is fp32 (peft's
``autocast_adapter_dtype``). A publish streams the effective weights ``W + delta_W`` (delta from
peft's own ``get_delta_weight``: ``B @ A * alpha / r``) in fp32, one bucket of parameters at a
time (`MergedWeights` behind a `serve_rft.trainer.policy.gathered.GatheredModel`): no second full copy
of the model is ever made, and the adapted model is never merged in place, so repeated
publishes add no rounding drift.
"""

from __future__ import annotations

from pathlib import Path

import torch

ADAPTER_DIR = "adapter"


def wrap(model, settings):
    """``model`` with trainable LoRA adapters on ``settings.target_modules`` (others frozen).

    Args:
        settings: `serve_rft.config.LoraSettings`.
    """
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                     target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


def _plain_name(peft_name: str) -> str:
    """``base_model.model.model.layers.0.q_proj.base_layer.weight`` -> ``model.layers.0.q_proj.weight``."""
    name = peft_name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


class MergedWeights:
    """The effective weights of a `peft.PeftModel` under the base model's parameter names,
    computed on demand (a `serve_rft.trainer.policy.gathered.GatheredModel`'s ``gather``).

    Args:
        peft_model: the trained LoRA model (its active adapters count).
        dtype: of the tensors returned (fp32: a bf16 base plus the fp32 delta, unrounded).
    """

    def __init__(self, peft_model, dtype: torch.dtype = torch.float32):
        from peft.tuners.lora import LoraLayer

        self.dtype = dtype
        self.base = {_plain_name(n): p for n, p in peft_model.named_parameters() if ".lora_" not in n}
        self.layers = {_plain_name(name + ".base_layer.weight"): m for name, m in peft_model.named_modules()
                       if isinstance(m, LoraLayer)}

    def specs(self) -> list[tuple[str, list[int], str]]:
        """``(name, shape, dtype name)`` of every weight, in the base model's order."""
        return [(n, list(p.shape), str(self.dtype)) for n, p in self.base.items()]

    @torch.no_grad()
    def gather(self, names: list[str], keep: bool = True) -> dict[str, torch.Tensor]:
        """``{name: base weight + LoRA delta}`` (CPU, ``dtype``) for ``names``.

        On FSDP2 ranks every rank calls it with the same ``names`` (each weight is gathered whole
        on every rank, a collective); ranks other than 0 pass ``keep=False``: no CPU copy, ``{}``.

        Raises:
            KeyError: a name that is no weight of the base model.
        """
        out = {}
        for name in names:
            w = _whole(self.base[name])
            module = self.layers.get(name)
            deltas = [_delta_weight(module, a) for a in module.active_adapters if a in module.lora_A] if module else []
            if not keep:  # the collectives are made; nothing is copied
                continue
            w = w.detach().to("cpu", self.dtype, copy=True)
            for d in deltas:
                w += d.to("cpu", self.dtype)
            out[name] = w
        return out


def root_adapter_names(tensors: dict[str, torch.Tensor], adapter: str = "default") -> dict[str, torch.Tensor]:
    """An adapter's tensors under peft's checkpoint names
    (``base_model.model.model.layers.0.q_proj.lora_A.weight``) renamed to the state-dict names
    of the transformers model it is injected into (``model.layers.0.q_proj.lora_A.default.weight``),
    what a sharded trainer loads them by (`serve_rft.trainer.sharding.fsdp.load_full`)."""
    out = {}
    for name, t in tensors.items():
        name = name.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.weight", f".{part}.{adapter}.weight")
        out[name] = t
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: an FSDP2 shard (DTensor) is gathered (a collective), a plain tensor is itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _delta_weight(module, adapter: str) -> torch.Tensor:
    """peft's ``get_delta_weight``: ``transpose(B @ A, fan_in_fan_out) * scaling`` (LoRA, Hu et
    al. 2021, eq. 3), from whole ``A`` and ``B`` when they are FSDP2 shards (a collective)."""
    a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
    if not hasattr(a, "full_tensor"):
        return module.get_delta_weight(adapter)
    from peft.utils.other import transpose

    return transpose(b.full_tensor().float() @ a.full_tensor().float(), module.fan_in_fan_out) * module.scaling[adapter]


@torch.no_grad()
def merge_into(peft_model, export_model) -> None:
    """Set ``export_model``'s weights to the adapted model's effective weights
    (`MergedWeights`: base + LoRA delta per adapted layer, base elsewhere), one tensor at a time.

    Raises:
        KeyError: a weight of ``export_model`` has no counterpart (different architecture).
    """
    merged = MergedWeights(peft_model)
    for name, p in export_model.named_parameters():
        p.copy_(merged.gather([name])[name])


def random_adapter(base_dir: str | Path, rank: int, seed: int, std: float = 0.05):
    """The model in ``base_dir`` wrapped with a rank-``rank`` adapter whose ``B`` matrices are
    N(0, ``std``) instead of zero, so it changes the policy at once (tests and benchmarks: a
    stand-in for a trained adapter)."""
    from transformers import AutoModelForCausalLM

    from serve_rft.config import LoraSettings

    torch.manual_seed(seed)
    model = wrap(AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32),
                 LoraSettings(rank=rank, alpha=2.0 * rank, merge_and_sync=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)
    return model








def save_adapter(peft_model, folder: str | Path) -> None:
    """Write the adapter (``adapter_model.safetensors`` + ``adapter_config.json``) to ``folder/adapter``."""
    peft_model.save_pretrained(str(Path(folder) / ADAPTER_DIR))


def load_adapter(peft_model, folder: str | Path) -> None:
    """Load adapter weights saved by `save_adapter` into ``peft_model``.

    Raises:
        FileNotFoundError: ``folder`` has no adapter.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_DIR / "adapter_model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (the state was not saved with LoRA)")
    result = set_peft_model_state_dict(peft_model, load_file(str(path)))
    if result.unexpected_keys:
        raise ValueError(f"adapter keys that fit no layer: {result.unexpected_keys[:5]}")

"""Model weights for weight-swap tests: the embedded model with every parameter moved by seeded
Gaussian noise, so that each seed is a distinct policy version whose logprobs differ from the
base model's."""

from __future__ import annotations

from pathlib import Path

import torch


def perturbed(model_dir: Path | str, seed: int, scale: float = 0.05):
    """The transformers model at ``model_dir`` (float32, CPU) with ``scale * N(0, 1)`` noise added
    to every parameter, drawn from a ``torch.Generator`` seeded with ``seed`` (the same seed gives
    the same weights).

    Returns:
        the ``AutoModelForCausalLM``, every tied weight moved once (tied tensors are one parameter).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model

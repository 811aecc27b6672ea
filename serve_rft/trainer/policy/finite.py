"""The trainer never applies, publishes or saves a non-finite update.

One non-finite number in a step (a reward that overflows float32, an overflow in a bf16
forward, a degenerate ratio) turns every parameter into NaN after ``optimizer.step()``: AdamW's
moments take the NaN gradient and keep it, a saved state carries it into every restart, and
replicas refuse every later version (the probe check). So:

- before the update, `skip_reason` looks at what the step computed: the advantages ``[B]``
  (float32), the batch's loss and the global gradient norm. Any non-finite one skips the step:
  the gradients are dropped, the weights, AdamW's state, the LR schedule and the running
  baseline stay as they were, and the trainer dead-letters the batch, counted. On N ranks every
  value it looks at is already the same on every rank (the advantages are computed from the
  whole batch on each rank, the loss is merged over the ranks' partials, the gradient norm is
  the all-reduced global norm), so all ranks skip together and no collective is left waiting.
- after the update and before a publish or a save, `check_finite` looks at every parameter and
  AdamW state tensor (each rank its shards, the verdict gathered); anything non-finite raises
  `NonFiniteState`, which ends the trainer process: Ray restarts it from its last saved state
  and the batch's entries, counted as a crashed attempt, are dead-lettered after
  ``trainer.max_entry_attempts``. Its cost: one read of the trained weights and AdamW's two
  moments per step and one device sync.

Optionally (``trainer.grad_norm_spike``) a step whose gradient norm is a spike against the
recent ones is skipped the same way (`GradNormGuard`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class NonFiniteState(RuntimeError):
    """A parameter or optimizer state tensor of the trainer holds NaN or infinity."""


def skip_reason(adv, loss: float, grad_norm: float) -> str | None:
    """Why a step must not be applied, or None.

    Args:
        adv: the batch's ``[B]`` advantages, float32 (what the loss multiplies).
        loss: the whole batch's loss (the sum over micro-batches and ranks).
        grad_norm: the global L2 norm of the gradient, before clipping.
    """
    import torch

    if not bool(torch.isfinite(adv).all()):
        bad = int((~torch.isfinite(adv)).sum())
        return f"non-finite advantage ({bad} of {adv.numel()}: a reward beyond float32's range?)"
    if not math.isfinite(loss):
        return f"non-finite loss {loss!r}"
    if not math.isfinite(grad_norm):
        return f"non-finite gradient norm {grad_norm!r}"
    return None


def _local(t):
    """A DTensor's local shard (FSDP2), or ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def nonfinite_tensors(model, optimizer) -> list[str]:
    """Names of this process's trained parameters (its shards on N ranks; frozen ones, such as
    a LoRA base, never change) and AdamW state tensors (``{param name}.{exp_avg|exp_avg_sq|...}``)
    that hold NaN or infinity; one device sync when none does."""
    import torch

    from serve_rft.trainer.sharding.fsdp import reshard

    reshard(model)  # sharded: the registered parameters must be the shards AdamW holds
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with torch.no_grad():
        tensors = [(n, _local(p)) for n, p in named]
        if optimizer is not None:
            for n, p in named:
                for key, t in optimizer.state.get(p, {}).items():
                    if torch.is_tensor(t) and t.is_floating_point():
                        tensors.append((f"{n}.{key}", _local(t)))
        tensors = [(n, t) for n, t in tensors if t.numel()]
        if not tensors:
            return []
        device = tensors[0][1].device  # AdamW's ``step`` is a CPU scalar beside CUDA moments
        flags = torch.stack([torch.isfinite(t).all().to(device) for _, t in tensors])
        if bool(flags.all()):
            return []
        return [n for (n, _), ok in zip(tensors, flags.tolist()) if not ok]


def check_finite(model, optimizer, world: int = 1) -> None:
    """Raise unless every parameter and AdamW state tensor of every rank is finite (on N ranks a
    collective: every rank calls it, and all raise together).

    Raises:
        NonFiniteState: names (up to 5) of the tensors that are not.
    """
    from serve_rft.trainer.sharding.fsdp import all_ranks_partials

    bad = nonfinite_tensors(model, optimizer)
    total = sum(p["bad"] for p in all_ranks_partials({"bad": float(len(bad))}, world))
    if total:
        raise NonFiniteState(f"{int(total)} trainer tensors hold NaN or infinity (here: {bad[:5]}); "
                             "the trainer must not publish or save them")


class GradNormGuard:
    """Skips a step whose global gradient norm spikes: above ``ratio`` times the median norm of
    the last ``window`` steps, once that many are known. Every finite norm joins the window,
    the spikes too, so a lasting shift of the norms is accepted after about ``window / 2``
    steps instead of skipping every step after it. The norm is the same on every rank, so is
    the window. Kept in memory only: a restarted trainer fills it again.

    Args:
        ratio: ``trainer.grad_norm_spike`` (None: never skips).
        window: ``trainer.grad_norm_window``.
    """

    def __init__(self, ratio: float | None, window: int):
        self.ratio = ratio
        self.norms: deque[float] = deque(maxlen=window)

    def reason(self, grad_norm: float) -> str | None:
        """Why the step with this (finite) gradient norm must be skipped, or None; records it."""
        if self.ratio is None:
            return None
        full = len(self.norms) == self.norms.maxlen
        median = statistics.median(self.norms) if full else 0.0
        self.norms.append(grad_norm)
        if median > 0 and grad_norm > self.ratio * median:
            return (f"gradient norm {grad_norm:.4g} is {grad_norm / median:.1f} times the median {median:.4g} "
                    f"of the last {len(self.norms) - 1} steps (trainer.grad_norm_spike={self.ratio:g})")
        return None

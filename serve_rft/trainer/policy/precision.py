"""bf16 autocast over fp32 weights without a bf16 copy of every weight held from the forward to
the backward.

Under ``torch.autocast`` a matmul casts its fp32 weight to bf16, and autograd saves that copy
(as a ``.t()`` view for ``F.linear``) because the input gradient needs it: 2 bytes per parameter
held from each layer's forward to its backward, on top of the fp32 weights, their gradients and
AdamW's moments. On the Qwen2.5-0.5B shape that is 0.92 GiB, which cancels most of what bf16
activations save at micro-batch 4 (docs/performance.md, Trainer step memory). `bf16_autocast`
saves a reference to the fp32 parameter instead and casts it again when the backward needs it:
the same cast of the same weights, so the same bits, and gradients equal to plain autocast's
(unit test); ``cache_enabled=False`` keeps autocast from also caching the copies until the
forward ends (each weight is used once per forward, so nothing is cast twice there).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_LOW = (torch.bfloat16, torch.float16)


class _Recast:
    """What a saved cast weight is packed as: the fp32 parameter, the dtype and whether the
    saved tensor was its ``.t()`` view."""

    __slots__ = ("param", "dtype", "transposed")

    def __init__(self, param: torch.Tensor, dtype: torch.dtype, transposed: bool):
        self.param, self.dtype, self.transposed = param, dtype, transposed


def _node(fn) -> str:
    return type(fn).__name__ if fn is not None else ""


def leaf_cast(t: torch.Tensor) -> _Recast | None:
    """``t`` as a cast of an fp32 ``nn.Parameter`` (autocast's ``param.to(bf16)``, or its
    ``.t()`` view, as autograd saves them for a matmul's backward), or None for any other tensor
    (activations, inputs)."""
    if t.dtype not in _LOW:
        return None
    fn, transposed = t.grad_fn, False
    if _node(fn) == "TBackward0":
        fn, transposed = fn.next_functions[0][0], True
    if _node(fn) != "ToCopyBackward0":
        return None
    param = getattr(fn.next_functions[0][0], "variable", None)  # AccumulateGrad of a leaf
    if not isinstance(param, torch.nn.Parameter) or param.dtype != torch.float32:
        return None  # weights only: they do not change before the backward
    want = tuple(param.shape[::-1]) if transposed else tuple(param.shape)
    if tuple(t.shape) != want or (transposed and param.dim() != 2):
        return None
    return _Recast(param, t.dtype, transposed)


def _pack(t: torch.Tensor):
    return leaf_cast(t) or t


def _unpack(saved):
    if isinstance(saved, _Recast):
        w = saved.param.detach().to(saved.dtype)
        return w.t() if saved.transposed else w
    return saved


@contextlib.contextmanager
def bf16_autocast(device_type: str, enabled: bool = True, recast: bool = True) -> Iterator[None]:
    """``torch.autocast(device_type, bf16)`` whose saved weight copies are recast in the backward
    (module docstring). ``recast=False``: plain autocast (FSDP2 ranks, whose unsharded parameters
    FSDP frees and gathers again itself). Use it for forward passes whose backward runs before the
    weights change (a step: forward, backward, then the optimizer).
    """
    if not enabled:
        yield
        return
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16, cache_enabled=not recast):
        if not recast:
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield

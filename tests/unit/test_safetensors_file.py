"""The safetensors file as the weights move (serve_rft/weights/safetensors_file.py): views of a
mapped file equal what was saved, and a malformed file is refused before any read."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from serve_rft.weights.safetensors_file import DTYPES, map_file, view


def test_views_of_the_mapped_file_equal_the_saved_tensors_and_adjacent_ones_form_oneview(tmp_path):
    gate, up = torch.randn(3, 4), torch.randn(5, 4)
    tensors = {"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up,
               "norm.weight": torch.randn(4).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "b.safetensors"))
    header, base, mapping = map_file(str(tmp_path / "b.safetensors"))
    for name, t in tensors.items():
        meta = header[name]
        start, end = (base + o for o in meta["data_offsets"])
        assert torch.equal(view(mapping, start, DTYPES[meta["dtype"]], meta["shape"], end - start), t)
    # safetensors stores tensors sorted by name: gate then up, next to each other = the fused weight
    g, u = header["mlp.gate_proj.weight"]["data_offsets"], header["mlp.up_proj.weight"]["data_offsets"]
    assert g[1] == u[0]
    fused = view(mapping, base + g[0], torch.float32, [8, 4], u[1] - g[0])
    assert torch.equal(fused, torch.cat([gate, up]))


@pytest.mark.parametrize("content", [b"", b"\x01\x02", b"\xff" * 8 + b"{}", b"\x10\x00\x00\x00\x00\x00\x00\x00{}"])
def test_a_malformed_file_is_refused(tmp_path, content):
    (tmp_path / "bad.safetensors").write_bytes(content)
    with pytest.raises(ValueError):
        map_file(str(tmp_path / "bad.safetensors"))


def test_a_header_larger_than_safetensors_allows_is_refused_before_it_is_read(tmp_path):
    import struct

    from serve_rft.weights.safetensors_file import MAX_HEADER_BYTES

    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        f.truncate(8 + MAX_HEADER_BYTES + 16)  # sparse: the file holds the claimed bytes
    with pytest.raises(ValueError, match="header of"):
        map_file(str(path))

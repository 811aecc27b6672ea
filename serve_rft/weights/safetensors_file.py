"""The safetensors file format, read and written where the weights move (no copy on reading).

The format (huggingface/safetensors README, "Format"): an 8-byte little-endian header size, a
JSON header giving each tensor's dtype, shape and ``data_offsets`` (bytes, relative to the data
that follows the header), then the tensors' bytes, with no holes.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from typing import Any

import torch

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
"""The format's dtype names."""

MAX_HEADER_BYTES = 100_000_000
"""The largest header read, as safetensors' own reader bounds it (``MAX_HEADER_SIZE``)."""


def map_file(path: str) -> tuple[dict[str, Any], int, mmap.mmap]:
    """Map a safetensors file read-only, its pages mapped up front (``MAP_POPULATE``: one call
    instead of a fault per page); nothing is copied.

    Returns:
        The header (name -> ``{"dtype", "shape", "data_offsets"}``, offsets relative to the data
        section; ``__metadata__`` dropped), the data section's start in the file (bytes), and the
        mapping.
    Raises:
        ValueError: the file is not a well-formed safetensors file.
        OSError: it cannot be opened or mapped.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes)")
        n = struct.unpack("<Q", f.read(8))[0]
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{path}: header of {n} bytes in a file of {size}")
        header = json.loads(f.read(n))
        mapping = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                            prot=mmap.PROT_READ)
    header.pop("__metadata__", None)
    return header, 8 + n, mapping


def entry(mapping: mmap.mmap, data_start: int, name: str, meta: Any) -> tuple[torch.Tensor, int, int]:
    """The tensor one header entry describes, as a `view`, with its first and end byte in the file.

    Raises:
        ValueError: the entry is malformed, or its bytes are not the file's or do not hold its
            shape of its dtype.
    """
    try:
        dtype = DTYPES[meta["dtype"]]
        shape = [int(n) for n in meta["shape"]]
        start, end = (data_start + int(o) for o in meta["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"tensor {name!r}: malformed header entry {meta!r}") from None
    count = 1
    for n in shape:
        count *= n
    if not data_start <= start <= end <= len(mapping) or end - start != count * dtype.itemsize:
        raise ValueError(f"tensor {name!r}: shape {shape} of {meta['dtype']} in bytes {start}-{end}")
    return view(mapping, start, dtype, shape, end - start), start, end


def view(mapping: mmap.mmap, start: int, dtype: torch.dtype, shape: list[int], nbytes: int) -> torch.Tensor:
    """``[*shape]`` tensor over ``nbytes`` bytes of ``mapping`` from byte ``start`` (no copy; it
    keeps the mapping alive). Read-only memory: only read from it."""
    with warnings.catch_warnings():  # torch warns that the buffer is not writable: nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=dtype, count=nbytes // dtype.itemsize, offset=start).view(shape)


def pack(named_tensors: list[tuple[str, torch.Tensor]]):
    """``(name, CPU tensor)`` pairs as the bytes of one safetensors file, **in the given order**
    (safetensors' own ``save`` sorts tensors by name). Each tensor is copied once, into the result.

    Returns:
        A read-only ``[nbytes]`` uint8 numpy array.
    Raises:
        KeyError: a dtype the format has no name for.
    """
    import numpy as np

    names = {dtype: name for name, dtype in DTYPES.items()}
    header, offset = {}, 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    out = np.empty(8 + len(raw) + offset, dtype=np.uint8)
    out[:8] = np.frombuffer(struct.pack("<Q", len(raw)), dtype=np.uint8)
    out[8:8 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    pos = 8 + len(raw)
    for _, t in named_tensors:
        n = t.numel() * t.element_size()
        if n:
            out[pos:pos + n] = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        pos += n
    out.flags.writeable = False
    return out

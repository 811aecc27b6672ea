"""Read back what a Weights & Biases offline run wrote: the history rows of its ``run-*.wandb`` file.

The file is a LevelDB-style log (LevelDB's "log format" doc, ``doc/log_format.md``: 32 KiB blocks of
records, each a 7-byte header ``crc32 (4), length (2), type (1)`` and its data; a record that does not
fit a block continues in the next as FIRST / MIDDLE / LAST parts; a block's tail shorter than a header
is zero padding) after W&B's own 7-byte file header ``":W&B", magic 0xBEE1, version 0`` (as W&B's
former Python reader ``wandb/sdk/internal/datastore.py`` checked it). Each record's data is a
``wandb.proto.wandb_internal_pb2.Record``; a ``history`` record holds one ``wandb.log`` call's items
as JSON. W&B's own reader now lives in its Go service, so the tests read the file with this.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    """Every record's data in ``path``, in order.

    Raises:
        ValueError: not a W&B log (its file header), or a record of an unknown type.
    """
    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"{path}: not a W&B run file ({ident!r}, {magic:#x}, {version})")
    out, parts, pos = [], [], HEADER
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # the block's zero-padded tail
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # zeros: padding up to the block's end
            pos += room
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            parts = [chunk]
        elif kind == MIDDLE:
            parts.append(chunk)
        elif kind == LAST:
            out.append(b"".join([*parts, chunk]))
            parts = []
        else:
            raise ValueError(f"{path}: record type {kind} at byte {pos}")
    return out


def parsed(path: Path) -> list:
    """Every record of ``path`` as a ``wandb_internal_pb2.Record``, in order."""
    from wandb.proto import wandb_internal_pb2

    out = []
    for raw in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        out.append(record)
    return out


def history(path: Path) -> list[dict]:
    """The run's history rows (one per ``wandb.log`` call): key -> value, ``_step`` included."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in parsed(path) if record.WhichOneof("record_type") == "history"]


def record_types(path: Path) -> dict[str, int]:
    """How many records of each ``Record`` type ``path`` holds (what a failed read-back shows)."""
    from collections import Counter

    return dict(Counter(str(record.WhichOneof("record_type")) for record in parsed(path)))

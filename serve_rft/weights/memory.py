"""MEMORY: versions as buckets in Ray's object store (shared memory on a node, network across).

The trainer snapshots its parameters into buckets of at most ``bucket_bytes`` (the tensors of
one block, which vLLM may fuse into one layer, stay together; a block larger than a bucket
travels alone), each serialized once as the bytes of a safetensors file in the trainer's order
(`pack_bucket`: a ``[nbytes]`` uint8 array, which Ray hands back without a copy: numpy
arrays are read zero-copy from the object store, Ray docs "Serialization", "Numpy Arrays"),
with the checksum of those bytes (XXH3-64, `serve_rft.weights.verify`); ``ray.put`` each; the
handle lists the ObjectRefs and checksums.

A replica pipelines the buckets: while its vLLM worker loads bucket k from a file in shared
memory (mapped, no copy; on CPU each linear layer is packed straight from it,
`serve_rft.explorer.engine.direct_reload`, else vLLM's layer-wise reload re-processes each layer
as soon as all its tensors arrived), the replica fetches bucket k+1 and writes it to the next
file, computing its checksum in the same pass (`_write_checked`; on CPU the two files are
rewritten in turn); a bucket whose bytes do not match never reaches the worker. So the replica's
extra memory is at most two buckets' files (one loading, one staged), not a second model. The
object store holds one copy per version that some replica still references; Ray frees it once no
handle refers to it.

With adapter-only LoRA sync the trainer publishes its `peft.PeftModel`: one object holds the
adapter's tensors and config; a replica writes it to a folder in shared memory and registers it
as the LoRA adapter of the version (`ExplorerEngine.load_adapter`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from typing import Any, Collection, Iterator

from serve_rft.weights.base import WeightSyncMethod


def iter_buckets(named_tensors: Iterator[tuple[str, Any]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Group ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` bytes each, order
    preserved, never splitting a run of tensors of one block (`block_of`: the parts a vLLM
    engine fuses into one layer, ``q/k/v_proj`` or ``gate/up_proj``, so they arrive together);
    a block larger than a bucket travels alone."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for _, run in itertools.groupby(named_tensors, key=lambda nt: block_of(nt[0])):
        block = list(run)
        block_size = sum(t.numel() * t.element_size() for _, t in block)
        if bucket and size + block_size > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += block
        size += block_size
    if bucket:
        yield bucket


def block_of(name: str) -> str:
    """The module two levels above a tensor (``model.layers.0.self_attn.q_proj.weight`` ->
    ``model.layers.0.self_attn``): its siblings are the layers vLLM may fuse with it. A name of
    fewer than three parts is a block of its own."""
    parts = name.split(".")
    return ".".join(parts[:-2]) if len(parts) > 2 else name


def checkpoint_tensors(model) -> Iterator[tuple[str, Any]]:
    """The model's parameters under their checkpoint names, tied weights once (as
    ``save_pretrained`` writes them), detached, contiguous, on CPU."""
    for name, p in model.named_parameters():  # remove_duplicate=True drops a tied lm_head
        yield name, p.detach().to("cpu", copy=True).contiguous()


class MemoryMethod(WeightSyncMethod):
    name = "memory"

    def __init__(self, bucket_bytes: int = 32 << 20):
        self.bucket_bytes = bucket_bytes

    def send(self, model, version: int, in_use: Collection[int] | None = ()) -> dict[str, Any]:
        import ray

        from serve_rft.weights.adapters import adapter_tensors, is_adapter_model

        from serve_rft.weights.verify import digest, tensors_checksum

        if is_adapter_model(model):
            tensors, config = adapter_tensors(model)
            return {"method": self.name, "adapter": True, "buckets": [ray.put((tensors, config))],
                    "checksums": [tensors_checksum(sorted(tensors.items()))],
                    "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
        refs, sums, total = [], [], 0
        for bucket in iter_buckets(checkpoint_tensors(model), self.bucket_bytes):
            total += sum(t.numel() * t.element_size() for _, t in bucket)
            blob = pack_bucket(bucket)
            sums.append(digest(blob))
            refs.append(ray.put(blob))
        return {"method": self.name, "buckets": refs, "bytes": total, "checksums": sums}

    async def receive(self, engine, handle: dict[str, Any], version: int) -> dict[str, float]:
        """Load the buckets of ``handle`` into the paused ``engine``, pipelined (module docstring).

        Returns:
            ``seconds`` (the whole load), ``bytes`` (tensor bytes), and where the time went,
            in seconds summed over the buckets (overlapping): ``fetch_s`` (from the object
            store), ``stage_s`` (written to shared memory and checked), ``engine_s`` (the
            worker's load), ``finish_s`` (vLLM's finalization, the tied head's repack).
        Raises:
            VersionCorrupt: a bucket's bytes do not match the trainer's checksum (earlier
                buckets may be loaded: the caller restores the previous version).
            Whatever Ray or vLLM's loader raises.
        """
        t0 = time.perf_counter()
        if handle.get("adapter"):
            await _receive_adapter(engine, handle, version)
            return {"seconds": time.perf_counter() - t0, "bytes": float(handle["bytes"])}
        sums = handle.get("checksums") or [None] * len(handle["buckets"])
        took = {"fetch_s": 0.0, "stage_s": 0.0, "engine_s": 0.0}
        await engine.begin_update()
        await _load_pipelined(engine, handle["buckets"], sums, took)
        t = time.perf_counter()
        await engine.finish_update(version)
        took["finish_s"] = time.perf_counter() - t
        return {"seconds": time.perf_counter() - t0, "bytes": float(handle["bytes"]), **took}


def pack_bucket(bucket: list[tuple[str, Any]]):
    """``(name, CPU tensor)`` pairs as the bytes of one safetensors file, in the bucket's order
    (the trainer's) but each block's weights before its other tensors: a fused layer's parts lie
    next to each other in the order vLLM fuses them, so the replica's engine packs them straight
    from the file as one view (`serve_rft.explorer.engine.direct_reload`).

    Returns:
        A read-only ``[nbytes]`` uint8 numpy array (what travels through the object store).
    """
    from serve_rft.weights.safetensors_file import pack

    # within a block, the weights first: a fused layer's parts (q, k, v) then lie next to each
    # other, not between their biases
    blocks = {b: i for i, b in enumerate(dict.fromkeys(block_of(n) for n, _ in bucket))}
    return pack(sorted(bucket, key=lambda nt: (blocks[block_of(nt[0])], not nt[0].endswith(".weight"))))


def unpack_bucket(blob) -> dict[str, Any]:
    """The tensors of a `pack_bucket` blob, by name (copies: they outlive the blob)."""
    from safetensors.torch import load

    return load(bytes(memoryview(blob)))


def _write_checked(blob, path: str, expected: str | None, index: int, chunk: int = 4 << 20) -> None:
    """Write ``blob`` to ``path`` (over what the file held: an existing file's pages are reused,
    not allocated again) and check its checksum (`serve_rft.weights.verify.digest`) in the same
    pass, a 4 MiB chunk at a time.

    Raises:
        VersionCorrupt: the bytes do not match ``expected`` (the file is removed).
        OSError: the file could not be written (the file is removed).
    """
    import xxhash

    from serve_rft.weights.verify import XXH3, VersionCorrupt

    view = memoryview(blob).cast("B")
    h = xxhash.xxh3_64()
    try:
        with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            for k in range(0, len(view), chunk):
                part = view[k:k + chunk]
                h.update(part)
                f.write(part)
            f.truncate()
        if expected is not None and XXH3 + h.hexdigest() != expected:
            raise VersionCorrupt(f"bucket {index}: checksum mismatch")
    except BaseException:
        _remove(path)
        raise


async def _stage(blob, path: str, expected: str | None, index: int) -> None:
    """`_write_checked` in a thread. Cancelled (a sync past its timeout), the write still ends
    in its thread; its file is removed then, so none is left behind.

    Raises:
        VersionCorrupt, OSError: as `_write_checked`.
    """
    writing = asyncio.ensure_future(asyncio.to_thread(_write_checked, blob, path, expected, index))
    try:
        await asyncio.shield(writing)
    except asyncio.CancelledError:
        writing.add_done_callback(lambda _: _remove(path))
        raise


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


async def _load_pipelined(engine, refs: list, sums: list, took: dict[str, float]) -> None:
    """Fetch, stage and check bucket k+1 while the engine loads bucket k; adds each stage's
    seconds to ``took``. Where the engine allows it (``staged_files_reusable``) the buckets take
    turns in two files, each rewritten in place (no shared-memory pages allocated per bucket:
    docs/performance.md, "Sync cost per method"); else each bucket gets a new file, removed once
    loaded. The engine is never left mid-load when this raises, and no staged
    file outlives it.

    Raises:
        VersionCorrupt, or whatever Ray or the engine raises.
    """
    slots = [engine.staging_path(), engine.staging_path()] if getattr(engine, "staged_files_reusable", False) else None
    staged: set[str] = set()

    async def load(path: str) -> None:
        t = time.perf_counter()
        try:
            await engine.load_bucket(path)
        finally:
            took["engine_s"] += time.perf_counter() - t
            if slots is None:
                _remove(path)

    loading: asyncio.Future | None = None
    try:
        for i, (ref, expected) in enumerate(zip(refs, sums)):
            t = time.perf_counter()
            blob = await ref
            took["fetch_s"] += time.perf_counter() - t
            t = time.perf_counter()
            path = slots[i % 2] if slots else engine.staging_path()
            staged.add(path)
            await _stage(blob, path, expected, i)  # slot i % 2: its last load (bucket i - 2) has ended
            took["stage_s"] += time.perf_counter() - t
            del blob
            if loading is not None:
                await asyncio.shield(loading)  # a cancel must not abandon the engine mid-load
            loading = asyncio.ensure_future(load(path))
        if loading is not None:
            await asyncio.shield(loading)
    finally:
        if loading is not None and not loading.done():
            await asyncio.wait([loading])  # its outcome is superseded by the error raised here
        for path in staged:
            _remove(path)


def _check_bucket(named_tensors, expected: str | None, index: int) -> None:
    """Raises:
        VersionCorrupt: an adapter's tensors do not match the trainer's checksum.
    """
    from serve_rft.weights.verify import VersionCorrupt, tensors_checksum

    if expected is not None and tensors_checksum(named_tensors) != expected:
        raise VersionCorrupt(f"bucket {index}: checksum mismatch")


async def _receive_adapter(engine, handle: dict[str, Any], version: int) -> None:
    """Write the adapter to a folder and register it; drop folders of versions the engine no
    longer keeps.

    Raises:
        EngineUnchanged: the adapter could not be fetched, written or loaded.
    """
    import shutil

    from serve_rft.weights.base import EngineUnchanged
    from serve_rft.weights.adapters import write_adapter

    root = engine.adapter_dir
    try:
        tensors, config = await handle["buckets"][0]
        _check_bucket(sorted(tensors.items()), (handle.get("checksums") or [None])[0], 0)
        folder = await asyncio.to_thread(write_adapter, root / f"v{version:06d}", tensors, config)
    except Exception as e:  # nothing reached the engine
        raise EngineUnchanged(f"adapter of version {version} not received: {e!r}") from e
    await engine.load_adapter(str(folder), version)
    keep = {f"v{v:06d}" for v in engine.adapters}
    for d in root.iterdir():
        if d.name not in keep:
            shutil.rmtree(d, ignore_errors=True)

"""MEMORY: versions as buckets in Ray's object store (shared memory on a node, network across).

The trainer snapshots its parameters into buckets of at most ``bucket_bytes`` (a tensor larger
than a bucket travels alone) and ``ray.put``s each; the handle lists the ObjectRefs. A replica
fetches one bucket at a time and hands it to its vLLM worker (through a shared-memory file,
`ExplorerEngine.load_bucket`), which loads it with vLLM's layer-wise reload (each layer is
re-processed as soon as all its tensors arrived), so the replica's extra memory is about one
bucket, not a second model. The object store holds one
copy per version that some replica still references; Ray frees it once no handle refers to it.

With adapter-only LoRA sync the trainer publishes its `peft.PeftModel`: one object holds the
adapter's tensors and config; a replica writes it to a folder in shared memory and registers it
as the LoRA adapter of the version (`ExplorerEngine.load_adapter`).
"""

from __future__ import annotations

import time
from typing import Any, Collection, Iterator

from serve_rft.weights.base import WeightSyncMethod


def iter_buckets(named_tensors: Iterator[tuple[str, Any]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Group ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` bytes each
    (a single larger tensor forms its own bucket). Order is preserved."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


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

        from serve_rft.weights.verify import tensors_checksum

        if is_adapter_model(model):
            tensors, config = adapter_tensors(model)
            return {"method": self.name, "adapter": True, "buckets": [ray.put((tensors, config))],
                    "checksums": [tensors_checksum(sorted(tensors.items()))],
                    "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
        refs, sums, total = [], [], 0
        for bucket in iter_buckets(checkpoint_tensors(model), self.bucket_bytes):
            total += sum(t.numel() * t.element_size() for _, t in bucket)
            sums.append(tensors_checksum(bucket))
            refs.append(ray.put(bucket))
        return {"method": self.name, "buckets": refs, "bytes": total, "checksums": sums}

    async def receive(self, engine, handle: dict[str, Any], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        if handle.get("adapter"):
            await _receive_adapter(engine, handle, version)
            return {"seconds": time.perf_counter() - t0, "bytes": float(handle["bytes"])}
        sums = handle.get("checksums") or [None] * len(handle["buckets"])
        await engine.begin_update()
        for i, (ref, expected) in enumerate(zip(handle["buckets"], sums)):
            bucket = await ref
            _check_bucket(bucket, expected, i)  # a corrupt bucket never reaches the engine
            await engine.load_bucket(bucket)
            del bucket
        await engine.finish_update(version)
        return {"seconds": time.perf_counter() - t0, "bytes": float(handle["bytes"])}


def _check_bucket(named_tensors, expected: str | None, index: int) -> None:
    """Raises:
        VersionCorrupt: the bucket's bytes do not match the trainer's checksum.
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
    import asyncio
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

"""A sharded policy's full weights, gathered from its ranks one bucket at a time.

`GatheredModel` is what a sharded trainer (``trainer.num_workers > 1``) publishes and saves: it
quacks like the transformers model the sync methods take (``named_parameters``,
``save_pretrained``, ``config``) but holds no weights. Each bucket of parameters (at most
``bucket_bytes`` of full tensors, in the model's own parameter order) is a collective over the
ranks: every rank calls ``full_tensor()`` on the same parameters (an all-gather of the FSDP2
shards) and rank 0 hands its copy to the caller through Ray's object store. So no process holds
more of the model beyond its own shard than one bucket (the bucketed transfer of Twinkle's
CheckpointEngine documentation), and ``save_pretrained`` writes one safetensors file per bucket
with the index Hugging Face loaders (transformers, vLLM) read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

DTYPE_BYTES = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2, "torch.float64": 8}


def plan_buckets(specs: list[tuple[str, list[int], str]], bucket_bytes: int) -> list[list[str]]:
    """Parameter names grouped into buckets of at most ``bucket_bytes`` bytes of full tensors
    (a larger tensor alone), in order.

    Args:
        specs: ``(name, full shape, dtype name)`` per parameter, e.g. ``("lm_head.weight",
            [vocab, hidden], "torch.float32")``.
    Raises:
        KeyError: a dtype not in `DTYPE_BYTES`.
    """
    out: list[list[str]] = []
    size = 0
    for name, shape, dtype in specs:
        n = DTYPE_BYTES[dtype]
        for d in shape:
            n *= d
        if out and out[-1] and size + n <= bucket_bytes:
            out[-1].append(name)
            size += n
        else:
            out.append([name])
            size = n
    return out


class GatheredModel:
    """The full model of a sharded policy, streamed from its ranks (module docstring).

    Args:
        gather: ``gather(names) -> {name: CPU tensor}`` (a collective on every rank).
        specs: ``(name, full shape, dtype name)`` of every parameter, in the model's order.
        config: the transformers ``PretrainedConfig`` of the model.
        bucket_bytes: full-tensor bytes per gathered bucket.
        source_dir: a model directory whose ``generation_config.json`` is copied by
            `save_pretrained` (as ``save_pretrained`` of the model it started from writes it).
    """

    def __init__(self, gather: Callable[[list[str]], dict[str, Any]], specs: list[tuple[str, list[int], str]],
                 config, bucket_bytes: int, source_dir: str | Path | None = None):
        self.gather = gather
        self.specs = specs
        self.config = config
        self.buckets = plan_buckets(specs, bucket_bytes)
        self.source_dir = Path(source_dir) if source_dir is not None else None

    def iter_buckets(self) -> Iterator[dict[str, Any]]:
        """One ``{name: full CPU tensor}`` dict per bucket; the previous one may be freed."""
        for names in self.buckets:
            got = self.gather(names)
            bucket = {n: got.pop(n) for n in names}
            del got
            yield bucket
            del bucket  # the caller's reference is its own: none is kept here while the next gathers

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        """``(name, full tensor)`` of every parameter, a bucket gathered at a time (tied weights
        once, as the sharded model names them)."""
        for bucket in self.iter_buckets():
            for name in list(bucket):
                yield name, bucket.pop(name)  # held by the caller alone from here

    def parameters(self) -> Iterator[Any]:
        for _, t in self.named_parameters():
            yield t

    def save_pretrained(self, folder: str | Path, safe_serialization: bool = True) -> None:
        """Write a Hugging Face model directory: ``config.json``, one
        ``model-{i:05d}-of-{n:05d}.safetensors`` per bucket and ``model.safetensors.index.json``.

        Raises:
            ValueError: ``safe_serialization`` False (only safetensors is written).
        """
        from safetensors.torch import save_file

        if not safe_serialization:
            raise ValueError("GatheredModel writes safetensors only")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(str(folder))
        if self.source_dir is not None and (self.source_dir / "generation_config.json").is_file():
            shutil.copy2(self.source_dir / "generation_config.json", folder / "generation_config.json")
        n = len(self.buckets)
        weight_map: dict[str, str] = {}
        total = 0
        for i, bucket in enumerate(self.iter_buckets(), start=1):
            name = f"model-{i:05d}-of-{n:05d}.safetensors"
            save_file({k: v.contiguous() for k, v in bucket.items()}, str(folder / name), metadata={"format": "pt"})
            for k, v in bucket.items():
                weight_map[k] = name
                total += v.numel() * v.element_size()
            del bucket
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))

"""CHECKPOINT: versions as committed safetensors folders on a (shared) filesystem.

The trainer writes ``v{version:06d}/`` atomically (temp folder, fsync, rename, ``COMMITTED``
marker; `serve_rft.weights.folders`), keeps the newest ``keep`` and every version a replica
still serves; each replica's vLLM worker reloads from the folder. Works across machines that
share the folder. With adapter-only LoRA sync the trainer publishes its `peft.PeftModel`, whose
``save_pretrained`` writes only the adapter (``adapter_config.json`` +
``adapter_model.safetensors``); replicas register such a folder as a vLLM LoRA adapter instead of
reloading weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Collection

from serve_rft.weights.base import WeightSyncMethod


def _folder_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


class CheckpointMethod(WeightSyncMethod):
    name = "checkpoint"
    durable = True

    def __init__(self, root: str | Path, keep: int = 5):
        self.root = Path(root)
        self.keep = keep

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def latest_version(self) -> int:
        from serve_rft.weights.folders import committed_versions

        versions = committed_versions(self.root)
        return versions[-1] if versions else 0

    def send(self, model, version: int, in_use: Collection[int] | None = ()) -> dict[str, Any]:
        from serve_rft.weights.folders import save_version

        from serve_rft.weights.adapters import is_adapter_model

        from serve_rft.weights.verify import folder_checksums

        path = save_version(model, self.root, version, self.keep, in_use)
        return {"method": self.name, "path": str(path), "adapter": is_adapter_model(model),
                "checksums": folder_checksums(path)}

    async def precheck(self, handle: dict[str, Any]) -> None:
        """The folder's safetensors files match the checksums the trainer published.

        Raises:
            VersionCorrupt: they do not (or the folder is gone).
        """
        import asyncio

        from serve_rft.weights.verify import VersionCorrupt, check_folder

        try:
            await asyncio.to_thread(check_folder, handle["path"], handle.get("checksums"))
        except OSError as e:
            raise VersionCorrupt(f"{handle['path']}: {e!r}") from e

    async def receive(self, engine, handle: dict[str, Any], version: int) -> dict[str, float]:
        """Load a committed version folder (or the initial model directory, version 0); an
        adapter folder is registered as the engine's LoRA adapter of ``version``.

        Raises:
            FileNotFoundError: the folder is not committed (no ``COMMITTED`` marker).
        """
        from serve_rft.weights.folders import MARKER

        path = Path(handle["path"])
        if version > 0 and not (path / MARKER).exists():
            raise FileNotFoundError(f"{path} is not a committed version (no {MARKER} marker)")
        if handle.get("adapter"):
            seconds = await engine.load_adapter(str(path), version)
        else:
            seconds = await engine.load_checkpoint(str(path), version)
        return {"seconds": seconds, "bytes": float(_folder_bytes(handle["path"]))}

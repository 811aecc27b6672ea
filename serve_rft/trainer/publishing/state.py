"""Trainer state checkpoints: a killed trainer resumes at the version it last saved.

Layout under ``root`` (``run_dir/trainer_state``), one committed folder per saved version,
written like a published version (`serve_rft.weights.folders`: temp folder, fsync, rename,
``COMMITTED`` marker), the newest ``keep`` kept:

====================  ==========================================================================
``v{version:06d}/``   ``config.json`` + ``model.safetensors`` (a sharded trainer or a LoRA merge:
                      one ``model-*.safetensors`` per bucket + ``model.safetensors.index.json``;
                      ``transformers.from_pretrained`` loads either) and the tokenizer files of
                      the model it started from
``optimizer.pt``      ``torch.optim`` state dict (``scheduler.pt``: the LR schedule's;
                      ``adapter/``: the LoRA adapter, when training one). A sharded trainer
                      (``trainer.num_workers > 1``) writes ``optimizer/`` instead: AdamW's state
                      as a ``torch.distributed.checkpoint`` folder, every rank its own shards
``rng.pt``            torch CPU (and CUDA) RNG state (sharded: ``rng-rank{r}.pt`` per rank)
``trainer_state.json`` ``version``, ``step``, ``baseline`` (running reward baseline), ``trained``:
                      ``[stream id, "{cid}:{i}", version]`` for every ready-stream entry trained
                      since the previous saved state, ``published``: the version numbers
                      published so far (the newest 4,096), for staleness in sync cycles
====================  ==========================================================================

``PUBLISHED`` (a file in ``root``) holds the highest version number the trainer ever started to
publish, written (fsynced) before each publish: a restarted trainer numbers new versions after
it, so a version number never names two different weights, whatever the sync method keeps.

Exactly-once: the trainer acknowledges ready entries only after a saved state covers
them. A trainer killed at any point restarts from its newest state, acknowledges that state's
``trained`` entries again (a no-op for those already acknowledged), and re-reads every entry
still delivered-but-unacknowledged: those were trained only into weights that were lost, so
they are trained again, into a new version. No entry is lost and none is trained twice into
the same line of weights.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from serve_rft.weights.folders import MARKER, committed_versions, fsync_folder, save_version, version_dir

log = logging.getLogger("serve_rft.trainer")

STATE_FILE = "trainer_state.json"
OPTIMIZER_DCP = "optimizer"
PUBLISHED_FILE = "PUBLISHED"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "generation_config.json")


@dataclass
class TrainerState:
    """What `load_state` returns besides the weights and optimizer it restores."""

    path: Path
    version: int
    step: int
    baseline: float | None
    trained: list[tuple[str, str, int]] = field(default_factory=list)
    published: list[int] = field(default_factory=list)


def save_state(root: str | Path, model, optimizer, version: int, step: int, baseline: float | None,
               trained: list[tuple[str, str, int]], tokenizer_dir: str | Path | None, keep: int = 2,
               scheduler=None, adapter_model=None, published: list[int] | None = None,
               shards: Callable[[Path], None] | None = None) -> Path:
    """Save a resumable trainer state as ``root/v{version:06d}`` (committed atomically).

    Args:
        model: what ``save_pretrained`` writes (a transformers model, or a sharded trainer's
            `serve_rft.trainer.policy.gathered.GatheredModel`).
        optimizer: the ``torch.optim`` optimizer, or None when ``shards`` writes it.
        trained: ``(stream id, member, version)`` of the entries trained since the last state.
        published: version numbers published so far, ascending (staleness counts cycles over them).
        tokenizer_dir: a model directory whose tokenizer files are copied alongside, so the
            folder is a complete Hugging Face model directory (None: no tokenizer).
        shards: a sharded trainer's writer of the per-rank files into the folder (optimizer
            shards, RNG, LR schedule), called before the folder is committed.
    Returns:
        The committed folder.
    Raises:
        FileExistsError: a state of that version exists already.
        ValueError: ``baseline`` is not finite (nothing is written).
    """
    import math

    import torch

    if baseline is not None and not math.isfinite(baseline):
        raise ValueError(f"running baseline {baseline!r} is not finite: a trainer state must not carry it")

    def extra(folder: Path) -> None:
        if optimizer is not None:
            torch.save(optimizer.state_dict(), folder / "optimizer.pt")
        if scheduler is not None:
            torch.save(scheduler.state_dict(), folder / "scheduler.pt")
        if adapter_model is not None:  # LoRA: model is the merged copy; resume needs the adapter
            from serve_rft.trainer.policy.lora import save_adapter

            save_adapter(adapter_model, folder)
        if shards is not None:
            shards(folder)
        else:
            torch.save(rng_state(), folder / "rng.pt")
        (folder / STATE_FILE).write_text(json.dumps(
            {"version": version, "step": step, "baseline": baseline,
             "trained": [list(t) for t in trained], "published": list(published or [])}))
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                src = Path(tokenizer_dir) / name
                if src.is_file():
                    shutil.copy2(src, folder / name)

    return save_version(model, root, version, keep=keep, extra=extra)


def rng_state() -> dict:
    """This process's torch CPU (and CUDA) RNG state, as ``rng.pt`` holds it."""
    import torch

    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def save_optimizer_shards(folder: str | Path, model, optimizer) -> None:
    """A sharded rank's AdamW state into ``folder/optimizer`` with torch.distributed.checkpoint
    (every rank writes its own shards; a collective) and its RNG into ``rng-rank{r}.pt``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(Path(folder) / OPTIMIZER_DCP))
    torch.save(rng_state(), Path(folder) / f"rng-rank{dist.get_rank()}.pt")


def latest_state(root: str | Path) -> Path | None:
    """The newest committed state folder under ``root``, or None."""
    versions = committed_versions(root)
    return version_dir(root, versions[-1]) if versions else None


def load_state(path: str | Path, optimizer, scheduler=None, model=None, rank: int = 0,
               world: int = 1) -> TrainerState:
    """Restore ``optimizer``, ``scheduler`` (LR schedule) and the RNG from a state folder and
    read its bookkeeping.

    The weights are loaded by building the model from ``path`` (`from_pretrained`), before the
    optimizer is made for its parameters. A sharded rank (``world > 1``; ``model``: its FSDP
    model) loads its AdamW shards from the ``optimizer/`` checkpoint, whatever number of ranks
    wrote it (torch.distributed.checkpoint reshards); a state saved by one process
    (``optimizer.pt``) resumes N ranks with fresh AdamW moments (logged), and the reverse too.

    Raises:
        FileNotFoundError: ``path`` is not a committed state.
    """
    import torch

    path = Path(path)
    state = read_state(path)  # raises FileNotFoundError before anything is restored
    sharded_state = (path / OPTIMIZER_DCP).is_dir()
    if world > 1 and sharded_state:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        sd = {"optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(sd, checkpoint_id=str(path / OPTIMIZER_DCP))
        set_optimizer_state_dict(model, optimizer, sd["optim"])
    elif world == 1 and not sharded_state:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    else:
        log.warning("%s was saved by %s: resuming %s with fresh AdamW moments", path,
                    "sharded ranks" if sharded_state else "one process",
                    f"{world} ranks" if world > 1 else "one process")
    if scheduler is not None and (path / "scheduler.pt").is_file():
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    rng_file = path / f"rng-rank{rank}.pt" if sharded_state else path / "rng.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    else:  # a rank beyond the world that saved the state
        log.warning("%s has no %s: rank %d starts its own random stream", path, rng_file.name, rank)
    return state


def read_state(path: str | Path) -> TrainerState:
    """The bookkeeping of a committed state folder (version, step, baseline, trained entries,
    published versions), without touching any torch object.

    Raises:
        FileNotFoundError: ``path`` is not a committed state.
    """
    path = Path(path)
    if not (path / MARKER).exists():
        raise FileNotFoundError(f"{path} is not a committed trainer state")
    meta = json.loads((path / STATE_FILE).read_text())
    return TrainerState(path=path, version=int(meta["version"]), step=int(meta["step"]),
                        baseline=meta["baseline"],
                        trained=[(str(a), str(b), int(c)) for a, b, c in meta["trained"]],
                        published=[int(v) for v in meta.get("published", [])])


def record_published(root: str | Path, version: int) -> None:
    """Durably record that ``version`` is about to be published: the file written and fsynced
    under a temp name, renamed over ``PUBLISHED``, then ``root`` fsynced (the rename is durable
    only then: fsync(2), NOTES)."""
    import os

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{PUBLISHED_FILE}.tmp"
    with open(tmp, "w") as f:
        f.write(str(version))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / PUBLISHED_FILE)
    fsync_folder(root)


def published_floor(root: str | Path) -> int:
    """The highest version ever recorded by `record_published` under ``root`` (0 if none)."""
    path = Path(root) / PUBLISHED_FILE
    return int(path.read_text()) if path.is_file() else 0


def trained_lists(root: str | Path) -> list[tuple[str, str, int]]:
    """The ``trained`` entries of every kept state, oldest state first. A restarted trainer
    acknowledges them all again (idempotent), which also repairs an acknowledgement that a
    crashed Redis lost from its last second of AOF."""
    out: list[tuple[str, str, int]] = []
    for v in committed_versions(root):
        meta = json.loads((version_dir(root, v) / STATE_FILE).read_text())
        out += [(str(a), str(b), int(c)) for a, b, c in meta["trained"]]
    return out

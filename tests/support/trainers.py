"""Stand-ins around a real `Publishing` trainer, for the unit tests of how a trainer publishes a
version (tests/unit/test_trainer_durability.py, tests/unit/test_trainer_nonfinite.py): a policy
that saves a two-file model, a synchronizer and a store that record the calls they get in a
shared ``log`` list, and a trainer with the state of step 1 that `Publishing._publish` runs on
with real folders."""

from __future__ import annotations

from pathlib import Path

from serve_rft.config import Config
from serve_rft.trainer.intake.feed import ExperienceFeed
from serve_rft.trainer.publishing.publishing import Publishing
from serve_rft.trainer.publishing.state import save_state


class TinyModel:
    """A model whose ``save_pretrained`` writes ``model.safetensors`` (7 bytes) and an empty
    ``config.json`` into ``path``."""

    def save_pretrained(self, path, safe_serialization=True):
        """Writes the two files into the existing folder ``path``."""
        (Path(path) / "model.safetensors").write_bytes(b"weights")
        (Path(path) / "config.json").write_text("{}")


class StandInPolicy:
    """A policy trainer whose weights are always finite, that publishes a `TinyModel` and saves
    a real trainer state with `serve_rft.trainer.publishing.state.save_state` (no optimizer, no tokenizer)."""

    def publish_model(self):
        """Returns a new `TinyModel`."""
        return TinyModel()

    def check_finite(self) -> None:
        """Passes: the stand-in holds no tensors."""

    def save(self, root, model, version, step, trained, tokenizer_dir, keep, published):
        """Saves ``model`` as the state of ``version`` / ``step`` under ``root``; returns what
        `save_state` returns."""
        return save_state(root, model, None, version, step, None, trained, None, keep, published=published)


class StandInRemote:
    """A Ray actor method stand-in: ``await remote(*args)`` appends ``(name,)`` to ``log`` and
    returns ``value``."""

    def __init__(self, log, name, value=None):
        self.log, self.name, self.value = log, name, value

    async def remote(self, *args):
        """Records the call; returns ``value``."""
        self.log.append((self.name,))
        return self.value


class StandInSynchronizer:
    """A synchronizer handle: ``in_use_versions`` returns ``[]`` (recorded nowhere), ``publish``
    records ``("announce",)`` in ``log``."""

    def __init__(self, log):
        self.in_use_versions = StandInRemote([], "in_use", [])
        self.publish = StandInRemote(log, "announce")


class StandInStore:
    """An experience store whose ``ack_entries`` records ``("ack",)`` in ``log`` and reports every
    entry acknowledged, none missing."""

    def __init__(self, log):
        self.log = log

    async def ack_entries(self, entries, state="trained"):
        """Records the call; returns ``(len(entries), 0)``."""
        self.log.append(("ack",))
        return len(entries), 0


class PublishingTrainer(Publishing):
    """A real `Publishing` at step 1, version 1, in phase ``training``, with one unsaved trained
    entry, ``save_interval`` 1 (every publish saves) and verification off; its state root is
    ``tmp / "trainer_state"``, its feed reads a `StandInStore` that records into ``log``."""

    def __init__(self, tmp: Path, log):
        self.cfg = Config()
        self.cfg.trainer.save_interval = 1
        self.cfg.synchronizer.verify = False
        self.state_root = tmp / "trainer_state"
        self.model_path = str(tmp)
        self.step_num = self.version = 1
        self.phase = "training"
        self.published = None
        self.unpublished, self.unsaved = [], [("1-0", "c:0", 1)]
        self.publishes_since_save = 0
        self.feed = ExperienceFeed(self.cfg.trainer, StandInStore(log))

"""The weight-sync method interface (Twinkle's CheckpointEngine documentation: prepare, send, receive, finalize).

A method moves one policy version from the trainer to an explorer replica. The trainer calls
``prepare`` once and ``send`` per published version; ``send`` returns a *handle* (a small dict,
possibly holding Ray ObjectRefs) that the synchronizer hands to each replica in its `SyncOrder`;
the replica calls ``receive`` with it. Replicas sync at different times (rolling), so a handle
must stay loadable until every replica moved past its version. A new method is one subclass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Awaitable, Callable, ClassVar, Collection


class EngineUnchanged(Exception):
    """``receive`` failed before it touched the engine: it still serves its previous version
    (nothing to restore)."""


class EngineBroken(Exception):
    """``receive`` failed and the engine cannot be restored in place (e.g. its workers are stuck
    in a broken collective): the replica must be replaced."""


class MethodUnavailable(RuntimeError):
    """The configured sync method cannot run on this machine (the message says what to use)."""


class WeightSyncMethod(ABC):
    """One way of moving weights: trainer side (``prepare``/``send``/``serve_window``/
    ``finalize``) and replica side (``receive``)."""

    name: ClassVar[str]
    handshake: ClassVar[bool] = False
    """True when a transfer needs the trainer in it at the same time (NCCL, the two-way
    handshake): the trainer then calls ``serve_window`` after each publish."""

    durable: ClassVar[bool] = False
    """True when a published version stays loadable after the trainer process that published
    it died (CHECKPOINT folders); a restarted trainer republishes otherwise."""

    engine_transfer: ClassVar[str | None] = None
    """The vLLM weight-transfer backend (``weight_transfer_config``) a replica's engine must
    enable to receive this method's versions (NCCL: ``"nccl"``); None: the engine loads them
    through its worker extension alone."""

    @classmethod
    def check_available(cls) -> None:
        """Fail fast, before anything starts, if this machine cannot run the method.

        Raises:
            MethodUnavailable: a prerequisite (a device, a vLLM feature) is missing.
        """

    def prepare(self) -> None:
        """Trainer side, once before the first ``send`` (folders, process groups)."""

    def latest_version(self) -> int:
        """Trainer side: the newest version this method already holds from an earlier trainer
        process (committed folders survive a restart; memory does not): 0 if none. A restarted
        trainer numbers new versions after it, so a version number never names two weights."""
        return 0

    @abstractmethod
    def send(self, model, version: int, in_use: Collection[int] | None = ()) -> dict[str, Any]:
        """Trainer side: publish ``model``'s weights as ``version``.

        Args:
            model: a transformers ``PreTrainedModel`` (any device).
            in_use: versions a replica serves, restores to on a failed load, is loading, or the
                synchronizer holds a handle of: their data must stay loadable, whatever their
                age (None: not known yet, e.g. a restarted synchronizer; drop nothing).
        Returns:
            The handle replicas pass to ``receive`` (``{"method": name, ...}``).
        """

    @abstractmethod
    async def receive(self, engine, handle: dict[str, Any], version: int) -> dict[str, float]:
        """Replica side: load the version behind ``handle`` into ``engine`` (an
        `ExplorerEngine`, paused by the caller) and label it ``version``.

        Returns:
            Timings and sizes: ``seconds``, ``bytes``; ``version`` if the version loaded is not
            ``version`` (NCCL sends the trainer's current one).
        Raises:
            EngineUnchanged: failed before touching the engine.
            EngineBroken: the engine cannot be restored in place.
            Whatever the transfer or vLLM's loader raises; the caller restores the previous version.
        """

    async def precheck(self, handle: dict[str, Any]) -> None:
        """Replica side, before it drains: check what can be checked without touching the engine
        (CHECKPOINT: the folder's checksums, `verify.check_folder`).

        Raises:
            serve_rft.weights.verify.VersionCorrupt: the bytes do not match.
        """

    async def serve_window(self, version: int, lagging: Callable[[], Awaitable[int]],
                           timeout_s: float) -> float:
        """Trainer side, after publishing ``version``, for handshake methods: hold the weights
        while replicas pull, until ``lagging()`` is 0 or ``timeout_s`` passed.

        Returns:
            Seconds the trainer waited (0 for pull-only methods).
        """
        return 0.0

    def peer_waiting(self) -> bool:
        """Trainer side, for handshake methods: a replica waits now for the trainer to join a
        transfer (the trainer then opens a ``serve_window``). Always False for pull-only methods."""
        return False

    def trainer_peer(self):
        """Trainer side: the object the trainer's per-replica transfer calls go to (NCCL: its
        `serve_rft.weights.nccl_sender.NcclSender`).

        Raises:
            RuntimeError: this method has no trainer-side peer (pull-only methods).
        """
        raise RuntimeError(f"sync method {self.name} has no trainer-side peer")

    def finalize(self) -> None:
        """Release what ``prepare``/``send`` hold."""

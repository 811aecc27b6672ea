"""The weight-sync method interface (seed 004's CheckpointEngine: prepare, send, receive, finalize).

A method moves one policy version from the trainer to an explorer replica. The trainer calls
``prepare`` once and ``send`` per published version; ``send`` returns a *handle* (a small dict,
possibly holding Ray ObjectRefs) that the synchronizer hands to each replica in its `SyncOrder`;
the replica calls ``receive`` with it. Replicas sync at different times (rolling), so a handle
must stay loadable until every replica moved past its version. A new method is one subclass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar


class WeightSyncMethod(ABC):
    """One way of moving weights: trainer side (``prepare``/``send``/``finalize``) and replica
    side (``receive``)."""

    name: ClassVar[str]

    def prepare(self) -> None:
        """Trainer side, once before the first ``send`` (folders, process groups)."""

    @abstractmethod
    def send(self, model, version: int, in_use_floor: int | None = None) -> dict[str, Any]:
        """Trainer side: publish ``model``'s weights as ``version``.

        Args:
            model: a transformers ``PreTrainedModel`` (any device).
            in_use_floor: oldest version a live replica serves; its data must stay loadable.
        Returns:
            The handle replicas pass to ``receive`` (``{"method": name, ...}``).
        """

    @abstractmethod
    async def receive(self, engine, handle: dict[str, Any], version: int) -> dict[str, float]:
        """Replica side: load the version behind ``handle`` into ``engine`` (an
        `ExplorerEngine`, paused by the caller) and label it ``version``.

        Returns:
            Timings and sizes: ``seconds``, ``bytes``.
        Raises:
            Whatever the transfer or vLLM's loader raises; the caller restores the previous version.
        """

    def finalize(self) -> None:
        """Release what ``prepare``/``send`` hold."""

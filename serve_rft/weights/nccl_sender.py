"""NCCL, the trainer's side: rank 0 of every replica's group, the send lock and the sync window.

See `serve_rft.weights.nccl` for the groups, the two-way handshake and the failure rules;
**unverified on this project's machines** (CPU only) like the rest of the NCCL method.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

RANK_OFFSET = 1  # the trainer is rank 0 of every group, a replica's workers follow


def update_info(model) -> dict[str, list]:
    """vLLM's ``NCCLWeightTransferUpdateInfo`` for ``model``: parameter names (checkpoint names,
    tied weights once), dtype names and shapes, in the order the trainer broadcasts them."""
    names, dtypes, shapes = [], [], []
    for name, p in model.named_parameters():
        names.append(name)
        dtypes.append(str(p.dtype).split(".")[-1])
        shapes.append(list(p.shape))
    return {"names": names, "dtype_names": dtypes, "shapes": shapes}


class _ReplicaDrivenClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol, all no-ops: in this service the *replica*
    makes these engine calls itself (it pauses and labels its own engine), at the same time as
    the trainer's side of each collective."""

    def init_weight_transfer_engine(self, init_info: dict) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


def worker_init_info(master_address: str, master_port: int, world_size: int, bucket_bytes: int) -> dict:
    """vLLM's worker-side ``NCCLWeightTransferInitInfo`` payload for one replica's group. The
    trainer builds it (and joins with the same wire parameters, `_vllm_connect`), so both sides
    cut the packed stream into the same buckets."""
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

    return worker_init_payload(NCCLWeightTransferInitInfo(
        master_address=master_address, master_port=master_port, rank_offset=RANK_OFFSET,
        world_size=world_size, packed=True, packed_buffer_size_bytes=bucket_bytes))


def _vllm_connect(init_info: dict, model):
    """Join rank 0 of a replica's group with vLLM's trainer engine (blocks until the replica's
    workers join). ``init_info`` is the `worker_init_info` the replica joins with. Returns the
    engine (``send_weights()``, ``shutdown()``)."""
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                              NCCLTrainerWeightTransferEngine)

    info = NCCLTrainerInitInfo(master_address=init_info["master_address"],
                               master_port=init_info["master_port"],
                               world_size=init_info["world_size"], rank=0, packed=True,
                               packed_buffer_size_bytes=init_info["packed_buffer_size_bytes"],
                               packed_num_buffers=init_info["packed_num_buffers"])
    return NCCLTrainerWeightTransferEngine.trainer_init(info, client=_ReplicaDrivenClient(),
                                                        source=ModuleSource(model))


class NcclSender:
    """Trainer side: one vLLM trainer engine per replica group, the send lock and the sync window.

    Args:
        connect: ``(init_info, model) -> engine`` joining a group as rank 0 (vLLM's by default;
            unit tests pass a fake). Runs in a thread: it blocks until the replica joins.
        reserve_timeout_s: how long a replica may wait for a window before `reserve` fails.
        lease_s: a reservation not followed by `broadcast` within this long is released (the
            replica died between the two calls).
        transfer_timeout_s: bound on joining a group and on one broadcast; on timeout the group
            is shut down (NCCL abort), which frees the thread blocked in the collective.
        bucket_bytes: the packed broadcast's bucket size (``synchronizer.bucket_bytes``).
    """

    def __init__(self, connect: Callable[[dict, Any], Any] = _vllm_connect,
                 reserve_timeout_s: float = 30.0, lease_s: float = 30.0,
                 transfer_timeout_s: float = 300.0, bucket_bytes: int = 32 << 20):
        self._connect = connect
        self.transfer_timeout_s = transfer_timeout_s
        self.bucket_bytes = bucket_bytes
        self.reserve_timeout_s = reserve_timeout_s
        self.lease_s = lease_s
        self.model = None
        self.version = 0
        self.groups: dict[str, Any] = {}
        self.waiting = 0
        self.window_open = False
        self._window = asyncio.Event()
        self._lock = asyncio.Lock()
        self._holder: str | None = None
        self._lease: asyncio.TimerHandle | None = None

    def endpoint(self, world_size: int) -> dict:
        """The worker init info of a new group: this node's address, a free TCP port for the
        rendezvous (rank 0 hosts it), ``world_size`` ranks, this sender's bucket size."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return worker_init_info(ray.util.get_node_ip_address(), port, world_size, self.bucket_bytes)

    async def _bounded(self, replica_id: str, group, fn) -> None:
        """Run the blocking collective ``fn`` in a thread for at most ``transfer_timeout_s``;
        on any failure shut ``group`` down (aborting its communicator frees the thread)."""
        try:
            await asyncio.wait_for(asyncio.to_thread(fn), self.transfer_timeout_s)
        except BaseException:
            if self.groups.get(replica_id) is group:
                del self.groups[replica_id]
            if group is not None:
                group.shutdown()
            raise

    async def connect(self, replica_id: str, init_info: dict) -> dict[str, list]:
        """Join ``replica_id``'s group as rank 0 (the replica joins concurrently).

        Returns:
            The update info (names, dtype names, shapes) the replica's workers receive with.
        Raises:
            RuntimeError: no model yet (nothing published).
        """
        if self.model is None:
            raise RuntimeError("the trainer has not published a version yet")
        async with self._lock:  # never set up a communicator while another one broadcasts
            old = self.groups.pop(replica_id, None)
            if old is not None:
                old.shutdown()
            made: list = []
            await self._bounded(replica_id, None,
                                lambda: made.append(self._connect(init_info, self.model)))
            self.groups[replica_id] = made[0]
        return update_info(self.model)

    async def reserve(self, replica_id: str) -> int:
        """Wait for a sync window and take the send lock for ``replica_id``.

        Returns:
            The version the coming broadcast carries (the window's).
        Raises:
            TimeoutError: no window within ``reserve_timeout_s`` (the engine is untouched).
            KeyError: ``replica_id`` has no group (`connect` first).
        """
        if replica_id not in self.groups:
            raise KeyError(f"replica {replica_id} has no NCCL group with the trainer")
        self.waiting += 1
        try:
            async with asyncio.timeout(self.reserve_timeout_s):
                while True:
                    await self._window.wait()
                    await self._lock.acquire()
                    if self.window_open:
                        break
                    self._lock.release()  # the window closed while we queued for the lock
        finally:
            self.waiting -= 1
        self._holder = replica_id
        self._lease = asyncio.get_running_loop().call_later(self.lease_s, self._expire, replica_id)
        return self.version

    def _expire(self, replica_id: str) -> None:
        if self._holder == replica_id:
            self._release()

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None
        self._holder = None
        if self._lock.locked():
            self._lock.release()

    async def broadcast(self, replica_id: str) -> dict[str, float]:
        """Broadcast the window's weights to ``replica_id``'s group (its workers receive at the
        same time), then release the lock.

        Returns:
            ``seconds`` and ``bytes`` sent.
        Raises:
            RuntimeError: ``replica_id`` does not hold the reservation (it expired).
            TimeoutError: the broadcast took longer than ``transfer_timeout_s``.
            Whatever the collective raises. Either way the group is shut down and dropped (the
            replica is replaced and connects anew).
        """
        if self._holder != replica_id:
            raise RuntimeError(f"replica {replica_id} does not hold the trainer's send reservation")
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None
        t0 = time.perf_counter()
        group = self.groups.get(replica_id)
        try:
            if group is None:
                raise KeyError(f"replica {replica_id} has no NCCL group with the trainer")
            await self._bounded(replica_id, group, group.send_weights)
        finally:
            self._release()
        nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return {"seconds": time.perf_counter() - t0, "bytes": float(nbytes)}

    async def serve_window(self, version: int, lagging: Callable[[], Awaitable[int]],
                           timeout_s: float, poll_s: float = 0.05) -> float:
        """The trainer's half of the handshake: keep the weights at ``version`` and let replicas
        pull until ``lagging()`` (live replicas due for a sync still below ``version``) is 0 and
        nobody waits or holds the lock, or ``timeout_s`` passed. The caller must not touch the
        weights until this returns.

        Returns:
            Seconds the window stayed open.
        """
        t0 = time.monotonic()
        self.version = version
        self.window_open = True
        self._window.set()
        try:
            while time.monotonic() - t0 < timeout_s:
                if self.waiting == 0 and not self._lock.locked() and await lagging() == 0:
                    break
                await asyncio.sleep(poll_s)
        finally:
            self.window_open = False
            self._window.clear()
            async with self._lock:  # a broadcast in progress finishes before the weights change
                pass
        return time.monotonic() - t0

    def shutdown(self) -> None:
        for group in self.groups.values():
            group.shutdown()
        self.groups.clear()

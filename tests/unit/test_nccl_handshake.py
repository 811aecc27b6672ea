"""NCCL method: the two-way handshake between a replica and the trainer, on CPU with fakes.

The collective itself (vLLM's NCCL engines) needs CUDA (`tests/gpu/test_nccl_sync.py`); here a
fake group stands in for it and proves the ordering the real one needs: the trainer broadcasts
only inside a sync window, while the replica's workers are receiving, one replica at a time,
and failures are classified so a replica never serves half a version.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from serve_rft.weights import EngineBroken, LoadFailed, load_or_restore
from serve_rft.weights.nccl import NcclMethod
from serve_rft.weights.nccl_sender import NcclSender, update_info


class FakeGroup:
    """Stands in for vLLM's trainer engine of one group: ``send_weights`` is a collective that
    completes only while the replica's side is receiving."""

    def __init__(self, fail: bool = False):
        self.receiving = threading.Event()
        self.sent = threading.Event()
        self.fail = fail
        self.aborted = threading.Event()
        self.sends = 0
        self.closed = False

    def send_weights(self) -> None:
        if not self.receiving.wait(5):
            raise RuntimeError("broadcast without a receiver would hang in NCCL")
        self.sends += 1
        if self.fail:  # a real peer failure leaves the sender blocked in the collective ...
            self.aborted.wait(30)  # ... until its communicator is aborted (shutdown)
            raise RuntimeError("NCCL error: communicator aborted")
        self.sent.set()

    def shutdown(self) -> None:
        self.closed = True
        self.aborted.set()


class FakeEngine:
    def __init__(self, sender: NcclSender, groups: dict, replica_id: str = "r1"):
        self.replica_id = replica_id
        self.world_size = 1
        self.nccl_update_info = None
        self.policy_version = 0
        self.calls: list[str] = []
        self.groups = groups

    async def init_weight_transfer(self, init_info: dict) -> None:
        self.calls.append("init")

    async def start_weight_update(self) -> None:
        self.calls.append("start")

    async def update_weights(self, info: dict) -> None:
        self.calls.append("update")
        group = self.groups[self.replica_id]
        group.receiving.set()
        assert await asyncio.to_thread(group.sent.wait, 5), "the trainer never broadcast"

    async def finish_weight_update(self, version: int) -> None:
        self.calls.append(f"finish:{version}")
        self.policy_version = version


class Peers:
    """The synchronizer + trainer calls, in process."""

    def __init__(self, sender: NcclSender):
        self.sender = sender

    async def group(self, replica_id, world_size):
        return {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": world_size}

    async def connect(self, replica_id, init):
        return await self.sender.connect(replica_id, init)

    async def reserve(self, replica_id):
        return await self.sender.reserve(replica_id)

    async def broadcast(self, replica_id):
        return await self.sender.broadcast(replica_id)


def _setup(fail: bool = False, reserve_timeout_s: float = 5.0):
    groups: dict[str, FakeGroup] = {}

    def connect(init_info, model):
        groups["r1"] = FakeGroup(fail)
        return groups["r1"]

    sender = NcclSender(connect=connect, reserve_timeout_s=reserve_timeout_s, transfer_timeout_s=1.0)
    model = torch.nn.Linear(4, 3)
    method = NcclMethod(timeout_s=10, peers=Peers(sender), sender=sender)
    handle = method.send(model, 7)
    return sender, method, handle, FakeEngine(sender, groups), groups


def test_update_info_lists_parameters_in_broadcast_order():
    info = update_info(torch.nn.Linear(4, 3))
    assert info == {"names": ["weight", "bias"], "dtype_names": ["float32", "float32"],
                    "shapes": [[3, 4], [3]]}


def test_replica_pulls_inside_the_trainers_window_and_is_labelled_with_its_version():
    sender, method, handle, engine, groups = _setup()
    lagging = {"n": 1}

    async def main():
        async def lag():
            return lagging["n"]

        pull = asyncio.create_task(method.receive(engine, handle, 7))
        await asyncio.sleep(0.2)
        assert not pull.done() and sender.waiting == 1, "the replica must wait for a window"
        window = asyncio.create_task(sender.serve_window(9, lag, timeout_s=10))
        info = await pull
        lagging["n"] = 0  # the replica reported back to the synchronizer
        waited = await window
        return info, waited

    info, waited = asyncio.run(main())
    assert engine.calls == ["init", "start", "update", "finish:9"]
    assert info["version"] == 9 and engine.policy_version == 9  # the window's version, not the order's
    assert info["bytes"] == (12 + 3) * 4
    assert groups["r1"].sends == 1 and waited < 5


def test_window_closes_when_nobody_lags_and_a_later_reservation_waits_for_the_next():
    sender, method, handle, engine, groups = _setup(reserve_timeout_s=0.3)

    async def main():
        async def none():
            return 0

        waited = await sender.serve_window(3, none, timeout_s=10)
        await sender.connect("r1", {})
        with pytest.raises(TimeoutError):
            await sender.reserve("r1")
        return waited

    assert asyncio.run(main()) < 0.5
    assert sender.waiting == 0 and not sender._lock.locked()


def test_window_times_out_when_a_replica_never_comes():
    sender, *_ = _setup()

    async def main():
        async def one():
            return 1

        return await sender.serve_window(3, one, timeout_s=0.3)

    assert 0.3 <= asyncio.run(main()) < 1.0


def test_a_reservation_without_broadcast_is_released_after_its_lease():
    sender, *_ = _setup()
    sender.lease_s = 0.2
    reserved = []

    async def main():
        async def lag():  # the replica lags until it reserved (then it is gone: no report)
            return 0 if reserved else 1

        await sender.connect("r1", {})
        window = asyncio.create_task(sender.serve_window(2, lag, timeout_s=5))
        await asyncio.sleep(0.05)
        reserved.append(await sender.reserve("r1"))  # ... and the replica dies before broadcasting
        assert reserved == [2]
        assert await window < 1.0  # closes once the lease ran out
        with pytest.raises(RuntimeError, match="does not hold"):
            await sender.broadcast("r1")

    asyncio.run(main())
    assert not sender._lock.locked()


def test_no_window_means_the_engine_is_untouched_and_nothing_is_restored():
    sender, method, handle, engine, groups = _setup(reserve_timeout_s=0.2)
    restored = []

    async def main():
        import serve_rft.weights as methods

        real = methods.receiver_for

        def receiver_for(h):
            if h is handle:
                return method
            restored.append(h)
            return real(h)

        methods.receiver_for = receiver_for
        try:
            with pytest.raises(LoadFailed, match="no sync window"):
                await load_or_restore(engine, handle, 7, {"method": "checkpoint", "path": "/x"}, 0)
        finally:
            methods.receiver_for = real

    asyncio.run(main())
    assert "start" not in engine.calls and restored == [] and engine.policy_version == 0


def test_a_hung_collective_is_bounded_engine_broken_and_the_trainer_aborts_the_group():
    """A peer failure blocks the trainer's broadcast; after transfer_timeout_s the trainer
    aborts the communicator (freeing its thread), releases the lock and closes the window."""
    sender, method, handle, engine, groups = _setup(fail=True)
    engine.update_weights = _receive_then_fail(engine, groups)
    method.timeout_s = 5

    async def main():
        async def one():
            return 1

        window = asyncio.create_task(sender.serve_window(4, one, timeout_s=2))
        with pytest.raises(EngineBroken, match="NCCL transfer of version 4 failed"):
            await method.receive(engine, handle, 4)
        assert await window < 3

    asyncio.run(main())
    assert groups["r1"].closed and "r1" not in sender.groups
    assert engine.policy_version == 0 and not sender._lock.locked()


def _receive_then_fail(engine, groups):
    async def update_weights(info):
        groups[engine.replica_id].receiving.set()
        raise RuntimeError("worker ran out of memory")  # the trainer is left in the collective
    return update_weights


def test_trainer_and_worker_init_info_agree_with_vllm(monkeypatch):
    """The payload the replica's workers join with parses as vLLM's worker init info, and the
    trainer joins rank 0 with the same wire parameters (vLLM's trainer engine, endpoint faked)."""
    from vllm.distributed.weight_transfer import nccl_engine
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    from serve_rft.weights.nccl_sender import _vllm_connect, worker_init_info

    payload = worker_init_info("10.0.0.1", 29555, world_size=3, bucket_bytes=1 << 20)
    worker = NCCLWeightTransferInitInfo(**payload)
    assert (worker.rank_offset, worker.world_size, worker.packed) == (1, 3, True)
    seen = {}

    def fake_endpoint(info):
        seen.update(address=info.master_address, port=info.master_port, world=info.world_size,
                    rank=info.rank, packed=info.packed, bucket=info.packed_buffer_size_bytes,
                    buffers=info.packed_num_buffers)
        return object()

    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", fake_endpoint)
    engine = _vllm_connect(payload, torch.nn.Linear(4, 3))
    assert engine.is_sender and engine.packed
    assert seen == {"address": "10.0.0.1", "port": 29555, "world": 3, "rank": 0, "packed": True,
                    "bucket": worker.packed_buffer_size_bytes, "buffers": worker.packed_num_buffers}
    assert (engine.packed_buffer_size_bytes, engine.packed_num_buffers) == (1 << 20, worker.packed_num_buffers)


def test_update_info_equals_vllms_module_source_metadata():
    from vllm.distributed.weight_transfer.base import ModuleSource

    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5))
    info = update_info(model)
    meta = ModuleSource(model).metadata()
    assert info["names"] == [m.name for m in meta]
    assert info["shapes"] == [list(m.shape) for m in meta]
    assert info["dtype_names"] == [str(m.dtype).split(".")[-1] for m in meta]

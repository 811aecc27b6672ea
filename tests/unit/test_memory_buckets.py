import asyncio
import os

import pytest
import torch

from serve_rft.weights.memory import checkpoint_tensors, iter_buckets


def test_buckets_respect_the_byte_bound_and_keep_order():
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 10, 30, 5, 100])]
    buckets = list(iter_buckets(iter(tensors), bucket_bytes=4 * 25))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]
    for b in buckets:
        size = sum(t.numel() * 4 for _, t in b)
        assert size <= 100 or len(b) == 1  # a tensor larger than a bucket travels alone
    assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]


def test_the_tensors_of_one_block_travel_in_one_bucket():
    """The parts vLLM fuses into one layer (siblings under one module) are never split; a block
    larger than a bucket travels alone; order is kept."""
    t = lambda n: torch.zeros(n, dtype=torch.float32)  # noqa: E731
    tensors = [("model.embed.weight", t(20)),
               ("model.layers.0.attn.q.weight", t(10)), ("model.layers.0.attn.k.weight", t(10)),
               ("model.layers.0.attn.v.weight", t(10)),
               ("model.layers.0.mlp.gate.weight", t(30)), ("model.layers.0.mlp.up.weight", t(30)),
               ("model.layers.0.norm.weight", t(2)), ("model.layers.1.norm.weight", t(2)), ("x", t(1))]
    buckets = [[n for n, _ in b] for b in iter_buckets(iter(tensors), bucket_bytes=4 * 40)]
    assert buckets == [["model.embed.weight"],
                       ["model.layers.0.attn.q.weight", "model.layers.0.attn.k.weight", "model.layers.0.attn.v.weight"],
                       ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.up.weight"],
                       ["model.layers.0.norm.weight", "model.layers.1.norm.weight", "x"]]


def test_in_a_packed_bucket_a_blocks_weights_lie_together_before_its_biases():
    """q, k, v weights next to each other in that order (vLLM's fused ``qkv_proj``), not between
    their biases; blocks keep their order."""
    import json
    import struct

    from serve_rft.weights.memory import pack_bucket

    names = ["model.embed.weight", "m.l.0.attn.q.weight", "m.l.0.attn.q.bias", "m.l.0.attn.k.weight",
             "m.l.0.attn.k.bias", "m.l.0.attn.v.weight", "m.l.0.attn.v.bias", "m.l.0.attn.o.weight",
             "m.l.0.norm.weight"]
    blob = pack_bucket([(n, torch.zeros(2)) for n in names])
    n = struct.unpack("<Q", bytes(blob[:8]))[0]
    header = json.loads(bytes(blob[8:8 + n]))
    assert sorted(header, key=lambda k: header[k]["data_offsets"][0]) == [
        "model.embed.weight", "m.l.0.attn.q.weight", "m.l.0.attn.k.weight", "m.l.0.attn.v.weight",
        "m.l.0.attn.o.weight", "m.l.0.attn.q.bias", "m.l.0.attn.k.bias", "m.l.0.attn.v.bias",
        "m.l.0.norm.weight"]


def test_checkpoint_tensors_send_tied_weights_once(embedded_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(embedded_model), dtype=torch.float32)
    names = [n for n, _ in checkpoint_tensors(model)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names))
    first = dict(checkpoint_tensors(model))["model.embed_tokens.weight"]
    with torch.no_grad():
        model.model.embed_tokens.weight += 1  # a snapshot, not a view of the live weights
    assert not torch.equal(first, model.model.embed_tokens.weight)


def test_a_packed_bucket_is_a_safetensors_file_and_unpacks_to_the_same_tensors():
    from safetensors.torch import load

    from serve_rft.weights.memory import pack_bucket, unpack_bucket

    bucket = [("a.weight", torch.randn(3, 4)), ("b", torch.arange(5, dtype=torch.bfloat16)),
              ("c", torch.tensor([1, 2], dtype=torch.int64))]
    blob = pack_bucket(bucket)
    assert blob.dtype.name == "uint8" and blob.ndim == 1
    got = unpack_bucket(blob)
    assert set(got) == {n for n, _ in bucket}
    for name, t in bucket:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)
    assert load(bytes(blob)).keys() == got.keys()  # what safetensors' own readers read
    # the tensors lie in the bucket's order (safetensors' own writer sorts them by name)
    import json
    import struct

    n = struct.unpack("<Q", bytes(blob[:8]))[0]
    header = json.loads(bytes(blob[8:8 + n]))
    assert sorted(bucket, key=lambda nt: header[nt[0]]["data_offsets"][0]) == bucket


class _Ref:
    """Stands in for a Ray ObjectRef of a packed bucket: awaiting it gives the blob."""

    def __init__(self, blob):
        self.blob = blob

    def __await__(self):
        async def fetch():
            await asyncio.sleep(0)
            return self.blob
        return fetch().__await__()


class _Engine:
    """Records what a replica's engine is asked; its load of a staged file lasts until the next
    bucket is staged beside it (up to 1 s: a replica that does not pipeline fails the test)."""

    def __init__(self, tmp_path, fail_at: int | None = None, hold_s: float = 0.0, reusable: bool = False):
        self.tmp_path, self.fail_at, self.hold_s = tmp_path, fail_at, hold_s
        self.staged_files_reusable = reusable
        self.paths: list[str] = []
        self.loaded: list[dict] = []
        self.staged_peak = 0
        self.loading = False
        self.finished = None
        self.n = 0

    def staging_path(self) -> str:
        self.n += 1
        return str(self.tmp_path / f"bucket-{self.n}.safetensors")

    def staged(self) -> int:
        return len(list(self.tmp_path.glob("bucket-*")))

    async def begin_update(self):
        pass

    async def load_bucket(self, path):
        from safetensors.torch import load_file

        self.paths.append(path)
        self.loading = True
        try:
            await asyncio.sleep(self.hold_s)
            for _ in range(100):  # until the next bucket is staged beside this one (or none is left)
                if self.staged() >= 2 or self.n == len(BUCKETS):
                    break
                await asyncio.sleep(0.01)
            self.staged_peak = max(self.staged_peak, self.staged())
            if self.fail_at is not None and len(self.loaded) == self.fail_at:
                raise RuntimeError("the loader refused the tensors")
            # copies: an engine keeps nothing of the file (safetensors' tensors are views of it)
            self.loaded.append({n: t.clone() for n, t in load_file(path).items()})
        finally:
            self.loading = False  # the file is the caller's to remove

    async def finish_update(self, version):
        self.finished = version


def _handle(buckets, corrupt: int | None = None):
    from serve_rft.weights.memory import pack_bucket
    from serve_rft.weights.verify import digest

    blobs = [pack_bucket(b) for b in buckets]
    sums = [digest(b) for b in blobs]
    if corrupt is not None:
        flipped = blobs[corrupt].copy()
        flipped[-1] ^= 0xFF  # one byte of the last tensor's data
        blobs[corrupt] = flipped
    return {"method": "memory", "bytes": 0, "buckets": [_Ref(b) for b in blobs], "checksums": sums}


BUCKETS = [[(f"w{i}.{j}", torch.full((64,), float(i * 10 + j))) for j in range(2)] for i in range(5)]


def test_receive_pipelines_buckets_with_at_most_two_staged_files(tmp_path):
    """Bucket k+1 is fetched, written and checked while the engine loads bucket k: at most two
    staged files exist at once (one loading, one waiting), all removed at the end, every
    bucket loaded once in order, then the update finished with its version."""
    from serve_rft.weights.memory import MemoryMethod

    engine = _Engine(tmp_path)
    info = asyncio.run(MemoryMethod().receive(engine, _handle(BUCKETS), 7))
    assert [list(b) for b in engine.loaded] == [[n for n, _ in b] for b in BUCKETS]
    assert all(torch.equal(engine.loaded[i][n], t) for i, b in enumerate(BUCKETS) for n, t in b)
    assert engine.staged_peak == 2 and engine.staged() == 0
    assert engine.finished == 7
    assert {"seconds", "bytes", "fetch_s", "stage_s", "engine_s", "finish_s"} <= info.keys()


def test_with_a_reusable_engine_two_files_take_turns_and_each_bucket_loads_intact(tmp_path):
    """An engine that keeps nothing of a file once loaded (the direct load): the buckets are
    written over two files in turn, never over the one loading, and both are removed at the end."""
    from serve_rft.weights.memory import MemoryMethod

    engine = _Engine(tmp_path, reusable=True)
    asyncio.run(MemoryMethod().receive(engine, _handle(BUCKETS), 7))
    assert len(set(engine.paths)) == 2 and engine.paths[0] != engine.paths[1]
    assert all(engine.paths[i] == engine.paths[i % 2] for i in range(len(BUCKETS)))
    assert all(torch.equal(engine.loaded[i][n], t) for i, b in enumerate(BUCKETS) for n, t in b)
    assert engine.staged_peak == 2 and engine.staged() == 0 and engine.finished == 7


def test_a_corrupt_bucket_never_reaches_the_engine_and_leaves_no_file(tmp_path):
    from serve_rft.weights.memory import MemoryMethod
    from serve_rft.weights.verify import VersionCorrupt

    engine = _Engine(tmp_path)
    with pytest.raises(VersionCorrupt, match="bucket 3"):
        asyncio.run(MemoryMethod().receive(engine, _handle(BUCKETS, corrupt=3), 7))
    assert len(engine.loaded) == 3  # the buckets before it; the caller restores the previous version
    assert not engine.loading and engine.staged() == 0 and engine.finished is None


def test_a_load_failure_propagates_and_leaves_no_file(tmp_path):
    from serve_rft.weights.memory import MemoryMethod

    engine = _Engine(tmp_path, fail_at=2)
    with pytest.raises(RuntimeError, match="refused"):
        asyncio.run(MemoryMethod().receive(engine, _handle(BUCKETS), 7))
    assert len(engine.loaded) == 2 and not engine.loading and engine.staged() == 0
    assert engine.finished is None


def test_a_receive_cancelled_mid_load_leaves_no_staged_file(tmp_path):
    """A sync past its timeout cancels the receive: the engine's load in flight ends first and
    no staged file is left in shared memory, whatever stage the cancel hit."""
    from serve_rft.weights.memory import MemoryMethod

    async def run(delay: float):
        engine = _Engine(tmp_path, hold_s=0.04)  # 5 buckets: the receive takes >= 0.2 s
        task = asyncio.ensure_future(MemoryMethod().receive(engine, _handle(BUCKETS), 7))
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)  # a write still running in its thread ends and is removed
        assert not engine.loading and engine.staged() == 0 and engine.finished is None

    for delay in (0.0, 0.005, 0.02, 0.05, 0.1):
        asyncio.run(run(delay))


def test_files_of_replicas_that_are_gone_are_removed_and_live_ones_kept(tmp_path):
    """A replica killed by SIGKILL mid-sync leaves its staged buckets, adapter folder and the
    folder of vLLM's IPC sockets in shared memory; the next replica to start removes them, never
    a live process's."""
    import stat
    import subprocess
    import uuid

    from serve_rft.explorer.engine.vllm_engine import remove_dead_replicas_files

    from serve_rft.explorer.engine.vllm_engine import _pid_namespace

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead, alive, ns = gone.pid, os.getpid(), _pid_namespace()
    names = {f"serve-rft-bucket-{ns}-{dead}-{uuid.uuid4().hex}.safetensors": True,
             f"serve-rft-bucket-{ns}-{alive}-{uuid.uuid4().hex}.safetensors": False,
             f"serve-rft-bucket-{ns + 1}-{dead}-{uuid.uuid4().hex}.safetensors": False,  # another pid namespace
             f"serve-rft-bucket-{ns}-99999999999-{uuid.uuid4().hex}.safetensors": False,  # no such pid
             f"serve-rft-bucket-{ns}-{dead}-not-a-uuid.safetensors": False, "other-file": False}
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    link = tmp_path / f"serve-rft-bucket-{ns}-{dead}-{uuid.uuid4().hex}.safetensors"
    link.symlink_to(tmp_path / "other-file")
    adapters = tmp_path / f"serve-rft-adapters-{ns}-{dead}-{uuid.uuid4().hex}"
    (adapters / "v000001").mkdir(parents=True)
    (adapters / "v000001" / "adapter_model.safetensors").write_bytes(b"x")
    ipc = tmp_path / f"serve-rft-ipc-{ns}-{dead}-{uuid.uuid4().hex[:8]}"  # vLLM's sockets' folder
    ipc.mkdir()
    os.mknod(ipc / str(uuid.uuid4()), stat.S_IFSOCK | 0o600)  # a socket file, as vLLM leaves them
    live_ipc = tmp_path / f"serve-rft-ipc-{ns}-{alive}-{uuid.uuid4().hex[:8]}"
    live_ipc.mkdir()
    names[live_ipc.name] = False
    removed = remove_dead_replicas_files(str(tmp_path))
    links = [p for p in tmp_path.iterdir() if p.is_symlink()]
    assert sorted(removed) == sorted([str(tmp_path / n) for n, gone_ in names.items() if gone_]
                                     + [str(adapters), str(ipc), str(link)])
    # a dead replica's symlink is removed as a link: what it points at stays
    assert not links and (tmp_path / "other-file").read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, gone_ in names.items() if not gone_)

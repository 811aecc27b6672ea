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


def test_replica_holds_at_most_one_bucket_at_a_time():
    """MEMORY receive fetches, loads and drops one bucket before fetching the next, so the
    replica's extra memory is about one bucket (the object store holds the published copy)."""
    import asyncio
    import gc
    import weakref

    from serve_rft.weights.memory import MemoryMethod

    live: set[int] = set()
    bucket_bytes = 4 * 1000
    peaks: list[int] = []

    class FetchOnAwait:  # stands in for a Ray ObjectRef: each await deserializes a new copy
        def __init__(self, sizes):
            self.sizes = sizes

        def __await__(self):
            async def fetch():
                out = []
                for n in self.sizes:
                    t = torch.zeros(n)
                    live.add(id(t))
                    weakref.finalize(t, live.discard, id(t))
                    out.append((f"w{id(t)}", t))
                return out
            return fetch().__await__()

    class Engine:
        async def begin_update(self):
            pass

        async def load_bucket(self, bucket):
            gc.collect()
            peaks.append(sum(t.numel() * 4 for _, t in bucket))
            assert len(live) == len(bucket), "a previous bucket is still alive"

        async def finish_update(self, version):
            pass

    handle = {"method": "memory", "bytes": 0, "buckets": [FetchOnAwait([500, 400]), FetchOnAwait([1000]),
                                                          FetchOnAwait([250, 250, 250])]}
    asyncio.run(MemoryMethod(bucket_bytes).receive(Engine(), handle, 1))
    assert len(peaks) == 3 and max(peaks) <= bucket_bytes

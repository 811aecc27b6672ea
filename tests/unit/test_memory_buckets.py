import torch

from serve_rft.synchronizer.methods.memory import checkpoint_tensors, iter_buckets


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


def test_tensor_wire_encoding_roundtrips_dtypes():
    from serve_rft.explorer.worker_ext import decode_tensor, encode_tensor

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.randn(3, 5).to(dtype)
        dt, shape, data = encode_tensor(t)
        assert torch.equal(decode_tensor(dt, shape, bytes(data)), t)

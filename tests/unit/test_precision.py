"""bf16 autocast whose saved weight copies are recast in the backward
(`serve_rft.trainer.policy.precision`): the same gradients as plain autocast, without holding a bf16
copy of every weight from the forward to the backward."""

from __future__ import annotations

import pytest
import torch

from serve_rft.trainer.policy import precision
from tests.support.batches import small_batch


def test_a_linear_layer_saves_its_weight_as_the_parameter_not_a_copy():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    packed = []

    def pack(t):
        packed.append(precision.leaf_cast(t))
        return precision._pack(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, precision._unpack):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            y = lin(x)
    recast = [r for r in packed if r is not None]
    assert len(recast) == 1 and recast[0].param is lin.weight and recast[0].transposed
    y.float().sum().backward()
    want_w, want_x = lin.weight.grad.clone(), x.grad.clone()
    lin.weight.grad = x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x).float().sum().backward()
    assert torch.equal(lin.weight.grad, want_w) and torch.equal(x.grad, want_x)


def _saved_bytes(model, ids, recast: bool) -> int:
    """Bytes of the tensors autograd keeps for the backward of one forward under bf16 autocast,
    counted after `precision._pack` (``recast``) or as plain autocast keeps them."""
    total = 0

    def pack(t):
        nonlocal total
        out = precision._pack(t) if recast else t
        if isinstance(out, torch.Tensor):
            total += out.numel() * out.element_size()
        return out

    with torch.autograd.graph.saved_tensors_hooks(pack, precision._unpack):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=not recast):
            model(ids).logits.float().sum().backward()
    return total


def test_the_saved_bytes_drop_by_two_per_matmul_weight(embedded_model):
    """Plain autocast keeps a bf16 copy of every decoder matmul weight (2 bytes per parameter);
    recast keeps none of them. Saved tensors of a shared storage (views) count once per save, as
    autograd holds them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(embedded_model), dtype=torch.float32)
    ids = torch.randint(2, 1000, (2, 24))
    plain, recast = _saved_bytes(model, ids, False), _saved_bytes(model, ids, True)
    matmul_weights = sum(m.weight.numel() for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear) and "layers." in n)
    assert plain - recast >= 2 * matmul_weights, (plain, recast, matmul_weights)


@pytest.mark.parametrize("impl", ["chunked", "full"])
def test_a_bf16_step_gives_plain_autocasts_gradients(embedded_model, impl):
    """`PolicyTrainer` under trainer.precision=bf16 (recast) and the same step under plain
    autocast: equal gradients, bit for bit."""
    from serve_rft.config import load_config
    from serve_rft.trainer.policy.policy import PolicyTrainer

    sets = ["trainer.lr=0.001", "trainer.precision=bf16", f"trainer.logprob_impl={impl}"]
    ours = PolicyTrainer(load_config(None, sets), str(embedded_model))
    plain = PolicyTrainer(load_config(None, sets), str(embedded_model))
    plain._autocast = lambda: torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    a, b = ours.step(small_batch()), plain.step(small_batch())
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for (name, x), y in zip(ours.model.named_parameters(), plain.model.parameters()):
        assert torch.equal(x.grad, y.grad), name

"""How the sharded step deals micro-batches to ranks and merges their figures
(`serve_rft.trainer.sharding.fsdp`); the step itself against the single process is
tests/integration/test_sharded_trainer.py."""

from __future__ import annotations

import pytest

from serve_rft.trainer.policy.micro_batches import accumulate
from serve_rft.trainer.sharding.fsdp import merge_ranks, my_parts


def test_parts_are_dealt_round_robin_and_padded_with_zero_loss_fillers():
    parts = [[0], [1, 2], [3], [4], [5]]
    assert my_parts(parts, 0, 1) == [(p, True) for p in parts]
    assert my_parts(parts, 0, 2) == [([0], True), ([3], True), ([5], True)]
    assert my_parts(parts, 1, 2) == [([1, 2], True), ([4], True), ([4], False)]
    assert my_parts([[0]], 1, 2) == [([0], False)]  # nothing of its own: a filler still runs
    dealt = [i for r in range(3) for p, counts in my_parts(parts, r, 3) if counts for i in p]
    assert sorted(dealt) == [0, 1, 2, 3, 4, 5]  # every experience counted once
    assert {len(my_parts(parts, r, 3)) for r in range(3)} == {2}  # the same collectives everywhere


def test_merging_ranks_gives_the_single_process_figures():
    parts = [({"entropy": 2.0, "ratio_max": 1.5, "opmd_residual_abs": 1.0}, 3, 1),
             ({"entropy": 6.0, "ratio_max": 1.2, "opmd_residual_abs": 5.0}, 1, 3),
             ({"entropy": 1.0, "ratio_max": 1.9, "opmd_residual_abs": 2.0}, 4, 2)]
    whole: dict = {}
    for stats, tokens, answers in parts:
        accumulate(whole, stats, tokens, answers, n_tokens=8, n_seqs=6)
    ranks = [{}, {}]
    for i, (stats, tokens, answers) in enumerate(parts):
        accumulate(ranks[i % 2], stats, tokens, answers, n_tokens=8, n_seqs=6)
    assert merge_ranks(ranks) == pytest.approx(whole)
    assert merge_ranks([{}, ranks[1]]) == pytest.approx(ranks[1])  # a rank with fillers only


def test_buckets_hold_at_most_bucket_bytes_of_full_tensors_in_order():
    from serve_rft.trainer.policy.gathered import plan_buckets

    specs = [("a", [10, 10], "torch.float32"), ("b", [50], "torch.float32"), ("c", [300], "torch.float32"),
             ("d", [20], "torch.bfloat16"), ("e", [10], "torch.float32")]
    # 400 B, 200 B, 1200 B (alone: larger than a bucket), 40 B, 40 B
    assert plan_buckets(specs, 600) == [["a", "b"], ["c"], ["d", "e"]]
    assert [n for b in plan_buckets(specs, 1) for n in b] == list("abcde")


@pytest.mark.parametrize("sets,match", [
    (["synchronizer.sync_method=nccl", "trainer.device=cuda", "explorer.num_gpus_per_replica=1"],
     "checkpoint or memory"),
])
def test_config_refuses_what_the_sharded_trainer_does_not_do(sets, match):
    from serve_rft.config import load_config

    with pytest.raises(ValueError, match=match):
        load_config(None, ["trainer.num_workers=2", *sets])
    load_config(None, sets)  # one worker: fine


@pytest.mark.parametrize("kind", ["qwen2", "llama_tied"])
def test_a_sharded_model_takes_the_chunked_path_with_the_full_paths_values_and_gradients(kind):
    """FSDP2 on one gloo rank: `shard` installs the chunked logprob path as a forward of the root
    (its embeddings and head gathered for it); logprobs, entropy and every gradient equal the
    unsharded model's full-logits path."""
    import copy

    import torch
    import torch.distributed as dist

    from serve_rft.buffer.redis_server import free_port
    from serve_rft.trainer.policy.token_logprobs import response_logprobs
    from serve_rft.trainer.sharding.fsdp import init_process_group, shard
    from serve_rft.trainer.policy.token_logprobs import SHARDED_HEAD
    from tests.support.tiny_lm import PROMPTS, RESPONSES, TEMPS, TOP_PS, tiny_causal_lm

    plain = tiny_causal_lm(kind)
    sharded = copy.deepcopy(plain)
    init_process_group(0, 1, "127.0.0.1", free_port("127.0.0.1"), "gloo")
    try:
        shard(sharded)
        assert hasattr(sharded, SHARDED_HEAD)
        got = response_logprobs(sharded, PROMPTS, RESPONSES, TEMPS, with_entropy=True, top_ps=TOP_PS,
                                chunk_tokens=3)
        want = response_logprobs(plain, PROMPTS, RESPONSES, TEMPS, with_entropy=True, top_ps=TOP_PS, impl="full")
        for g, w in zip(got, want):
            assert torch.allclose(g, w, atol=1e-5), (g - w).abs().max()
        (got[0] * got[1]).sum().backward()
        (want[0] * want[1]).sum().backward()
        grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
        for n, p in plain.named_parameters():
            assert torch.allclose(grads[n], p.grad, atol=1e-5), n
    finally:
        dist.destroy_process_group()

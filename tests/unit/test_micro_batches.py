"""Token-budget micro-batching: `serve_rft.trainer.policy.micro_batches.partition` (pure) and a
`PolicyTrainer` step whose gradient and statistics do not depend on the partition."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from serve_rft.trainer.policy.micro_batches import accumulate, padded_tokens, partition
from tests.support.batches import PROMPT_LENS, RESPONSE_LENS, uneven_batch


def test_without_a_token_budget_parts_are_consecutive_runs():
    assert partition([5, 1, 9, 2, 2], 2) == [[0, 1], [2, 3], [4]]
    assert partition([5, 1, 9], 0) == [[0, 1, 2]] == partition([5, 1, 9])
    assert partition([]) == [] == partition([], 3, 10)


def test_token_budget_sorts_longest_first_and_packs_greedily():
    lengths = [3, 10, 4, 4, 25, 1]
    parts = partition(lengths, max_tokens=12)
    # 25 alone (over the budget), 10 alone (2 x 10 > 12), then 4, 4, 3 (3 x 4 = 12), then 1
    assert parts == [[4], [1], [2, 3, 0], [5]]
    assert [padded_tokens(lengths, p) for p in parts] == [25, 10, 12, 1]
    assert partition(lengths, max_size=2, max_tokens=12) == [[4], [1], [2, 3], [0, 5]]
    assert partition([2, 2, 2], max_tokens=100) == [[0, 1, 2]]  # ties keep the batch order


def test_bad_arguments_are_refused():
    for kwargs in ({"max_size": -1}, {"max_tokens": 0}):
        with pytest.raises(ValueError):
            partition([1, 2], **kwargs)
    with pytest.raises(ValueError, match="lengths"):
        partition([1, -2], max_tokens=4)


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(0, 60), max_size=40), max_size=st.one_of(st.none(), st.integers(0, 8)),
       max_tokens=st.one_of(st.none(), st.integers(1, 120)))
def test_partition_properties(lengths, max_size, max_tokens):
    parts = partition(lengths, max_size, max_tokens)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))  # each index exactly once
    assert all(parts)
    assert parts == partition(list(lengths), max_size, max_tokens)  # deterministic
    for p in parts:
        if max_size:
            assert len(p) <= max_size
        if max_tokens is not None:
            assert padded_tokens(lengths, p) <= max_tokens or len(p) == 1  # only an over-long one alone
    if max_tokens is None:
        assert [i for p in parts for i in p] == list(range(len(lengths)))
    else:  # longest first, equal lengths in batch order, across and within parts
        flat = [i for p in parts for i in p]
        assert flat == sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        # greedy: a part could not have taken the next part's first index
        for p, q in zip(parts, parts[1:]):
            assert (max_size and len(p) == max_size) or padded_tokens(lengths, p + q[:1]) > max_tokens


def test_accumulate_weights_tokens_answers_and_maxima():
    totals: dict[str, float] = {}
    accumulate(totals, {"entropy": 2.0, "ratio_max": 1.5, "max_abs_logprob_diff": 0.1,
                        "opmd_residual_abs": 1.0}, tokens=3, answers=1, n_tokens=4, n_seqs=4)
    accumulate(totals, {"entropy": 6.0, "ratio_max": 1.2, "max_abs_logprob_diff": 0.3,
                        "opmd_residual_abs": 5.0}, tokens=1, answers=3, n_tokens=4, n_seqs=4)
    assert totals == pytest.approx({"entropy": 3.0, "ratio_max": 1.5, "max_abs_logprob_diff": 0.3,
                                    "opmd_residual_abs": 4.0})


# --- a trainer step: the partition changes neither the gradient nor the statistics ---

BUDGET = 30  # five parts: [6] (36 tokens, over the budget), [5], [4], [1, 0], [3, 7, 2]


@pytest.mark.parametrize("algorithm,agg", [("grpo", "token_mean"), ("grpo", "seq_mean_token_mean"),
                                           ("reinforce", "seq_mean_token_sum"), ("opmd", None),
                                           ("opmd_kimi", None)])
def test_token_budget_micro_batches_give_the_whole_batch_step(embedded_model, algorithm, agg):
    from serve_rft.config import load_config
    from serve_rft.trainer.policy.policy import PolicyTrainer

    sets = [f"trainer.algorithm={algorithm}", "trainer.kl_coef=0.1", "trainer.lr=0",
            "trainer.logprob_chunk_tokens=5"] + ([f"trainer.loss_agg={agg}"] if agg else [])
    lengths = [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
    parts = partition(lengths, max_tokens=BUDGET)
    assert len(parts) == 5 and max(map(len, parts)) >= 2 and max(lengths) > BUDGET
    # each group's two members in different parts: the advantages / tau log Z follow them
    where = {i: n for n, p in enumerate(parts) for i in p}
    assert all(where[i] != where[7 - i] for i in range(4))

    whole = PolicyTrainer(load_config(None, sets), str(embedded_model))
    split = PolicyTrainer(load_config(None, sets + [f"trainer.micro_batch_tokens={BUDGET}"]), str(embedded_model))
    a, b = whole.step(uneven_batch()), split.step(uneven_batch())
    assert a["micro_batches"] == 1 and b["micro_batches"] == len(parts)
    assert a.keys() == b.keys()
    for k in a.keys() - {"micro_batches", "step_seconds"}:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), k
    assert a["entropy"] > 0 and a["kl_ref"] >= 0 and a["max_abs_logprob_diff"] > 0
    if algorithm == "opmd_kimi":
        assert a["opmd_residual_abs"] > 0
    for (name, x), y in zip(whole.model.named_parameters(), split.model.parameters()):
        assert torch.allclose(x.grad, y.grad, rtol=1e-5, atol=1e-6), name


def test_both_limits_apply_in_a_step(embedded_model):
    from serve_rft.config import load_config
    from serve_rft.trainer.policy.policy import PolicyTrainer

    lengths = [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
    sets = ["trainer.lr=0", "trainer.micro_batch_size=2", "trainer.micro_batch_tokens=100"]
    stats = PolicyTrainer(load_config(None, sets), str(embedded_model)).step(uneven_batch())
    assert stats["micro_batches"] == len(partition(lengths, 2, 100)) == 4


@pytest.mark.parametrize("impl", ["chunked", "full"])
def test_a_micro_batch_of_empty_responses_steps(embedded_model, impl):
    """One experience per micro-batch: the one with an empty response is a part with no response
    token. It still runs the forward and backward (a sharded rank must make its peers'
    collectives; one process needs a loss with a graph) and adds nothing to the gradient."""
    from serve_rft.config import load_config
    from serve_rft.trainer.policy.policy import PolicyTrainer

    assert 0 in RESPONSE_LENS
    sets = ["trainer.lr=0", f"trainer.logprob_impl={impl}"]
    whole = PolicyTrainer(load_config(None, sets), str(embedded_model))
    split = PolicyTrainer(load_config(None, sets + ["trainer.micro_batch_size=1"]), str(embedded_model))
    a, b = whole.step(uneven_batch()), split.step(uneven_batch())
    assert b["micro_batches"] == len(RESPONSE_LENS)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
    for x, y in zip(whole.model.parameters(), split.model.parameters()):
        assert torch.allclose(x.grad, y.grad, rtol=1e-5, atol=1e-6)

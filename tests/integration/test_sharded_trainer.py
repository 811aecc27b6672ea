"""The sharded trainer (`serve_rft.trainer.sharding.worker_group`, FSDP2 over gloo on CPU) against the
single-process `PolicyTrainer` on the same batch: two Ray actors, each a rank holding half of
every parameter, gradient and AdamW moment. The summed gradient (rtol 1e-4) and every figure of
the step (loss, statistics, grad norm; rtol 1e-5) equal the single process's, and the next
weights differ by at most a tenth of one AdamW step, for an odd number of micro-batches (a rank
runs a zero-loss filler) and with the KL reference sharded too."""

from __future__ import annotations

import pytest
import torch

from serve_rft.service.ray_start import init_local_ray
from tests.support.batches import uneven_batch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_local():
    import ray

    init_local_ray(ray.init, num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("sets", [["trainer.algorithm=grpo", "trainer.micro_batch_size=3"],
                                  ["trainer.algorithm=opmd", "trainer.kl_coef=0.1", "trainer.micro_batch_size=2"]])
def test_two_ranks_take_the_single_process_step(ray_local, embedded_model, sets):
    from serve_rft.config import load_config
    from serve_rft.trainer.policy.policy import PolicyTrainer
    from serve_rft.trainer.sharding.worker_group import WorkerGroup

    cfg = load_config(None, sets + ["trainer.lr=1e-3", "trainer.num_threads=1"])
    single = PolicyTrainer(cfg, str(embedded_model))
    before = {n: p.detach().clone() for n, p in single.model.named_parameters()}
    want = single.step(uneven_batch())
    group = WorkerGroup(cfg, str(embedded_model), world=2)
    try:
        got = group.step(uneven_batch())
        assert got["micro_batches"] == want["micro_batches"] >= 3
        for k in want.keys() - {"step_seconds"}:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
        grads, params = group.full_tensors("grads"), group.full_tensors("params")
    finally:
        group.stop()
    worst = {}
    for name, p in single.model.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-6), name
        worst[name] = float((params[name] - p.detach()).abs().max())
    # AdamW's first update is lr * g / (|g| + 1e-8): where g is ~1e-8 a last-bit difference in the
    # summed gradient moves the update by a visible fraction of lr (5e-6 and 3e-5 at lr 1e-3 here)
    assert max(worst.values()) <= 0.1 * cfg.trainer.lr, worst
    assert any(not torch.equal(before[n], p.detach()) for n, p in single.model.named_parameters())


def test_two_ranks_skip_a_non_finite_update_together(ray_local, embedded_model):
    """A reward beyond float32 on a singleton (advantage inf) on two ranks: both skip the step
    (neither waits in a collective the other left), the weights are unchanged and finite, and the
    next step trains. A micro-batch per rank, so each rank runs its own part."""
    from serve_rft.config import load_config
    from serve_rft.trainer.sharding.worker_group import WorkerGroup

    cfg = load_config(None, ["trainer.algorithm=grpo", "trainer.micro_batch_size=1", "trainer.lr=1e-3",
                             "trainer.num_threads=1"])
    batch = uneven_batch()
    huge = [b.model_copy(deep=True) for b in batch[:2]]
    for i, b in enumerate(huge):
        b.experience.group_id = f"single{i}"
    huge[0].reward = 1e39
    group = WorkerGroup(cfg, str(embedded_model), world=2)
    try:
        group.step(batch)
        before = group.full_tensors("params")
        stats = group.step(huge)
        assert "advantage" in stats["skipped"]
        after = group.full_tensors("params")
        assert all(torch.equal(before[n], after[n]) for n in before)
        group.call("check_finite")
        assert "skipped" not in group.step(batch)
        group.call("check_finite")
    finally:
        group.stop()


def _two_rank_sets(run_dir, *more: str) -> list[str]:
    """Settings of a two-rank GRPO trainer publishing from ``run_dir`` in several buckets."""
    return ["trainer.algorithm=grpo", "trainer.micro_batch_size=3", "trainer.lr=1e-3", "trainer.num_threads=1",
            "trainer.num_workers=2", f"service.run_dir={run_dir}", "synchronizer.bucket_bytes=300000", *more]


def test_two_ranks_publish_save_and_resume(ray_local, embedded_model, tmp_path):
    """The sharded trainer's publish (gathered bucket by bucket) is the whole model: the CHECKPOINT
    folder loads with transformers and equals the ranks' parameters, the MEMORY buckets hold the
    same tensors, and the probe equals a forward of the loaded model. A trainer state saved by
    the ranks (weights gathered, AdamW shards via torch.distributed.checkpoint) resumes a new group
    whose next step equals the step the old group takes on the same batch."""
    import ray
    from transformers import AutoModelForCausalLM

    from serve_rft.config import load_config
    from serve_rft.trainer.policy.token_logprobs import trainer_probe
    from serve_rft.trainer.sharding.sharded_policy import ShardedPolicy
    from serve_rft.trainer.publishing.state import latest_state
    from serve_rft.weights import make_method
    from serve_rft.weights.memory import checkpoint_tensors, unpack_bucket

    sets = _two_rank_sets(tmp_path)
    cfg = load_config(None, sets + ["synchronizer.sync_method=checkpoint"])
    policy = ShardedPolicy(cfg, str(embedded_model))
    try:
        policy.step(uneven_batch())
        params = policy.group.full_tensors("params")
        model = policy.publish_model()
        assert len(model.buckets) > 3  # several buckets at this bucket size
        method = make_method(cfg)
        method.prepare()
        handle = method.send(model, 1)
        loaded = AutoModelForCausalLM.from_pretrained(handle["path"], dtype=torch.float32)
        for name, p in loaded.named_parameters():
            assert torch.equal(p.detach(), params[name]), name
        mem = make_method(load_config(None, sets + ["synchronizer.sync_method=memory"]))
        buckets = mem.send(model, 1)["buckets"]
        got = {k: v for ref in buckets for k, v in unpack_bucket(ray.get(ref)).items()}
        assert got.keys() == dict(checkpoint_tensors(loaded)).keys()
        assert all(torch.equal(got[k], params[k]) for k in got)
        probe = policy.probe(model, 1)
        want = trainer_probe(loaded, 1)
        assert probe["token_ids"] == want["token_ids"]
        assert probe["logprobs"] == pytest.approx(want["logprobs"], abs=1e-5)

        policy.save(tmp_path / "trainer_state", model, 1, 1, [("0-1", "g:0", 1)], str(embedded_model), 2, [0, 1])
        state = latest_state(tmp_path / "trainer_state")
        assert (state / "optimizer").is_dir() and (state / "rng-rank1.pt").is_file()
        next_batch = list(reversed(uneven_batch()))
        want_stats = policy.step(next_batch)
        want_params = policy.group.full_tensors("params")
    finally:
        policy.stop()
    resumed = ShardedPolicy(cfg, str(embedded_model), state)
    try:
        assert resumed.resumed.version == 1 and resumed.resumed.trained == [("0-1", "g:0", 1)]
        got_stats = resumed.step(next_batch)
        got_params = resumed.group.full_tensors("params")
    finally:
        resumed.stop()
    for k in want_stats.keys() - {"step_seconds"}:
        assert got_stats[k] == pytest.approx(want_stats[k], rel=1e-6, abs=1e-7), k
    for name, p in want_params.items():  # AdamW's moments were restored: the same second step
        assert torch.allclose(got_params[name], p, rtol=0, atol=1e-7), name


def test_two_ranks_reset_to_a_published_version(ray_local, embedded_model, tmp_path):
    """``canary.on_reject=reset`` on a sharded trainer: after two more steps the ranks take back
    version 1's weights from its CHECKPOINT folder and from its MEMORY buckets (every parameter
    equal to the published tensors, the probe check passes), AdamW's moments are gone on every
    rank, and a reset to version 0 takes the initial model directory back, checked against the
    probe the ranks took of it at start."""
    import ray
    from transformers import AutoModelForCausalLM

    from serve_rft.config import load_config
    from serve_rft.trainer.sharding.sharded_policy import ShardedPolicy
    from serve_rft.weights import make_method

    sets = _two_rank_sets(tmp_path, "synchronizer.rollout=canary", "synchronizer.canary.on_reject=reset")
    cfg = load_config(None, sets + ["synchronizer.sync_method=checkpoint"])
    policy = ShardedPolicy(cfg, str(embedded_model))
    try:
        policy.step(uneven_batch())
        v1 = policy.group.full_tensors("params")
        model = policy.publish_model()
        handles = {}
        for method in ("checkpoint", "memory"):
            sender = make_method(load_config(None, sets + [f"synchronizer.sync_method={method}"]))
            sender.prepare()
            handles[method] = {**sender.send(model, 1), "probe": policy.probe(model, 1)}
        for method, handle in handles.items():
            policy.step(uneven_batch())
            policy.step(list(reversed(uneven_batch())))
            moved = policy.group.full_tensors("params")
            assert any(not torch.equal(moved[n], v1[n]) for n in v1)
            diff = policy.reset_to(handle, 1)
            assert diff is not None and diff <= 1e-5, (method, diff)
            now = policy.group.full_tensors("params")
            assert all(torch.equal(now[n], v1[n]) for n in v1), method
            assert ray.get([r.optimizer_state_size.remote() for r in policy.group.ranks]) == [0, 0]
        policy.step(uneven_batch())
        diff = policy.reset_to({"method": "checkpoint", "path": str(embedded_model)}, 0)
        assert diff is not None and diff <= 1e-5
        now = policy.group.full_tensors("params")
        initial = AutoModelForCausalLM.from_pretrained(str(embedded_model), dtype=torch.float32)
        assert all(torch.equal(now[n], p.detach()) for n, p in initial.named_parameters())
    finally:
        policy.stop()


LORA = ["trainer.lora.rank=4", "trainer.lora.alpha=8", "trainer.algorithm=grpo", "trainer.micro_batch_size=3",
        "trainer.lr=1e-2", "trainer.num_threads=1", "synchronizer.bucket_bytes=300000"]


def test_two_ranks_train_lora_publish_merged_and_resume(ray_local, embedded_model, tmp_path):
    """LoRA on two ranks (bf16 frozen base, fp32 adapter, both sharded with their layers, a KL
    reference through the disabled adapter): the step's figures equal one process's on the same
    batch, the merged publish (a CHECKPOINT folder streamed bucket by bucket) equals one
    process's merged weights, the probe equals a forward of the folder's model within the bf16
    tolerance, and a state saved by the ranks (merged weights + adapter + AdamW shards) resumes a
    group whose next step equals the old group's."""
    from transformers import AutoModelForCausalLM

    from serve_rft.config import load_config
    from serve_rft.trainer.policy.token_logprobs import trainer_probe
    from serve_rft.trainer.policy.policy import PolicyTrainer
    from serve_rft.trainer.sharding.sharded_policy import ShardedPolicy
    from serve_rft.trainer.publishing.state import latest_state
    from serve_rft.weights import make_method

    sets = LORA + ["trainer.precision=bf16", "trainer.kl_coef=0.1", "synchronizer.sync_method=checkpoint",
                   f"service.run_dir={tmp_path}"]
    single = PolicyTrainer(load_config(None, sets), str(embedded_model))
    want = single.step(uneven_batch())
    policy = ShardedPolicy(load_config(None, sets + ["trainer.num_workers=2"]), str(embedded_model))
    try:
        got = policy.step(uneven_batch())
        for k in want.keys() - {"step_seconds"}:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), k
        model = policy.publish_model()
        method = make_method(load_config(None, sets))
        method.prepare()
        handle = method.send(model, 1)
        loaded = AutoModelForCausalLM.from_pretrained(handle["path"], dtype=torch.float32)
        merged = single.merged.gather([n for n, _ in loaded.named_parameters()])
        for name, p in loaded.named_parameters():  # AdamW's first step is lr * sign(g): summed grads agree
            assert torch.allclose(p.detach(), merged[name], rtol=0, atol=1e-6), name
        probe = policy.probe(model, 1)
        assert probe["logprobs"] == pytest.approx(trainer_probe(loaded, 1)["logprobs"], abs=0.25)  # bf16 forward
        policy.save(tmp_path / "trainer_state", model, 1, 1, [("0-1", "g:0", 1)], str(embedded_model), 2, [0, 1])
        state = latest_state(tmp_path / "trainer_state")
        assert (state / "adapter" / "adapter_model.safetensors").is_file()
        next_batch = list(reversed(uneven_batch()))
        want_next = policy.step(next_batch)
        want_params = policy.group.full_tensors("params")
    finally:
        policy.stop()
    resumed = ShardedPolicy(load_config(None, sets + ["trainer.num_workers=2"]), str(embedded_model), state)
    try:
        got_next = resumed.step(next_batch)
        got_params = resumed.group.full_tensors("params")
    finally:
        resumed.stop()
    for k in want_next.keys() - {"step_seconds"}:
        assert got_next[k] == pytest.approx(want_next[k], rel=1e-6, abs=1e-7), k
    for name, p in want_params.items():
        assert torch.equal(got_params[name], p), name


def test_two_ranks_publish_the_lora_adapter_alone_and_reset_to_it(ray_local, embedded_model, tmp_path):
    """Adapter-only LoRA sync on two ranks: the published MEMORY bucket holds the adapter whole,
    equal to one process's after the same step; with ``canary.on_reject=reset`` the ranks take
    version 1's adapter back after two more steps (every adapter weight equal, the probe check
    passes) and version 0 is the zero adapter (every ``lora_B`` zero)."""
    import ray

    from serve_rft.config import load_config
    from serve_rft.trainer.policy.policy import PolicyTrainer
    from serve_rft.trainer.sharding.sharded_policy import ShardedPolicy
    from serve_rft.weights import make_method
    from serve_rft.weights.adapters import adapter_tensors

    sets = LORA + ["trainer.lora.merge_and_sync=false", "synchronizer.sync_method=memory",
                   "synchronizer.rollout=canary", "synchronizer.canary.on_reject=reset", f"service.run_dir={tmp_path}"]
    single = PolicyTrainer(load_config(None, sets), str(embedded_model))
    single.step(uneven_batch())
    want, _ = adapter_tensors(single.model)
    policy = ShardedPolicy(load_config(None, sets + ["trainer.num_workers=2"]), str(embedded_model))
    try:
        policy.step(uneven_batch())
        model = policy.publish_model()
        handle = {**make_method(load_config(None, sets)).send(model, 1), "probe": policy.probe(model, 1)}
        assert handle["adapter"]
        tensors, _config = ray.get(handle["buckets"][0])
        assert tensors.keys() == want.keys()
        assert all(torch.allclose(tensors[k], want[k], rtol=0, atol=1e-6) for k in want)
        v1 = policy.group.full_tensors("params")
        policy.step(uneven_batch())
        policy.step(list(reversed(uneven_batch())))
        moved = policy.group.full_tensors("params")
        assert any(not torch.equal(moved[n], v1[n]) for n in v1 if ".lora_" in n)
        diff = policy.reset_to(handle, 1)
        assert diff is not None and diff <= 1e-5
        now = policy.group.full_tensors("params")
        assert all(torch.equal(now[n], v1[n]) for n in v1)
        diff = policy.reset_to({"method": "checkpoint", "path": str(embedded_model)}, 0)  # a replica's base handle
        assert diff is not None and diff <= 1e-5
        now = policy.group.full_tensors("params")
        assert all(not p.any() for n, p in now.items() if "lora_B" in n)
    finally:
        policy.stop()

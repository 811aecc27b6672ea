"""Tensor-parallel replicas (``explorer.tensor_parallel_size``) on vLLM's CPU backend: an engine
of two workers answers exactly as an engine of one, every CPU sync method reaches both workers
(checked by the logprobs of what it serves and by the probe a version's handle carries,
`serve_rft.weights.verify`), and when the process that owns the engine dies by SIGKILL, as a
replica does, its EngineCore and both workers end.

The two-worker engine runs in a child process (``python -m`` this module), standing in for a
replica: it prints its results as one JSON line and waits to be killed. A rolling sync of such
replicas under load through the whole stack is a benchmark (`benchmarks/zero_downtime.py` with
``--set explorer.tensor_parallel_size=2``; docs/operations/deploy.md, Placement): a stack of
two-worker replicas takes more of the suite's 30 minutes than this machine has left."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from serve_rft.service.ray_start import init_local_ray
from tests.support.weights import perturbed

pytestmark = pytest.mark.integration

PROMPTS = [[1, 87, 306, 201, 343, 78, 316, 308, 275, 691, 2, 201, 1, 347, 829, 935, 201],
           [1, 201, 347, 829], [5, 6, 7, 8, 9, 10, 11, 12]]
ROOT = Path(__file__).resolve().parents[2]
ENGINE_EXIT_S = 5.0
"""How long a killed replica's engine processes may take to end: the workers' watch polls every
0.5 s. vLLM's EngineCore notices its workers' death by itself only after 10-15 s here."""


async def _greedy(engine, tag: str) -> list[list[int]]:
    """Each prompt's greedy answer (16 tokens at most)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    answers = []
    for i, prompt in enumerate(PROMPTS):
        sp = SamplingParams(temperature=0.0, max_tokens=16, output_kind=RequestOutputKind.FINAL_ONLY)
        async for ro in engine.generate(prompt, sp, f"{tag}-{i}"):
            pass
        answers.append(list(ro.outputs[0].token_ids))
    return answers


async def _served_vs(engine, model, tag: str) -> float:
    """Largest |difference| between the logprobs of a seeded sample vLLM served and ``model``'s
    (transformers) logprobs of the same tokens."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from serve_rft.trainer.policy.token_logprobs import response_logprobs

    sp = SamplingParams(temperature=1.0, max_tokens=24, logprobs=0, seed=3, output_kind=RequestOutputKind.FINAL_ONLY)
    async for ro in engine.generate(PROMPTS[0], sp, tag):
        pass
    out = ro.outputs[0]
    ids = list(out.token_ids)
    served = torch.tensor([out.logprobs[i][t].logprob for i, t in enumerate(ids)])
    with torch.no_grad():
        lp, _ = response_logprobs(model, [PROMPTS[0]], [ids], [1.0])
    return float((served - lp[0, : len(ids)]).abs().max())


def _load_on_rank_0_only(worker, path: str) -> str:
    """Run in each vLLM worker (``collective_rpc``): rank 0 loads the checkpoint at ``path``,
    the other ranks keep what they hold, as if the version reached one worker only."""
    return worker.load_policy_weights(path, direct=False) if worker.rank == 0 else "kept"


async def _run(model_dir: Path, work: Path, tp: int) -> dict:
    """Start an engine of ``tp`` workers; greedy answers at the initial weights and after a
    CHECKPOINT load of version 1 (``perturbed(model_dir, 1)``); with ``tp`` > 1 also a MEMORY
    load of version 2, version 1 loaded into rank 0 only against both versions' probes, and
    version 1 loaded into both. Leaves the engine running (the caller ends it)."""
    from serve_rft.config import ExplorerConfig
    from serve_rft.explorer.engine.vllm_engine import ExplorerEngine
    from serve_rft.trainer.policy.token_logprobs import trainer_probe
    from serve_rft.weights import CheckpointMethod, MemoryMethod
    from serve_rft.weights.verify import ProbeMismatch, check_probe

    ck_model = perturbed(model_dir, 1)
    work.mkdir(parents=True, exist_ok=True)
    ck = CheckpointMethod(work / "ck")
    ck.prepare()
    ck_handle = ck.send(ck_model, 1)
    engine = await ExplorerEngine.create(str(model_dir), ExplorerConfig(tensor_parallel_size=tp))
    got: dict = {"workers": len(engine.engine_pids), "world_size": engine.world_size, "engine": engine}
    got["greedy_v0"] = await _greedy(engine, "v0")
    await engine.pause("wait")
    await ck.receive(engine, ck_handle, 1)
    await engine.resume()
    got["greedy_v1"] = await _greedy(engine, "v1")
    got["checkpoint"] = await _served_vs(engine, ck_model, "v1")
    got["load_path"] = engine.load_path
    if tp == 1:
        return got
    mem_model = perturbed(model_dir, 2)
    mem = MemoryMethod(bucket_bytes=1 << 20)  # two buckets for the tiny model
    await engine.pause("wait")
    await mem.receive(engine, mem.send(mem_model, 2), 2)
    await engine.resume()
    got["memory"] = await _served_vs(engine, mem_model, "v2")
    # version 1 into rank 0 only: neither version 1's probe nor version 2's holds
    probe1, probe2 = trainer_probe(ck_model, 1), trainer_probe(mem_model, 2)
    await engine.pause("wait")
    got["partial_rpc"] = await engine.llm.collective_rpc(_load_on_rank_0_only, args=(str(work / "ck" / "v000001"),))
    await engine.resume()
    got["partial_probes_refused"] = 0
    for probe in (probe1, probe2):
        try:
            check_probe(probe, await engine.probe_logprobs(probe["token_ids"]), 1e-3)
        except ProbeMismatch:
            got["partial_probes_refused"] += 1
    await engine.pause("wait")
    await ck.receive(engine, ck_handle, 1)
    await engine.resume()
    got["probe_after_full_load"] = check_probe(probe1, await engine.probe_logprobs(probe1["token_ids"]), 1e-3)
    return got


def _child(model_dir: str, work: str) -> None:
    """The stand-in replica: a two-worker engine's results as one JSON line, then wait to be
    killed (the engine's processes watch this one)."""
    import ray

    init_local_ray(ray.init, num_cpus=1, include_dashboard=False, log_to_driver=False)

    async def go():
        got = await _run(Path(model_dir), Path(work), 2)
        got.pop("engine")
        print(json.dumps(got), flush=True)
        await asyncio.sleep(3600)

    asyncio.run(go())


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_two_workers_answer_as_one_every_sync_method_reaches_both_and_they_end_with_the_replica(
        embedded_model, tmp_path):
    """Greedy answers at the initial weights and after a CHECKPOINT load equal a one-worker
    engine's; after CHECKPOINT and MEMORY loads the served logprobs are the new weights' (both
    workers' slices changed: a stale slice would move them); a version loaded into one worker
    only is refused by the probe check, and loading it into both passes it. Then the child
    process is killed with SIGKILL: its EngineCore and both workers end within `ENGINE_EXIT_S`
    (shown failing, the EngineCore still running, with the workers' end of their EngineCore
    taken out of `PolicyWeightsExtension.watch_replica`).

    The child sends a function to the workers (vLLM's ``collective_rpc`` with a callable, which
    vLLM pickles only with ``VLLM_ALLOW_INSECURE_SERIALIZATION``)."""
    import psutil

    child_log = tmp_path / "child.log"  # its errors, for the assertion below
    with open(child_log, "w") as err:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.test_engine_tensor_parallel", str(embedded_model),
             str(tmp_path / "tp2")], cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
            env={**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}, start_new_session=True)
    engine_processes: list[int] = []
    try:
        async def one_worker() -> dict:
            got = await _run(embedded_model, tmp_path / "tp1", 1)
            got.pop("engine").shutdown()
            return got

        one = asyncio.run(one_worker())
        line = next((x for x in child.stdout if x.startswith("{")), None)  # vLLM may print before it
        assert line, f"the two-worker child exited with {child.wait()}:\n{child_log.read_text()[-3000:]}"
        two = json.loads(line)
        engine_processes = [p.pid for p in psutil.Process(child.pid).children(recursive=True)
                            if p.name().startswith("VLLM::")]
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        deadline = time.monotonic() + ENGINE_EXIT_S
        while time.monotonic() < deadline and any(map(_running, engine_processes)):
            time.sleep(0.2)
        left = [pid for pid in engine_processes if _running(pid)]
    finally:
        try:  # the child's session: what is left of it (Ray's processes; anything if a check failed)
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()
        for pid in engine_processes:  # should they outlive it (the assertion below fails), end them
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    assert (one["workers"], one["world_size"], two["workers"], two["world_size"]) == (1, 1, 2, 2), (one, two)
    assert two["greedy_v0"] == one["greedy_v0"] and two["greedy_v1"] == one["greedy_v1"], (one, two)
    assert one["greedy_v0"] != one["greedy_v1"]  # the load changed the answers
    assert one["checkpoint"] < 1e-4 and two["checkpoint"] < 1e-4 and two["memory"] < 1e-4, (one, two)
    assert two["load_path"] == "layerwise (tensor-parallel)", two  # vLLM's loader cuts each worker's slice
    assert sorted(two["partial_rpc"]) == ["kept", "layerwise (turned off)"], two
    assert two["partial_probes_refused"] == 2 and two["probe_after_full_load"] < 1e-4, two
    assert len(engine_processes) == 3 and not left, (engine_processes, left)  # EngineCore + 2 workers


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])

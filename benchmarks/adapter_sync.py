"""Adapter-only LoRA sync vs full-weight sync on one vLLM-CPU engine (Twinkle's CheckpointEngine documentation).

For each way of moving a new policy version into a running engine, ``--repeats`` versions:
the trainer-side publish seconds (``send``), the replica-side seconds the engine spends on it,
the seconds it serves nothing (pause to resume; adapters need no pause), the bytes moved, and
max |vLLM logprob - trainer logprob| afterwards (the version really arrived). Then decode
throughput of the same requests on the base engine and on the LoRA engine serving an adapter
(vLLM's LoRA kernels cost time on every token).

    .venv/bin/python benchmarks/adapter_sync.py [--model DIR] [--rank 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

PROMPT = [1, 87, 306, 201, 343, 78, 316, 308, 275, 691, 2, 201, 1, 347, 829, 935, 201]


def _adapter_model(base: str, rank: int, seed: int):
    from serve_rft.trainer.policy.lora import random_adapter

    return random_adapter(base, rank, seed)


def _merged(base: str, peft_model):
    from transformers import AutoModelForCausalLM

    from serve_rft.trainer.policy import lora

    out = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora.merge_into(peft_model, out)
    return out


async def _throughput(engine, requests: int, max_tokens: int, reps: int = 5) -> float:
    """Generated tokens per second for ``requests`` concurrent requests (ignore_eos): the median
    of ``reps`` runs after one warm-up run."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0,
                        output_kind=RequestOutputKind.FINAL_ONLY)

    async def one(i):
        async for ro in engine.generate(PROMPT + [i % 50 + 3], sp, f"tp-{uuid.uuid4().hex}"):
            pass
        return len(ro.outputs[0].token_ids)

    runs = []
    for k in range(reps + 1):
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(requests))))
        if k:
            runs.append(tokens / (time.perf_counter() - t0))
    return statistics.median(runs)


async def run(base: str, rank: int, repeats: int, requests: int, max_tokens: int) -> dict:
    from serve_rft.config import ExplorerConfig
    from serve_rft.explorer.engine.vllm_engine import ExplorerEngine
    from serve_rft.weights import CheckpointMethod, MemoryMethod
    from serve_rft.trainer.policy.logprob_check import max_abs_diff

    work = Path(tempfile.mkdtemp(prefix="srft-adapter-"))
    out: dict = {}
    for mode in ("full", "adapter"):
        engine = await ExplorerEngine.create(base, ExplorerConfig(kv_cache_gib=2), lora_rank=(
            next(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= rank) if mode == "adapter" else None))
        try:
            out[f"{mode}_engine_tokens_per_s_base_weights"] = await _throughput(engine, requests, max_tokens)
            version = 0
            for method in (CheckpointMethod(work / mode), MemoryMethod()):
                method.prepare()
                rows = []
                for k in range(repeats):
                    version += 1
                    peft_model = _adapter_model(base, rank, seed=version)
                    merged = _merged(base, peft_model)
                    t0 = time.perf_counter()
                    handle = method.send(peft_model if mode == "adapter" else merged, version)
                    send_s = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    if mode == "full":
                        await engine.pause("wait")
                    info = await method.receive(engine, handle, version)
                    if mode == "full":
                        await engine.resume()
                    out_of_service = time.perf_counter() - t0 if mode == "full" else 0.0
                    rows.append({"send_s": send_s, "load_s": info["seconds"], "bytes": info["bytes"],
                                 "out_of_service_s": out_of_service,
                                 "max_abs_logprob_diff": await max_abs_diff(engine, merged, PROMPT, 16)})
                out[f"{mode}_{method.name}"] = {
                    "runs": rows,
                    **{f"median_{k}": statistics.median(r[k] for r in rows)
                       for k in ("send_s", "load_s", "bytes", "out_of_service_s")},
                    "max_abs_logprob_diff": max(r["max_abs_logprob_diff"] for r in rows)}
            out[f"{mode}_engine_tokens_per_s_version_{version}"] = await _throughput(engine, requests, max_tokens)
        finally:
            engine.shutdown()
    return out


def main() -> None:
    from serve_rft.config import ModelConfig
    from serve_rft.model.embedded import ensure_embedded_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF model dir (default: the embedded model; "
                    "'half_b': sync_cost.py's random-init ~0.47 B Qwen2)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/adapter_sync.json")
    a = ap.parse_args()
    base = str(ensure_embedded_model(ModelConfig().cache_dir))
    if a.model == "half_b":
        sys.path.insert(0, str(Path(__file__).parent))
        from sync_cost import build_half_b

        base = str(build_half_b(Path(base), Path(ModelConfig().cache_dir) / "bench-qwen2-0.5b"))
    elif a.model:
        base = a.model
    res = asyncio.run(run(base, a.rank, a.repeats, a.requests, a.max_tokens))
    sys.path.insert(0, str(Path(__file__).parent))
    from provenance import record

    res = {**record(), "model": Path(base).name, **res}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, dict)} |
                     {k: {kk: vv for kk, vv in v.items() if kk != "runs"} for k, v in res.items() if isinstance(v, dict)},
                     indent=1))


if __name__ == "__main__":
    main()

"""The engine tap's behaviour logprobs three ways, side by side on one engine: CPU seconds per
1,000 output tokens of the process that runs vLLM's output processing (the replica's front end).

One `ExplorerEngine` (the replica's: its EngineCore in a process of its own) in this process;
``--concurrency`` workers stream (``DELTA``) requests of ``--max-tokens`` tokens back to back,
each output read as the engine tap reads it (`Sampled.add`). Three variants of the same request:

- ``decoded``: ``logprobs=0`` as vLLM returns it by default: per-position dicts, every logprob
  token decoded (what a client that asks for logprobs gets);
- ``tap_only``: ``logprobs=0, flat_logprobs=True``: what the tap asks for where the client asked
  for no logprobs (vLLM's flat container, tokens not decoded:
  `vllm_engine.decode_no_tap_only_logprob_tokens`);
- ``none``: no logprobs, what vLLM's own server computes for such a client (no behaviour
  logprobs: the floor).

Rounds run the three in turn, the order rotating. Per round: this process's CPU seconds
(``time.process_time``: all its threads) and the EngineCore's per 1,000 output tokens, tokens/s;
the ratios ``tap_only / decoded`` and ``none / decoded`` per round, their medians and 95 %
percentile-bootstrap intervals over the rounds (`vs_vllm.bootstrap_median`).

    .venv/bin/python benchmarks/tap_logprobs_ab.py [--rounds 6] [--duration 8] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import command, machine  # noqa: E402
from vs_vllm import bootstrap_median  # noqa: E402

VARIANTS = {"decoded": {"logprobs": 0}, "tap_only": {"logprobs": 0, "flat_logprobs": True}, "none": {}}


async def run(engine, prompt: list[int], params: dict, concurrency: int, duration: float,
              max_tokens: int) -> dict:
    """``concurrency`` streaming workers for ``duration`` seconds; CPU seconds of this process and
    of the engine's processes per 1,000 output tokens, and output tokens/s."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from serve_rft.explorer.engine.experience_log import Sampled

    engine_procs = [psutil.Process(p) for p in engine.engine_pids]
    tokens = 0
    stop_at = time.monotonic() + duration

    async def worker() -> None:
        nonlocal tokens
        while time.monotonic() < stop_at:
            sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA, **params)
            choice = Sampled(0)
            async for ro in engine.generate(prompt, sp, uuid.uuid4().hex):
                if sp.logprobs is not None:
                    choice.add(ro.outputs[0])
                tokens += len(ro.outputs[0].token_ids)

    t0, cpu0 = time.monotonic(), time.process_time()
    eng0 = sum(sum(p.cpu_times()[:2]) for p in engine_procs)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds, cpu = time.monotonic() - t0, time.process_time() - cpu0
    eng = sum(sum(p.cpu_times()[:2]) for p in engine_procs) - eng0
    return {"output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds,
            "front_cpu_s_per_1k_tokens": 1000 * cpu / tokens, "engine_cpu_s_per_1k_tokens": 1000 * eng / tokens}


async def bench(model: str, a: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from serve_rft.config import ExplorerConfig
    from serve_rft.explorer.engine.vllm_engine import ExplorerEngine

    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a story about the sea."}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    engine = await ExplorerEngine.create(model, ExplorerConfig())
    names = list(VARIANTS)
    rounds = []
    try:
        for name in names:  # warm-up, not counted
            await run(engine, prompt, VARIANTS[name], a.concurrency, 2.0, a.max_tokens)
        for r in range(a.rounds):
            order = names[r % 3:] + names[:r % 3]
            rounds.append({n: await run(engine, prompt, VARIANTS[n], a.concurrency, a.duration, a.max_tokens)
                           for n in order})
    finally:
        engine.shutdown()
    ratios = {}
    for n in ("tap_only", "none"):
        for key in ("front_cpu_s_per_1k_tokens", "engine_cpu_s_per_1k_tokens", "output_tokens_per_s"):
            ratios[f"{n}/decoded {key}"] = bootstrap_median([r[n][key] / r["decoded"][key] for r in rounds])
    medians = {n: {key: statistics.median(r[n][key] for r in rounds) for key in rounds[0][n]} for n in names}
    return {"rounds": rounds, "medians": medians, "ratios": ratios}


def main() -> None:
    from serve_rft.config import ModelConfig
    from serve_rft.model.embedded import ensure_embedded_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/tap_logprobs_ab.json")
    a = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # the engine as in a 1-CPU Ray replica
    model = str(ensure_embedded_model(ModelConfig().cache_dir))
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        res = asyncio.run(bench(model, a))
    finally:
        ray.shutdown()
    out = {"command": command(), "args": vars(a), "machine": machine(), **res}
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({"medians": res["medians"], "ratios": {k: (v["median"], v["ci95"]) for k, v in res["ratios"].items()}},
                     indent=1))


if __name__ == "__main__":
    main()

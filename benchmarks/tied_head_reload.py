"""The vLLM-CPU tied-LM-head reload bug, measured: after loading new weights into a running
engine, how far are vLLM's logprobs from the new weights' (transformers) logprobs?

- plain ``reload_weights`` (vLLM's worker method): the tied head keeps its old packed copy;
- ``load_policy_weights`` (serve_rft's worker extension): re-ties and re-packs the head.

    .venv/bin/python benchmarks/tied_head_reload.py
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import torch

PROMPT = [1, 87, 306, 201, 343, 78, 316, 308, 275, 691, 2, 201, 1, 347, 829, 935, 201]


async def main() -> dict:
    from transformers import AutoModelForCausalLM

    from serve_rft.config import ExplorerConfig, ModelConfig
    from serve_rft.explorer.engine.vllm_engine import ExplorerEngine
    from serve_rft.model.embedded import ensure_embedded_model
    from serve_rft.trainer.policy.logprob_check import max_abs_diff

    base = ensure_embedded_model(ModelConfig().cache_dir)
    work = Path(tempfile.mkdtemp(prefix="srft-tied-"))
    engine = await ExplorerEngine.create(str(base), ExplorerConfig())

    results = {}
    try:
        for seed, rpc in [(1, "reload_weights"), (2, "load_policy_weights")]:
            model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
            g = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
            path = work / f"v{seed}"
            model.save_pretrained(str(path), safe_serialization=True)
            kwargs = {"weights_path": str(path)}
            if rpc == "reload_weights":
                kwargs["is_checkpoint_format"] = True
            await engine.pause("wait")
            await engine.llm.collective_rpc(rpc, kwargs=kwargs)
            await engine.resume()
            results[rpc] = await max_abs_diff(engine, model, PROMPT, max_tokens=16)
    finally:
        engine.shutdown()
    sys.path.insert(0, str(Path(__file__).parent))
    from provenance import record

    return {**record(), "max_abs_logprob_diff_vs_new_weights": results}


if __name__ == "__main__":
    out = asyncio.run(main())
    Path("benchmarks/results").mkdir(parents=True, exist_ok=True)
    Path("benchmarks/results/tied_head_reload.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out))

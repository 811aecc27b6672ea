"""Sync cost per method: trainer-side send and replica-side load, per replica and for a roll.

For each model (the embedded one, and a random-init Qwen2 of about 0.5 B parameters built
locally) and each CPU method (CHECKPOINT, MEMORY): publish a new version from a transformers
model (``send``), then load it into two real vLLM-CPU engines one after the other (a roll over
two replicas: pause, ``receive``, resume), and check the engines now compute the new weights'
logprobs. Each version's two loads take the two load paths, alternating (straight into vLLM-CPU's
packed layers, `serve_rft.explorer.engine.direct_reload`, or vLLM's layer-wise reload), so the
paths are compared side by side. Each replica's load is timed as a replica syncs: the method's precheck (CHECKPOINT: the
folder's checksums, before the drain), pause, receive (MEMORY: the buckets' checksums as they
arrive), resume, the probe check (`serve_rft.weights.verify`; a replica holds new requests until
it passed). Next to it, the copy bound measured
in the same run: model bytes / memory-copy bandwidth (a torch tensor clone) and / page-cache read
bandwidth (reading the safetensors file), and the engine's own floor on CPU: the model's linear
weights through vLLM-CPU's oneDNN pack (``create_onednn_mm``) from memory.

    .venv/bin/python benchmarks/sync_cost.py --out benchmarks/results/sync_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from provenance import record  # benchmarks/ (the script's folder)

HALF_B_ARCH = dict(hidden_size=1024, intermediate_size=5632, num_hidden_layers=24,
                   num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=2048,
                   rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def build_half_b(tokenizer_dir: Path, out: Path) -> Path:
    """A ~0.47 B-parameter Qwen2 (random init, fp32) sharing the embedded model's tokenizer."""
    if (out / "model.safetensors").exists():
        return out
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = Qwen2Config(vocab_size=len(tok), bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, torch_dtype="float32", **HALF_B_ARCH)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def memcpy_gbps(nbytes: int = 1 << 30, reps: int = 3) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst = src.clone()
        best = min(best, time.perf_counter() - t0)
        del dst
    return nbytes / best / 1e9


def pack_gbps(model, reps: int = 2) -> float:
    """The CPU engine's pack bound: bytes per second of vLLM-CPU's oneDNN pack
    (``create_onednn_mm``, what a load runs for every linear weight) over the model's linear
    weights, from memory, in this process (best of ``reps``)."""
    from vllm import _custom_ops as ops

    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        handles = [ops.create_onednn_mm(w.t(), 32) for w in weights]
        best = min(best, time.perf_counter() - t0)
        del handles
    return nbytes / best / 1e9


def file_read_gbps(path: Path, reps: int = 3) -> float:
    """Page-cache read bandwidth: the file read into one reused 64 MiB buffer (``readinto``, so
    no allocation or first-touch page faults count), best of ``reps``."""
    size = path.stat().st_size
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
        best = min(best, time.perf_counter() - t0)
    return size / best / 1e9


def _perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


async def _logprob_check(engine, model) -> float:
    from serve_rft.trainer.policy.logprob_check import max_abs_diff

    prompt = [1, 87, 306, 201, 343, 78, 316, 308, 275, 691, 2, 201, 1, 347, 829, 935, 201]
    return await max_abs_diff(engine, model, prompt, max_tokens=8)


async def bench_model(name: str, model_dir: Path, work: Path, bucket_bytes: int, rounds: int) -> list[dict]:
    """Per method, ``rounds`` versions, each loaded into both engines in turn; each load goes
    straight into the packed layers (``direct``) or through vLLM's layer-wise reload, the two
    paths alternating over engines and rounds (each engine loads each path equally often)."""
    from statistics import median

    from transformers import AutoModelForCausalLM

    from serve_rft.config import ExplorerConfig
    from serve_rft.explorer.engine.vllm_engine import ExplorerEngine
    from serve_rft.trainer.policy.token_logprobs import trainer_probe
    from serve_rft.weights import CheckpointMethod, MemoryMethod
    from serve_rft.weights.verify import check_probe, probe_ids

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    ecfg = ExplorerConfig(max_model_len=256, max_num_seqs=8)
    engines = [await ExplorerEngine.create(str(model_dir), ecfg) for _ in range(2)]
    for e in engines:  # an engine's first prompt-logprobs request is slower, once: not a load's cost
        await e.probe_logprobs(probe_ids(model.config.vocab_size, 0))
    mem_bw = memcpy_gbps()
    pack_bw = pack_gbps(model)
    rows = []
    version = 0
    try:
        for i, method in enumerate([CheckpointMethod(work / f"{name}-ckpt", keep=2), MemoryMethod(bucket_bytes)]):
            method.prepare()
            per_replica, sends, rolls, diffs = [], [], [], []
            for r in range(rounds):
                version += 1
                _perturb(model, seed=version)
                t0 = time.perf_counter()
                handle = method.send(model, version)
                sends.append(time.perf_counter() - t0)
                t_roll = time.perf_counter()
                probe = trainer_probe(model, version)
                for k, engine in enumerate(engines):  # a roll: one replica after the other
                    engine.direct_weight_load = (r + k) % 2 == 0
                    t1 = time.perf_counter()
                    await method.precheck(handle)  # CHECKPOINT: the folder's checksums, before the drain
                    precheck_s = time.perf_counter() - t1
                    pause_s = await engine.pause("wait")
                    info = await method.receive(engine, handle, version)
                    await engine.resume()  # as a replica: resumed, new requests held until the probe passed
                    t2 = time.perf_counter()
                    check_probe(probe, await engine.probe_logprobs(probe["token_ids"]), 0.01)
                    probe_s = time.perf_counter() - t2
                    per_replica.append({"round": r, "replica": k,
                                        "load_path": "direct" if engine.direct_weight_load else "layerwise",
                                        "load_s": info["seconds"], "pause_s": pause_s,
                                        "precheck_s": precheck_s, "probe_s": probe_s,
                                        "verified_load_s": precheck_s + info["seconds"] + probe_s,
                                        "total_s": time.perf_counter() - t1,
                                        **{k: round(v, 4) for k, v in info.items() if k.endswith("_s")}})
                rolls.append(time.perf_counter() - t_roll)
                diffs.append(max([await _logprob_check(e, model) for e in engines]))
            nbytes = info["bytes"]
            read_bw = None
            bound_bw = mem_bw
            if method.name == "checkpoint":
                read_bw = file_read_gbps(Path(handle["path"]) / "model.safetensors")
                bound_bw = read_bw
            bound_s = nbytes / (bound_bw * 1e9)
            memcpy_s = nbytes / (mem_bw * 1e9)
            by_path = {}
            for path in ("direct", "layerwise"):
                mine = [p for p in per_replica if p["load_path"] == path]
                load = median(p["load_s"] for p in mine)
                verified = median(p["verified_load_s"] for p in mine)
                by_path[path] = {
                    "loads": len(mine), "load_s_median": round(load, 4),
                    "load_s_range": [round(min(p["load_s"] for p in mine), 4), round(max(p["load_s"] for p in mine), 4)],
                    "verified_load_s_median": round(verified, 4),
                    "verified_load_s_range": [round(min(p["verified_load_s"] for p in mine), 4),
                                              round(max(p["verified_load_s"] for p in mine), 4)],
                    "load_gbps": round(nbytes / load / 1e9, 3),
                    "load_s_over_bound_s": round(load / bound_s, 2),
                    "verified_load_s_over_bound_s": round(verified / bound_s, 2),
                    "verified_load_s_over_memcpy_bound_s": round(verified / memcpy_s, 2),
                    "verified_load_s_over_pack_bound_s": round(verified / (nbytes / (pack_bw * 1e9)), 2),
                }
            rows.append({
                "model": name, "params": n_params, "method": method.name, "bytes": nbytes, "rounds": rounds,
                "send_s_median": round(median(sends), 4), "roll_s_2_replicas_median": round(median(rolls), 4),
                "bound": ("page-cache read" if method.name == "checkpoint" else "memory copy"),
                "bound_gbps": round(bound_bw, 3), "bound_s": round(bound_s, 4),
                "memcpy_bound_s": round(memcpy_s, 4), "memcpy_gbps": round(mem_bw, 3),
                "pack_gbps": round(pack_bw, 3), "pack_bound_s": round(nbytes / (pack_bw * 1e9), 4),
                "file_read_gbps": round(read_bw, 3) if read_bw else None,
                "by_load_path": by_path, "per_replica": per_replica,
                "max_abs_logprob_diff_after": max(diffs),
            })
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_replica"}), flush=True)
    finally:
        for e in engines:
            e.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/sync_cost.json")
    ap.add_argument("--models", default="embedded,half_b")
    ap.add_argument("--bucket-bytes", type=int, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=4, help="versions per method (each path loads rounds times)")
    a = ap.parse_args()
    import ray

    from serve_rft.config import ModelConfig
    from serve_rft.model.embedded import ensure_embedded_model

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=4 << 30)
    embedded = ensure_embedded_model(ModelConfig().cache_dir)
    work = Path(tempfile.mkdtemp(prefix="srft-sync-bench-"))
    models = {"embedded": embedded}
    if "half_b" in a.models:
        models["half_b"] = build_half_b(embedded, Path(ModelConfig().cache_dir) / "bench-qwen2-0.5b")
    rows = []
    for name in a.models.split(","):
        rows.extend(asyncio.run(bench_model(name, models[name], work, a.bucket_bytes, a.rounds)))
    ray.shutdown()
    out = {**record(), "results": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""Trainer throughput: `PolicyTrainer.step` on synthetic experiences, a random-init Qwen2.

The model is a seeded random init of ``--shape``: ``embedded`` (the project's embedded model,
`serve_rft.model.embedded.ARCH`, vocabulary 1,024) or ``qwen2.5-0.5b`` (Qwen2.5-0.5B's config:
hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4,864, vocabulary 151,936, tied
embeddings), saved to a temporary folder that `PolicyTrainer` loads as it loads any model.
The batch is ``--batch`` `RewardedExperience` of ``--prompt-tokens`` random prompt ids and
``--response-tokens`` random response ids, in groups of ``--group-size`` (GRPO groups),
rewards 0/1, sampled at ``--temperature`` / ``--top-p``; their behaviour logprobs are the
model's own (one no-grad pass before the steps), so PPO ratios start at 1 as on-policy data's
do. ``--warmup`` steps, then ``--steps`` timed steps (each ended by a device sync).
``--impl`` picks ``trainer.logprob_impl``: ``chunked`` (LM head on response tokens in chunks,
serve_rft/trainer/policy/token_logprobs.py) or ``full`` (``[B, L, V]`` fp32 logits, the old path).

Reported (JSON, ``--out``): seconds per step (median and each), response and total (prompt +
response) tokens per second at the median, peak memory over the timed steps and what was held
before them (CUDA: ``torch.cuda.max_memory_allocated`` and ``memory_allocated``; CPU: the
process's resident set, Linux's ``VmHWM`` reset through ``/proc/self/clear_refs`` after the
warm-up steps and glibc's ``malloc_trim``, and ``VmRSS`` then; so the CPU figure is what the
steps take on top of model, optimizer state and batch, allocator slack included, not the
model's build), the whole process's peak RSS (``resource.getrusage``, build included), and on
CUDA the MFU:

    FLOPs per step = 6 * P_body * tokens_total + 6 * V * H * tokens_response
                     + 12 * n_layers * n_heads * head_dim * sum_i S_i^2
    MFU = FLOPs per step / median step seconds / (--peak-tflops * 1e12)

``P_body``: every parameter but the input embedding and the LM head (the transformer layers
and the final norm): 2 FLOPs per parameter per token forward, 4 backward (Kaplan et al. 2020,
"6N"). The LM head counts on the response positions only: those are the logits the loss needs
(the ``full`` path computes them on prompt positions too; that work is not counted, so both
impls are measured against the same useful work). Attention scores and their weighted sum per
layer: 12 * d_attn * S^2 per sequence of S tokens, forward + backward, no causal discount (PaLM,
Chowdhery et al. 2022, appendix B). Not counted: a KL reference pass (``--kl-coef``), the
chunked backward's recomputed head matmul, the optimizer. ``--peak-tflops`` default 989: H100
SXM dense bf16 (for fp32 runs pass the fp32 peak).

``--lora-rank r`` trains a LoRA adapter instead (trainer.lora: frozen base in the compute dtype,
fp32 adapter); its FLOPs count 4 per frozen weight per token (forward + input gradients).

Needs torch, transformers, pydantic (and pyyaml, a transformers dependency); importing
`serve_rft.trainer.policy.policy` imports neither Ray nor vLLM (the JSON records that), so no stub.

    python benchmarks/trainer_throughput.py --shape embedded --steps 2 --out /tmp/tt.json
    python benchmarks/trainer_throughput.py --shape qwen2.5-0.5b --impl chunked \\
        --out benchmarks/results/trainer_throughput_chunked.json
    python benchmarks/trainer_throughput.py --shape qwen2.5-0.5b --impl full \\
        --out benchmarks/results/trainer_throughput_full.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from provenance import record  # benchmarks/ (the script's folder)

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)


def build_model(shape: str, folder: Path, seed: int) -> dict:
    """Save a seeded random-init Qwen2 of ``shape`` to ``folder``; return its config dict."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from serve_rft.model.embedded import ARCH, VOCAB_SIZE

    arch = dict(ARCH, vocab_size=VOCAB_SIZE) if shape == "embedded" else dict(QWEN25_05B)
    cfg = Qwen2Config(pad_token_id=0, bos_token_id=0, eos_token_id=1, **arch)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).to(torch.float32).save_pretrained(str(folder), safe_serialization=True)
    return arch


def _status_bytes(field: str) -> int:
    """``field`` (``VmRSS``, ``VmHWM``) of /proc/self/status, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_cpu_peak() -> int:
    """Give freed heap pages back (glibc ``malloc_trim``), reset the peak resident set
    (``VmHWM``, Linux's ``clear_refs`` 5) and return the resident set now, bytes."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def make_batch(a, vocab: int):
    """``a.batch`` synthetic rewarded experiences (behaviour logprobs filled in later)."""
    from serve_rft.types import Experience, RewardedExperience, SamplingInfo

    rnd = random.Random(a.seed)
    out = []
    for i in range(a.batch):
        g = f"g{i // a.group_size}"
        exp = Experience(
            completion_id=f"c{i}", choice_index=0, group_id=g, replica_id="bench",
            prompt_token_ids=[rnd.randrange(2, vocab) for _ in range(a.prompt_tokens)],
            response_token_ids=[rnd.randrange(2, vocab) for _ in range(a.response_tokens)],
            behaviour_logprobs=[0.0] * a.response_tokens, token_versions=[(0, 0, a.response_tokens)],
            sampling=SamplingInfo(temperature=a.temperature, top_p=a.top_p, max_tokens=a.response_tokens),
            finish_reason="length")
        out.append(RewardedExperience(experience=exp, reward=float(rnd.random() < 0.5), stream_id=f"0-{i}"))
    return out


def flops_per_step(model, arch: dict, batch, frozen_base: bool = False) -> float:
    """The docstring's FLOPs per step; ``frozen_base`` (LoRA): 4 FLOPs per weight per token, not
    6 (no weight gradients for the frozen base; the adapter's own FLOPs are not counted)."""
    head = model.get_output_embeddings().weight
    embed = model.get_input_embeddings().weight
    seen = {id(embed), id(head)}
    body = sum(p.numel() for n, p in model.named_parameters() if id(p) not in seen and ".lora_" not in n)
    lengths = [len(b.experience.prompt_token_ids) + len(b.experience.response_token_ids) for b in batch]
    response = sum(len(b.experience.response_token_ids) for b in batch)
    d_attn = arch["hidden_size"]  # n_heads * head_dim (head_dim = hidden / heads in Qwen2)
    per_weight = 4.0 if frozen_base else 6.0
    return (per_weight * body * sum(lengths) + per_weight * head.numel() * response
            + 12.0 * arch["num_hidden_layers"] * d_attn * sum(s * s for s in lengths))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["embedded", "qwen2.5-0.5b"], default="qwen2.5-0.5b")
    ap.add_argument("--impl", choices=["chunked", "full"], default="chunked")
    ap.add_argument("--chunk-tokens", type=int, default=1024)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    ap.add_argument("--autocast", choices=["recast", "plain"], default="recast",
                    help="bf16: recast the weights in the backward (one trainer process) or plain autocast "
                         "(FSDP2 ranks), which holds their bf16 copies from the forward")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--response-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--micro-batch-size", type=int, default=0)
    ap.add_argument("--algorithm", default="grpo")
    ap.add_argument("--kl-coef", type=float, default=0.0)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (trainer.num_threads)")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="train a LoRA adapter of this rank (alpha 2r, the default target modules) "
                         "over a frozen base held in the compute dtype; 0: full fine-tuning")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)

    import torch
    import transformers

    from serve_rft.config import load_config
    from serve_rft.trainer.policy.token_logprobs import response_logprobs
    from serve_rft.trainer.policy.policy import PolicyTrainer

    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    sets = [f"trainer.device={device}", f"trainer.precision={a.precision}", f"trainer.logprob_impl={a.impl}",
            f"trainer.logprob_chunk_tokens={a.chunk_tokens}", f"trainer.micro_batch_size={a.micro_batch_size}",
            f"trainer.algorithm={a.algorithm}", f"trainer.kl_coef={a.kl_coef}", f"trainer.lr={a.lr}",
            f"trainer.num_threads={a.threads}", f"trainer.seed={a.seed}"]
    if a.lora_rank:
        sets += [f"trainer.lora.rank={a.lora_rank}", f"trainer.lora.alpha={2.0 * a.lora_rank}"]
    cfg = load_config(None, sets)
    cuda = device == "cuda"
    with tempfile.TemporaryDirectory(prefix="trainer_throughput.") as tmp:
        t0 = time.perf_counter()
        arch = build_model(a.shape, Path(tmp), a.seed)
        trainer = PolicyTrainer(cfg, tmp)
        trainer.recast_bf16 = a.autocast == "recast"
        setup_s = time.perf_counter() - t0
    batch = make_batch(a, arch["vocab_size"])
    exps = [b.experience for b in batch]
    with torch.no_grad(), trainer._autocast():  # behaviour logprobs: the model's own
        lp, _ = response_logprobs(trainer.model, [e.prompt_token_ids for e in exps],
                                  [e.response_token_ids for e in exps], [a.temperature] * len(exps),
                                  trainer.pad_id, top_ps=[a.top_p] * len(exps),
                                  chunk_tokens=a.chunk_tokens, impl=a.impl)
    for e, row in zip(exps, lp.float().cpu()):
        e.behaviour_logprobs = row[: len(e.response_token_ids)].tolist()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(a.warmup):
        trainer.step(batch)
    sync()
    if cuda:
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        held = reset_cpu_peak()
    times, stats = [], {}
    for _ in range(a.steps):
        t = time.perf_counter()
        stats = trainer.step(batch)
        sync()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    response = sum(len(e.response_token_ids) for e in exps)
    total = response + sum(len(e.prompt_token_ids) for e in exps)
    flops = flops_per_step(trainer.model, arch, batch, frozen_base=bool(a.lora_rank))
    out = {
        **record([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "shape": a.shape, "arch": arch, "impl": a.impl, "chunk_tokens": a.chunk_tokens,
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()}, "
                                                              f"{torch.get_num_threads()} threads)",
        "precision": ("fp32" if not trainer.bf16 else "bf16 autocast, bf16 frozen base, fp32 adapter"
                      if a.lora_rank else "bf16 autocast (fp32 weights, recast in the backward)"
                      if trainer.recast_bf16 else "bf16 autocast (fp32 weights, plain: bf16 copies held)"),
        "autocast": a.autocast if trainer.bf16 else None,
        "lora_rank": a.lora_rank or None,
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "batch": a.batch, "prompt_tokens": a.prompt_tokens, "response_tokens": a.response_tokens,
        "temperature": a.temperature, "top_p": a.top_p, "micro_batch_size": a.micro_batch_size,
        "algorithm": a.algorithm, "kl_coef": a.kl_coef, "warmup_steps": a.warmup, "steps": a.steps,
        "setup_s": round(setup_s, 2), "step_s_median": med, "step_s": times,
        "response_tokens_per_s": response / med, "total_tokens_per_s": total / med,
        "memory_measure": "cuda max_memory_allocated" if cuda else "cpu resident set (VmHWM after reset)",
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else _status_bytes("VmHWM"),
        "memory_before_steps_bytes": held,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "flops_per_step": flops, "peak_tflops": a.peak_tflops if cuda else None,
        "mfu": flops / med / (a.peak_tflops * 1e12) if cuda else None,
        "last_step": {k: stats.get(k) for k in ("loss", "grad_norm", "entropy", "max_abs_logprob_diff")},
        "imported_ray_or_vllm": sorted(m for m in ("ray", "vllm") if m in sys.modules),
    }
    text = json.dumps(out, indent=2)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
